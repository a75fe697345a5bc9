"""MixedPrecision under real DDP on the CPU (gloo, 2 processes): ddp, ddp_spawn, ddp_notebook, two nodes, SyncBatchNorm.

Each test starts ``ddp_scripts/train.py`` as a user would start a training script, in a subprocess with a timeout,
and reads back the JSON report every rank writes at the end of training.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from lightning_mp import MixedPrecision
from lightning_mp.callbacks import GradientHealthMonitor, LayerDtypeMonitor, LossScaleMonitor
from tests.ddp_scripts.launch import clean_environment, finish, free_port, reports, run, start
from tests.helpers import TinyRegressor, loader, make_trainer, read_events, scalars, texts

INJECT_AT = (2, 5)


def _assert_ranks_agree(ranks: list[dict[str, Any]], skipped_at: tuple[int, ...], overflowing_rank: int) -> None:
    """Every rank skipped exactly the injected steps with the same scales, and ended with the same parameters."""
    assert [r["global_rank"] for r in ranks] == [0, 1]
    assert all(r["world_size"] == 2 for r in ranks)
    # Recorded after each batch: global_step has already advanced past the step that was skipped.
    assert [step - 1 for step, _, skipped in ranks[0]["steps"] if skipped] == list(skipped_at)
    assert ranks[0]["steps"] == ranks[1]["steps"]
    assert ranks[0]["stats"] == ranks[1]["stats"]
    assert ranks[0]["stats"]["skipped_steps"] == len(skipped_at)
    assert ranks[0]["stats"]["loss_scale"] == 2.0**8 / 2 ** len(skipped_at)
    checksums = {checksum for r in ranks for checksum in r["checksums"]}
    assert len(checksums) == 1, "the parameters differ across ranks"
    # Only the rank whose own gradients overflowed counts a local overflow.
    assert [r["local_overflows"] for r in ranks] == [
        len(skipped_at) if rank == overflowing_rank else 0 for rank in range(2)
    ]


def _rank_zero_events(out: Path) -> EventAccumulator:
    """The run's TensorBoard events, after checking that only rank zero wrote an event file."""
    log_dir = out / "tb" / "version_0"
    event_files = list(log_dir.glob("events.out.tfevents.*"))
    assert len(event_files) == 1, f"expected one event file, from rank zero only: {event_files}"
    return read_events(log_dir)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One strategy='ddp' run with an overflow on rank 1 at steps 2 and 5, with the three monitors and TensorBoard."""
    out = tmp_path_factory.mktemp("ddp")
    run(["--strategy", "ddp", "--out", str(out), "--inject-rank", "1", "--inject-at", "2,5", "--telemetry"])
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("optimizer", "precision"), [("fused-adam", "16-mixed"), ("fused-adam", "bf16-mixed"), ("adam", "bf16-mixed")]
)
def test_ddp_fused_adam_overflow_on_one_rank_keeps_ranks_identical_every_step(tmp_path, optimizer, precision):
    """Adam under strategy='ddp' (fused, or handed to the fused kernel in bf16), an overflow on rank 1 only, three
    monitors: same params every step, no hang."""
    arguments = ["--strategy", "ddp", "--out", str(tmp_path), "--optimizer", optimizer, "--telemetry"]
    run([*arguments, "--precision", precision, "--inject-rank", "1", "--inject-at", "2,5"], timeout=90)
    ranks = reports(tmp_path)
    if precision == "16-mixed":
        _assert_ranks_agree(ranks, INJECT_AT, overflowing_rank=1)
    else:
        # bf16 scales nothing, but the inf check (which only reads the gradients) is agreed across ranks the same way.
        assert ranks[0]["stats"] == ranks[1]["stats"] and ranks[0]["stats"]["skipped_steps"] == len(INJECT_AT)
        assert ranks[0]["steps"] == ranks[1]["steps"]
    assert ranks[0]["step_checksums"] == ranks[1]["step_checksums"]
    assert len(set(ranks[0]["step_checksums"])) == len(ranks[0]["step_checksums"]) - len(INJECT_AT)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("optimizer", "algorithm", "precision"),
    [("fused-sgd", "norm", "16-mixed"), ("fused-adamw", "value", "bf16-mixed")],
)
def test_ddp_fused_optimizer_with_clipping_and_an_overflow_on_one_rank(tmp_path, optimizer, algorithm, precision):
    """Fused SGD/AdamW with gradient clipping under DDP, an inf on rank 1 only: both ranks skip it, same params."""
    arguments = ["--strategy", "ddp", "--out", str(tmp_path), "--optimizer", optimizer, "--precision", precision]
    clipping = ["--gradient-clip-val", "0.05", "--gradient-clip-algorithm", algorithm]
    run([*arguments, *clipping, "--inject-rank", "1", "--inject-at", "2,5"], timeout=90)
    ranks = reports(tmp_path)
    if precision == "16-mixed":
        _assert_ranks_agree(ranks, INJECT_AT, overflowing_rank=1)
    else:
        assert ranks[0]["stats"] == ranks[1]["stats"] and ranks[0]["stats"]["skipped_steps"] == len(INJECT_AT)
    assert ranks[0]["step_checksums"] == ranks[1]["step_checksums"]
    assert len(set(ranks[0]["step_checksums"])) == len(ranks[0]["step_checksums"]) - len(INJECT_AT)


@pytest.mark.slow
def test_ddp_overflow_on_one_rank_is_skipped_by_every_rank(ddp_run):
    """strategy='ddp': an overflow on rank 1 only makes both ranks skip; scale and parameters stay identical."""
    _assert_ranks_agree(reports(ddp_run), INJECT_AT, overflowing_rank=1)


@pytest.mark.slow
def test_ddp_counters_are_reduced_over_ranks_and_logged_once(ddp_run):
    """The skip counters are logged once, from rank zero, as the number of lost updates, not a sum over ranks."""
    events = _rank_zero_events(ddp_run)
    assert list(scalars(events, "precision/skipped_steps_total").values())[-1] == len(INJECT_AT)
    # Only rank 1 overflowed: rank 0, which writes the logs, knows its count only through the sum over ranks.
    assert list(scalars(events, "precision/rank_overflows_total").values())[-1] == len(INJECT_AT)
    steps = [event.step for event in events.Scalars("precision/loss_scale")]
    assert len(steps) == len(set(steps)), "a step was logged more than once"
    assert list(scalars(events, "precision/loss_scale").values())[-1] == 2.0**8 / 4


@pytest.mark.slow
def test_ddp_overflow_forensics_name_the_parameter_of_the_rank_that_overflowed(ddp_run):
    """Rank zero's gradients were finite, yet the overflow report names rank 1's parameter: names are gathered."""
    reports_text = list(texts(_rank_zero_events(ddp_run), "precision/overflow").values())
    assert len(reports_text) == len(INJECT_AT)
    assert all("first.weight" in text and "[16, 8]" in text for text in reports_text)


@pytest.mark.slow
def test_ddp_spawn_with_the_monitors(tmp_path):
    """strategy='ddp_spawn' pickles the plugin and the monitors; an overflow on rank 0 only is skipped everywhere."""
    run(["--strategy", "ddp_spawn", "--out", str(tmp_path), "--inject-rank", "0", "--inject-at", "2,5", "--telemetry"])
    ranks = reports(tmp_path)
    _assert_ranks_agree(ranks, INJECT_AT, overflowing_rank=0)
    assert ranks[0]["pid"] != ranks[1]["pid"]


@pytest.mark.slow
def test_ddp_notebook_forks_and_stays_consistent(tmp_path):
    """strategy='ddp_notebook' (fork) trains with the plugin and keeps the ranks identical."""
    run(["--strategy", "ddp_notebook", "--out", str(tmp_path), "--inject-rank", "1", "--inject-at", "2,5"])
    ranks = reports(tmp_path)
    _assert_ranks_agree(ranks, INJECT_AT, overflowing_rank=1)
    assert {r["strategy"] for r in ranks} == {"DDPStrategy"}


@pytest.mark.slow
def test_two_nodes_on_one_machine(tmp_path):
    """num_nodes=2, one process per node, launched per node with NODE_RANK as on a cluster: the plugin needs nothing."""
    port = str(free_port())
    nodes = []
    try:
        for node_rank in range(2):
            env = clean_environment(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(node_rank))
            arguments = ["--out", str(tmp_path), "--num-nodes", "2", "--devices", "1", "--inject-at", "2,5"]
            nodes.append(start(arguments, env))
    finally:
        outputs = [finish(node, timeout=60) for node in nodes]
    assert "max_steps=8" in outputs[0]
    ranks = reports(tmp_path)
    assert [r["node_rank"] for r in ranks] == [0, 1]
    _assert_ranks_agree(ranks, INJECT_AT, overflowing_rank=1)


def test_plugin_and_monitors_pickle_after_training(tmp_path):
    """The plugin and every monitor pickle, also after training, when the scaler holds tensors."""
    plugin = MixedPrecision("16-mixed", init_scale=2.0**8)
    callbacks = [LossScaleMonitor(), GradientHealthMonitor(), LayerDtypeMonitor()]
    logger = TensorBoardLogger(tmp_path)
    make_trainer(plugin, max_steps=2, callbacks=callbacks, logger=logger).fit(TinyRegressor(inject_at=(1,)), loader())
    restored_plugin, _ = pickle.loads(pickle.dumps((plugin, callbacks)))
    assert restored_plugin.stats == plugin.stats
    assert restored_plugin.scaler.state_dict() == plugin.scaler.state_dict()


class WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 1)


OPT_LEVELS = [
    ("O0", "32-true", {}),
    ("O1", "16-mixed", {}),
    ("O1", "bf16-mixed", {}),
    ("O2", "16-mixed", {}),
    ("O2", "bf16-mixed", {}),
    ("lean-exact", "bf16-mixed", {}),
    ("O3", "16-mixed", {}),
    ("O3", "bf16-mixed", {}),
    # keep_fp32 by BatchNorm type still matches once sync_batchnorm has turned the norm into a SyncBatchNorm.
    ("O3", "16-mixed", {"keep_fp32": [nn.BatchNorm1d]}),
]


@pytest.mark.parametrize(("opt_level", "precision", "extra"), OPT_LEVELS)
def test_sync_batchnorm_composes_with_every_opt_level(opt_level, precision, extra):
    """sync_batchnorm=True, then the plugin: the norm is a SyncBatchNorm whose running statistics stay fp32.

    DDPStrategy.setup converts BatchNorm with the Trainer's layer sync and then calls the plugin's
    ``convert_module``; this runs the same two steps in that order. torch's SyncBatchNorm forward needs a GPU.
    """
    model = TorchSyncBatchNorm().apply(WithBatchNorm())
    plugin = MixedPrecision(precision, opt_level=opt_level, **extra)
    plugin.setup_for_device("cpu")
    plugin.convert_module(model)
    assert isinstance(model.norm, nn.SyncBatchNorm)
    assert model.norm.running_mean.dtype == torch.float32
    assert model.norm.running_var.dtype == torch.float32
    assert model.norm.num_batches_tracked.dtype == torch.int64
    assert model.norm.weight.dtype == torch.float32
    # O3 casts the weights; O2 puts half model parameters in their place (the fp32 masters go to the optimizer).
    assert model.linear.weight.dtype == (
        plugin.half_dtype if opt_level in ("O2", "O3", "lean-exact") else torch.float32
    )
    # Lightning's teardown reverts the conversion; the plugin's dtypes survive it.
    reverted = TorchSyncBatchNorm().revert(model)
    assert not isinstance(reverted.norm, nn.SyncBatchNorm)
    assert reverted.norm.running_mean.dtype == torch.float32
