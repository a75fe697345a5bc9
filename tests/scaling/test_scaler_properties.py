"""Properties of the scale rules and of the LossScaler that applies them, over any sequence of iterations.

:func:`~lightning_mp.scaling.rules.next_state` is checked against the documented invariants on its own; then the real
scaler is driven with real (tiny) tensors, with a plain optimizer (rules on the host) and a fused one (rules on the
device), and must follow the pure function step by step.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_mp import LossScaleCollapseError, LossScaler, MixedPrecision
from lightning_mp.scaling.rules import COLLAPSE_FLOOR, FLOAT32_MAX, ScalerSettings, ScaleState, next_state

# Derandomized: CI must not fail on an example no earlier run saw; raise max_examples locally to search further.
PROPERTY_SETTINGS = settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


@st.composite
def valid_fields(draw: st.DrawFn) -> dict[str, Any]:
    """Settings within their documented ranges, with scales small enough that a real fp32 gradient never overflows."""
    max_scale = draw(st.floats(1e-3, 2.0**24))
    min_scale = draw(st.one_of(st.none(), st.floats(1e-6, max_scale)))
    init_scale = draw(st.floats(min_scale if min_scale is not None else 1e-6, max_scale))
    return {
        "init_scale": init_scale,
        "growth_factor": draw(st.one_of(st.floats(1.0, 8.0, exclude_min=True), st.just(1e300))),
        "backoff_factor": draw(st.floats(0.0, 1.0, exclude_min=True, exclude_max=True)),
        "growth_interval": draw(st.integers(1, 5)),
        "hysteresis": draw(st.integers(1, 4)),
        "consecutive_hysteresis": draw(st.booleans()),
        "min_scale": min_scale,
        "max_scale": max_scale,
        "on_min_scale": draw(st.sampled_from(["raise", "warn"])),
    }


@PROPERTY_SETTINGS
@given(settings=valid_fields(), overflows=st.lists(st.booleans(), max_size=60))
def test_next_state_keeps_the_scale_in_bounds_with_a_finite_inverse(settings, overflows):
    """Over any sequence of iterations the rules keep the scale a float32 in [floor, max_scale] with finite 1/scale."""
    rules = ScalerSettings(**settings)
    assume(rules.floor_float32 <= rules.max_scale)
    state = rules.initial_state()
    for overflow in overflows:
        transition = next_state(state, overflow, rules)
        if transition.event == "collapsed":
            assert overflow and rules.on_min_scale == "raise" and transition.state.scale == state.scale
            return
        state = transition.state
        assert rules.floor <= state.scale <= rules.max_scale
        assert math.isfinite(1.0 / state.scale)
        assert torch.tensor(state.scale, dtype=torch.float32).item() == state.scale
        assert 0 <= state.hysteresis_left <= rules.hysteresis
        assert 0 <= state.growth_tracker < rules.growth_interval


@PROPERTY_SETTINGS
@given(settings=valid_fields(), clean=st.integers(0, 30))
def test_hysteresis_absorbs_exactly_hysteresis_minus_one_overflows(settings, clean):
    """From a full tracker, hysteresis - 1 overflows in a row keep the scale; the next one backs off (or collapses)."""
    rules = ScalerSettings(**settings)
    state = ScaleState(rules.initial_state().scale, 0, rules.hysteresis)
    for _ in range(rules.hysteresis - 1):
        transition = next_state(state, True, rules)
        assert transition.state.scale == state.scale and transition.event == "none"
        state = transition.state
    assert next_state(state, True, rules).event in ("backed_off", "held_at_floor", "collapsed", "none")
    assert next_state(state, True, rules).state.hysteresis_left == 0


def test_a_huge_growth_factor_grows_to_max_scale():
    """growth_factor=1e300 overflows float32, yet the scale grows to max_scale instead of staying put."""
    rules = ScalerSettings(init_scale=2.0, growth_factor=1e300, growth_interval=1, max_scale=2.0**20)
    transition = next_state(rules.initial_state(), False, rules)
    assert transition.state.scale == 2.0**20 and transition.event == "grew"


def test_growth_tracker_counts_iterations_and_resets_on_overflow():
    """growth_interval clean iterations grow the scale once; an overflow in between restarts the count."""
    rules = ScalerSettings(init_scale=8.0, growth_interval=3)
    state = rules.initial_state()
    for overflow in (False, False, True, False, False):
        state = next_state(state, overflow, rules).state
    assert (state.scale, state.growth_tracker) == (4.0, 2)
    assert next_state(state, False, rules).state.scale == 8.0


def _drive(scaler: LossScaler, model: nn.Linear, optimizer: torch.optim.Optimizer, overflow: bool) -> None:
    """One real step: scaled backward, an inf planted in the gradient on overflow, step and update."""
    optimizer.zero_grad(set_to_none=True)
    loss = model(torch.ones(1, 2)).sum()
    scaler.scale(loss).backward()
    if overflow:
        model.weight.grad[0, 1] = math.inf
    scaler.step(optimizer)
    scaler.update()


@pytest.mark.slow
@pytest.mark.parametrize("fused", [False, True], ids=["rules-on-host", "rules-on-device"])
@PROPERTY_SETTINGS
@given(settings=valid_fields(), overflows=st.lists(st.booleans(), max_size=30))
def test_scaler_follows_next_state_on_the_host_and_on_the_device(fused, settings, overflows):
    """The real scaler (plain SGD: host rules; fused Adam: device rules) moves exactly as next_state says."""
    rules = ScalerSettings(**settings)
    # A range so narrow that it holds no float32 at all cannot be kept by a float32 scale.
    assume(rules.floor_float32 <= rules.max_scale)
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    optimizer = (
        torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
        if fused
        else torch.optim.SGD(model.parameters(), lr=1e-3)
    )
    scaler = LossScaler("cpu", **settings)
    expected = rules.initial_state()
    skipped = 0
    for overflow in overflows:
        before = [p.detach().clone() for p in model.parameters()]
        transition = next_state(expected, overflow, rules)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if transition.event == "collapsed":
                with pytest.raises(LossScaleCollapseError) as error:
                    _drive(scaler, model, optimizer, overflow)
                assert error.value.floor == rules.floor and error.value.scale == expected.scale
                return
            _drive(scaler, model, optimizer, overflow)
        expected, skipped = transition.state, skipped + overflow
        assert any("at its floor" in str(w.message) for w in caught) == (transition.event == "held_at_floor")
        assert scaler.get_scale() == expected.scale
        assert scaler.scale(torch.ones(())).item() == expected.scale, "the device scale differs from the rules"
        assert (scaler.hysteresis_tracker, scaler.state_dict()["_growth_tracker"]) == (
            expected.hysteresis_left,
            expected.growth_tracker,
        )
        stats = scaler.stats()
        assert (stats.skipped_steps, stats.last_step_skipped) == (skipped, overflow)
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        assert unchanged == overflow


INVALID = {
    "init_scale": [0.0, -1.0, math.nan, math.inf, True, "65536", None, 1e-9, 10**400],
    "growth_factor": [1.0, 0.5, -2.0, math.nan, math.inf, False, None],
    "backoff_factor": [0.0, 1.0, 1.5, -0.5, math.nan, True, None],
    "growth_interval": [0, -3, 2.5, math.inf, True, "10", None, 2**31, 10**400],
    "hysteresis": [0, -1, 1.5, False, "2", None],
    "min_scale": [0.0, -1.0, math.nan, math.inf, True, "1", 1e-30],
    "consecutive_hysteresis": ["no", 1, None],
    "max_scale": [0.0, -1.0, math.nan, math.inf, False, None, 1e39, 10**400],
    "on_min_scale": ["ignore", "", None, 1],
}


_PLUGIN_DEFAULTS_WHEN_NONE = {
    "init_scale": 2.0**16,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2000,
}
"""torch's defaults, which MixedPrecision takes when these settings are None."""


def _is_valid(settings: dict[str, Any]) -> bool:
    """The documented ranges, written out independently of lightning_mp's checks."""

    def integer(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value <= 2**31 - 1

    def real(value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        try:
            return math.isfinite(float(value))
        except OverflowError:
            return False

    min_scale, max_scale, init_scale = settings["min_scale"], settings["max_scale"], settings["init_scale"]
    return (
        real(init_scale)
        and init_scale > 0
        and real(settings["growth_factor"])
        and settings["growth_factor"] > 1
        and real(settings["backoff_factor"])
        and 0 < settings["backoff_factor"] < 1
        and integer(settings["growth_interval"])
        and settings["growth_interval"] >= 1
        and integer(settings["hysteresis"])
        and settings["hysteresis"] >= 1
        and real(max_scale)
        and COLLAPSE_FLOOR <= max_scale <= FLOAT32_MAX
        and (min_scale is None or (real(min_scale) and COLLAPSE_FLOOR <= min_scale <= max_scale))
        and (min_scale if min_scale is not None else COLLAPSE_FLOOR) <= init_scale <= max_scale
        and isinstance(settings["consecutive_hysteresis"], bool)
        and settings["on_min_scale"] in ("raise", "warn")
    )


@st.composite
def any_fields(draw: st.DrawFn) -> dict[str, Any]:
    """Valid settings with any number of them replaced by invalid values."""
    settings = draw(valid_fields())
    for name, bad_values in INVALID.items():
        if draw(st.integers(0, 4)) == 0:
            settings[name] = draw(st.sampled_from(bad_values))
    return settings


@PROPERTY_SETTINGS
@given(settings=any_fields(), overflows=st.lists(st.booleans(), max_size=6))
def test_invalid_arguments_raise_value_error_and_valid_ones_never_crash(settings, overflows):
    """Every invalid argument is a ValueError, from LossScaler and MixedPrecision alike; valid ones train."""
    # The plugin's torch settings take None for "torch's default", so that a GradScaler passed as `scaler` can be told
    # apart from settings given beside it; for the plugin a None there is that default, not an invalid value.
    plugin_fields = {
        name: value for name, value in settings.items() if not (name in _PLUGIN_DEFAULTS_WHEN_NONE and value is None)
    }
    plugin_valid = _is_valid(
        {**settings, **{n: _PLUGIN_DEFAULTS_WHEN_NONE[n] for n in settings.keys() - plugin_fields.keys()}}
    )
    cases = {
        "LossScaler": (lambda: LossScaler("cpu", **settings), _is_valid(settings)),
        "MixedPrecision": (lambda: MixedPrecision("16-mixed", **settings), plugin_valid),
    }
    for name, (construct, valid) in cases.items():
        if valid:
            construct()
            continue
        try:
            construct()
        except ValueError:
            continue
        raise AssertionError(f"{name} accepted invalid arguments {settings}")
    if not _is_valid(settings):
        return
    scaler = LossScaler("cpu", **settings)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for overflow in overflows:
            try:
                _drive(scaler, model, optimizer, overflow)
            except LossScaleCollapseError:
                # The one documented way a valid scaler stops: the scale reached its floor.
                assert settings["on_min_scale"] == "raise"
                return
    assert all(torch.isfinite(p).all() for p in model.parameters())
