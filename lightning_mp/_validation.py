"""Argument checks that raise ValueError naming the argument, the value given and what is allowed.

Numbers may be Python numbers, numpy scalars or 0-d tensors of the right kind (an integer for an integer argument, any
real number for a float argument); booleans are never numbers, and a boolean argument must be a real ``bool``. Every
check returns the value as a plain Python ``int``, ``float`` or ``bool``, so that nothing downstream holds a tensor.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any

import torch

INT32_MAX = 2**31 - 1
"""The largest count the scaler keeps in an int32 device tensor (torch's growth tracker is int32)."""


def check_choice(owner: str, name: str, value: Any, allowed: Iterable[Any]) -> None:
    """Raise unless ``value`` is one of ``allowed``."""
    allowed = list(allowed)
    if value not in allowed:
        raise ValueError(f"{owner}({name}={value!r}) is not supported: {name} must be one of {allowed}.")


def _is_numpy_bool(value: Any) -> bool:
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")


def _as_python_number(value: Any, integer: bool) -> int | float | None:
    """``value`` as a Python int (``integer``) or float, or None when it is not a number of that kind."""
    if isinstance(value, torch.Tensor):
        if value.ndim != 0 or value.dtype == torch.bool or value.is_complex():
            return None
        if integer and value.is_floating_point():
            return None
        value = value.item()
    if isinstance(value, bool) or _is_numpy_bool(value):
        return None
    if integer:
        return int(value) if isinstance(value, numbers.Integral) else None
    if not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:
        # An int beyond float range: not a finite float, reported as such rather than as an OverflowError.
        return math.inf


def check_number(
    owner: str,
    name: str,
    value: Any,
    *,
    above: float | None = None,
    at_least: float | None = None,
    below: float | None = None,
    at_most: float | None = None,
    integer: bool = False,
) -> Any:
    """Raise unless ``value`` is a finite real number (an int if ``integer``) within the given bounds.

    Returns:
        ``value`` as a Python ``int`` (``integer=True``) or ``float``.

    Raises:
        ValueError: naming ``owner``, ``name``, the value and the allowed range.

    """
    kind = "an integer" if integer else "a finite number"
    bounds = []
    if above is not None:
        bounds.append(f"> {above:g}")
    if at_least is not None:
        bounds.append(f">= {at_least:g}")
    if below is not None:
        bounds.append(f"< {below:g}")
    if at_most is not None:
        bounds.append(f"<= {at_most:g}")
    allowed = kind + (" " + " and ".join(bounds) if bounds else "")
    number = _as_python_number(value, integer)
    ok = (
        number is not None
        and (integer or math.isfinite(number))
        and (above is None or number > above)
        and (at_least is None or number >= at_least)
        and (below is None or number < below)
        and (at_most is None or number <= at_most)
    )
    if not ok:
        raise ValueError(f"{owner}({name}={value!r}) is not allowed: {name} must be {allowed}.")
    return number


def check_bool(owner: str, name: str, value: Any) -> bool:
    """Raise unless ``value`` is ``True`` or ``False`` (a Python or numpy bool): ``'no'`` is not a boolean."""
    if isinstance(value, bool) or _is_numpy_bool(value):
        return bool(value)
    raise ValueError(f"{owner}({name}={value!r}) is not allowed: {name} must be True or False.")
