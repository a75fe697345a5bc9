"""Properties of the LossScaler: its arguments, and its scale over any sequence of clean and overflowing steps.

The real scaler is driven with real (tiny) tensors and checked, step by step, against a reference model of the rules
in :mod:`lightning_mp.scaler`, written here independently of the implementation.
"""

from __future__ import annotations

import math
import struct
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_mp import LossScaleCollapseError, LossScaler, MixedPrecision

FLOOR_WITHOUT_MIN_SCALE = 2.0**-24
PROPERTY_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def f32(value: float) -> float:
    """The float32 the device-side scale would hold."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.inf


def f32_inside(value: float, low: float, high: float) -> float:
    """The float32 nearest to ``value`` among those in ``[low, high]``: the scale never leaves the user's range."""
    rounded = torch.tensor(value, dtype=torch.float32)
    if rounded.item() < low:
        rounded = torch.nextafter(rounded, torch.tensor(math.inf))
    elif rounded.item() > high:
        rounded = torch.nextafter(rounded, torch.tensor(0.0))
    return rounded.item()


@dataclass
class ReferenceScaler:
    """The documented rules: hysteresis, growth after a clean window, backoff, floor and ceiling."""

    init_scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    hysteresis: int
    consecutive_hysteresis: bool
    min_scale: float | None
    max_scale: float
    on_min_scale: str
    scale: float = 0.0
    growth_tracker: int = 0
    hysteresis_left: int = 0
    counters: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.scale = f32_inside(self.init_scale, self.floor, self.max_scale)
        self.hysteresis_left = self.hysteresis
        self.counters = dict.fromkeys(("steps", "skipped", "backoffs", "growths"), 0)

    @property
    def floor(self) -> float:
        return self.min_scale if self.min_scale is not None else FLOOR_WITHOUT_MIN_SCALE

    def step(self, overflow: bool) -> str:
        """Apply one step; return "collapse", "floor" (warned, held at the floor) or "ok"."""
        self.counters["steps"] += 1
        if not overflow:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                if not self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                grown = f32(self.scale * self.growth_factor)
                ceiling = f32_inside(self.max_scale, 0.0, self.max_scale)
                grown = min(grown if math.isfinite(grown) else self.scale, ceiling)
                if grown > self.scale:
                    self.scale, self.counters["growths"] = grown, self.counters["growths"] + 1
            return "ok"
        self.counters["skipped"] += 1
        self.growth_tracker = 0
        self.hysteresis_left -= 1
        if self.hysteresis_left > 0:
            return "ok"
        backed_off = f32(self.scale * self.backoff_factor)
        outcome = "ok"
        if backed_off < self.floor:
            if self.on_min_scale == "raise":
                return "collapse"
            backed_off, outcome = f32_inside(self.floor, self.floor, math.inf), "floor"
        if backed_off < self.scale:
            self.scale, self.counters["backoffs"] = backed_off, self.counters["backoffs"] + 1
        return outcome


def _drive(scaler: LossScaler, model: nn.Linear, optimizer: torch.optim.Optimizer, overflow: bool) -> None:
    """One real step: scaled backward, an inf planted in the gradient on overflow, step and update."""
    optimizer.zero_grad(set_to_none=True)
    loss = model(torch.ones(1, 2)).sum()
    scaler.scale(loss).backward()
    if overflow:
        model.weight.grad[0, 1] = math.inf
    scaler.step(optimizer)
    scaler.update()


@st.composite
def valid_knobs(draw: st.DrawFn) -> dict[str, Any]:
    """Knobs within their documented ranges, with scales small enough that a real fp32 gradient never overflows."""
    max_scale = draw(st.floats(1e-3, 2.0**24))
    min_scale = draw(st.one_of(st.none(), st.floats(1e-6, max_scale)))
    init_scale = draw(st.floats(min_scale if min_scale is not None else 1e-6, max_scale))
    return {
        "init_scale": init_scale,
        "growth_factor": draw(st.floats(1.0, 8.0, exclude_min=True)),
        "backoff_factor": draw(st.floats(0.0, 1.0, exclude_min=True, exclude_max=True)),
        "growth_interval": draw(st.integers(1, 5)),
        "hysteresis": draw(st.integers(1, 4)),
        "consecutive_hysteresis": draw(st.booleans()),
        "min_scale": min_scale,
        "max_scale": max_scale,
        "on_min_scale": draw(st.sampled_from(["raise", "warn"])),
    }


@PROPERTY_SETTINGS
@given(knobs=valid_knobs(), overflows=st.lists(st.booleans(), max_size=40))
def test_scale_follows_the_reference_rules_and_stays_in_bounds(knobs, overflows):
    """Over any sequence of steps the scale stays in [min_scale, max_scale] and moves exactly as the rules say."""
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    reference = ReferenceScaler(**knobs)
    low = reference.floor
    # A range so narrow that it holds no float32 at all cannot be kept by a float32 scale.
    assume(f32_inside(low, low, math.inf) <= knobs["max_scale"])
    scaler = LossScaler("cpu", **knobs)
    for overflow in overflows:
        before = [p.detach().clone() for p in model.parameters()]
        expected = reference.step(overflow)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if expected == "collapse":
                try:
                    _drive(scaler, model, optimizer, overflow)
                except LossScaleCollapseError as error:
                    assert error.floor == low
                    assert error.scale == reference.scale
                    return
                raise AssertionError("the scale fell below its floor without LossScaleCollapseError")
            _drive(scaler, model, optimizer, overflow)
        assert any("at its floor" in str(w.message) for w in caught) == (expected == "floor")
        assert low <= scaler.get_scale() <= knobs["max_scale"]
        assert scaler.get_scale() == reference.scale
        assert scaler.scale(torch.ones(())).item() == reference.scale, "the loss is not multiplied by the scale"
        assert scaler.hysteresis_tracker == reference.hysteresis_left
        assert scaler.state_dict()["_growth_tracker"] == reference.growth_tracker
        stats = scaler.stats()
        assert (stats.optimizer_steps, stats.skipped_steps) == (
            reference.counters["steps"],
            reference.counters["skipped"],
        )
        assert (stats.scale_backoffs, stats.scale_growths) == (
            reference.counters["backoffs"],
            reference.counters["growths"],
        )
        assert stats.last_step_skipped == overflow
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        assert unchanged == overflow


INVALID = {
    "init_scale": [0.0, -1.0, math.nan, math.inf, True, "65536", None],
    "growth_factor": [1.0, 0.5, -2.0, math.nan, math.inf, False, None],
    "backoff_factor": [0.0, 1.0, 1.5, -0.5, math.nan, True, None],
    "growth_interval": [0, -3, 2.5, math.inf, True, "10", None],
    "hysteresis": [0, -1, 1.5, False, "2", None],
    "min_scale": [0.0, -1.0, math.nan, math.inf, True, "1"],
    "max_scale": [0.0, -1.0, math.nan, math.inf, False, None],
    "on_min_scale": ["ignore", "", None, 1],
}


def _is_valid(knobs: dict[str, Any]) -> bool:
    """The documented ranges, written out independently of lightning_mp's checks."""

    def real(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    def integer(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    min_scale, max_scale, init_scale = knobs["min_scale"], knobs["max_scale"], knobs["init_scale"]
    return (
        real(init_scale)
        and init_scale > 0
        and real(knobs["growth_factor"])
        and knobs["growth_factor"] > 1
        and real(knobs["backoff_factor"])
        and 0 < knobs["backoff_factor"] < 1
        and integer(knobs["growth_interval"])
        and knobs["growth_interval"] >= 1
        and integer(knobs["hysteresis"])
        and knobs["hysteresis"] >= 1
        and real(max_scale)
        and max_scale > 0
        and (min_scale is None or (real(min_scale) and 0 < min_scale <= max_scale))
        and (min_scale if min_scale is not None else 0) <= init_scale <= max_scale
        and knobs["on_min_scale"] in ("raise", "warn")
    )


@st.composite
def any_knobs(draw: st.DrawFn) -> dict[str, Any]:
    """Valid knobs with any number of them replaced by invalid values."""
    knobs = draw(valid_knobs())
    for name, bad_values in INVALID.items():
        if draw(st.integers(0, 4)) == 0:
            knobs[name] = draw(st.sampled_from(bad_values))
    return knobs


@PROPERTY_SETTINGS
@given(knobs=any_knobs(), overflows=st.lists(st.booleans(), max_size=6))
def test_invalid_arguments_raise_value_error_and_valid_ones_never_crash(knobs, overflows):
    """Every invalid argument is a ValueError, from LossScaler and MixedPrecision alike; valid ones train."""
    constructors = {
        "LossScaler": lambda: LossScaler("cpu", **knobs),
        "MixedPrecision": lambda: MixedPrecision("16-mixed", **knobs),
    }
    if not _is_valid(knobs):
        for name, construct in constructors.items():
            try:
                construct()
            except ValueError:
                continue
            raise AssertionError(f"{name} accepted invalid arguments {knobs}")
        return
    MixedPrecision("16-mixed", **knobs)
    scaler = constructors["LossScaler"]()
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for overflow in overflows:
            try:
                _drive(scaler, model, optimizer, overflow)
            except LossScaleCollapseError:
                # The one documented way a valid scaler stops: the scale reached its floor.
                assert knobs["on_min_scale"] == "raise"
                return
    assert all(torch.isfinite(p).all() for p in model.parameters())
