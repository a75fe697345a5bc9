"""O2 beside Lightning's callbacks that match the optimizer's parameters to the model's: backbone finetuning (fresh
and resumed), weight averaging, the learning-rate monitor and the model summary, each compared with fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    EMAWeightAveraging,
    LearningRateMonitor,
    ModelSummary,
    StochasticWeightAveraging,
)
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from tests.helpers import make_trainer
from tests.policies.o2.helpers import PRECISIONS
from tests.policies.o2.user_path_helpers import (
    TOLERANCE,
    Regressor,
    batches,
    holds_each_tensor_once,
    largest_relative_error,
    plugin,
    weights,
)


class WithBackbone(Regressor):
    """The MLP's first two layers are its ``backbone`` (for BackboneFinetuning); the optimizer gets only what
    requires a gradient, as BackboneFinetuning's recipe asks; no validation loop."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = self.net[:3]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return batches(4)


class ValidatedBackbone(WithBackbone):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch))

    def val_dataloader(self) -> DataLoader:
        return batches(1)


EVALUATIONS: dict[str, tuple[type[WithBackbone], dict[str, Any]]] = {
    "no validation": (WithBackbone, {}),
    "no sanity check": (ValidatedBackbone, {"num_sanity_val_steps": 0}),
    "sanity check": (ValidatedBackbone, {}),
}
"""Whether an evaluation forward runs before the first training epoch: only with the sanity check."""


def fit_with_callbacks(
    model: L.LightningModule, precision: str, callbacks: Callable[[], list[L.Callback]], **kwargs: Any
) -> tuple[L.Trainer, list[L.Callback]]:
    made = callbacks()
    options = {"max_steps": -1, "max_epochs": 2, "callbacks": made, **kwargs}
    trainer = make_trainer(plugin(precision), **options)
    trainer.fit(model)
    return trainer, made


@pytest.mark.parametrize("evaluation", list(EVALUATIONS))
@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_backbone_finetuning_trains_like_fp32_with_or_without_an_evaluation_first(
    precision: str, evaluation: str
) -> None:
    """BackboneFinetuning unfreezes the backbone into a group of its fp32 parameters, whatever ran before the first
    epoch, and trains like fp32; no optimizer holds a tensor twice."""
    model_class, options = EVALUATIONS[evaluation]

    def finetuning() -> list[L.Callback]:
        return [BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=1.0)]

    fp32 = model_class()
    fit_with_callbacks(fp32, "32-true", finetuning, **options)
    model = model_class()
    trainer, _ = fit_with_callbacks(model, precision, finetuning, **options)
    optimizer = trainer.optimizers[0]
    assert len(optimizer.param_groups) == 2 and holds_each_tensor_once(optimizer)
    assert [id(p) for p in optimizer.param_groups[1]["params"]] == [id(p) for p in model.backbone.parameters()]
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert largest_relative_error(weights(model), weights(fp32)) < TOLERANCE[precision]


def averaging_callbacks(kind: str) -> Callable[[], list[L.Callback]]:
    if kind == "StochasticWeightAveraging":
        return lambda: [StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)]
    return lambda: [EMAWeightAveraging(decay=0.5)]


@pytest.mark.parametrize("kind", ["StochasticWeightAveraging", "EMAWeightAveraging"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_weight_averaging_without_evaluation_averages_the_fp32_weights_like_fp32(precision: str, kind: str) -> None:
    """SWA (averaging from the first epoch's start) and EMA, with no evaluation before training, average the fp32
    weights the optimizer steps, and end like fp32."""
    fp32 = WithBackbone()
    fit_with_callbacks(fp32, "32-true", averaging_callbacks(kind))
    model = WithBackbone()
    fit_with_callbacks(model, precision, averaging_callbacks(kind))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert largest_relative_error(weights(model), weights(fp32)) < TOLERANCE[precision]


class SummaryRecorder(ModelSummary):
    """Lightning's ModelSummary, recording the counts it prints."""

    def summarize(self, summary_data: Any, total_parameters: int, trainable_parameters: int, *args: Any, **kw: Any):  # type: ignore[no-untyped-def]
        self.counts = (total_parameters, trainable_parameters, [row for row in summary_data if row[0] == "Params"])


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_learning_rate_monitor_and_model_summary_report_what_fp32_reports(precision: str, tmp_path: Path) -> None:
    """LearningRateMonitor logs the learning rate of every group (the backbone's added at epoch 1) and ModelSummary
    counts the total and trainable parameters, as in fp32."""

    def callbacks() -> list[L.Callback]:
        return [
            BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=1.0),
            LearningRateMonitor(logging_interval="step"),
            SummaryRecorder(),
        ]

    reports = []
    for run in ("32-true", precision):
        logger = CSVLogger(tmp_path / run)
        _, made = fit_with_callbacks(WithBackbone(), run, callbacks, logger=logger, enable_model_summary=True)
        monitor, summary = made[1], made[2]
        assert isinstance(monitor, LearningRateMonitor) and isinstance(summary, SummaryRecorder)
        reports.append((monitor.lrs, summary.counts))
    assert reports[0][0] and reports[1] == reports[0]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_backbone_finetuning_resumed_after_unfreezing_trains_like_fp32(precision: str, tmp_path: Path) -> None:
    """Resumed from a checkpoint taken after the backbone was unfrozen, BackboneFinetuning rebuilds its groups from
    the model's parameters at ``on_fit_start``: they are the fp32 masters, which train like fp32's."""
    results = []
    for run in ("32-true", precision):
        first = WithBackbone()
        callbacks = [BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=1.0)]
        trainer = make_trainer(
            plugin(run), max_steps=-1, max_epochs=2, callbacks=callbacks, default_root_dir=tmp_path / run
        )
        trainer.fit(first)
        path = tmp_path / run / "unfrozen.ckpt"
        trainer.save_checkpoint(path)
        model = WithBackbone()
        callbacks = [BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=1.0)]
        resumed = make_trainer(plugin(run), max_steps=-1, max_epochs=3, callbacks=callbacks)
        resumed.fit(model, ckpt_path=path)
        optimizer = resumed.optimizers[0]
        assert len(optimizer.param_groups) == 2 and holds_each_tensor_once(optimizer)
        assert {id(p) for group in optimizer.param_groups for p in group["params"]} == {
            id(p) for p in model.parameters()
        }
        results.append(weights(model))
    assert largest_relative_error(results[1], results[0]) < TOLERANCE[precision]
