"""The FP8 telemetry's rules: pure functions from per-layer cast statistics to a ranking and to fallback decisions.

They take what :class:`~lightning_mp.fp8.telemetry.FP8Monitor` measured on one logging step, a :data:`LayerStats`
(``layer -> operand -> stat name -> value``, the operands being the input, the weight and the output gradient), and
hold no torch and no Lightning, so that every rank decides the same from the same numbers and the tests drive them
directly.

**Which layer is worst.** :func:`rank_layers`: the layer losing the largest share of its values (underflow plus
saturation, over its three operands) first, ties broken by the lowest SQNR. The share comes first because a whole
tensor's SQNR hides an outlier: one feature a thousand times larger than the rest dominates both the signal and the
scale, so the tensor's SQNR stays near 30 dB while the small values, scaled down with it, flush to zero.

**When a layer falls back to bf16.** A :class:`FallbackRule` sets the limits: a layer whose underflow share exceeds
``max_underflow``, or whose SQNR falls below ``min_sqnr_db``, on any operand, crosses them on that step.
:func:`fallback_decisions` keeps, per layer, the number of logging steps in a row it crossed them, and names the
layers whose streak reaches ``patience``; a step within the limits ends the streak.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_mp.arguments.checks import arguments_of, check_number

LayerStats = Mapping[str, Mapping[str, Mapping[str, float]]]
"""``layer -> operand -> stat name -> value``, as one logging step measured it."""


@dataclass(frozen=True)
class FallbackRule:
    """When a layer goes back to bf16: a limit crossed on any operand for ``patience`` logging steps in a row.

    The fields are those of the FP8 settings' ``fallback_*`` fields (:meth:`from_settings` reads them).

    Args:
        max_underflow: the largest share of non-zero values an FP8 cast may flush to zero, in [0, 1]; None for no
            limit.
        min_sqnr_db: the lowest SQNR an FP8 cast may have, in dB (e4m3 keeps about 30 dB, e5m2 about 25 dB on
            well-scaled data); None for no limit.
        patience: how many logging steps in a row a limit must be crossed, at least 1.

    Raises:
        ValueError: naming the argument, the value and what is allowed.

    """

    max_underflow: float | None = 0.1
    min_sqnr_db: float | None = 20.0
    patience: int = 3

    def __post_init__(self) -> None:
        with arguments_of(type(self).__name__):
            self._check_limits()

    def _check_limits(self) -> None:
        if self.max_underflow is not None:
            check_number("max_underflow", self.max_underflow, at_least=0, at_most=1)
        if self.min_sqnr_db is not None:
            check_number("min_sqnr_db", self.min_sqnr_db)
        if self.max_underflow is None and self.min_sqnr_db is None:
            raise ValueError(
                "FallbackRule(max_underflow=None, min_sqnr_db=None) is not allowed: set at least one limit."
            )
        check_number("patience", self.patience, at_least=1, integer=True)

    @classmethod
    def from_settings(cls, settings: Any) -> FallbackRule:
        """The rule of FP8 settings, from their ``fallback_max_underflow``, ``_min_sqnr_db`` and ``_patience``."""
        return cls(settings.fallback_max_underflow, settings.fallback_min_sqnr_db, settings.fallback_patience)

    def violation(self, operands: Mapping[str, Mapping[str, float]]) -> str | None:
        """Why this step's statistics of one layer cross the limits, or None when they do not."""
        reasons = []
        for operand, stats in operands.items():
            underflow, sqnr = stats.get("underflow_share", math.nan), stats.get("sqnr_db", math.nan)
            if self.max_underflow is not None and underflow > self.max_underflow:
                reasons.append(f"{operand} underflow share {underflow:.2%} > {self.max_underflow:.2%}")
            if self.min_sqnr_db is not None and sqnr < self.min_sqnr_db:
                reasons.append(f"{operand} SQNR {sqnr:.1f} dB < {self.min_sqnr_db:g} dB")
        return "; ".join(reasons) or None


def fallback_decisions(
    streaks: Mapping[str, int], sample: LayerStats, rule: FallbackRule
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Update the per-layer streaks of limit-crossing logging steps with one sample, and say which layers fall back.

    A pure function: the same streaks and sample give the same decisions on every rank.

    Args:
        streaks: ``layer -> logging steps in a row`` it crossed the limits, before this sample.
        sample: this logging step's statistics, per layer and operand.
        rule: the limits and how many steps in a row.

    Returns:
        ``(streaks, decisions)``: the new streaks (layers that fall back are dropped), and ``(layer, reason)`` for
        each layer whose streak reached ``rule.patience``, in the sample's order.

    Example:
        >>> rule = FallbackRule(max_underflow=0.1, patience=2)
        >>> bad = {"fc": {"input": {"underflow_share": 0.5, "sqnr_db": 30.0}}}
        >>> streaks, decided = fallback_decisions({}, bad, rule)
        >>> streaks, decided
        ({'fc': 1}, [])
        >>> fallback_decisions(streaks, bad, rule)[1]
        [('fc', 'input underflow share 50.00% > 10.00% for 2 logging steps in a row')]

    """
    updated: dict[str, int] = {}
    decisions = []
    for layer, operands in sample.items():
        reason = rule.violation(operands)
        if reason is None:
            continue
        streak = streaks.get(layer, 0) + 1
        if streak >= rule.patience:
            decisions.append((layer, f"{reason} for {streak} logging step{'s' if streak != 1 else ''} in a row"))
        else:
            updated[layer] = streak
    return updated, decisions


def rank_layers(sample: LayerStats) -> list[str]:
    """Layers from worst to best: the largest share of values lost (underflow plus saturation), then the lowest SQNR."""

    def badness(layer: str) -> tuple[float, float]:
        operands = sample[layer].values()
        lost = max((s.get("underflow_share", 0.0) + s.get("saturated_share", 0.0) for s in operands), default=0.0)
        sqnr = min((s.get("sqnr_db", math.inf) for s in operands), default=math.inf)
        return (-_finite_or(lost, 0.0), _finite_or(sqnr, math.inf))

    return sorted(sample, key=badness)


def _finite_or(value: float, default: float) -> float:
    return value if math.isfinite(value) else default


__all__ = ["FallbackRule", "LayerStats", "fallback_decisions", "rank_layers"]
