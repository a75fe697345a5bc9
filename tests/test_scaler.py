"""The LossScaler on its own, driven by hand like a torch GradScaler: hysteresis, bounds, modes and state."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_mp import LossScaleCollapseError, LossScaler


def _step(scaler: LossScaler, model: nn.Linear, optimizer: torch.optim.Optimizer, overflow: bool) -> None:
    """One real fp16-autocast step; ``overflow`` plants an inf in the weight gradient."""
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.ones(2, 4)).float().pow(2).mean()
    scaler.scale(loss).backward()
    if overflow:
        model.weight.grad[0, 0] = float("inf")
    scaler.step(optimizer)
    scaler.update()


@pytest.fixture
def model_and_optimizer() -> tuple[nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def test_hysteresis_two_absorbs_one_overflow_and_backs_off_on_the_second(model_and_optimizer):
    """With hysteresis=2 the first overflow is skipped at the same scale; the second consecutive one halves it."""
    model, optimizer = model_and_optimizer
    scaler = LossScaler("cpu", init_scale=1024.0, hysteresis=2, growth_interval=100)
    _step(scaler, model, optimizer, overflow=True)
    assert scaler.get_scale() == 1024.0
    assert scaler.skipped_steps == 1 and scaler.scale_backoffs == 0
    _step(scaler, model, optimizer, overflow=True)
    assert scaler.get_scale() == 512.0
    assert scaler.skipped_steps == 2 and scaler.scale_backoffs == 1
    # The tracker refills only at a growth: a third overflow backs off at once, as in DeepSpeed and Megatron.
    _step(scaler, model, optimizer, overflow=False)
    _step(scaler, model, optimizer, overflow=True)
    assert scaler.get_scale() == 256.0


def test_consecutive_hysteresis_refills_after_a_clean_step(model_and_optimizer):
    """With consecutive_hysteresis=True only overflows in a row count towards a backoff."""
    model, optimizer = model_and_optimizer
    scaler = LossScaler("cpu", init_scale=1024.0, hysteresis=2, consecutive_hysteresis=True, growth_interval=100)
    for overflow in (True, False, True, False, True):
        _step(scaler, model, optimizer, overflow)
    assert scaler.get_scale() == 1024.0
    assert scaler.skipped_steps == 3


def test_scale_never_exceeds_max_scale(model_and_optimizer):
    """Growth stops at max_scale and growths are counted only when the scale really grew."""
    model, optimizer = model_and_optimizer
    scaler = LossScaler("cpu", init_scale=2.0**10, growth_interval=1, max_scale=2.0**12)
    for _ in range(6):
        _step(scaler, model, optimizer, overflow=False)
        assert scaler.get_scale() <= 2.0**12
    assert scaler.get_scale() == 2.0**12
    assert scaler.scale_growths == 2


def test_min_scale_raise_names_the_step_scale_and_parameter(model_and_optimizer):
    """An overflow that would push the scale below min_scale raises LossScaleCollapseError with a useful message."""
    model, optimizer = model_and_optimizer
    scaler = LossScaler("cpu", init_scale=2.0**11, min_scale=2.0**10, growth_interval=100)
    scaler.param_names = {id(p): n for n, p in model.named_parameters()}
    _step(scaler, model, optimizer, overflow=True)
    assert scaler.get_scale() == 2.0**10
    with pytest.raises(LossScaleCollapseError) as caught:
        _step(scaler, model, optimizer, overflow=True)
    error = caught.value
    assert error.step == 2 and error.scale == 2.0**10
    assert [name for name, _ in error.nonfinite_parameters] == ["weight"]
    assert "weight [2, 4]" in str(error) and "bf16" in str(error)


def test_min_scale_warn_stays_at_the_floor(model_and_optimizer):
    """With on_min_scale='warn' the scale stays at the floor and each collapse warns instead of raising."""
    model, optimizer = model_and_optimizer
    scaler = LossScaler("cpu", init_scale=2.0, min_scale=1.0, on_min_scale="warn", growth_interval=100)
    _step(scaler, model, optimizer, overflow=True)
    with pytest.warns(RuntimeWarning, match="floor"):
        _step(scaler, model, optimizer, overflow=True)
    assert scaler.get_scale() == 1.0
    assert scaler.skipped_steps == 2


def test_collapse_without_min_scale_still_ends(model_and_optimizer):
    """With min_scale=None an always-overflowing model stops with the error within a bounded number of steps."""
    model, optimizer = model_and_optimizer
    scaler = LossScaler("cpu", init_scale=2.0**16, growth_interval=100)
    with pytest.raises(LossScaleCollapseError):
        for _ in range(200):
            _step(scaler, model, optimizer, overflow=True)
    assert scaler.skipped_steps <= 41


def test_static_mode_keeps_the_scale_and_skips_overflows(model_and_optimizer):
    """A static scale never moves, yet an overflowing step is still skipped."""
    model, optimizer = model_and_optimizer
    scaler = LossScaler("cpu", init_scale=128.0, mode="static", growth_interval=1)
    before = model.weight.detach().clone()
    _step(scaler, model, optimizer, overflow=True)
    assert torch.equal(model.weight, before)
    for _ in range(3):
        _step(scaler, model, optimizer, overflow=False)
    assert scaler.get_scale() == 128.0 and scaler.skipped_steps == 1


def test_check_mode_scales_nothing_and_skips_non_finite(model_and_optimizer):
    """Check mode (bf16/fp32) leaves the loss as it is but still refuses to step on inf gradients."""
    model, optimizer = model_and_optimizer
    scaler = LossScaler("cpu", mode="check")
    loss = torch.tensor(3.0)
    assert scaler.scale(loss) is loss and scaler.get_scale() == 1.0
    before = model.weight.detach().clone()
    _step(scaler, model, optimizer, overflow=True)
    assert torch.equal(model.weight, before) and scaler.skipped_steps == 1


def test_state_dict_round_trip_continues_exactly(model_and_optimizer):
    """A restored scaler has the same scale, trackers and counters, and keeps torch's five keys."""
    model, optimizer = model_and_optimizer
    scaler = LossScaler("cpu", init_scale=256.0, hysteresis=3, growth_interval=5)
    for overflow in (False, True, False, False):
        _step(scaler, model, optimizer, overflow)
    state = scaler.state_dict()
    assert {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"} <= set(state)
    restored = LossScaler("cpu", init_scale=256.0, hysteresis=3, growth_interval=5)
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    assert restored.hysteresis_tracker == 2 and restored._get_growth_tracker() == 2
    assert restored.stats() == scaler.stats()


def test_loads_torch_grad_scaler_state(model_and_optimizer):
    """torch's own five-key GradScaler state (Lightning's plugin writes it) loads, counters starting at zero."""
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=4096.0)
    scaler = LossScaler("cpu")
    scaler.load_state_dict(torch_scaler.state_dict())
    assert scaler.get_scale() == 4096.0 and scaler.skipped_steps == 0


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"backoff_factor": 0.0}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"hysteresis": 0}, "hysteresis"),
        ({"init_scale": 0.0}, "init_scale"),
        ({"init_scale": math.inf}, "init_scale"),
        ({"min_scale": 8.0, "max_scale": 4.0, "init_scale": 4.0}, "min_scale"),
        ({"init_scale": 2.0**30}, "init_scale"),
        ({"on_min_scale": "ignore"}, "on_min_scale"),
        ({"mode": "auto"}, "mode"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, argument):
    """Each invalid knob raises ValueError naming the argument and the value."""
    with pytest.raises(ValueError, match=argument) as caught:
        LossScaler("cpu", **kwargs)
    assert repr(next(iter(kwargs.values()))) in str(caught.value) or argument == "min_scale"
