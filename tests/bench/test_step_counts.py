"""Host syncs and compute ops of one steady-state iteration: lightning_mp against the torch loop and Lightning.

Every count is taken in the same test, on the same tiny transformer LM and batch, with
:func:`lightning_mp.bench.counting.count_syncs_and_ops`; counts are deterministic, so they are asserted exactly.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lightning_mp import LossScaler, MixedPrecision
from lightning_mp.bench import cli as bench_cli
from lightning_mp.bench.counting import count_syncs_and_ops
from lightning_mp.bench.counts import OPTIMIZERS, PRECISIONS, count_iteration, tiny_language_model
from tests.helpers import TinyRegressor, loader, make_trainer

# Slow: each test counts a whole iteration of three loops side by side: the fast loop leaves the module out.
pytestmark = pytest.mark.slow

FUSED = ("fused Adam", "fused AdamW", "fused SGD")


def _extra_op_allowance(precision: str, optimizer_name: str) -> int:
    """Ops allowed over Lightning's plugin: 2, plus torch's own step-counter revert in fused Adam's skip path.

    Given a ``found_inf`` tensor, torch's fused Adam and AdamW subtract it from their step counters (one
    ``_foreach_sub_``); in bf16 and fp32 every Adam and AdamW step runs through that kernel, while Lightning's
    plugins pass no flag and check nothing, so they never pay it.
    """
    pays_the_revert = precision != "16-mixed" and "Adam" in optimizer_name
    return 2 + pays_the_revert


@pytest.fixture(scope="module")
def tiny_lm():
    return tiny_language_model(vocab_size=8, d_model=8, seq_len=4, batch_size=1)


@pytest.mark.parametrize("optimizer_name", list(OPTIMIZERS))
@pytest.mark.parametrize("precision", PRECISIONS)
def test_syncs_and_ops_per_iteration_match_the_peers(tiny_lm, precision, optimizer_name):
    """No sync with fused optimizers, nor with any optimizer in bf16 and fp32; fp16 adds nothing to torch's; few ops."""
    make_model, batch = tiny_lm
    counts = count_iteration(precision, optimizer_name, make_model, batch)
    torch_loop, lightning = counts["torch loop"], counts["Lightning"]
    assert torch_loop.syncs == lightning.syncs
    for ours in ("lightning_mp", "LossScaler"):
        if optimizer_name in FUSED or precision != "16-mixed":
            # bf16 and fp32 hand every step to a fused kernel that skips on the device; no read of a CPU step count.
            assert counts[ours].syncs == 0, (ours, counts[ours].sync_ops)
        else:
            # fp16 with a non-fused optimizer: the scaler's skip decision is the torch loop's own sync.
            assert counts[ours].syncs <= torch_loop.syncs, counts[ours].sync_ops
        assert counts[ours].compute_ops <= lightning.compute_ops + _extra_op_allowance(precision, optimizer_name)


@pytest.mark.parametrize("mode", ["dynamic", "check"])
@pytest.mark.parametrize("optimizer_name", list(FUSED))
def test_a_fused_step_and_update_never_sync_and_still_skip(optimizer_name, mode):
    """With a fused optimizer, step, update, stats and get_scale make no host sync, yet an inf gradient is skipped."""
    model = nn.Linear(4, 2)
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    scaler = LossScaler("cpu", mode=mode, init_scale=256.0, growth_interval=1)
    for step in range(4):
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(model(torch.ones(2, 4)).square().mean()).backward()
        if step == 3:
            model.weight.grad[0, 0] = float("inf")
        before = model.weight.detach().clone()
        with count_syncs_and_ops() as counts:
            scaler.step(optimizer)
            scaler.update()
            scaler.stats()
            scaler.get_scale()
        # The first fused step makes the host view of the flag, once; fused SGD with momentum takes its very first
        # step on the host (its kernel cannot skip a first momentum step), so its first fused step is the second.
        if step > (optimizer_name == "fused SGD"):
            assert counts.syncs == 0, counts.sync_ops
    assert torch.equal(model.weight, before)
    assert scaler.stats().skipped_steps == 1 and scaler.stats().last_step_skipped
    assert scaler.get_scale() == (256.0 * 2**3 / 2 if mode == "dynamic" else 1.0)  # three growths, one backoff


def test_bench_counts_prints_a_markdown_table_of_syncs_and_ops(capsys, tmp_path):
    """python -m lightning_mp.bench --counts --quick prints one row per configuration with each contestant's counts,
    and writes the same report to --out."""

    out = tmp_path / "counts.md"
    banners = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    level = banners.level
    assert bench_cli.main(["--counts", "--quick", "--out", str(out)]) == 0
    assert banners.level == level, "the benchmark quiets Lightning's banners only while it runs"
    printed = capsys.readouterr().out
    assert out.read_text() == printed
    assert (
        "| precision | optimizer | torch loop: syncs / ops | Lightning: syncs / ops | lightning_mp: syncs / ops |"
        in printed
    )
    row = next(line for line in printed.splitlines() if line.startswith("| 16-mixed | fused Adam |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")][2:]
    syncs = [int(cell.split("/")[0]) for cell in cells]
    assert syncs == [0, 0, 0]


@pytest.mark.parametrize("optimizer", ["sgd", "fused-adam"])
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_reading_the_plugins_stats_and_scale_after_a_trainer_run_never_syncs(precision, optimizer):
    """plugin.stats, its dict and plugin.scaler.get_scale() after real Trainer steps read no device value."""
    plugin = MixedPrecision(precision, init_scale=2.0**8)
    make_trainer(plugin, max_steps=3).fit(TinyRegressor(inject_at=(1,), optimizer=optimizer), loader(batch_size=8))
    with count_syncs_and_ops() as counts:
        stats = plugin.stats
        stats.as_dict()
        scale = plugin.scaler.get_scale() if plugin.scaler is not None else 1.0
    assert counts.syncs == 0, counts.sync_ops
    assert stats.skipped_steps == 1 and stats.optimizer_steps == 3
    assert scale == (2.0**7 if precision == "16-mixed" else 1.0)


class _BatchNormRegressor(TinyRegressor):
    """TinyRegressor with a BatchNorm between its layers, whose running statistics a skipped step puts back."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.norm = nn.BatchNorm1d(self.first.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.norm(self.first(x))))


class _CountTrainingBatches(L.Callback):
    """Host syncs made from the start to the end of each training batch: forward, backward, step and update."""

    def __init__(self) -> None:
        self.syncs: list[int] = []
        self._counting: Any = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._counting = count_syncs_and_ops()
        self._counts = self._counting.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._counting.__exit__(None, None, None)
        self.syncs.append(self._counts.syncs)


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_a_trainer_step_of_a_batchnorm_model_makes_no_sync_in_bf16_and_fp32(precision):
    """With BatchNorm and a foreach AdamW, a Trainer iteration makes no host sync in bf16 and fp32: the running
    statistics of a skipped step are put back on the device, from the device flag, never read on the host."""
    counter = _CountTrainingBatches()
    trainer = make_trainer(MixedPrecision(precision), max_steps=4, callbacks=[counter])
    trainer.fit(_BatchNormRegressor(optimizer="foreach AdamW"), loader(batch_size=8))
    assert counter.syncs[1:] == [0, 0, 0]  # the first iteration creates the optimizer's state
