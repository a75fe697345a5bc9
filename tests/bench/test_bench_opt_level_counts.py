"""`python -m lightning_mp.bench --counts`, per opt level: weight casts, ops, Python calls and DDP bytes per step.

The instrument is checked on cases whose answer is known whatever O2's design: O1 casts each weight once in
forward (autocast's cache), fp32 and O3 cast nothing, a deliberate cast is counted in its phase, fp32 gradients
cross the wire at 4 bytes per parameter, half gradients at 2.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from typing_extensions import override

from lightning_mp.bench import cli as bench_cli
from lightning_mp.bench.allreduced_bytes import AllReducedBytes, measure_allreduced_bytes
from lightning_mp.bench.opt_level_counts import (
    LIGHTNING_BF16_TRUE,
    O2_HOOK_PYTHON_CALLS,
    OptLevelCounts,
    count_opt_level,
    opt_level_table,
    opt_level_target_lines,
)
from tests.helpers import TinyRegressor, loader

# Slow: the benchmark's own runs, counted per opt level: the fast loop leaves the module out.
pytestmark = pytest.mark.slow


def regressor_task(steps: int) -> tuple[L.LightningModule, Any]:
    """Two linear layers (4 weights, each used by one matrix product) and ``steps`` batches."""
    return TinyRegressor(), loader(n=8 * steps)


class CastingRegressor(TinyRegressor):
    """Casts its first weight once more in the training step and once in ``on_before_optimizer_step``."""

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.first.weight.detach().half()
        return super().training_step(batch, batch_idx)

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.first.weight.detach().half()


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_o1_casts_each_weight_once_in_forward_and_never_in_backward_or_step(precision: str) -> None:
    """O1 casts every weight once per forward (autocast's cache, reused by backward), and none in the step."""
    counts = count_opt_level("O1", precision, regressor_task)
    assert counts.weights == 4
    assert (counts.casts_forward, counts.casts_backward, counts.casts_step) == (counts.weights, 0, 0)
    assert counts.casts_per_weight("forward") == 1.0
    assert counts.casts_per_weight() == 1.0


@pytest.mark.parametrize(("opt_level", "precision"), [("O0", "32-true"), ("O3", "16-mixed"), ("O3", "bf16-mixed")])
def test_fp32_and_o3_cast_no_weight(opt_level: str, precision: str) -> None:
    """Training in one dtype (fp32, or O3's half weights) casts no weight in any phase of a step."""
    counts = count_opt_level(opt_level, precision, regressor_task)
    assert counts.casts == 0
    assert counts.compute_ops > 0 and counts.python_calls > 0


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_o2_meets_its_count_targets_against_o1_on_the_markov_model(precision: str) -> None:
    """On the benchmark's model a steady O2 step casts no weight in forward or backward and at most one per weight in
    the step, dispatches no more ops than O1's, and makes no more Python calls than O1's plus its hooks' fixed few."""
    o1 = count_opt_level("O1", precision)
    o2 = count_opt_level("O2", precision)
    assert (o2.casts_forward, o2.casts_backward) == (0, 0) and o2.casts_step <= o2.weights
    assert o2.compute_ops <= o1.compute_ops
    assert o2.python_calls <= o1.python_calls + O2_HOOK_PYTHON_CALLS


def test_a_deliberate_cast_of_a_weight_is_counted_in_its_phase() -> None:
    """A weight cast in the training step counts in forward, one in on_before_optimizer_step in the step."""
    counts = count_opt_level("O0", "32-true", lambda steps: (CastingRegressor(), loader(n=8 * steps)))
    assert (counts.casts_forward, counts.casts_backward, counts.casts_step) == (1, 0, 1)


def test_counts_of_the_markov_model_are_the_same_in_two_runs() -> None:
    """The benchmark's model gives the same casts, ops, syncs and Python calls every time: they are counts, not
    timings."""
    first = count_opt_level("O1", "bf16-mixed")
    assert first == count_opt_level("O1", "bf16-mixed")
    assert 0 < first.casts_forward <= first.weights and first.casts_backward == first.casts_step == 0


def test_a_skipped_counted_step_is_refused_with_its_reason() -> None:
    """An fp16 overflow in a counted step would count a skip, not a steady step: the count fails and says why."""
    with pytest.raises(RuntimeError, match="O1 16-mixed: a counted step was skipped"):
        count_opt_level("O1", "16-mixed", lambda steps: (TinyRegressor(inject_at=(2,)), loader(n=8 * steps)))


def test_table_gives_casts_per_weight_and_bytes_against_o1() -> None:
    """The table shows each phase's casts per weight, and DDP bytes with their dtype and ratio to O1."""
    counts = [
        OptLevelCounts("O1", "bf16-mixed", 4, 4, 0, 0, 100, 0, 1000),
        OptLevelCounts("O3", "bf16-mixed", 4, 0, 0, 0, 90, 0, 900),
    ]
    allreduced = [
        AllReducedBytes("O1", "bf16-mixed", {"torch.float32": 400}, 100),
        AllReducedBytes("O3", "bf16-mixed", {"torch.bfloat16": 200}, 100),
    ]
    rows = opt_level_table(counts, allreduced).splitlines()[2:]
    assert rows == [
        "| O1 | bf16-mixed | 1.00 / 0.00 / 0.00 | 100 | 1,000 | 400 (torch.float32) | 1.00x |",
        "| O3 | bf16-mixed | 0.00 / 0.00 / 0.00 | 90 | 900 | 200 (torch.bfloat16) | 0.50x |",
    ]


def test_lightnings_bf16_true_is_counted_as_a_baseline_row() -> None:
    """Lightning's own bf16-true, lean's step-time reference, is counted like an opt level: bf16 weights, no casts."""
    counts = count_opt_level(*LIGHTNING_BF16_TRUE)
    assert (counts.opt_level, counts.precision) == ("Lightning", "bf16-true")
    assert counts.casts == 0 and counts.weights == 18 and counts.python_calls > 0


def test_target_lines_check_lean_against_o1() -> None:
    """Under the table, lean is checked for host syncs, and for ops and Python calls against O1's."""
    o1 = OptLevelCounts("O1", "bf16-mixed", 4, 4, 0, 0, 100, 0, 1000)
    lean = OptLevelCounts("lean", "bf16-mixed", 4, 0, 0, 8, 100, 0, 1100)
    assert opt_level_target_lines([o1, lean]) == [
        "lean bf16-mixed host syncs per step, none: 0 -> met",
        "lean bf16-mixed ops and Python calls <= O1's: 100 vs 100, 1,100 vs 1,000 -> MISSED",
    ]


def test_counts_report_has_the_opt_level_table(capsys: pytest.CaptureFixture[str]) -> None:
    """`--counts --quick` prints the opt levels' table after the syncs table, O2's targets under it."""
    assert bench_cli.main(["--counts", "--quick"]) == 0
    report = capsys.readouterr().out
    assert "| opt level | precision | weight casts fwd / bwd / step (per weight) |" in report
    assert "| O2 | 16-mixed |" in report
    assert "O2 16-mixed weight casts: none in forward or backward, <= 1 per weight in the step" in report


def test_ddp_all_reduces_4_bytes_per_parameter_in_fp32_and_2_with_half_weights() -> None:
    """Under DDP (gloo, 2 processes) fp32 gradients (fp32 training, O1) cost 4 bytes per parameter per step on the
    wire, O3's bf16 gradients 2, each in buckets of its dtype."""
    o0, o1, o3 = measure_allreduced_bytes([("O0", "32-true"), ("O1", "16-mixed"), ("O3", "bf16-mixed")], timeout=60)
    assert o0.bytes_by_dtype == {"torch.float32": 4 * o0.trainable_elements}
    assert o1.bytes_by_dtype == o0.bytes_by_dtype
    assert o3.bytes_by_dtype == {"torch.bfloat16": 2 * o3.trainable_elements}
    assert o3.total / o1.total == 0.5
