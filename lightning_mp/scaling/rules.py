"""The loss scaler's settings and its scale rules, as plain data and a pure function.

:class:`ScalerSettings` declares every setting once, with its default, its documentation and its check;
:func:`next_state` says how the scale and its two trackers move after one iteration, given whether any gradient of
that iteration was inf or NaN. Nothing here touches torch: :class:`~lightning_mp.scaler.LossScaler` applies these
rules on the host when the inf flag is already there, and mirrors them with device ops when it is not (fused
optimizers), and the tests drive them directly.

The rules (dynamic mode; static and check modes never move the scale):

* overflow: the growth tracker resets to 0 and the hysteresis tracker drops by one (never below 0). When it is 0 the
  scale is multiplied by ``backoff_factor``. With ``hysteresis=1`` (the default) this is torch's rule.
* clean iteration: the growth tracker counts up; after ``growth_interval`` clean iterations in a row it resets, the
  scale is multiplied by ``growth_factor`` (capped at ``max_scale``, so even ``growth_factor=1e300`` reaches it) and
  the hysteresis tracker refills. With ``consecutive_hysteresis=True`` it refills after every clean iteration.
* floor: a backoff that would go below the floor (``min_scale``, or ``2**-24`` when it is None) is a collapse. With
  ``on_min_scale="raise"`` the caller raises; with ``"warn"`` the scale stays at the floor.

The scale is a float32 on the device, so every scale here is rounded to float32 and kept inside ``[floor, max_scale]``
after rounding. Since the floor is at least ``2**-24`` and ``max_scale`` at most float32's largest value, ``1/scale``
is always finite. A static scale is the user's own choice and is not bound by the dynamic floor: it may be any normal
float32 (from ``2**-126``, whose inverse ``2**126`` is still finite, to float32's largest), for example a scale below
1 that shrinks a loss whose gradients would overflow fp16.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from lightning_mp.arguments.checks import INT32_MAX, arguments_of, caller, check_choice, check_flag, check_number, exact
from lightning_mp.arguments.setting_docs import setting

__all__ = [
    "COLLAPSE_FLOOR",
    "FLOAT32_MAX",
    "SCALER_DEFAULTS",
    "STATIC_SCALE_FLOOR",
    "ScaleState",
    "ScalerSettings",
    "Transition",
    "next_state",
]

ScalingMode = Literal["dynamic", "static", "check"]
OnMinScale = Literal["raise", "warn"]
Event = Literal["none", "grew", "backed_off", "held_at_floor", "collapsed"]

COLLAPSE_FLOOR = 2.0**-24
"""The smallest scale ever used: below it no fp16 gradient is distinguishable from zero."""

FLOAT32_MAX = struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0]
"""The largest finite float32: a larger scale would be inf on the device."""

STATIC_SCALE_FLOOR = 2.0**-126
"""The smallest static scale: float32's smallest normal number. Its inverse ``2**126`` is finite in float32, and a
normal scale is not flushed to zero where denormals are."""


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    check_choice(name, value, allowed)
    return value


def to_float32(value: float) -> float:
    """Round a Python float to the nearest float32, as the device-side scale tensor stores it (inf beyond range)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def float32_within(value: float, low: float, high: float) -> float:
    """``value`` clamped to ``[low, high]`` and rounded to a float32 that still lies inside ``[low, high]``.

    A bound such as ``min_scale=1e-6`` is not a float32: rounding to the nearest one can land just outside the range
    the user asked for, so the result is moved one float32 step back inside.
    """
    rounded = to_float32(min(max(value, low), high))
    if rounded < low or rounded > high:
        bits = struct.unpack("<I", struct.pack("<f", rounded))[0]
        # For positive floats, the next larger float32 is the next integer bit pattern.
        rounded = struct.unpack("<f", struct.pack("<I", bits + (1 if rounded < low else -1)))[0]
    return rounded


def _interval(name: str, value: Any) -> int:
    return check_number(name, value, at_least=1, at_most=INT32_MAX, integer=True)


def _scale_bound(name: str, value: Any) -> float:
    return check_number(name, value, at_least=COLLAPSE_FLOOR, at_most=FLOAT32_MAX)


@dataclass(frozen=True)
class ScalerSettings:
    """Every setting of the loss scaler, with its default, its documentation and its check, declared once.

    :class:`~lightning_mp.LossScaler` and :class:`~lightning_mp.MixedPrecision` take these settings as keyword arguments
    with these defaults, and their docstrings are written from the fields' ``doc``
    (:mod:`lightning_mp.arguments.setting_docs`). Each
    field's ``metadata`` holds its ``doc`` and its ``check``; ``__post_init__`` runs the checks, then the ones that
    involve two settings. Numbers may be Python numbers, numpy scalars or 0-d tensors; booleans must be ``True`` or
    ``False``. They are stored as Python ``int``/``float``/``bool``.

    Error messages name the public call that built the settings (``LossScaler(...)``, ``MixedPrecision(...)``, or
    ``ScalerSettings(...)`` when built directly): :func:`lightning_mp.arguments.checks.arguments_of`.

    Raises:
        ValueError: naming the argument, the value and what is allowed.

    Example:
        >>> ScalerSettings(init_scale=1024.0, hysteresis=2).floor
        5.960464477539063e-08

    """

    init_scale: float = field(
        default=2.0**16,
        metadata=setting(
            "the first loss scale (fp16), in ``[min_scale, max_scale]``; a static scale is any normal float32, from"
            " ``2**-126`` (whose inverse is finite) to float32's largest; unused when nothing is scaled.",
        ),
    )
    growth_factor: float = field(
        default=2.0,
        metadata=setting(
            "scale multiplier after ``growth_interval`` clean iterations; > 1 (the scale stops at ``max_scale``).",
            lambda name, value: check_number(name, value, above=1),
        ),
    )
    backoff_factor: float = field(
        default=0.5,
        metadata=setting(
            "scale multiplier on an overflow that exhausts the hysteresis; in (0, 1).",
            lambda name, value: check_number(name, value, above=0, below=1),
        ),
    )
    growth_interval: int = field(
        default=2000,
        metadata=setting(
            "clean iterations in a row before the scale grows, in [1, 2**31 - 1]. An iteration is one scale update"
            " (after its last optimizer step), so several optimizers or accumulated batches count once.",
            _interval,
        ),
    )
    hysteresis: int = field(
        default=1,
        metadata=setting(
            "overflows tolerated before the scale backs off (DeepSpeed's and Megatron's meaning), in [1, 2**31 - 1]; 1"
            " is torch's behaviour.",
            _interval,
        ),
    )
    consecutive_hysteresis: bool = field(
        default=False,
        metadata=setting(
            "refill the hysteresis after every clean iteration, not only after a growth.",
            check_flag,
        ),
    )
    min_scale: float | None = field(
        default=None,
        metadata=setting(
            "the scale's floor, from ``2**-24`` to ``max_scale``; None means the collapse floor ``2**-24``.",
            lambda name, value: None if value is None else _scale_bound(name, value),
        ),
    )
    max_scale: float = field(
        default=2.0**24,
        metadata=setting(
            "the scale never grows past this; from ``2**-24`` to float32's largest value.",
            _scale_bound,
        ),
    )
    on_min_scale: OnMinScale = field(
        default="raise",
        metadata=setting(
            '``"raise"`` :class:`~lightning_mp.errors.LossScaleCollapseError`, or ``"warn"`` and stay at the floor,'
            " when an overflow would push the scale below the floor.",
            lambda name, value: _choice(name, value, ("raise", "warn")),
        ),
    )
    mode: ScalingMode = field(
        default="dynamic",
        metadata=setting(
            '``"dynamic"``, ``"static"`` (a fixed ``init_scale``) or ``"check"`` (nothing scaled, non-finite'
            " steps skipped: bf16 and fp32).",
            lambda name, value: _choice(name, value, ("dynamic", "static", "check")),
        ),
    )
    max_consecutive_skips: int | None = field(
        default=100,
        metadata=setting(
            "stop with :class:`~lightning_mp.errors.NonFiniteStepsError` after this many skipped steps in a row of one"
            " optimizer (1 to 2**31 - 1), in every precision; None never stops.",
            lambda name, value: None if value is None else _interval(name, value),
        ),
    )
    skip_nonfinite: bool = field(
        default=True,
        metadata=setting(
            "skip every step whose gradients hold an inf or a NaN, without a host sync for torch's Adam, AdamW, SGD and"
            " Adagrad (:mod:`lightning_mp.scaler`). Only where nothing is scaled (bf16, fp32) may it be False: then"
            ' nothing is checked, as in Lightning\'s ``"bf16-mixed"`` and ``"32-true"``, a step writes inf/NaN into'
            " the weights, and ``skipped_steps`` stays 0. A scaled run (fp16) always skips: its overflows are routine.",
            check_flag,
        ),
    )

    def __post_init__(self) -> None:
        with arguments_of(type(self).__name__):
            self._check_settings()

    def _check_settings(self) -> None:
        normalised = {
            field.name: field.metadata["check"](field.name, getattr(self, field.name))
            for field in fields(self)
            if "check" in field.metadata
        }
        min_scale, max_scale = normalised["min_scale"], normalised["max_scale"]
        if min_scale is not None and min_scale > max_scale:
            raise ValueError(
                f"{caller()}(min_scale={self.min_scale!r}, max_scale={self.max_scale!r}) is not allowed: min_scale"
                " must be <= max_scale."
            )
        if self.mode == "check":
            normalised["init_scale"] = 1.0
        elif self.mode == "static":
            normalised["init_scale"] = check_number(
                "init_scale", self.init_scale, at_least=STATIC_SCALE_FLOOR, at_most=FLOAT32_MAX
            )
        else:
            low = COLLAPSE_FLOOR if min_scale is None else min_scale
            init_scale = check_number("init_scale", self.init_scale, above=0)
            if not low <= init_scale <= max_scale:
                raise ValueError(
                    f"{caller()}(init_scale={self.init_scale!r}) is not allowed: init_scale must lie in"
                    f" [min_scale, max_scale] = [{exact(low)}, {exact(max_scale)}] (min_scale=None means"
                    f" the floor {exact(COLLAPSE_FLOOR)})."
                )
            normalised["init_scale"] = init_scale
        for name, value in normalised.items():
            object.__setattr__(self, name, value)

    @property
    def floor(self) -> float:
        """The smallest scale allowed: ``min_scale``, or ``2**-24`` when it is None."""
        return self.min_scale if self.min_scale is not None else COLLAPSE_FLOOR

    @property
    def floor_float32(self) -> float:
        """The floor as the smallest float32 not below it."""
        return float32_within(self.floor, self.floor, math.inf)

    @property
    def ceiling_float32(self) -> float:
        """``max_scale`` as the largest float32 not above it."""
        return float32_within(self.max_scale, 0.0, self.max_scale)

    @property
    def scales_loss(self) -> bool:
        """Whether the loss is multiplied at all (dynamic or static mode)."""
        return self.mode != "check"

    def initial_state(self) -> ScaleState:
        """The state before the first iteration."""
        if self.mode == "dynamic":
            scale = float32_within(self.init_scale, self.floor, self.max_scale)
        else:
            scale = to_float32(self.init_scale)
        return ScaleState(scale=scale, growth_tracker=0, hysteresis_left=self.hysteresis)


SCALER_DEFAULTS = ScalerSettings()
"""The default of every setting, where a signature or a message needs one."""


@dataclass(frozen=True)
class ScaleState:
    """The part of the scaler that moves: the scale and its two trackers.

    Attributes:
        scale: the scale the next backward uses (a float32 value).
        growth_tracker: clean iterations in a row since the last growth or overflow.
        hysteresis_left: overflows still tolerated before the next backoff.

    """

    scale: float
    growth_tracker: int = 0
    hysteresis_left: int = 1


@dataclass(frozen=True)
class Transition:
    """The result of :func:`next_state`: the new state and what happened to the scale."""

    state: ScaleState
    event: Event = "none"


def next_state(state: ScaleState, found_inf: bool, settings: ScalerSettings) -> Transition:
    """Apply the scale rules of the module docstring to one iteration.

    Args:
        state: the state before the iteration.
        found_inf: whether any gradient of the iteration (any optimizer, any rank) was inf or NaN.
        settings: the settings.

    Returns:
        The new state and the event: ``"grew"``, ``"backed_off"``, ``"held_at_floor"`` (a backoff stopped at the
        floor with ``on_min_scale="warn"``), ``"collapsed"`` (the same with ``"raise"``: the caller raises, and the
        state is the one before the backoff) or ``"none"``.

    Example:
        >>> settings = ScalerSettings(init_scale=8.0, growth_interval=2)
        >>> next_state(ScaleState(8.0, 1, 1), found_inf=False, settings=settings)
        Transition(state=ScaleState(scale=16.0, growth_tracker=0, hysteresis_left=1), event='grew')
        >>> next_state(ScaleState(8.0, 1, 1), found_inf=True, settings=settings).state.scale
        4.0

    """
    if settings.mode != "dynamic":
        return Transition(state)
    if found_inf:
        hysteresis_left = max(state.hysteresis_left - 1, 0)
        if hysteresis_left > 0:
            return Transition(ScaleState(state.scale, 0, hysteresis_left))
        candidate = to_float32(state.scale * settings.backoff_factor)
        if candidate < settings.floor:
            if settings.on_min_scale == "raise":
                return Transition(ScaleState(state.scale, 0, hysteresis_left), "collapsed")
            return Transition(ScaleState(settings.floor_float32, 0, hysteresis_left), "held_at_floor")
        event: Event = "backed_off" if candidate < state.scale else "none"
        return Transition(ScaleState(candidate, 0, hysteresis_left), event)
    hysteresis_left = settings.hysteresis if settings.consecutive_hysteresis else state.hysteresis_left
    growth_tracker = state.growth_tracker + 1
    if growth_tracker < settings.growth_interval:
        return Transition(ScaleState(state.scale, growth_tracker, hysteresis_left))
    candidate = min(to_float32(state.scale * settings.growth_factor), settings.ceiling_float32)
    grown = candidate > state.scale
    return Transition(ScaleState(max(candidate, state.scale), 0, settings.hysteresis), "grew" if grown else "none")
