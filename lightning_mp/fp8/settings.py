"""The FP8 mode's settings: which recipe, which layers stay bf16, when a layer falls back; checked once.

:class:`FP8Settings` is what ``MixedPrecision(..., fp8=...)`` takes (a recipe name is short for
``FP8Settings(recipe=name)``). Building one validates every field, so a built one is valid, and each refusal names
the argument, the value given and what is allowed.

The recipes are torchao's (``torchao.float8.Float8LinearConfig.from_recipe_name``), all with dynamic scaling, that
is a scale computed from the current amax of each operand at every matmul:

- ``"tensorwise"``: one scale per tensor for the input, the weight and the output gradient; the fastest (cuBLAS's
  tensorwise FP8 kernel).
- ``"rowwise"``: one scale per row (input, output gradient) or column (weight), rounded down to a power of two;
  more accurate where one row's outliers would crush the others' resolution.
- ``"rowwise_with_gw_hp"``: ``"rowwise"``, with the weight-gradient matmul kept in high precision (bf16); the most
  accurate of the three, and the slowest.

The fallback thresholds are read by the telemetry callback (:mod:`lightning_mp.fp8.telemetry`): a layer whose
underflow share stays above ``fallback_max_underflow``, or whose quantisation SQNR stays below
``fallback_min_sqnr_db``, for ``fallback_patience`` consecutive logging steps goes back to bf16 for the rest of the
run, when ``fallback=True``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import nn

from lightning_mp.arguments.checks import arguments_of, caller, check_choice, check_flag, check_number

__all__ = ["RECIPES", "REGEX_PREFIX", "ExcludePattern", "FP8Settings", "Fp8Recipe", "fp8_settings_from_argument"]

Fp8Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]
"""The name of one of torchao's float8 training recipes."""
RECIPES: tuple[str, ...] = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
"""torchao's float8 training recipes that ``fp8=`` takes, from the fastest to the most accurate."""
REGEX_PREFIX = "re:"
ExcludePattern = type[nn.Module] | str
"""A module type, a qualified module name (its whole subtree), or a ``"re:"`` regular expression on the name."""


def _check_exclude(patterns: Any) -> tuple[ExcludePattern, ...]:
    """The ``exclude`` patterns as a tuple; raise naming the entry that is neither a type, a name nor a regex."""
    if patterns is None:
        return ()
    if isinstance(patterns, (str, type)) or not isinstance(patterns, Sequence):
        raise ValueError(
            f"{caller()}(exclude={patterns!r}) is not allowed: exclude must be a list of module types, qualified names"
            " or 're:' patterns, for example exclude=['lm_head', 're:.*attn.*'] (or [] or None for none)."
        )
    for pattern in patterns:
        if isinstance(pattern, type) and issubclass(pattern, nn.Module):
            continue
        if not isinstance(pattern, str) or not pattern or pattern == REGEX_PREFIX:
            raise ValueError(
                f"{caller()}(exclude=[..., {pattern!r}, ...]) is not allowed: each entry must be an nn.Module subclass,"
                " a qualified module name ('blocks.0.mlp') or a regular expression prefixed with 're:' ('re:.*attn.*')."
            )
        if pattern.startswith(REGEX_PREFIX):
            try:
                re.compile(pattern[len(REGEX_PREFIX) :])
            except re.error as error:
                raise ValueError(
                    f"{caller()}(exclude=[..., {pattern!r}, ...]) is not allowed: {pattern[len(REGEX_PREFIX) :]!r} is"
                    f" not a valid regular expression ({error})."
                ) from error
    return tuple(patterns)


@dataclass(frozen=True)
class FP8Settings:
    """How the FP8 mode runs: the recipe, the layers kept in bf16, and the fallback thresholds.

    Args:
        recipe: torchao's float8 training recipe: ``"tensorwise"``, ``"rowwise"`` or ``"rowwise_with_gw_hp"``
            (module docstring).
        keep_first_last: keep the input-side and the output-side linear layer in bf16, as Accelerate does: the
            embedding-side projection and the output head are the layers FP8 hurts most. They are found by what they
            do, not by registration order (:func:`~lightning_mp.fp8.selection.end_layers`).
        exclude: more layers to keep in bf16: module types, qualified names (a name keeps its whole subtree) or
            ``"re:"`` regular expressions matched against the whole qualified name, as ``keep_fp32`` takes them.
        fsdp_float8_all_gather: under FSDP2, all-gather the weights in FP8 (torchao's float8 all-gather), half the
            bytes of bf16; ``"tensorwise"`` only.
        fallback: return a layer to bf16 when its statistics cross the thresholds below: an ``FP8Monitor`` given no
            rule of its own measures the layers and takes these thresholds (a Trainer without one warns).
        fallback_max_underflow: the share of an operand's elements that may underflow to zero after scaling, in
            ``[0, 1]``.
        fallback_min_sqnr_db: the lowest acceptable quantisation SQNR of an operand, in dB (e4m3 gives about 30 dB
            on well-scaled data).
        fallback_patience: how many consecutive logging steps a layer must cross a threshold before it falls back.

    Raises:
        ValueError: for a field outside what is allowed, naming the field, the value and what is allowed.

    Example:
        >>> FP8Settings(recipe="rowwise", exclude=["re:.*lm_head"]).recipe
        'rowwise'

    """

    recipe: Fp8Recipe | str = "tensorwise"
    keep_first_last: bool = True
    exclude: Sequence[ExcludePattern] | None = field(default=())
    fsdp_float8_all_gather: bool = False
    fallback: bool = False
    fallback_max_underflow: float = 0.1
    fallback_min_sqnr_db: float = 20.0
    fallback_patience: int = 3

    def __post_init__(self) -> None:
        with arguments_of(type(self).__name__):
            self._check_settings()

    def _check_settings(self) -> None:
        check_choice("recipe", self.recipe, RECIPES)
        set_field = object.__setattr__  # the dataclass is frozen; the checks store plain values once
        set_field(self, "exclude", _check_exclude(self.exclude))
        for name in ("keep_first_last", "fsdp_float8_all_gather", "fallback"):
            set_field(self, name, check_flag(name, getattr(self, name)))
        set_field(
            self,
            "fallback_max_underflow",
            check_number("fallback_max_underflow", self.fallback_max_underflow, at_least=0.0, at_most=1.0),
        )
        set_field(self, "fallback_min_sqnr_db", check_number("fallback_min_sqnr_db", self.fallback_min_sqnr_db))
        set_field(
            self,
            "fallback_patience",
            check_number("fallback_patience", self.fallback_patience, integer=True, at_least=1),
        )
        if self.fsdp_float8_all_gather and self.recipe != "tensorwise":
            raise ValueError(
                f"{caller()}(recipe={self.recipe!r}, fsdp_float8_all_gather=True) is not allowed: torchao's float8"
                " all-gather scales each weight as one tensor, so it needs recipe='tensorwise'. Use"
                " recipe='tensorwise', or fsdp_float8_all_gather=False to gather in bf16."
            )


def fp8_settings_from_argument(fp8: Any) -> FP8Settings | None:
    """``MixedPrecision(fp8=...)`` as settings: None stays None, a recipe name becomes ``FP8Settings(recipe=name)``.

    Raises:
        ValueError: for anything else, naming ``fp8``, the value and what is allowed.

    Example:
        >>> fp8_settings_from_argument("rowwise").recipe
        'rowwise'

    """
    if fp8 is None or isinstance(fp8, FP8Settings):
        return fp8
    if isinstance(fp8, str):
        try:
            return FP8Settings(recipe=fp8)
        except ValueError:
            pass
    allowed = ", ".join(repr(recipe) for recipe in RECIPES)
    raise ValueError(
        f"{caller()}(fp8={fp8!r}) is not supported: fp8 must be None (no FP8), one of the recipes {allowed}, or an"
        " FP8Settings(recipe=..., exclude=..., ...) from lightning_mp.fp8."
    )
