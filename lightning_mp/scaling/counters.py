"""The loss scaler's counters: what the steps did, counted per iteration and per optimizer.

The scaler decides; the counters only count. Once the host can read an iteration's inf flags (at once on the CPU, one
iteration late on an accelerator), the scaler hands them over with the optimizers that stepped:

* every optimizer that stepped adds one to ``optimizer_steps``; one whose flag is set (its step was skipped) adds
  one to ``skipped_steps`` and extends its own streak of skips in a row, and a clean step ends its streak;
* ``last_step_skipped`` says whether any step of that iteration was skipped;
* a scale that moved down counts a backoff, one that moved up a growth.

Streaks are kept per optimizer (by the index the scaler gave it), so that an optimizer whose gradients are never
finite is caught even while another one steps cleanly; ``consecutive_skips`` is the longest current streak.

The state is declared once, as the fields of :class:`StepCounters` (as torchmetrics declares a metric's state): a new
``StepCounters`` is the reset, pickling copies the fields, and the checkpoint's ``counters`` are the fields marked as
counters, plus ``consecutive_skips``, which is derived from the streaks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

_COUNTER = {"counter": True}


@dataclass
class StepCounters:
    """Counters and streaks of a loss scaler's steps.

    Example:
        >>> counters = StepCounters()
        >>> counters.record_iteration(stepped=[0, 1], skipped={1})
        >>> counters.record_iteration(stepped=[0, 1], skipped={1})
        >>> counters.counters()
        {'optimizer_steps': 4, 'skipped_steps': 2, 'scale_backoffs': 0, 'scale_growths': 0, 'consecutive_skips': 2}

    """

    optimizer_steps: int = field(default=0, metadata=_COUNTER)
    """Optimizer steps asked for, skipped ones included."""
    skipped_steps: int = field(default=0, metadata=_COUNTER)
    """Steps skipped because a gradient held an inf or a NaN."""
    scale_backoffs: int = field(default=0, metadata=_COUNTER)
    """Iterations after which the scale moved down."""
    scale_growths: int = field(default=0, metadata=_COUNTER)
    """Iterations after which the scale moved up."""
    last_step_skipped: bool = False
    """Whether a step of the last counted iteration was skipped."""
    streaks: dict[int, int] = field(default_factory=dict)
    """Optimizer index -> its current number of skipped steps in a row."""
    last_nonfinite: dict[int, list[tuple[str, tuple[int, ...]]]] = field(default_factory=dict)
    """Per optimizer, the non-finite gradients seen at a skipped step near the streak limit, for the error: a manual
    loop that zeroes the gradients after ``step`` leaves none to inspect once the streak is counted."""

    @classmethod
    def counter_names(cls) -> tuple[str, ...]:
        """The names of the checkpoint's ``counters``, in its order."""
        return (*(f.name for f in fields(cls) if f.metadata.get("counter")), "consecutive_skips")

    @property
    def consecutive_skips(self) -> int:
        """The longest current streak of skipped steps among the optimizers."""
        return max(self.streaks.values(), default=0)

    def record_iteration(self, stepped: Iterable[int], skipped: set[int]) -> None:
        """Count one iteration: the optimizers (by index) that stepped, and those of them whose step was skipped."""
        stepped = sorted(stepped)
        skipped_now = [index for index in stepped if index in skipped]
        self.optimizer_steps += len(stepped)
        self.skipped_steps += len(skipped_now)
        self.last_step_skipped = bool(skipped_now)
        for index in stepped:
            if index in skipped:
                self.streaks[index] = self.streaks.get(index, 0) + 1
            else:
                self.streaks[index] = 0
                self.last_nonfinite.pop(index, None)

    def record_scale_move(self, before: float, after: float) -> None:
        """Count a backoff or a growth when the scale moved from ``before`` to ``after``."""
        self.scale_backoffs += after < before
        self.scale_growths += after > before

    def near_streak_limit(self, index: int, limit: int | None) -> bool:
        """Whether optimizer ``index``'s next skip may end its streak at ``limit``.

        Within two steps of the limit: the host may count an iteration one step late.
        """
        return limit is not None and self.streaks.get(index, 0) + 2 >= limit

    def streaks_reaching(self, limit: int | None) -> list[tuple[int, int]]:
        """``(optimizer index, streak)`` of every streak at or beyond ``limit``; none when ``limit`` is None."""
        if limit is None:
            return []
        return [(index, streak) for index, streak in self.streaks.items() if streak >= limit]

    def counters(self) -> dict[str, int]:
        """The checkpoint's ``counters``: every counter field, then ``consecutive_skips``."""
        return {name: getattr(self, name) for name in self.counter_names()}

    def streak_list(self, optimizers: int) -> list[int]:
        """The checkpoint's ``streaks``: one per optimizer index, for at least ``optimizers`` optimizers."""
        return [self.streaks.get(i, 0) for i in range(max(optimizers, len(self.streaks)))]

    @classmethod
    def restored(cls, counters: Mapping[str, Any], streaks: list[int], last_step_skipped: bool) -> StepCounters:
        """A counters from validated checkpoint values (``consecutive_skips`` is derived from ``streaks``)."""
        stored = {f.name: counters[f.name] for f in fields(cls) if f.metadata.get("counter")}
        return cls(**stored, last_step_skipped=last_step_skipped, streaks=dict(enumerate(streaks)))
