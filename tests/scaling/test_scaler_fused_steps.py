"""bf16 and fp32 ("check" mode) skip non-finite steps on the device: the fused step of foreach and single-tensor
Adam, AdamW, SGD and Adagrad, against the optimizer used as the user configured it.

A step runs through torch's fused kernel of the same update rule, given the inf flag: no host sync, the user's
optimizer object, param_groups and state layout unchanged, and the trajectory within rounding of the user's form.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from lightning_mp import LossScaler
from lightning_mp.bench.counting import count_syncs_and_ops
from tests.helpers import OPTIMIZER_FORMS, assert_within_rounding

HANDED_OFF = [name for name in OPTIMIZER_FORMS if not name.startswith("fused")]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _backward(model: nn.Module, step: int, overflow: bool = False) -> None:
    model.zero_grad(set_to_none=True)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
    model(x).pow(2).mean().backward()
    if overflow:
        model[0].weight.grad[0, 0] = float("nan")


def _state(optimizer: torch.optim.Optimizer) -> dict:
    return copy.deepcopy(optimizer.state_dict())


@pytest.mark.parametrize("name", HANDED_OFF)
def test_a_check_mode_step_never_syncs_and_a_nonfinite_one_changes_nothing(name):
    """In bf16/fp32 a steady step and update make no host sync; a NaN step leaves weights and state untouched."""
    model = _model()
    optimizer = OPTIMIZER_FORMS[name](model.parameters(), lr=0.1)
    scaler = LossScaler("cpu", mode="check")
    for step in range(4):
        _backward(model, step, overflow=step == 3)
        weights, state = [p.detach().clone() for p in model.parameters()], _state(optimizer)
        with count_syncs_and_ops() as counts:
            scaler.step(optimizer)
            scaler.update()
        # SGD's very first momentum step is decided on the host (its fused kernel cannot skip it safely), and the
        # first step decided on the device makes the host's view of the flag, once.
        if step > 1:
            assert counts.syncs == 0, counts.sync_ops
    for before, after in zip(weights, model.parameters(), strict=True):
        assert torch.equal(before, after)
    after_state = _state(optimizer)
    for index, saved in state["state"].items():
        for key, value in saved.items():
            assert torch.equal(after_state["state"][index][key], value), key  # exp_avg, step, momentum, sum
    assert scaler.stats().skipped_steps == 1 and scaler.stats().optimizer_steps == 4
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("name", HANDED_OFF)
def test_the_fused_step_keeps_the_users_optimizer_configuration_and_state_layout(name):
    """param_groups read as configured after steps, and the state dict loads into a fresh optimizer of the same form."""
    model = _model()
    optimizer = OPTIMIZER_FORMS[name](model.parameters(), lr=0.1)
    configured = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    scaler = LossScaler("cpu", mode="check")
    for step in range(3):
        _backward(model, step)
        scaler.step(optimizer)
        scaler.update()
    assert [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups] == configured
    assert not hasattr(optimizer, "found_inf") and not hasattr(optimizer, "grad_scale")
    twin = _model()
    resumed = OPTIMIZER_FORMS[name](twin.parameters(), lr=0.1)
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # as a checkpoint file would
    twin.load_state_dict(model.state_dict())
    _backward(model, 9)
    _backward(twin, 9)
    optimizer.step()  # the user's own form, without the scaler, continues from the handed-off state
    resumed.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", HANDED_OFF)
def test_a_handed_off_optimizer_pickles_and_steps_on_as_its_copy_does(name):
    """After steps through the fused kernel, a pickled copy of model and optimizer (ddp_spawn, torch.save) has the
    same state_dict, and both take the same steps on, their own form's and handed-off ones alike."""
    model = _model()
    optimizer = OPTIMIZER_FORMS[name](model.parameters(), lr=0.1)
    scaler = LossScaler("cpu", mode="check")
    for step in range(2):
        _backward(model, step)
        scaler.step(optimizer)
        scaler.update()
    copied_model, copied_optimizer = pickle.loads(pickle.dumps((model, optimizer)))
    state, copied_state = _state(optimizer), _state(copied_optimizer)
    assert state["param_groups"] == copied_state["param_groups"]
    for index, saved in state["state"].items():
        assert saved.keys() == copied_state["state"][index].keys()
        assert all(torch.equal(value, copied_state["state"][index][key]) for key, value in saved.items())
    copied_scaler = LossScaler("cpu", mode="check")
    for step, through_scaler in ((2, False), (3, True)):
        for each in ((model, optimizer, scaler), (copied_model, copied_optimizer, copied_scaler)):
            each_model, each_optimizer, each_scaler = each
            _backward(each_model, step)
            if through_scaler:
                each_scaler.step(each_optimizer)
                each_scaler.update()
            else:
                each_optimizer.step()
    for a, b in zip(model.parameters(), copied_model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", HANDED_OFF)
def test_the_fused_kernel_follows_the_users_form_within_rounding(name):
    """Over 50 steps the weights stay within a few float32 roundings of those the user's own form computes.

    The fused kernels evaluate the same update rule in another order (bias corrections, fused multiply-adds), so
    single roundings differ; the trajectory does not drift beyond them.
    """
    ours, theirs = _model(), _model()
    ours_optimizer = OPTIMIZER_FORMS[name](ours.parameters(), lr=0.01)
    theirs_optimizer = OPTIMIZER_FORMS[name](theirs.parameters(), lr=0.01)
    scaler = LossScaler("cpu", mode="check")
    for step in range(50):
        _backward(ours, step)
        _backward(theirs, step)
        scaler.step(ours_optimizer)
        scaler.update()
        theirs_optimizer.step()
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert_within_rounding(a, b)


@pytest.mark.parametrize("name", ["foreach AdamW", "single-tensor SGD"])
def test_optimizers_the_fused_kernel_cannot_take_are_skipped_on_the_host(name):
    """Complex parameters and differentiable optimizers keep their own form; a NaN step is still skipped."""
    weight = nn.Parameter(torch.ones(2, dtype=torch.complex64))
    optimizer = OPTIMIZER_FORMS[name]([weight], lr=0.1)
    scaler = LossScaler("cpu", mode="check")
    weight.grad = torch.full((2,), complex(float("nan"), 0.0))
    with count_syncs_and_ops() as counts:
        scaler.step(optimizer)
    scaler.update()
    assert counts.syncs == 1 and torch.equal(weight, torch.ones(2, dtype=torch.complex64))
    weight.grad = torch.ones(2, dtype=torch.complex64)
    scaler.step(optimizer)
    scaler.update()
    assert not torch.equal(weight, torch.ones(2, dtype=torch.complex64))
    assert scaler.stats().skipped_steps == 1


def test_skip_nonfinite_false_takes_every_step_like_lightning():
    """skip_nonfinite=False checks nothing: no op of its own, and a NaN step reaches the weights, as in Lightning."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=True)
    scaler = LossScaler("cpu", mode="check", skip_nonfinite=False)
    reference = copy.deepcopy(model)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1, foreach=True)
    for step in range(2):
        _backward(model, step)
        _backward(reference, step)
        with count_syncs_and_ops() as reference_counts:
            reference_optimizer.step()
        with count_syncs_and_ops() as counts:
            scaler.step(optimizer)
            scaler.update()
    assert (counts.compute_ops, counts.syncs) == (reference_counts.compute_ops, reference_counts.syncs)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)
    _backward(model, 2, overflow=True)
    scaler.step(optimizer)
    scaler.update()
    assert not torch.isfinite(model[0].weight).all() and scaler.stats().skipped_steps == 0


@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_skip_nonfinite_false_is_refused_where_the_loss_is_scaled(mode):
    """An fp16 scaler must skip overflowing steps: skip_nonfinite=False with a scaled mode is a clear error."""
    with pytest.raises(ValueError, match=rf"LossScaler\(mode='{mode}', skip_nonfinite=False\) is not allowed"):
        LossScaler("cpu", mode=mode, skip_nonfinite=False)
    with pytest.raises(ValueError, match=r"skip_nonfinite='no'\) is not allowed: skip_nonfinite must be True or"):
        LossScaler("cpu", mode="check", skip_nonfinite="no")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_foreach_adamw_step_never_syncs_and_its_step_count_moves_to_the_device():
    """On CUDA a bf16/fp32 foreach AdamW step and update make no host sync, a NaN step changes nothing, and the step
    count lives on the device from the first handed-off step on (as with fused=True)."""
    model = _model().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=True)
    scaler = LossScaler("cuda", mode="check")
    for step in range(4):
        model.zero_grad(set_to_none=True)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step)).cuda()
        model(x).pow(2).mean().backward()
        if step == 3:
            model[0].weight.grad[0, 0] = float("nan")
        weights = [p.detach().clone() for p in model.parameters()]
        with count_syncs_and_ops() as counts:
            scaler.step(optimizer)
            scaler.update()
        if step > 0:
            assert counts.syncs == 0, counts.sync_ops
    for before, after in zip(weights, model.parameters(), strict=True):
        assert torch.equal(before, after)
    steps = [optimizer.state[p]["step"] for p in model.parameters()]
    assert all(s.device.type == "cuda" and s.item() == 3 for s in steps)
    assert optimizer.param_groups[0]["foreach"] is True and not optimizer.param_groups[0]["fused"]
