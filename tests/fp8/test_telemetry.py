"""FP8Monitor: per-layer FP8 statistics against plain torch casts, the planted outlier named, its costs, the
TensorBoard events, and the opt-in fallback."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

pytest.importorskip("torchao")

from lightning_mp.fp8.telemetry import FallbackRule, FP8Monitor, fallback_decisions, rank_layers
from tests.ddp_scripts.launch import clean_environment, finish
from tests.fp8.fp8_models import TinyFp8Net, back_to_linear
from tests.helpers import BatchCostRecorder, fit, make_trainer, read_events, scalars, texts

EVERY = 2


def fit_logging_to_tensorboard(
    tmp_path, model: L.LightningModule, callbacks: list, max_steps: int = EVERY, name: str = "fp8"
) -> L.Trainer:
    """Fit ``model`` with ``callbacks``, logging every :data:`EVERY` steps to a TensorBoardLogger under
    ``tmp_path/name``; the Trainer."""
    return fit(
        model,
        max_steps=max_steps,
        log_every_n_steps=EVERY,
        logger=TensorBoardLogger(tmp_path, name=name),
        callbacks=callbacks,
    )


class CaptureFirstLayer(L.Callback):
    """The test's own record of ``net.fc1``'s input, weight and output gradient on the batch ``batch``."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.tensors: dict[str, torch.Tensor] = {}

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx != self.batch:
            return
        layer = pl_module.net.fc1
        self.tensors["weight"] = layer.weight.detach().clone()

        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            self.tensors["input"] = args[0].detach().clone()
            output.register_hook(lambda gradient: self.tensors.__setitem__("grad_output", gradient.clone()))

        self.handle = layer.register_forward_hook(hook)

    def on_train_batch_end(self, *args: Any) -> None:
        if hasattr(self, "handle"):
            self.handle.remove()
            del self.handle


def per_tensor_reference(tensor: torch.Tensor, dtype: torch.dtype) -> dict[str, float]:
    """Per-tensor dynamic scaling with plain torch float8 casts."""
    amax = tensor.abs().max().item()
    scale = torch.finfo(dtype).max / amax
    restored = (tensor.float() * scale).to(dtype).float() / scale
    noise = (tensor - restored).pow(2).sum().item()
    nonzero = tensor != 0
    return {
        "amax": amax,
        "scale": scale,
        "underflow_share": ((restored == 0) & nonzero).sum().item() / nonzero.sum().item(),
        "sqnr_db": 10 * math.log10(tensor.pow(2).sum().item() / noise),
    }


@pytest.mark.slow
def test_logged_stats_match_a_per_tensor_reference(tmp_path):
    """Under tensorwise scaling, the logged amax, scale, underflow share and SQNR of a layer's input, weight (e4m3)
    and output gradient (e5m2) equal plain torch casts of the same tensors, as read back from TensorBoard."""
    capture = CaptureFirstLayer(batch=EVERY - 1)
    fit_logging_to_tensorboard(tmp_path, TinyFp8Net("tensorwise"), [FP8Monitor(every_n_steps=EVERY), capture])
    events = read_events(tmp_path / "fp8" / "version_0")
    for operand, dtype in (
        ("input", torch.float8_e4m3fn),
        ("weight", torch.float8_e4m3fn),
        ("grad_output", torch.float8_e5m2),
    ):
        expected = per_tensor_reference(capture.tensors[operand], dtype)
        for stat, value in expected.items():
            logged = scalars(events, f"fp8_monitor/net.fc1/{operand}/{stat}")
            assert set(logged) == {EVERY - 1}, (operand, stat)
            assert logged[EVERY - 1] == pytest.approx(value, rel=1e-5, abs=1e-7), (operand, stat)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_planted_outlier_is_named_worst_within_one_logging_interval(tmp_path, recipe):
    """One feature of a layer's input scaled by 1e4 makes that layer the worst at the first logging step, in the
    callback, in the TensorBoard text and in the underflow scalars, and the heatmaps are written."""
    monitor = FP8Monitor(every_n_steps=EVERY, heatmap_every_n_samples=1)
    fit_logging_to_tensorboard(tmp_path, TinyFp8Net(recipe, outlier=True), [monitor])
    assert monitor.worst_layers[0] == "net.fc2"
    events = read_events(tmp_path / "fp8" / "version_0")
    table = texts(events, "fp8_monitor/worst_layers")[EVERY - 1]
    assert table.index("net.fc2") < min(table.find(other) % len(table) for other in ("net.fc1", "net.fc3"))
    planted = scalars(events, "fp8_monitor/net.fc2/input/underflow_share")[EVERY - 1]
    assert planted > 0.01
    assert scalars(events, "fp8_monitor/net.fc1/input/underflow_share")[EVERY - 1] < planted / 10
    assert {"fp8_monitor/heatmap/underflow_share", "fp8_monitor/heatmap/sqnr_db"} <= set(events.Tags()["images"])


@pytest.mark.slow
def test_no_sync_and_no_op_between_logging_steps_and_one_sync_on_them(tmp_path):
    """A step that does not log costs nothing (same syncs and ops as without the monitor); a logging step adds at
    most one host sync."""
    costs = {}
    for name, monitors in (("plain", []), ("monitored", [FP8Monitor(every_n_steps=EVERY)])):
        recorder = BatchCostRecorder()
        fit_logging_to_tensorboard(
            tmp_path, TinyFp8Net(), [recorder.opener(), *monitors, recorder.closer()], max_steps=2 * EVERY, name=name
        )
        costs[name] = recorder.per_batch
    plain, monitored = costs["plain"], costs["monitored"]
    for batch in range(2 * EVERY):
        if (batch + 1) % EVERY:
            assert monitored[batch].syncs == plain[batch].syncs, monitored[batch].sync_ops
            assert monitored[batch].ops == plain[batch].ops, monitored[batch].ops_by_name - plain[batch].ops_by_name
        else:
            assert monitored[batch].syncs - plain[batch].syncs == 1, monitored[batch].sync_ops
            assert monitored[batch].ops > plain[batch].ops


@pytest.mark.slow
def test_fallback_returns_the_outlier_layer_and_only_it_to_bf16(tmp_path):
    """With fallback on, the layer whose underflow crosses the limit on 2 logging steps in a row, and only it, is
    handed to the fallback function after the second, with the reason; training goes on with its same weights."""
    model = TinyFp8Net("tensorwise", outlier=True)
    weight = model.net.fc2.weight
    calls: list[tuple[str, str]] = []

    def fall_back(module: nn.Module, name: str, reason: str) -> None:
        calls.append((name, reason))
        back_to_linear(module, name, reason)

    monitor = FP8Monitor(
        every_n_steps=EVERY,
        fallback=FallbackRule(max_underflow=0.001, min_sqnr_db=None, patience=2),
        fallback_fn=fall_back,
    )
    fit_logging_to_tensorboard(tmp_path, model, [monitor], max_steps=3 * EVERY)
    assert [name for name, _ in calls] == ["net.fc2"]
    assert "input underflow share" in calls[0][1] and "2 logging steps in a row" in calls[0][1]
    assert type(model.net.fc2) is nn.Linear and model.net.fc2.weight is weight
    assert type(model.net.fc1) is not nn.Linear
    assert monitor.fell_back == dict(calls)
    assert set(monitor.samples[-1].stats) == {"net.fc1", "net.fc3"}
    assert "net.fc2" in texts(read_events(tmp_path / "fp8" / "version_0"), "fp8_monitor/fallback")[2 * EVERY - 1]


@pytest.mark.slow
def test_a_layer_fallen_back_stays_in_bf16_after_a_resume(tmp_path):
    """The layers that fell back are in the checkpoint: a run resumed from it returns them to bf16 before its first
    step, and measures only the layers still in FP8."""
    rule = FallbackRule(max_underflow=0.001, min_sqnr_db=None, patience=1)
    trainer = fit_logging_to_tensorboard(
        tmp_path, TinyFp8Net(outlier=True), [FP8Monitor(EVERY, fallback=rule, fallback_fn=back_to_linear)]
    )
    trainer.save_checkpoint(tmp_path / "fell_back.ckpt")
    resumed_model, monitor = TinyFp8Net(), FP8Monitor(EVERY, fallback=rule, fallback_fn=back_to_linear)
    trainer = make_trainer(
        max_steps=2 * EVERY, log_every_n_steps=EVERY, logger=TensorBoardLogger(tmp_path), callbacks=[monitor]
    )
    trainer.fit(resumed_model, ckpt_path=tmp_path / "fell_back.ckpt")
    assert list(monitor.fell_back) == ["net.fc2"]
    assert type(resumed_model.net.fc2) is nn.Linear
    assert [set(sample.stats) for sample in monitor.samples] == [{"net.fc1", "net.fc3"}]


def test_fallback_rule_counts_consecutive_steps_and_resets():
    """A layer must cross a limit on consecutive logging steps; a step within the limits starts it over."""
    rule = FallbackRule(max_underflow=0.1, min_sqnr_db=20.0, patience=2)
    bad = {"a": {"grad_output": {"underflow_share": 0.0, "sqnr_db": 12.0}}}
    good = {"a": {"grad_output": {"underflow_share": 0.0, "sqnr_db": 30.0}}}
    streaks, decided = fallback_decisions({}, bad, rule)
    streaks, decided = fallback_decisions(streaks, good, rule)
    assert (streaks, decided) == ({}, [])
    streaks, _ = fallback_decisions(streaks, bad, rule)
    _, decided = fallback_decisions(streaks, bad, rule)
    assert decided == [("a", "grad_output SQNR 12.0 dB < 20 dB for 2 logging steps in a row")]


def test_fallback_rule_reads_the_fp8_settings_thresholds():
    """The rule takes the FP8 settings' fallback_* fields, so the thresholds are declared once."""
    settings = SimpleNamespace(fallback_max_underflow=0.2, fallback_min_sqnr_db=18.0, fallback_patience=4)
    assert FallbackRule.from_settings(settings) == FallbackRule(max_underflow=0.2, min_sqnr_db=18.0, patience=4)


def test_rank_puts_lost_values_before_sqnr():
    """The layer that loses the most values ranks worst, even when its SQNR looks better; then the lowest SQNR."""
    sample = {
        "quiet": {"input": {"underflow_share": 0.0, "saturated_share": 0.0, "sqnr_db": 25.0}},
        "outlier": {"input": {"underflow_share": 0.05, "saturated_share": 0.0, "sqnr_db": 32.0}},
        "noisy": {"input": {"underflow_share": 0.0, "saturated_share": 0.0, "sqnr_db": 20.0}},
    }
    assert rank_layers(sample) == ["outlier", "noisy", "quiet"]


def test_bad_arguments_are_refused_by_name():
    """Each bad argument is refused with its name, the value and what is allowed."""
    with pytest.raises(ValueError, match="every_n_steps"):
        FP8Monitor(every_n_steps=0)
    with pytest.raises(TypeError, match=r"fallback=0\.1"):
        FP8Monitor(fallback=0.1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="fallback_fn"):
        FP8Monitor(fallback_fn="fc2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="patience"):
        FallbackRule(patience=0)
    with pytest.raises(ValueError, match="max_underflow"):
        FallbackRule(max_underflow=2.0)
    with pytest.raises(ValueError, match="at least one limit"):
        FallbackRule(max_underflow=None, min_sqnr_db=None)


@pytest.mark.slow
def test_under_ddp_every_rank_falls_back_the_same_layer(tmp_path):
    """Under DDP on 2 processes, with the outlier planted on rank 0 only, both ranks return the same layer (and only
    it) to bf16, decided on the same statistics, and their weights stay equal."""
    process = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("ddp_fp8_fallback.py")), "--out", str(tmp_path)],
        env=clean_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    finish(process, timeout=120)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert ranks[0]["samples"] == ranks[1]["samples"]
    assert [rank["fell_back"] for rank in ranks] == [["net.fc2"], ["net.fc2"]]
    assert [rank["fc2_type"] for rank in ranks] == ["Linear", "Linear"]
    assert ranks[0]["fc2_weight_sum"] == ranks[1]["fc2_weight_sum"]
