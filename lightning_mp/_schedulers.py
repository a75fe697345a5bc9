"""Learning-rate schedulers that do not advance on a skipped optimizer step.

When the loss scaler skips a step, Lightning still calls ``scheduler.step()`` for ``interval="step"`` schedulers.
The schedule then runs ahead of the optimizer, and torch warns "Detected call of lr_scheduler.step() before
optimizer.step()" when the very first step was skipped. The plugin marks the optimizer after each step with
:data:`SKIPPED_FLAG`; a scheduler made skip-aware here reads that mark and does nothing on a skipped step.

Only the scheduler's class is swapped for a subclass with a guarded ``step``: its ``state_dict`` (instance
attributes) is unchanged, ``isinstance`` checks still hold, and checkpoints stay loadable without lightning_mp.
"""

from __future__ import annotations

import sys
from typing import Any

SKIPPED_FLAG = "_lightning_mp_last_step_skipped"
"""Attribute set on an optimizer: True when its most recent step was skipped for non-finite gradients."""

_SKIP_AWARE_MARK = "_lightning_mp_skip_aware"


def _skip_aware_class(scheduler_class: type) -> type:
    name = f"SkipAware{scheduler_class.__name__}"
    module = sys.modules[__name__]
    existing = getattr(module, name, None)
    if isinstance(existing, type) and existing.__bases__ == (scheduler_class,):
        return existing

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self.optimizer, SKIPPED_FLAG, False):
            return None
        return scheduler_class.step(self, *args, **kwargs)

    aware = type(name, (scheduler_class,), {"step": step, _SKIP_AWARE_MARK: True, "__module__": __name__})
    # Registered under its name so that the scheduler stays picklable in this process.
    setattr(module, name, aware)
    return aware


def make_skip_aware(scheduler: Any) -> None:
    """Make ``scheduler.step()`` a no-op while its optimizer's last step was skipped. Idempotent."""
    if getattr(type(scheduler), _SKIP_AWARE_MARK, False) or not hasattr(scheduler, "optimizer"):
        return
    scheduler.__class__ = _skip_aware_class(type(scheduler))


def mark_step(optimizer: Any, skipped: bool) -> None:
    """Record on ``optimizer`` whether its most recent step was skipped."""
    setattr(optimizer, SKIPPED_FLAG, skipped)
