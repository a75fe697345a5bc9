"""What a steady O2 step costs the host and the device: one cast per weight at the step and none in forward or
backward, and no more ATen ops or Python calls than O1's step."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_mp import MixedPrecision
from lightning_mp.bench.counting import count_python_calls, count_syncs_and_ops
from tests.policies.o2.helpers import HALF, PRECISIONS


class WeightCasts(TorchDispatchMode):
    """Counts the reads of the given fp32 weights by ops that write half tensors (casts), and all ops.

    A concatenation of weights holds weights: O2 in bf16 rounds its masters into the model from one (setting the
    tie bit, :func:`~lightning_mp.policies.o2.split.write_rounded`), and a cast from it casts a weight.
    """

    def __init__(self, weights: list[Tensor]) -> None:
        super().__init__()
        self.pointers = {weight.untyped_storage().data_ptr() for weight in weights}
        self.casts = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        tensors = [t for t in tree_leaves((args, kwargs, output)) if isinstance(t, Tensor)]
        if func is torch.ops.aten.cat.default and any(
            t.untyped_storage().data_ptr() in self.pointers for t in tree_leaves(args) if isinstance(t, Tensor)
        ):
            self.pointers.add(output.untyped_storage().data_ptr())
        if any(t.dtype in HALF.values() for t in tensors):
            self.casts += sum(
                t.dtype == torch.float32 and t.untyped_storage().data_ptr() in self.pointers
                for t in tree_leaves((args, kwargs))
                if isinstance(t, Tensor)
            )
        return output


def fabric_step_counts(opt_level: str, precision: str) -> tuple[int, int, int, int]:
    """(weight casts in forward and backward, in the optimizer step, compute ops per step, Python calls per step).

    Compute ops are the dispatched ops that are neither views nor host reads: each launches a kernel on a GPU.
    """
    plugin = MixedPrecision(precision, opt_level=opt_level)  # type: ignore[arg-type]
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    model, optimizer = fabric.setup(model, optimizer)
    features, target = torch.randn(8, 8), torch.randint(0, 4, (8,))

    def forward_backward() -> None:
        fabric.backward(F.cross_entropy(model(features), target))

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(2):  # steady state
        forward_backward()
        step()
    # The fp32 weights: O2's masters, kept beside its half parameters; O1's parameters themselves.
    masters = plugin.policy.masters if opt_level == "O2" else None  # type: ignore[union-attr]
    weights = masters.master_params if masters is not None else [p for p in model.parameters() if p.ndim]
    with WeightCasts(weights) as in_forward_and_backward:
        forward_backward()
    with WeightCasts(weights) as in_step:
        step()
    with count_syncs_and_ops() as counts:
        forward_backward()
        step()
    with count_python_calls() as calls:
        forward_backward()
        step()
    plugin.teardown()
    return in_forward_and_backward.casts, in_step.casts, counts.compute_ops, calls.python_calls


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_casts_each_weight_once_per_optimizer_step_and_never_in_forward_or_backward(precision: str) -> None:
    """Steady O2 steps cast no weight in forward or backward and each converted weight once at the step."""
    in_forward_and_backward, in_step, _, _ = fabric_step_counts("O2", precision)
    assert in_forward_and_backward == 0
    assert in_step == 4  # the two linears' weights and biases; the LayerNorm stays fp32


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_dispatches_no_more_compute_ops_than_o1_and_a_fixed_few_more_python_calls(precision: str) -> None:
    """A steady O2 step dispatches no more compute ops than O1 (in bf16 its masters are rounded into the model in a
    fixed few ops per chunk of weights), and makes a fixed few more Python calls (its optimizer hooks), whatever the
    number of parameters: nothing per parameter."""
    _, _, o1_ops, o1_calls = fabric_step_counts("O1", precision)
    _, _, o2_ops, o2_calls = fabric_step_counts("O2", precision)
    assert o2_ops <= o1_ops
    assert o2_calls <= o1_calls + 16
