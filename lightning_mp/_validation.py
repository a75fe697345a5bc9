"""Argument checks that raise ValueError naming the argument, the value given and what is allowed."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any


def check_choice(owner: str, name: str, value: Any, allowed: Iterable[Any]) -> None:
    """Raise unless ``value`` is one of ``allowed``."""
    allowed = list(allowed)
    if value not in allowed:
        raise ValueError(f"{owner}({name}={value!r}) is not supported: {name} must be one of {allowed}.")


def check_number(
    owner: str,
    name: str,
    value: Any,
    *,
    above: float | None = None,
    at_least: float | None = None,
    below: float | None = None,
    integer: bool = False,
) -> None:
    """Raise unless ``value`` is a finite real number (an int if ``integer``) within the given bounds."""
    kind = "an integer" if integer else "a finite number"
    bounds = []
    if above is not None:
        bounds.append(f"> {above:g}")
    if at_least is not None:
        bounds.append(f">= {at_least:g}")
    if below is not None:
        bounds.append(f"< {below:g}")
    allowed = kind + (" " + " and ".join(bounds) if bounds else "")
    is_number = isinstance(value, int) if integer else isinstance(value, (int, float))
    ok = (
        is_number
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (above is None or value > above)
        and (at_least is None or value >= at_least)
        and (below is None or value < below)
    )
    if not ok:
        raise ValueError(f"{owner}({name}={value!r}) is not allowed: {name} must be {allowed}.")
