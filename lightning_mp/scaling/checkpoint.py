"""The loss scaler's checkpoint: the dict it writes, and its validation (a dict in, a validated state out).

A scaler's ``state_dict`` (:func:`state_dict_of`) holds torch's five GradScaler keys (``scale``,
``growth_factor``, ``backoff_factor``, ``growth_interval``, ``_growth_tracker``), then the hysteresis and its
tracker, the bounds, the mode, the ``counters`` of :class:`~lightning_mp.scaling.counters.StepCounters`, the
per-optimizer ``streaks`` and ``last_step_skipped``. :func:`validated_state` reads such a dict, or torch's five-key
one, against this run's settings:

* the run's settings win over the dict's settings; a difference is warned about, naming the setting and both values;
* counters and streaks must be non-negative integers with ``consecutive_skips <= skipped_steps <= optimizer_steps``;
  streaks at or beyond this run's ``max_consecutive_skips`` are clamped below it (with a warning), so a resumed run
  is not stopped by its first skip; a dict without ``streaks`` gives optimizer 0 the streak ``consecutive_skips``;
* in dynamic mode the scale must be a finite positive number (training never writes another, so another is damage);
  one outside ``[floor, max_scale]`` is clamped into it, and trackers beyond this run's ``growth_interval`` and
  ``hysteresis`` are clamped to them, each with a warning naming the key and both values. Static and check modes
  keep their own scale.

Nothing here touches torch or the scaler: the functions take the dict and the settings and return plain data, so the
tests drive them directly. Warnings point at the caller of the scaler's ``load_state_dict``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from lightning_mp.arguments.checks import caller, check_number
from lightning_mp.scaling.counters import StepCounters
from lightning_mp.scaling.rules import ScalerSettings, ScaleState, float32_within

_CALLER_OF_LOAD = 3
"""The stack level of the scaler's caller, seen from a function that ``load_state_dict`` calls."""


@dataclass(frozen=True)
class LoadedScalerState:
    """A validated scaler checkpoint, fitted to this run's settings."""

    scale_state: ScaleState | None
    """The scale and its trackers; None where this run's mode keeps its own (static, check)."""
    counters: StepCounters
    """The counters and streaks."""


def state_dict_of(
    settings: ScalerSettings, state: ScaleState, counters: StepCounters, optimizers: int
) -> dict[str, Any]:
    """The scaler's ``state_dict``: torch's five keys, then the trackers, bounds, mode and counters.

    Args:
        settings: the run's settings.
        state: the host scale and its trackers.
        counters: the counters and streaks.
        optimizers: how many optimizers the scaler has seen (each gets a streak).

    """
    return {
        "scale": state.scale,
        "growth_factor": settings.growth_factor,
        "backoff_factor": settings.backoff_factor,
        "growth_interval": settings.growth_interval,
        "_growth_tracker": state.growth_tracker,
        "hysteresis": settings.hysteresis,
        "hysteresis_tracker": state.hysteresis_left,
        "consecutive_hysteresis": settings.consecutive_hysteresis,
        "min_scale": settings.min_scale,
        "max_scale": settings.max_scale,
        "mode": settings.mode,
        "last_step_skipped": counters.last_step_skipped,
        "counters": counters.counters(),
        "streaks": counters.streak_list(optimizers),
    }


def validated_state(state_dict: Any, settings: ScalerSettings) -> LoadedScalerState:
    """Validate a scaler's ``state_dict`` (or torch's GradScaler dict) against this run's ``settings``.

    Messages name the caller (``LossScaler.load_state_dict``): :func:`~lightning_mp.arguments.checks.arguments_of`.

    Args:
        state_dict: the dict to restore.
        settings: this run's settings, which win over the dict's.

    Returns:
        The scale state (dynamic mode only) and the counters to continue from.

    Raises:
        RuntimeError: if ``state_dict`` is empty.
        ValueError: if a field is malformed; the message names the key, the value and what was expected.

    """
    if not isinstance(state_dict, dict):
        raise ValueError(f"{caller()}(state_dict={state_dict!r}) is not allowed: expected a dict.")
    if not state_dict:
        raise RuntimeError("The loss scaler state dict is empty: there is no scale to restore.")
    _warn_on_changed_settings(state_dict, settings)
    counters = _validated_counters(state_dict, settings.max_consecutive_skips)
    scale_state = _validated_scale_state(state_dict, settings) if settings.mode == "dynamic" else None
    return LoadedScalerState(scale_state, counters)


def _warn_on_changed_settings(state_dict: dict[str, Any], settings: ScalerSettings) -> None:
    this_run = {
        "growth_factor": settings.growth_factor,
        "backoff_factor": settings.backoff_factor,
        "growth_interval": settings.growth_interval,
        "hysteresis": settings.hysteresis,
    }
    changed = [f"{k}: {state_dict[k]} -> {v}" for k, v in this_run.items() if k in state_dict and state_dict[k] != v]
    if changed:
        warnings.warn(
            "The checkpoint's loss-scaler settings differ from this run's; this run's are used ("
            + ", ".join(changed)
            + ").",
            UserWarning,
            stacklevel=_CALLER_OF_LOAD + 1,
        )


def _validated_counters(state_dict: dict[str, Any], max_consecutive_skips: int | None) -> StepCounters:
    counters = state_dict.get("counters", {})
    if not isinstance(counters, dict):
        raise ValueError(f"{caller()}: key 'counters' holds {counters!r}; expected a dict of non-negative integers.")
    values = {name: _count(f"counters['{name}']", counters.get(name, 0)) for name in StepCounters.counter_names()}
    if values["skipped_steps"] > values["optimizer_steps"] or values["consecutive_skips"] > values["skipped_steps"]:
        raise ValueError(
            f"{caller()}: counters {values} are inconsistent; expected consecutive_skips <= skipped_steps <="
            " optimizer_steps."
        )
    streaks = state_dict.get("streaks", [values["consecutive_skips"]] if values["consecutive_skips"] else [])
    if not isinstance(streaks, list):
        raise ValueError(f"{caller()}: key 'streaks' holds {streaks!r}; expected a list of non-negative integers.")
    streaks = [_count(f"streaks[{i}]", s) for i, s in enumerate(streaks)]
    limit = max_consecutive_skips
    if limit is not None and any(s >= limit for s in streaks):
        warnings.warn(
            f"The checkpoint's skip streaks {streaks} reach this run's max_consecutive_skips={limit}; they are"
            f" clamped to {limit - 1}.",
            UserWarning,
            stacklevel=_CALLER_OF_LOAD + 1,
        )
        streaks = [min(s, limit - 1) for s in streaks]
    last_step_skipped = state_dict.get("last_step_skipped", False)
    if not isinstance(last_step_skipped, bool):
        raise ValueError(f"{caller()}: key 'last_step_skipped' holds {last_step_skipped!r}; expected a bool.")
    return StepCounters.restored(values, streaks, last_step_skipped)


def _validated_scale_state(state_dict: dict[str, Any], settings: ScalerSettings) -> ScaleState:
    if "scale" not in state_dict:
        raise ValueError(f"{caller()}: the dict has no key 'scale'; expected the loss scale, a positive number.")
    raw_scale = state_dict["scale"]
    try:
        # Training never makes a scale of 0, a negative one or a non-finite one: such a value is damage.
        scale = check_number("scale", raw_scale, above=0)
    except ValueError:
        raise ValueError(
            f"{caller()}: key 'scale' holds {raw_scale!r}; expected a finite positive number (the loss scale). No"
            " training writes such a scale, so the checkpoint is damaged: restore another one, or drop the"
            " scaler's state to start again from init_scale."
        ) from None
    low, high = settings.floor, settings.max_scale
    if not low <= scale <= high:
        warnings.warn(
            f"The checkpoint's key 'scale' holds {scale:g}, outside [{low:g}, {high:g}]; it is clamped to"
            f" {min(max(scale, low), high):g}.",
            UserWarning,
            stacklevel=_CALLER_OF_LOAD + 1,
        )
    growth_tracker = _count("_growth_tracker", state_dict.get("_growth_tracker", 0))
    hysteresis_left = _count("hysteresis_tracker", state_dict.get("hysteresis_tracker", settings.hysteresis))
    fitted_growth = min(growth_tracker, settings.growth_interval - 1)
    fitted_hysteresis = min(hysteresis_left, settings.hysteresis)
    for key, saved, fitted in (
        ("_growth_tracker", growth_tracker, fitted_growth),
        ("hysteresis_tracker", hysteresis_left, fitted_hysteresis),
    ):
        if saved != fitted:
            warnings.warn(
                f"The checkpoint's key {key!r} holds {saved}, beyond this run's settings; it is clamped to {fitted}.",
                UserWarning,
                stacklevel=_CALLER_OF_LOAD + 1,
            )
    return ScaleState(float32_within(scale, low, high), fitted_growth, fitted_hysteresis)


def _count(key: str, value: Any) -> int:
    try:
        return check_number(key, value, at_least=0, integer=True)
    except ValueError:
        raise ValueError(f"{caller()}: key {key!r} holds {value!r}; expected a non-negative integer.") from None
