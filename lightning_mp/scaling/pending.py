"""The statistics an iteration will leave once its update has run, read before that update.

Fabric's step runs the scaler's ``update`` late (at the next backward), yet a logger after ``optimizer.step()``
wants this iteration's counters. :func:`stats_after_update` applies the iteration on copies: the steps are counted
in a copy of the :class:`~lightning_mp.scaling.counters.StepCounters` and the scale moved by
:func:`~lightning_mp.scaling.rules.next_state`, as the update will. Nothing of the scaler changes and nothing raises
(a collapse keeps the scale here and raises at the update itself). Where a flag is still on an accelerator it cannot
be read without waiting, and the caller falls back to the statistics as they are.
"""

from __future__ import annotations

import copy

from lightning_mp.scaling.counters import StepCounters
from lightning_mp.scaling.inf_flags import IterationRecord
from lightning_mp.scaling.modes import Scaling
from lightning_mp.scaling.rules import ScalerSettings, ScaleState, next_state
from lightning_mp.scaling.stats import PrecisionStats

__all__ = ["stats_after_update"]


def stats_after_update(
    record: IterationRecord, counters: StepCounters, state: ScaleState, settings: ScalerSettings, scaling: Scaling
) -> PrecisionStats | None:
    """The statistics after ``record``'s update; None where a flag cannot be read without waiting for a device.

    Args:
        record: the iteration in progress.
        counters: the counters before it (not changed).
        state: the host scale before it.
        settings: the settings.
        scaling: the scaler's mode, which says what scale a user reads.

    """
    flags = record.peek() if record.stepped and record.new_scale is None else None
    if flags is None:
        return None
    counters = copy.deepcopy(counters)
    counters.record_iteration(record.stepped, {index for index, skipped in flags.items() if skipped})
    transition = next_state(state, any(flags.values()), settings)
    scale = state.scale
    if transition.event != "collapsed":
        counters.record_scale_move(scale, transition.state.scale)
        scale = transition.state.scale
    return PrecisionStats.from_counters(scaling.loss_scale(scale), counters.last_step_skipped, counters.counters())
