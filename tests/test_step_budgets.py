"""Host budgets: the host syncs, ops and Python calls a piece adds to a steady step, counted, never timed.

A sync stalls the host until the device catches up, and every Python call is host time a small model's step cannot
hide. :func:`lightning_mp.bench.counting.count_syncs_and_ops` and
:func:`~lightning_mp.bench.counting.count_python_calls` count them exactly and deterministically, so each budget is an
exact or upper bound. The behaviour of each piece is tested in the module that mirrors it; the budgets that guard a
whole step sit beside their subject: ``bench/test_step_counts.py`` (lightning_mp against torch's loop and Lightning),
``policies/o2/test_step_costs.py`` (O2 against O1) and ``callbacks/test_telemetry_costs.py`` (the callbacks' logging).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from typing_extensions import override

from lightning_mp import MixedPrecision
from lightning_mp.bench.counting import count_python_calls, count_syncs_and_ops
from lightning_mp.bench.opt_level_counts import Task, count_opt_level, markov_counting_task
from lightning_mp.bench.workloads import OPTIMIZER_KINDS, make_optimizer
from lightning_mp.tasks import TinyTransformerLM
from tests.engine.fabric_helpers import batch, train_step
from tests.engine.fabric_helpers import setup as setup_fabric
from tests.policies.test_casting import layers, to_lean_half

# Slow: each budget is counted over warmed-up steps of a real run: the fast loop leaves the module out.
pytestmark = pytest.mark.slow


def test_a_fabric_step_syncs_the_host_once_and_reading_the_stats_never() -> None:
    """A steady-state fp16 Fabric step syncs once (torch's skip decision); the lazy update and the stats add none."""
    plugin = MixedPrecision("16-mixed", init_scale=2.0**8, growth_interval=1)
    fabric, model, optimizer = setup_fabric(plugin)
    train_step(fabric, model, optimizer, seed=0)
    x, y = batch(1)
    loss = nn.functional.mse_loss(model(x), y)
    with count_syncs_and_ops() as step_counts:
        fabric.backward(loss)  # applies the previous step's pending update first
        optimizer.step()
    with count_syncs_and_ops() as stats_counts:
        logged = plugin.stats.as_dict()
    assert step_counts.syncs == 1
    assert stats_counts.syncs == 0
    assert logged["precision/optimizer_steps"] == 2.0
    assert logged["precision/loss_scale"] == 2.0**10


def python_calls_of_a_forward(model: nn.Module, inputs: Tensor) -> int:
    """Python calls of one forward of ``model``, after a first forward that warms it up."""
    model(inputs)
    with count_python_calls() as calls:
        model(inputs)
    return calls.python_calls


def test_lean_casting_hooks_add_a_few_python_calls_per_module_to_a_forward() -> None:
    """Every forward runs the hooks of every half module: they add at most 8 Python calls per hooked module (torch's
    own dispatch of a module with hooks is 3 of them), so a step's host work stays near O1's."""
    inputs = torch.randn(2, 4)
    plain = python_calls_of_a_forward(layers().bfloat16(), inputs.bfloat16())
    hooked = python_calls_of_a_forward(to_lean_half(layers()), inputs)
    assert hooked - plain <= 8 * 8


def test_fp8_cast_stats_run_on_the_device_without_a_host_sync() -> None:
    """Computing the statistics synchronises nothing: a caller reads many of them in one transfer."""
    pytest.importorskip("torchao")  # the FP8 mode's tests run where torchao is installed
    from lightning_mp.fp8.quant import RECIPES, cast_stats

    tensor = torch.randn(32, 32)
    with count_syncs_and_ops() as counts:
        for recipe in RECIPES.values():
            cast_stats(tensor, recipe.input)
            cast_stats(tensor, recipe.grad_output)
    assert counts.syncs == 0, counts.sync_ops


class CountedLM(TinyTransformerLM):
    """The steady-step counter's tiny LM, trained with the optimizer ``optimizer`` names (no scheduler)."""

    def __init__(self, optimizer: str, **sizes: Any) -> None:
        super().__init__(**sizes)
        self.optimizer_name = optimizer

    @override
    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd-momentum":
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return make_optimizer(self.optimizer_name, self.parameters())  # type: ignore[arg-type]


def counted_task(optimizer: str) -> Task:
    """The counter's Markov-text task, with the model trained by ``optimizer``."""

    def task(steps: int) -> tuple[LightningModule, Any]:
        model, data = markov_counting_task(steps)
        return CountedLM(optimizer, **model.hparams), data

    return task


@pytest.mark.parametrize("optimizer", [*OPTIMIZER_KINDS, "sgd-momentum"])
@pytest.mark.parametrize("opt_level", ["lean", "lean-kahan"])
def test_a_steady_lean_step_makes_no_host_sync_and_casts_each_bf16_weight_twice(opt_level: str, optimizer: str) -> None:
    """Lean with fused, foreach or single-tensor AdamW, or SGD: a steady Trainer step never waits for the device, and
    casts each bf16 weight twice, in the optimizer step only (into the fp32 update, and the rounded result back)."""
    counts = count_opt_level(opt_level, "bf16-mixed", counted_task(optimizer))
    model, _ = markov_counting_task(1)
    bf16_weights = sum(1 for name, _ in model.named_parameters() if "norm" not in name)
    assert counts.syncs == 0
    assert (counts.casts_forward, counts.casts_backward, counts.casts_step) == (0, 0, 2 * bf16_weights)


def test_a_steady_lean_step_dispatches_no_more_ops_than_o1() -> None:
    """Lean's step, the stochastic rounding included, launches no more kernels than O1's on the counter's LM."""
    lean = count_opt_level("lean", "bf16-mixed", counted_task("fused"))
    o1 = count_opt_level("O1", "bf16-mixed", counted_task("fused"))
    assert lean.compute_ops <= o1.compute_ops


@pytest.mark.parametrize("optimizer", [*OPTIMIZER_KINDS, "sgd-momentum"])
def test_a_steady_lean_exact_step_adds_no_host_sync_and_at_most_a_tenth_of_work_to_o2(optimizer: str) -> None:
    """lean-exact's packing (rebuild the masters, take the remainders, round) adds no host sync to O2's (none with
    AdamW) and at most 10% to its compute ops and Python calls, with fused, foreach or single-tensor AdamW, or SGD with
    momentum; it casts no weight in forward or backward."""
    exact = count_opt_level("lean-exact", "bf16-mixed", counted_task(optimizer))
    o2 = count_opt_level("O2", "bf16-mixed", counted_task(optimizer))
    assert exact.syncs == o2.syncs
    assert exact.syncs == 0
    assert (exact.casts_forward, exact.casts_backward) == (0, 0)
    assert exact.compute_ops <= 1.10 * o2.compute_ops
    assert exact.python_calls <= 1.10 * o2.python_calls
