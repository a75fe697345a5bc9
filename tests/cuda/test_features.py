"""The package's features on the device: a torch GradScaler, DDP, the monitors, inference, the advisor, host syncs.

Each body runs on ``"cuda"`` (``pytest -m cuda tests/cuda``) and, where the CPU can run it, on ``"cpu"`` too.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins.precision import MixedPrecision as LightningMixedPrecision
from lightning.pytorch.plugins.precision import Precision as LightningPrecision
from torch.utils.data import DataLoader

from lightning_mp import (
    GradientHealthMonitor,
    LayerDtypeMonitor,
    LossScaleMonitor,
    PrecisionSentinel,
    advise,
    to_inference,
)
from tests.cuda.matrix import (
    FRONT_ENDS,
    PRECISION_LEVELS,
    NormalizedRegressor,
    assert_trained_and_skipped,
    make_network,
    make_plugin,
    on_device,
    train,
    train_with_trainer,
)
from tests.helpers import make_trainer, read_events, regression_data, scalars, texts

pytestmark = pytest.mark.filterwarnings("ignore:.*opt_level='O3'", "ignore:lightning_mp:UserWarning")


@pytest.mark.parametrize("front_end", FRONT_ENDS)
@pytest.mark.parametrize("device", [on_device("cpu"), on_device("cuda")])
def test_a_torch_grad_scaler_passed_as_scaler_is_honoured(device: str, front_end: str) -> None:
    """GradScaler(device, init_scale, growth_interval) sets the scale's start and growth; the inf step backs it off."""
    scaler = torch.amp.GradScaler(device, init_scale=2.0**8, growth_interval=2)
    plugin = make_plugin("16-mixed", "O1", scaler=scaler)
    train(front_end, device, "16-mixed", "O1", "sgd-momentum", plugin=plugin)
    stats = plugin.stats
    # 256 grows to 512 after two clean steps, halves at the inf step, and grows again after the next two.
    assert (stats.scale_growths, stats.scale_backoffs, stats.skipped_steps) == (2, 1, 1)
    assert stats.loss_scale == 2.0**9


@pytest.mark.parametrize("device", [on_device("cpu", pytest.mark.slow), on_device("cuda")])
@pytest.mark.parametrize("optimizer", ["fused-adamw", "sgd-momentum"])
def test_ddp_with_one_device_trains_and_skips_the_inf_step(
    device: str, optimizer: str, single_process_group: None
) -> None:
    """strategy='ddp' on one device (NCCL on a GPU) trains in fp16 with finite weights and skips the planted step."""
    network, plugin = train_with_trainer(device, "16-mixed", "O1", optimizer, strategy="ddp")
    assert_trained_and_skipped(network, plugin)


@pytest.mark.slow
@pytest.mark.parametrize("device", [on_device("cpu"), on_device("cuda")])
def test_the_four_monitors_write_tensorboard_events_on_the_device(device: str, tmp_path: Path) -> None:
    """The four monitors log the scale, the skip, gradient health, layer dtypes and heatmaps into real event files."""
    logger = TensorBoardLogger(tmp_path)
    callbacks = [
        LossScaleMonitor(),
        GradientHealthMonitor(),
        LayerDtypeMonitor(every_n_steps=1),
        PrecisionSentinel(every_n_steps=1),
    ]
    trainer = make_trainer(
        make_plugin("16-mixed", "O1"),
        accelerator=device,
        callbacks=callbacks,
        logger=logger,
        log_every_n_steps=1,
        max_steps=6,  # on a GPU a fused step's skip reaches the host, and the logs, one iteration late
    )
    with pytest.warns(RuntimeWarning, match="skipped because gradients were not finite"):  # GradientHealthMonitor
        trainer.fit(NormalizedRegressor("fused-adamw"), DataLoader(regression_data(), batch_size=8))
    events = read_events(logger.log_dir)
    assert scalars(events, "precision/loss_scale")
    assert max(scalars(events, "precision/skipped_steps_total").values()) == 1
    assert all(map(torch.isfinite, map(torch.tensor, scalars(events, "precision/grad_norm").values())))
    assert any(tag.startswith("precision/layers/") for tag in events.Tags()["scalars"])
    assert texts(events, "precision/overflow")
    assert "Linear" in next(iter(texts(events, "precision/layer_dtypes").values()))
    assert events.Tags()["images"], "the sentinel wrote no heatmap"


@pytest.mark.parametrize("device", [on_device("cpu"), on_device("cuda")])
def test_to_inference_converts_on_the_device(device: str) -> None:
    """to_inference gives a bf16 copy that stays on the device, runs there and reports its parity."""
    network = make_network().to(device).eval()
    batch = torch.randn(16, 8, device=device)
    copy = to_inference(network, torch.bfloat16, batch=batch, verbose=False)
    assert {p.device.type for p in copy.parameters()} == {device}
    assert copy[0].weight.dtype == torch.bfloat16
    torch.testing.assert_close(copy(batch).float(), network(batch), atol=0.1, rtol=0.1)
    assert copy.parity is not None


@pytest.mark.parametrize("device", [on_device("cpu"), on_device("cuda")])
def test_advise_measures_on_the_device(device: str) -> None:
    """advise on a model on the device measures there and recommends a precision."""
    model = NormalizedRegressor("fused-adamw", inf_step=None).to(device)
    advice = advise(model, DataLoader(regression_data(), batch_size=8), batches=2)
    assert advice.precision in ("16-mixed", "bf16-mixed", "32-true")
    assert next(model.parameters()).device.type == device


class _SyncCounter(L.Callback):
    """Count the host syncs CUDA's sync debug mode reports within each training batch after the first ``warmup``."""

    def __init__(self, warmup: int = 2) -> None:
        self.warmup = warmup
        self.per_batch: list[int] = []
        self._caught: Any = None
        self._recorded: list[warnings.WarningMessage] = []

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.warmup:
            self._caught = warnings.catch_warnings(record=True)
            self._recorded = self._caught.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self._caught is None:
            return
        torch.cuda.set_sync_debug_mode("default")
        self._caught.__exit__(None, None, None)
        self._caught = None
        self.per_batch.append(sum("synchronizing" in str(w.message) for w in self._recorded))


def _syncs_per_step(plugin: Any, optimizer: str) -> int:
    counter = _SyncCounter()
    trainer = make_trainer(plugin, accelerator="cuda", callbacks=[counter], max_steps=6)
    trainer.fit(NormalizedRegressor(optimizer, inf_step=None), DataLoader(regression_data(), batch_size=8))
    return max(counter.per_batch)


def _lightning_plugin(precision: str) -> Any:
    if precision == "32-true":
        return LightningPrecision()
    return LightningMixedPrecision(precision, "cuda")  # type: ignore[arg-type]


@pytest.mark.parametrize("device", [on_device("cuda")])
@pytest.mark.parametrize(("precision", "opt_level"), PRECISION_LEVELS)
def test_fused_steps_sync_no_more_than_lightnings_plugin(device: str, precision: str, opt_level: str) -> None:
    """With fused AdamW each step syncs the host no more often than Lightning's built-in plugin at that precision."""
    ours = _syncs_per_step(make_plugin(precision, opt_level), "fused-adamw")
    lightnings = _syncs_per_step(_lightning_plugin(precision), "fused-adamw")
    # Lean reads the skip flag before its rounded update, which a skip inside the kernel would not leave intact
    # (lightning_mp.stochastic_rounding documents the one sync).
    allowed = lightnings + (1 if opt_level.startswith("lean") else 0)
    assert ours <= allowed, f"{ours} host syncs per step, Lightning's plugin {lightnings}"


@pytest.mark.parametrize("device", [on_device("cpu"), on_device("cuda")])
@pytest.mark.parametrize(("eval_precision", "expected"), [("bf16-true", torch.bfloat16), ("32-true", torch.float32)])
def test_validation_runs_in_eval_precision_on_the_device(
    device: str, eval_precision: str, expected: torch.dtype
) -> None:
    """O2 fp16 training validates with bf16 or fp32 weights on the device, autocast off; the evaluation weights are
    freed after each Trainer call."""
    seen: set[tuple[torch.dtype, str, bool]] = set()

    class Validated(NormalizedRegressor):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            weight = next(self.parameters())
            seen.add((weight.dtype, weight.device.type, torch.is_autocast_enabled(weight.device.type)))
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.network(x).float(), y))

    model = Validated("fused-adamw", inf_step=None)
    plugin = make_plugin("16-mixed", "O2", eval_precision=eval_precision)
    validation = DataLoader(regression_data(16, seed=1), batch_size=8)
    trainer = make_trainer(plugin, accelerator=device, max_steps=4, val_check_interval=2)
    trainer.fit(model, DataLoader(regression_data(), batch_size=8), validation)
    assert seen == {(expected, device, False)}
    assert trainer.callback_metrics["val_loss"].isfinite() and plugin.evaluation_weights is None
    seen.clear()
    trainer.validate(model, validation, verbose=False)
    assert seen == {(expected, device, False)} and plugin.evaluation_weights is None
