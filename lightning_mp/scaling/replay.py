"""The host's replay of one iteration: count its steps and move the host scale by the rules.

Once the host can read an iteration's inf flags (at once on the CPU, one iteration late on an accelerator), the scaler
hands the iteration's record to :func:`replay_iteration`:

* the flags read as 0 are marked clean in the :class:`~lightning_mp.scaling.inf_flags.InfFlagPool` (their next use
  needs no ``zero_``);
* the :class:`~lightning_mp.scaling.ledger.StepLedger` counts the optimizers that stepped and those that skipped;
* a scale set by hand (``update(new_scale)``) replaces the rules for this iteration; otherwise
  :func:`~lightning_mp.scaling.rules.next_state` moves the scale, the ledger counts a backoff or a growth, a collapse
  raises :class:`~lightning_mp.errors.LossScaleCollapseError` naming the parameters to blame, and a scale held at its
  floor warns.

The scaler then writes the new scale to the device where the device did not move it already, and raises on a streak
of skipped steps (:mod:`~lightning_mp.scaling.culprits`).

When the host can read an iteration is :class:`DeferredReplay`'s job. Where every flag is already on the host (the
steps read them, or they live in CPU memory) the iteration is replayed at its update. Where a flag stays on an
accelerator, its update publishes a non-blocking copy of each flag (:mod:`~lightning_mp.scaling.host_mirror`) and
the iteration waits: the next update replays it, by then without waiting, and a checkpoint or a pickle replays it
first (waiting for the copy). So the host is at most one iteration behind, and never waits for the device on a
steady step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import replace

from lightning_mp.errors import LossScaleCollapseError
from lightning_mp.scaling.culprits import Culprits
from lightning_mp.scaling.host_mirror import HostMirror
from lightning_mp.scaling.inf_flags import InfFlagPool, IterationRecord
from lightning_mp.scaling.ledger import StepLedger
from lightning_mp.scaling.rules import ScalerSettings, ScaleState, next_state

__all__ = ["DeferredReplay", "replay_iteration"]


def replay_iteration(
    record: IterationRecord,
    state: ScaleState,
    settings: ScalerSettings,
    ledger: StepLedger,
    flags: InfFlagPool,
    culprits: Callable[[list[int]], Culprits],
) -> ScaleState:
    """Count ``record`` in ``ledger`` and return the host scale state after it.

    Args:
        record: an iteration whose flags the host can read now (waiting for their copies if they are in flight).
        state: the host state before the iteration.
        settings: the knobs.
        ledger: the counters, updated in place.
        flags: the flag pool, told which flags read as 0.
        culprits: names the parameters of the given optimizers whose gradients are not finite.

    Raises:
        LossScaleCollapseError: when an overflow would push the scale below its floor and ``on_min_scale="raise"``.

    """
    verdicts = record.read()
    flags.mark_clean(record, verdicts)
    ledger.record_iteration(record.stepped, {index for index, skipped in verdicts.items() if skipped})
    if record.new_scale is not None:
        return replace(state, scale=record.new_scale)
    transition = next_state(state, any(verdicts.values()), settings)
    if transition.event == "collapsed":
        raise LossScaleCollapseError(
            step=ledger.optimizer_steps,
            scale=state.scale,
            floor=settings.floor,
            nonfinite_parameters=culprits(sorted(verdicts)),
        )
    ledger.record_scale_move(state.scale, transition.state.scale)
    if transition.event == "held_at_floor":
        warnings.warn(
            f"The loss scale is at its floor {settings.floor:g} and gradients still overflow: steps keep being skipped."
            " Try precision='bf16-mixed', keep_fp32=[...] for the overflowing layers, or a lower learning rate.",
            RuntimeWarning,
            stacklevel=5,
        )
    return transition.state


class DeferredReplay:
    """Replays each closed iteration once the host can read its flags: at once, or at the next update."""

    def __init__(self) -> None:
        self.pending: IterationRecord | None = None
        """On an accelerator, the last iteration, replayed on the host at the next update."""
        self.mirror = HostMirror()

    def end_iteration(self, record: IterationRecord, replay: Callable[[IterationRecord], None]) -> None:
        """Replay ``record`` now where its flags are on the host; else publish them and replay the previous one."""
        if not record.on_host:
            record.readers = {i: self.mirror.publish(i, f) for i, f in record.device_flags.items()}
            record.ready = self.mirror.end_iteration(next(iter(record.device_flags.values())).device)
        if record.ready is not None:
            # An accelerator: read the previous iteration now, this one at the next update.
            previous, self.pending = self.pending, record
            if previous is not None:
                replay(previous)
            return
        self.settle(replay)
        replay(record)

    def settle(self, replay: Callable[[IterationRecord], None]) -> None:
        """Replay the iteration still waiting for its flags' host copies, if any (waiting for them)."""
        if self.pending is not None:
            previous, self.pending = self.pending, None
            replay(previous)
