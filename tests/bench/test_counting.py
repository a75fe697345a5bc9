"""The counting helper, checked on cases whose answer is known before anything else relies on it."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from lightning_mp.bench.counting import WeightCastCounter, count_python_calls, count_syncs_and_ops


def _scaled_step_setup(fused: bool) -> tuple[nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]:
    model = nn.Linear(8, 4)
    optimizer = (
        torch.optim.Adam(model.parameters(), fused=True)
        if fused
        else torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
    )
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(2):  # past lazy initialisation: count a steady-state step
        optimizer.zero_grad()
        scaler.scale(model(torch.randn(2, 8)).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad()
    scaler.scale(model(torch.randn(2, 8)).sum()).backward()
    return model, optimizer, scaler


def test_torch_grad_scaler_step_syncs_once_with_a_foreach_optimizer() -> None:
    """torch's GradScaler.step reads the inf flag once to decide the skip: the counter sees exactly that one."""
    _, optimizer, scaler = _scaled_step_setup(fused=False)
    with count_syncs_and_ops() as counts:
        scaler.step(optimizer)
    assert counts.syncs == 1
    assert counts.sync_ops == ["aten._local_scalar_dense.default"]
    assert counts.compute_ops > 0


def test_torch_grad_scaler_step_never_syncs_with_a_fused_optimizer() -> None:
    """A fused optimizer takes the inf flag into its kernel: torch's GradScaler.step makes no sync."""
    _, optimizer, scaler = _scaled_step_setup(fused=True)
    with count_syncs_and_ops() as counts:
        scaler.step(optimizer)
        scaler.update()
    assert counts.syncs == 0


def test_item_tolist_bool_and_numpy_each_count_one_sync() -> None:
    """Every way of reading a tensor into Python counts once, however many levels it passes through."""
    values = torch.arange(4.0)
    with count_syncs_and_ops() as counts:
        values.sum().item()
        values.tolist()
        bool(values.sum() > 0)
        values.numpy()
    assert counts.syncs == 4


def test_pure_compute_counts_ops_and_no_sync() -> None:
    """A region that only computes on tensors has no sync, and each op is counted once."""
    x = torch.randn(3, 3)
    with count_syncs_and_ops() as counts:
        torch.mm(x, x).relu_()
    assert counts.syncs == 0
    assert counts.ops_by_name["aten.mm.default"] == 1
    assert counts.ops_by_name["aten.relu_.default"] == 1
    assert counts.compute_ops == 2


def test_python_calls_count_python_functions_only() -> None:
    """Three calls of a Python function count three; C functions such as len() count nothing."""

    def python_function() -> int:
        return len([1, 2])

    with count_python_calls() as calls:
        for _ in range(3):
            python_function()
    assert calls.python_calls == 3


def test_python_calls_leave_out_the_excluded_functions() -> None:
    """A tool that starts and stops the counter from its own functions can leave their calls out of the count."""

    def counted() -> None:
        pass

    def tool_hook() -> None:
        counted()

    with count_python_calls(excluding=[tool_hook.__code__]) as calls:
        tool_hook()
    assert calls.python_calls == 1


@pytest.mark.slow
def test_python_calls_leave_out_what_the_garbage_collector_runs() -> None:
    """No garbage collection runs in the block, so garbage piled up before it adds no weak-reference callback to the
    count; the collector is back on after it."""

    class Node:
        def __init__(self) -> None:
            self.me = self  # a cycle: only the garbage collector frees it

    def noted(reference: weakref.ref) -> None:
        pass

    gc.collect()
    keep = [weakref.ref(node, noted) for node in [Node() for _ in range(100)]]  # young garbage, not collected yet
    with count_python_calls() as calls:
        for _ in range(2000):  # enough allocations to trigger a collection, were the collector on
            Node()
    assert calls.python_calls == 2000  # the __init__ calls, no callback
    assert gc.isenabled()
    gc.collect()
    assert all(reference() is None for reference in keep)


def _linear_with_its_weights() -> tuple[nn.Module, list[torch.Tensor]]:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    return model, list(model.parameters())


def test_autocast_casts_each_weight_once_per_forward_and_backward_casts_none() -> None:
    """Under autocast every weight is cast once, however often it is used (the cache); backward casts no weight."""
    model, weights = _linear_with_its_weights()
    inputs = torch.randn(3, 4)
    with WeightCastCounter(model.parameters) as casts:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(inputs).float().sum() + model(inputs).float().sum()
        casts.start_phase("backward")
        loss.backward()
    assert casts.by_phase == {"forward": len(weights)}


def test_casts_of_views_and_writes_into_weights_count_and_casts_of_gradients_do_not() -> None:
    """A cast of a transposed weight, a copy_ or _foreach_copy_ of half values into fp32 weights each count per
    weight; casting gradients or copying within one dtype does not."""
    model, weights = _linear_with_its_weights()
    model(torch.randn(3, 4)).sum().backward()
    half_copies = [weight.detach().half() for weight in weights]
    with WeightCastCounter(model.parameters, phase="step") as casts, torch.no_grad():
        weights[0].t().half()
        weights[0].copy_(half_copies[0])
        torch._foreach_copy_(weights, half_copies)
        for weight in weights:
            assert weight.grad is not None
            weight.grad.half()
        weights[1].copy_(weights[1].clone())
    assert casts.by_phase == {"step": 1 + 1 + len(weights)}


def test_weights_are_looked_up_again_at_each_phase() -> None:
    """A tensor that becomes a weight between phases (a master copy swapped in) counts from the next phase on."""
    master = torch.zeros(4, 4)
    weights: list[torch.Tensor] = []
    with WeightCastCounter(lambda: weights) as casts:
        master.half()
        weights.append(master)
        casts.start_phase("step")
        master.half()
    assert casts.by_phase == {"step": 1}
