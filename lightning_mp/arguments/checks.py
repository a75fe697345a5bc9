"""Argument checks that raise ValueError naming the caller, the argument, the value given and what is allowed.

A message names the public call the user made (``MixedPrecision(opt_level='o4') is not supported: ...``). That name
is not passed down through every helper: the public entry point opens :func:`arguments_of` around its checks, and a
check reads :func:`caller` when it raises. The outermost entry point wins, so a ``ScalerSettings`` that
``MixedPrecision`` builds for its scaler reports ``MixedPrecision(...)``, the call the user actually wrote, while a
``ScalerSettings`` the user builds reports ``ScalerSettings(...)``. The name lives in a context variable, so threads
and asyncio tasks checking arguments at the same time each see their own caller.

Numbers may be Python numbers, numpy scalars or 0-d tensors of the right kind (an integer for an integer argument, any
real number for a float argument); booleans are never numbers, and a boolean argument must be a real ``bool``. Every
check returns the value as a plain Python ``int``, ``float`` or ``bool``, so that nothing downstream holds a tensor.
"""

from __future__ import annotations

import contextlib
import difflib
import math
import numbers
from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar
from typing import Any

import torch

INT32_MAX = 2**31 - 1
"""The largest count the scaler keeps in an int32 device tensor (torch's growth tracker is int32)."""


_CALLER: ContextVar[str | None] = ContextVar("lightning_mp_argument_caller", default=None)
UNNAMED_CALLER = "lightning_mp"
"""What a message names when a check runs outside any :func:`arguments_of` block."""


@contextlib.contextmanager
def arguments_of(name: str) -> Iterator[None]:
    """Name ``name`` (a class or ``Class.method``) in the messages of every check made inside the block.

    Example:
        >>> with arguments_of("LossScaler"):
        ...     check_flag("enabled", "yes")
        Traceback (most recent call last):
        ...
        ValueError: LossScaler(enabled='yes') is not allowed: enabled must be True or False.

    """
    if _CALLER.get() is not None:
        yield
        return
    token = _CALLER.set(name)
    try:
        yield
    finally:
        _CALLER.reset(token)


def caller() -> str:
    """The public call whose arguments are being checked: the outermost :func:`arguments_of` name."""
    return _CALLER.get() or UNNAMED_CALLER


def suggest(value: Any, allowed: Iterable[Any], aliases: Mapping[Any, Any] | None = None) -> Any | None:
    """The allowed value closest to ``value``, or None when nothing is close.

    A near miss is, in this order: an alias (``aliases`` maps common spellings such as ``"fp16"`` or ``16`` to the
    allowed value), the same text in another case (``"o2"`` for ``"O2"``), or a close spelling (``"16-mxied"``).

    Example:
        >>> suggest("o2", ["O0", "O1", "O2"])
        'O2'
        >>> suggest(16, ["16-mixed", "bf16-mixed"], {"16": "16-mixed"})
        '16-mixed'

    """
    allowed = [choice for choice in allowed if isinstance(choice, str)]
    text = str(value)
    for key in (value, text, text.lower()):
        with contextlib.suppress(TypeError):
            if aliases and key in aliases:
                return aliases[key]
    for choice in allowed:
        if choice.lower() == text.lower():
            return choice
    close = difflib.get_close_matches(text, allowed, n=1, cutoff=0.75)
    return close[0] if close else None


def check_choice(name: str, value: Any, allowed: Iterable[Any], aliases: Mapping[Any, Any] | None = None) -> None:
    """Raise unless ``value`` is one of ``allowed`` (of the same type); the message says "did you mean" for a near miss.

    Raises:
        ValueError: naming the argument, the value given, what is allowed and, where one exists, the near miss.

    """
    allowed = list(allowed)
    # Only a value of the choice's own type can equal it: ``==`` on a numpy array or a tensor compares elementwise,
    # and ``in`` would then ask the truth value of an array, or accept a one-element array.
    if not any(type(value) is type(choice) and value == choice for choice in allowed):
        guess = suggest(value, allowed, aliases)
        hint = f" Did you mean {name}={guess!r}?" if guess is not None else ""
        raise ValueError(f"{caller()}({name}={value!r}) is not supported: {name} must be one of {allowed}.{hint}")


def check_flag(name: str, value: Any) -> bool:
    """Return ``value`` as a bool; accept only True/False (also as numpy or 0-d tensor booleans).

    Strings are refused: ``"no"`` is truthy in Python and would turn a feature on.

    Raises:
        ValueError: naming the argument and the value.

    """
    value = plain_scalar(value)
    if not isinstance(value, bool):
        raise ValueError(f"{caller()}({name}={value!r}) is not allowed: {name} must be True or False.")
    return value


def plain_scalar(value: Any) -> Any:
    """A numpy scalar or a 0-d tensor as the Python bool, int or float it holds; anything else unchanged.

    Reading a 0-d tensor on an accelerator synchronises with it, which is harmless in a constructor.
    """
    if isinstance(value, torch.Tensor) and value.ndim == 0 and not value.is_complex():
        return value.item()
    item = getattr(type(value), "item", None)
    if type(value).__module__ == "numpy" and callable(item) and getattr(value, "ndim", None) == 0:
        python_value = value.item()
        if isinstance(python_value, (bool, int, float)):
            return python_value
    return value


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


def exact(value: float) -> str:
    """``value`` written so that it reads back exactly: an integer in full, a tiny power of two as ``2**-24``.

    Example:
        >>> exact(2**31 - 1), exact(2.0**-24), exact(0.5), exact(1e300)
        ('2147483647', '2**-24', '0.5', '1e+300')

    """
    if isinstance(value, int) or (value.is_integer() and abs(value) < 2**53):
        return str(int(value))
    mantissa, exponent = math.frexp(value)
    if mantissa == 0.5 and exponent <= -9:
        return f"2**{exponent - 1}"
    return repr(value)


def check_number(
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

    The message prints the bounds exactly (:func:`exact`): ``<= 2147483647``, not ``<= 2.14748e+09``.

    Returns:
        ``value`` as a Python ``int`` (``integer=True``) or ``float``.

    Raises:
        ValueError: naming the :func:`caller`, ``name``, the value and the allowed range.

    """
    kind = "an integer" if integer else "a finite number"
    bounds = []
    if above is not None:
        bounds.append(f"> {exact(above)}")
    if at_least is not None:
        bounds.append(f">= {exact(at_least)}")
    if below is not None:
        bounds.append(f"< {exact(below)}")
    if at_most is not None:
        bounds.append(f"<= {exact(at_most)}")
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
        raise ValueError(f"{caller()}({name}={value!r}) is not allowed: {name} must be {allowed}.")
    return number
