"""What the monitors cost, counted per batch with lightning_mp.bench.counting against the same run without them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_mp import MixedPrecision
from lightning_mp.bench.counting import StepCounts, count_syncs_and_ops
from lightning_mp.callbacks import GradientHealthMonitor, LayerDtypeMonitor, LossScaleMonitor, PrecisionSentinel
from tests.ddp_scripts.launch import clean_environment, finish
from tests.helpers import BatchCostRecorder, TinyLanguageModel, make_trainer

# Slow: each cost is counted against a second run without the monitors: the fast loop leaves the module out.
pytestmark = pytest.mark.slow

LOG_EVERY = 3
MAX_STEPS = 6


def per_batch_costs(tmp_path, monitors: list, name: str, optimizer: str) -> list[StepCounts]:
    recorder = BatchCostRecorder()
    trainer = make_trainer(
        MixedPrecision("16-mixed"),
        max_steps=MAX_STEPS,
        log_every_n_steps=LOG_EVERY,
        logger=TensorBoardLogger(tmp_path, name=name),
        callbacks=[recorder.opener(), *monitors, recorder.closer()],
    )
    trainer.fit(TinyLanguageModel(optimizer=optimizer))
    return recorder.per_batch


@pytest.fixture(
    scope="module", params=[("adamw", False), ("sgd", False), ("adamw", True)], ids=["adamw", "sgd", "with-sentinel"]
)
def plain_and_monitored(request, tmp_path_factory) -> tuple[list[StepCounts], list[StepCounts]]:
    """The same fp16 O1 LM run twice, without and with all three monitors logging every third step (and, in one
    variant, the precision sentinel sampling at the same steps)."""
    optimizer, with_sentinel = request.param
    root = tmp_path_factory.mktemp("costs")
    plain = per_batch_costs(root, [], "plain", optimizer)
    monitors = [LossScaleMonitor(), GradientHealthMonitor(), LayerDtypeMonitor(every_n_steps=LOG_EVERY)]
    if with_sentinel:
        monitors.append(PrecisionSentinel(every_n_steps=LOG_EVERY))
    monitored = per_batch_costs(root, monitors, "monitored", optimizer)
    return plain, monitored


def logging_batches() -> set[int]:
    return {batch for batch in range(MAX_STEPS) if (batch + 1) % LOG_EVERY == 0}


def test_monitors_add_no_sync_and_at_most_two_ops_between_logging_steps(plain_and_monitored):
    """On a step that does not log, the three monitors together add 0 host syncs and at most 2 dispatched ops."""
    plain, monitored = plain_and_monitored
    # Batch 0 is the sentinel's first sample; every other batch that does not log must be free, the one right after a
    # logging step included (nothing is read late).
    quiet = [batch for batch in range(1, MAX_STEPS) if batch not in logging_batches()]
    assert quiet
    for batch in quiet:
        assert monitored[batch].syncs == plain[batch].syncs, monitored[batch].sync_ops
        assert monitored[batch].ops - plain[batch].ops <= 2, monitored[batch].ops_by_name - plain[batch].ops_by_name


def test_a_logging_step_adds_one_sync_and_a_quarter_of_a_step_at_most(plain_and_monitored):
    """A logging step with all three monitors (and the sentinel's sample, and its first-step sample) adds at most
    1 sync and at most 25% of a plain step's ops."""
    plain, monitored = plain_and_monitored
    for batch in sorted(logging_batches() | {0}):
        assert monitored[batch].syncs - plain[batch].syncs <= 1, monitored[batch].sync_ops
        added = monitored[batch].ops - plain[batch].ops
        assert added <= 0.25 * plain[batch].ops, monitored[batch].ops_by_name - plain[batch].ops_by_name


def test_gradient_histogram_is_one_batched_op(plain_and_monitored):
    """The whole gradient histogram is one histc over all gradients, not one op per gradient element group."""
    plain, monitored = plain_and_monitored
    batch = min(logging_batches())
    added = monitored[batch].ops_by_name - plain[batch].ops_by_name
    assert added["aten.histc.default"] == 1
    assert sum(count for name, count in added.items() if "scatter" in name or "log2" in name) == 1


def fit_with_progress_bar(tmp_path, prog_bar: bool) -> tuple[StepCounts, TQDMProgressBar]:
    bar = TQDMProgressBar(refresh_rate=1)
    trainer = make_trainer(
        MixedPrecision("16-mixed", init_scale=2.0**10),
        max_steps=4,
        logger=TensorBoardLogger(tmp_path, name=str(prog_bar)),
        log_every_n_steps=50,
        callbacks=[LossScaleMonitor(prog_bar=prog_bar), bar],
        enable_progress_bar=True,
    )
    model = TinyLanguageModel(optimizer="sgd")
    with count_syncs_and_ops() as counts:
        trainer.fit(model)
    return counts, bar


def test_loss_scale_on_the_progress_bar_costs_no_sync_and_no_copy(tmp_path):
    """prog_bar=True shows the scale on a real TQDM bar without one more sync or host-to-device copy in the run."""
    shown_counts, shown_bar = fit_with_progress_bar(tmp_path, True)
    hidden_counts, _ = fit_with_progress_bar(tmp_path, False)
    assert "loss_scale=1024.0" in shown_bar.train_progress_bar.postfix
    assert shown_counts.syncs == hidden_counts.syncs
    assert shown_counts.host_to_device_copies == hidden_counts.host_to_device_copies


DDP_SCRIPT = Path(__file__).with_name("ddp_monitor_costs.py")


def start_ddp_costs(out: Path, monitors: bool) -> subprocess.Popen:
    """Start ``ddp_monitor_costs.py`` on 2 gloo processes; it writes each rank's per-batch costs under ``out``."""
    out.mkdir()
    return subprocess.Popen(
        [sys.executable, str(DDP_SCRIPT), "--out", str(out), *(["--monitors"] if monitors else [])],
        env=clean_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def test_ddp_logging_step_reduces_every_counter_in_one_collective_and_one_sync(tmp_path):
    """Under DDP (2 processes) with the three monitors and the sentinel, a logging step adds 1 collective and at most
    1 sync per rank, other steps add no collective and no sync (but the sentinel's first sample on rank 0)."""
    # Both runs at once: the start-up of four interpreters, not the six steps, is what takes time.
    runs = {name: start_ddp_costs(tmp_path / name, monitors=name == "monitored") for name in ("plain", "monitored")}
    for process in runs.values():
        finish(process, timeout=60)
    plain, monitored = (
        [json.loads((tmp_path / name / f"rank{rank}.json").read_text()) for rank in range(2)] for name in runs
    )
    for rank in range(2):
        for batch, (before, after) in enumerate(zip(plain[rank], monitored[rank], strict=True)):
            logging = batch in logging_batches()
            sentinel_sample = rank == 0 and batch == 0
            assert after["collectives"] - before["collectives"] == int(logging), (rank, batch)
            assert after["syncs"] - before["syncs"] == int(logging or sentinel_sample), (rank, batch, after["sync_ops"])
            budget = 0.25 * before["ops"] if logging or sentinel_sample else 2
            assert after["ops"] - before["ops"] <= budget, (rank, batch)
