"""O2 on the paths users take with Lightning's documented recipes: discarding a backward's gradients (every kind of
``zero_grad``), callbacks that match the optimizer's parameters to the model's, and tied weights with ``keep_fp32`` on
one side. Each run is a real Trainer or Fabric on a tiny 3-layer MLP, compared with the same recipe in fp32."""

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
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecision
from tests.helpers import make_trainer

PRECISIONS = ["bf16-mixed", "16-mixed"]
BATCHES = 8


def batches(count: int = BATCHES) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(count * 8, 8, generator=generator)
    target = features @ torch.randn(8, 2, generator=generator)
    return DataLoader(TensorDataset(features, target), batch_size=8)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))


def plugin(precision: str, opt_level: str = "O2", **kwargs: Any) -> MixedPrecision | None:
    """The plugin for a run; None for the fp32 reference, which runs with Lightning's own fp32."""
    if precision == "32-true":
        return None
    if precision == "16-mixed":
        kwargs.setdefault("init_scale", 2.0**10)  # no overflow of the scale itself: the planted infs alone skip
    return MixedPrecision(precision, opt_level=opt_level, **kwargs)  # type: ignore[arg-type]


def weights(model: nn.Module) -> dict[str, Tensor]:
    return {name: value.detach().float().clone() for name, value in model.state_dict().items()}


def largest_relative_error(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> float:
    """The largest ``|actual - expected| / |expected|`` over the tensors, each measured by its norm."""
    return max(float((actual[name] - value).norm() / value.norm()) for name, value in expected.items())


def assert_same(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=0, atol=0, msg=name)


def holds_each_tensor_once(optimizer: torch.optim.Optimizer) -> bool:
    held = [id(p) for group in optimizer.param_groups for p in group["params"]]
    return len(held) == len(set(held))


class Regressor(L.LightningModule):
    """The 3-layer MLP with SGD (momentum 0.9), trained on a seeded regression problem."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.net = mlp()
        self.lr = lr

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def loss(self, batch: Any) -> Tensor:
        features, target = batch
        return F.mse_loss(self(features).float(), target)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return batches()


# ------------------------------------------------------------------------------------------------ discarded gradients


class StepsEveryOtherBatch(Regressor):
    """Lightning's "step every N batches" recipe: the other batches run the closure (training_step, zero_grad,
    backward) alone, so their gradients are discarded by the next closure's zero_grad. ``inf_at`` plants an inf in
    the loss of those batches."""

    def __init__(self, inf_at: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.inf_at = inf_at

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        return loss * float("inf") if batch_idx in self.inf_at else loss

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        if batch_idx % 2 == 1:
            optimizer.step(closure=optimizer_closure)
        else:
            optimizer_closure()


def fit_weights(model: L.LightningModule, precision: str, opt_level: str = "O2", **kwargs: Any) -> dict[str, Tensor]:
    trainer = make_trainer(plugin(precision, opt_level), max_steps=-1, max_epochs=1, **kwargs)
    trainer.fit(model)
    return weights(model)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_stepping_every_other_batch_trains_like_fp32_within_o1s_error(precision: str) -> None:
    """Lightning's "step every N batches" recipe at O2 steps with the stepping batch's gradient only, as in fp32: the
    weights stay as close to fp32's as O1's do."""
    fp32 = fit_weights(StepsEveryOtherBatch(), "32-true")
    o1 = fit_weights(StepsEveryOtherBatch(), precision, "O1")
    o2 = fit_weights(StepsEveryOtherBatch(), precision, "O2")
    assert largest_relative_error(o2, fp32) <= 2 * largest_relative_error(o1, fp32) + 1e-6


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_an_inf_in_a_discarded_backward_skips_no_step(precision: str) -> None:
    """An inf in a backward whose gradients the next closure's zero_grad discards skips no step, as in fp32 and O1."""
    model = StepsEveryOtherBatch(inf_at=(2, 4))
    trainer = make_trainer(plugin(precision), max_steps=-1, max_epochs=1)
    trainer.fit(model)
    assert trainer.precision_plugin.stats.skipped_steps == 0  # type: ignore[attr-defined]
    assert_same(weights(model), fit_weights(StepsEveryOtherBatch(), precision))


def discard_by(how: str, model: nn.Module, optimizer: Any, features: Tensor) -> None:
    """Discard the gradients of the backwards so far, as a user would.

    ``model.zero_grad()`` comes after a forward without gradients (a metric computed between the backwards), after
    which O2's model shows its fp32 masters rather than the half weights that hold the gradients.
    """
    if how == "optimizer.zero_grad()":
        optimizer.zero_grad()
    elif how == "optimizer.zero_grad(set_to_none=False)":
        optimizer.zero_grad(set_to_none=False)
    else:
        with torch.no_grad():
            model(features)
        model.zero_grad()


DISCARDS = ["optimizer.zero_grad()", "optimizer.zero_grad(set_to_none=False)", "model.zero_grad()"]


class DiscardsAFirstBackward(Regressor):
    """Manual optimization: ``manual_backward(first); <discard>; manual_backward(second); opt.step()``. The first
    loss is another batch's, a hundred times larger (or inf with ``inf_first``); ``discard=None`` leaves it out."""

    def __init__(self, discard: str | None, inf_first: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.discard = discard
        self.inf_first = inf_first

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        if self.discard is not None:
            features, target = batch
            first = 100 * F.mse_loss(self(features.flip(0)).float(), target)
            self.manual_backward(first * float("inf") if self.inf_first else first)
            discard_by(self.discard, self, optimizer, features)
        self.manual_backward(self.loss(batch))
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("how", DISCARDS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_manual_optimization_steps_with_the_gradient_of_the_backward_after_a_discard(
    precision: str, how: str
) -> None:
    """``manual_backward(l1); discard; manual_backward(l2); opt.step()`` steps exactly as ``manual_backward(l2)`` alone
    does: the discarded gradient reaches no weight."""
    expected = fit_weights(DiscardsAFirstBackward(None), precision)
    assert_same(fit_weights(DiscardsAFirstBackward(how), precision), expected)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_manual_optimization_skips_no_step_for_an_inf_in_a_discarded_backward(precision: str) -> None:
    """An inf in a backward that ``optimizer.zero_grad()`` discards skips no step and reaches no weight."""
    model = DiscardsAFirstBackward("optimizer.zero_grad()", inf_first=True)
    trainer = make_trainer(plugin(precision), max_steps=-1, max_epochs=1)
    trainer.fit(model)
    assert trainer.precision_plugin.stats.skipped_steps == 0  # type: ignore[attr-defined]
    assert_same(weights(model), fit_weights(DiscardsAFirstBackward(None), precision))


def fabric_weights(precision: str, discard: str | None, inf_first: bool = False) -> tuple[dict[str, Tensor], int]:
    """A Fabric loop of ``backward(first); <discard>; backward(second); step``: the weights and the skipped steps."""
    mixed = plugin(precision)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[mixed])
    net = mlp()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = fabric.setup(net, optimizer)
    for features, target in batches():
        if discard is not None:
            first = 100 * F.mse_loss(model(features.flip(0)).float(), target)
            fabric.backward(first * float("inf") if inf_first else first)
            discard_by(discard, model, optimizer, features)
        fabric.backward(F.mse_loss(model(features).float(), target))
        optimizer.step()
        optimizer.zero_grad()
    assert mixed is not None
    skipped = mixed.stats.skipped_steps
    mixed.teardown()
    return weights(net), skipped


@pytest.mark.parametrize("how", DISCARDS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_fabric_steps_with_the_gradient_of_the_backward_after_a_discard(precision: str, how: str) -> None:
    """Under Fabric, a backward discarded by the wrapped optimizer's or the model's zero_grad reaches no weight."""
    expected, _ = fabric_weights(precision, None)
    actual, _ = fabric_weights(precision, how)
    assert_same(actual, expected)


def test_o2_fabric_skips_no_step_for_an_inf_in_a_discarded_backward() -> None:
    """Under Fabric, an inf in a backward that zero_grad discards skips no step."""
    actual, skipped = fabric_weights("16-mixed", "optimizer.zero_grad()", inf_first=True)
    expected, _ = fabric_weights("16-mixed", None)
    assert skipped == 0
    assert_same(actual, expected)


# ------------------------------------------------------------------------------------------------ callbacks


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

TOLERANCE = {"bf16-mixed": 4e-2, "16-mixed": 1e-3}
"""The largest relative error of trained weights against fp32 allowed at O2: O1 on the same callback runs measures at
most 2.2e-2 in bf16 and 3e-4 in fp16 (O2 measures the same)."""


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


# ------------------------------------------------------------------------------------------------ tied weights


class TiedLanguageModel(L.LightningModule):
    """GPT-2's layout in small: a token embedding ``wte``, the 3-layer MLP, and an ``lm_head`` tied to ``wte``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(16, 8)
        self.mlp = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
        self.lm_head = nn.Linear(8, 16, bias=False)
        self.lm_head.weight = self.wte.weight
        self.tie_in_step: list[tuple[bool, torch.dtype]] = []

    def forward(self, tokens: Tensor) -> Tensor:
        return self.lm_head(self.mlp(self.wte(tokens)))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self.tie_in_step.append((self.wte.weight is self.lm_head.weight, self.lm_head.weight.dtype))
        tokens, target = batch
        return F.cross_entropy(self(tokens).float(), target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return tokens()


def tokens() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    sequence = torch.randint(0, 16, (BATCHES * 8 + 1,), generator=generator)
    return DataLoader(TensorDataset(sequence[:-1], sequence[1:]), batch_size=8)


SIDES = {"wte": "lm_head", "lm_head": "wte"}
"""The side of the tie that ``keep_fp32`` names -> the other side, which the warning names."""


@pytest.mark.parametrize("kept", list(SIDES))
@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_keep_fp32_on_one_side_of_a_tie_keeps_both_sides_fp32_and_trains_like_fp32(
    precision: str, kept: str
) -> None:
    """``keep_fp32`` on either side of a tied weight keeps the tie one fp32 weight (with a warning naming the other
    side); the optimizer the Trainer builds after the conversion holds it once, and the weights train like fp32's."""
    fp32 = TiedLanguageModel()
    make_trainer(max_steps=-1, max_epochs=1).fit(fp32)
    model = TiedLanguageModel()
    trainer = make_trainer(plugin(precision, keep_fp32=[kept]), max_steps=-1, max_epochs=1)
    with pytest.warns(UserWarning, match=rf"'{SIDES[kept]}' is kept in fp32 too: .*tied to '{kept}.weight'"):
        trainer.fit(model)
    assert holds_each_tensor_once(trainer.optimizers[0])
    assert set(model.tie_in_step) == {(True, torch.float32)}
    assert model.wte.weight is model.lm_head.weight
    assert largest_relative_error(weights(model), weights(fp32)) < TOLERANCE[precision]


def fabric_tied_weights(precision: str, kept: str | None) -> tuple[dict[str, Tensor], bool]:
    """A Fabric loop whose optimizer is built after ``fabric.setup`` (as litgpt's pretraining does): the trained
    weights, and whether the optimizer held each tensor once."""
    mixed = plugin(precision, keep_fp32=[kept]) if kept is not None else plugin(precision)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[mixed] if mixed is not None else None)
    net = TiedLanguageModel()
    model = fabric.setup(net)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for source, target in tokens():
        fabric.backward(F.cross_entropy(model(source).float(), target))
        optimizer.step()
        optimizer.zero_grad()
    once = holds_each_tensor_once(optimizer.optimizer)
    if mixed is not None:
        mixed.teardown()
    return weights(net), once


@pytest.mark.parametrize("kept", list(SIDES))
@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_fabric_optimizer_built_after_setup_holds_a_kept_tie_once_and_trains_like_fp32(
    precision: str, kept: str
) -> None:
    """Under Fabric, an optimizer built on the model's parameters after setup holds a tie kept on one side once, and
    the weights train like fp32's."""
    expected, _ = fabric_tied_weights("32-true", None)
    with pytest.warns(UserWarning, match=rf"'{SIDES[kept]}' is kept in fp32 too"):
        actual, once = fabric_tied_weights(precision, kept)
    assert once
    assert largest_relative_error(actual, expected) < TOLERANCE[precision]


class AddsAHeldLayerAgain(Regressor):
    """Manual optimization that adds, inside its training step, a group with a layer the optimizer holds already."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        self.manual_backward(self.loss(batch))
        if batch_idx == 1:
            optimizer.add_param_group({"params": list(self.net[0].parameters())})
        optimizer.step()
        optimizer.zero_grad()


def test_o2_refuses_a_group_that_would_make_the_optimizer_hold_a_master_twice() -> None:
    """A group added with half weights whose masters the optimizer holds already (torch refuses the same parameter in
    two groups in fp32) is refused at the step, naming the parameter, instead of stepping it twice."""
    trainer = make_trainer(plugin("bf16-mixed"), max_steps=-1, max_epochs=1)
    with pytest.raises(ValueError, match=r"param group 1 holds 'net.0.weight', which the optimizer holds already"):
        trainer.fit(AddsAHeldLayerAgain())


class SparseTiedLanguageModel(TiedLanguageModel):
    """The tied model with a sparse embedding, which O2 keeps computing with its fp32 weight; plain SGD."""

    def __init__(self) -> None:
        super().__init__()
        self.wte.sparse = True

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_a_weight_tied_to_a_module_that_computes_in_fp32_gets_no_half_copy(precision: str) -> None:
    """A head tied to a sparse embedding (which O2 leaves fp32) shares its fp32 weight, with a warning naming both;
    the optimizer holds it once and it trains like fp32."""
    fp32 = SparseTiedLanguageModel()
    make_trainer(max_steps=-1, max_epochs=1).fit(fp32)
    model = SparseTiedLanguageModel()
    trainer = make_trainer(plugin(precision), max_steps=-1, max_epochs=1)
    with pytest.warns(UserWarning, match=r"'lm_head.weight' stays an fp32 weight .* tied to 'wte.weight'"):
        trainer.fit(model)
    assert holds_each_tensor_once(trainer.optimizers[0])
    assert set(model.tie_in_step) == {(True, torch.float32)}
    assert largest_relative_error(weights(model), weights(fp32)) < TOLERANCE[precision]


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


class ClipsEveryParameter(L.Callback):
    """Clips the norm of all the model's gradients before each step, as many training scripts do."""

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        torch.nn.utils.clip_grad_norm_(pl_module.parameters(), max_norm=1e6)


class HeadOnlyOptimizer(Regressor):
    """The first layer takes gradients but is in no optimizer."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.net[2:].parameters(), lr=self.lr, momentum=0.9)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_clipping_all_model_gradients_works_with_a_layer_in_no_optimizer(precision: str) -> None:
    """``clip_grad_norm_(pl_module.parameters())`` before the step sees dense fp32 gradients on every parameter,
    one that no optimizer holds included, and the run trains like fp32."""
    fp32 = HeadOnlyOptimizer()
    make_trainer(max_steps=-1, max_epochs=1, callbacks=[ClipsEveryParameter()]).fit(fp32)
    model = HeadOnlyOptimizer()
    make_trainer(plugin(precision), max_steps=-1, max_epochs=1, callbacks=[ClipsEveryParameter()]).fit(model)
    assert all(p.grad is None or (p.grad.dtype == torch.float32 and not p.grad.is_sparse) for p in model.parameters())
    assert largest_relative_error(weights(model), weights(fp32)) < TOLERANCE[precision]


class UntoggledGAN(L.LightningModule):
    """A GAN's two optimizers in manual optimization without ``toggle_optimizer``: the generator's backward also
    gives the discriminator gradients, which the discriminator's ``zero_grad`` discards before its own backward."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        features, _ = batch
        opt_g, opt_d = self.optimizers()
        fake = self.generator(features)
        g_loss = F.softplus(-self.discriminator(fake)).float().mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        real, fake = self.discriminator(features), self.discriminator(fake.detach())
        d_loss = (F.softplus(-real) + F.softplus(fake)).float().mean()
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.SGD(self.generator.parameters(), lr=0.05, momentum=0.9),
            torch.optim.SGD(self.discriminator.parameters(), lr=0.05, momentum=0.9),
        ]

    def train_dataloader(self) -> DataLoader:
        return batches()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_gan_without_toggle_optimizer_trains_like_fp32(precision: str) -> None:
    """The discriminator steps with its own loss's gradient only, as in fp32: its zero_grad discards what the
    generator's backward left on it."""
    fp32 = UntoggledGAN()
    make_trainer(max_steps=-1, max_epochs=1).fit(fp32)
    model = UntoggledGAN()
    make_trainer(plugin(precision), max_steps=-1, max_epochs=1).fit(model)
    assert largest_relative_error(weights(model), weights(fp32)) < TOLERANCE[precision]
