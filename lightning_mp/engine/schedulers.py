"""Learning-rate schedulers that do not advance on a skipped optimizer step.

When the loss scaler skips a step, Lightning still calls ``scheduler.step()`` for ``interval="step"`` schedulers.
The schedule then runs ahead of the optimizer, and torch warns "Detected call of lr_scheduler.step() before
optimizer.step()" when the very first step was skipped.

The plugin puts a :class:`SkipAwareScheduler` in front of each such scheduler, in Lightning's scheduler
configuration (so ``self.lr_schedulers()`` returns it too). The wrapper asks the plugin whether the optimizer's last
step was skipped and, if so, does nothing; otherwise it calls the scheduler. The user's scheduler keeps its class
(``isinstance`` sees the wrapper as one) and its state, nothing is written on the optimizer, every other attribute
is forwarded, and the wrapper pickles as the scheduler it wraps: ``torch.save(self.lr_schedulers())`` writes a file
that loads without lightning_mp.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any


class SkipAwareScheduler:
    """Forward everything to ``scheduler``, except ``step()`` after a skipped optimizer step.

    Args:
        scheduler: a torch learning-rate scheduler (anything with ``step()``).
        step_was_skipped: answers whether the most recent step of the scheduler's optimizer was skipped.

    Example:
        >>> import torch
        >>> optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        >>> skipped = [True]
        >>> scheduler = SkipAwareScheduler(torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5), lambda: skipped[0])
        >>> scheduler.step()
        >>> scheduler.get_last_lr()
        [1.0]

    """

    __slots__ = ("scheduler", "step_was_skipped")

    def __init__(self, scheduler: Any, step_was_skipped: Callable[[], bool]) -> None:
        object.__setattr__(self, "scheduler", scheduler)
        object.__setattr__(self, "step_was_skipped", step_was_skipped)

    # isinstance() falls back on ``__class__``: ``isinstance(self.lr_schedulers(), ReduceLROnPlateau)``, Lightning's
    # manual-optimization recipe for passing the metric, holds for a wrapped scheduler; type() still tells them apart.
    @property  # type: ignore[misc]  # overriding object.__class__ with a read-only property is the intent
    def __class__(self) -> type:
        """The wrapped scheduler's class."""
        return type(self.scheduler)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Advance the wrapped scheduler, unless its optimizer's last step was skipped."""
        if self.step_was_skipped():
            return None
        return self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.scheduler, name, value)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickle as the user's scheduler itself, fetched by a standard-library callable (itemgetter(0) of a
        # one-element list): the file loads in a process that never imported lightning_mp.
        return operator.itemgetter(0), ([self.scheduler],)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.scheduler!r})"
