"""The counting helper, checked on cases whose answer is known before anything else relies on it."""

from __future__ import annotations

import torch
from torch import nn

from lightning_mp.counting import count_python_calls, count_syncs_and_ops


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
