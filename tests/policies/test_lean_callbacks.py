"""Lean beside Lightning's weight averaging (EMA, SWA) and model summary: fp32 averages of the bf16 weights, and
sizes counted from the half weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import (
    EMAWeightAveraging,
    ModelCheckpoint,
    StochasticWeightAveraging,
    WeightAveraging,
)
from lightning.pytorch.utilities.model_summary import summarize
from torch.optim.swa_utils import get_ema_multi_avg_fn
from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

from lightning_mp import MixedPrecision
from lightning_mp.policies.lean import _FOREACH_AVERAGING_DEVICE_TYPES
from tests.helpers import TinyRegressor, loader, make_trainer
from tests.policies.lean_helpers import (
    LeanNet,
    classification_loader,
)


def test_ema_weight_averaging_keeps_an_fp32_average_of_the_bf16_weights() -> None:
    """Lightning's EMAWeightAveraging trains with lean: fp32 average, bf16 model, the average copied in at the end."""
    model = LeanNet()
    ema = EMAWeightAveraging(decay=0.5)
    trainer = make_trainer(MixedPrecision("bf16-mixed", opt_level="lean"), callbacks=[ema], max_steps=4)
    trainer.fit(model, classification_loader())
    averaged = ema._average_model
    assert averaged is not None
    assert averaged.module.head.weight.dtype == torch.float32
    assert model.head.weight.dtype == torch.bfloat16
    assert int(averaged.n_averaged) == 4
    assert torch.equal(model.head.weight, averaged.module.head.weight.bfloat16())
    assert not torch.equal(averaged.module.head.weight, averaged.module.head.weight.bfloat16().float())


def test_foreach_weight_averaging_is_refused_at_setup_naming_the_per_tensor_alternative() -> None:
    """WeightAveraging(multi_avg_fn=...) with lean fails before the first step with a ValueError naming avg_fn."""
    model = LeanNet()
    averaging = WeightAveraging(multi_avg_fn=get_ema_multi_avg_fn(0.999))
    trainer = make_trainer(MixedPrecision("bf16-mixed", opt_level="lean"), callbacks=[averaging], max_steps=2)
    with pytest.raises(ValueError, match=r"multi_avg_fn=get_ema_multi_avg_fn.*get_ema_avg_fn\(decay\).*'O2'"):
        trainer.fit(model, classification_loader())
    assert model.losses == []


def test_foreach_averaging_is_refused_on_the_devices_where_torch_averages_with_foreach() -> None:
    """Lean's list of the devices where AveragedModel picks its foreach update is this torch's (older releases list
    no MTIA, where lean then refuses one case more)."""
    expected = set(_get_foreach_kernels_supported_devices())
    ours = {*_FOREACH_AVERAGING_DEVICE_TYPES, torch.device("privateuseone").type}
    assert ours == expected or (ours - expected == {"mtia"} and "mtia" not in expected)


def test_stochastic_weight_averaging_copies_its_average_into_the_bf16_model() -> None:
    """Lightning's StochasticWeightAveraging trains with lean and leaves the bf16 model holding its fp32 average."""
    model = LeanNet()
    swa = StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1)
    trainer = make_trainer(MixedPrecision("bf16-mixed", opt_level="lean"), callbacks=[swa], max_steps=-1, max_epochs=3)
    trainer.fit(model, classification_loader(batches=2))
    average = swa._average_model
    assert average.head.weight.dtype == torch.float32
    assert model.head.weight.dtype == torch.bfloat16
    assert torch.equal(model.head.weight, average.head.weight.bfloat16())
    assert len(model.losses) == 6


def test_resume_with_ema_weight_averaging_restores_the_bf16_model_and_the_fp32_average(tmp_path: Path) -> None:
    """A lean run with EMAWeightAveraging resumed from a mid-run checkpoint ends bitwise equal to an unbroken one."""

    def run(max_steps: int, ckpt_path: Path | None = None, save: bool = False) -> tuple[LeanNet, EMAWeightAveraging]:
        model, ema = LeanNet(), EMAWeightAveraging(decay=0.5)
        callbacks: list[Callback] = [ema]
        if save:
            callbacks.append(ModelCheckpoint(tmp_path, filename="mid", every_n_train_steps=4, save_top_k=-1))
        trainer = make_trainer(
            MixedPrecision("bf16-mixed", opt_level="lean"),
            callbacks=callbacks,
            max_steps=max_steps,
            max_epochs=-1,
            enable_checkpointing=save,
        )
        trainer.fit(model, classification_loader(), ckpt_path=ckpt_path)
        return model, ema

    unbroken_model, unbroken_ema = run(8)
    run(4, save=True)
    resumed_model, resumed_ema = run(8, ckpt_path=tmp_path / "mid.ckpt")
    assert resumed_model.head.weight.dtype == torch.bfloat16
    assert torch.equal(resumed_model.head.weight, unbroken_model.head.weight)
    assert unbroken_ema._average_model is not None and resumed_ema._average_model is not None
    assert resumed_ema._average_model.module.head.weight.dtype == torch.float32
    assert torch.equal(resumed_ema._average_model.module.head.weight, unbroken_ema._average_model.module.head.weight)


class _RecordModelSize(Callback):
    """The model size Lightning's ModelSummary reports at the start of fit, when the precision is set up."""

    def __init__(self) -> None:
        self.megabytes: float | None = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.megabytes = summarize(pl_module).model_size


@pytest.mark.parametrize(
    ("ours", "lightnings"),
    [
        (MixedPrecision("bf16-mixed", opt_level="lean"), "bf16-true"),
        (MixedPrecision("16-mixed", opt_level="O3"), "16-true"),
    ],
)
def test_model_summary_sizes_half_weight_levels_by_their_half_weights(ours: MixedPrecision, lightnings: str) -> None:
    """Lightning's ModelSummary sizes a lean (or O3) model by its half weights, as for bf16-true (16-true), not as fp32;
    the checkpoint still names the mixed precision the plugin was given."""
    sizes = {}
    for name, options in (("ours", {"plugins": [ours]}), ("Lightning's", {"precision": lightnings}), ("fp32", {})):
        recorder = _RecordModelSize()
        # The size is read when fit starts, with the precision set up: no batch needs to run.
        make_trainer(limit_train_batches=0, callbacks=[recorder], **options).fit(TinyRegressor(), loader())
        sizes[name] = recorder.megabytes
    assert sizes["ours"] == sizes["Lightning's"] == pytest.approx(sizes["fp32"] / 2)
    assert ours.state_dict()["precision"] == ours.requested_precision
