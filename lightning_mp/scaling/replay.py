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

:meth:`HostReplay.replay` then writes the new scale to the device where the device did not move it already, and
raises on a streak of skipped steps (:mod:`~lightning_mp.scaling.culprits`).

:class:`HostReplay` keeps the host's scale state and counters, and decides when the host reads an iteration. Where
every flag is already on the host (the steps read them, or they live in CPU memory) the iteration is replayed at its
update. Where a flag stays on an accelerator, its update publishes a non-blocking copy of each flag
(:mod:`~lightning_mp.scaling.host_mirror`) and the iteration waits: the next update replays it, by then without
waiting, and a checkpoint or a pickle replays it first (waiting for the copy). So the host is at most one iteration
behind, and never waits for the device on a steady step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import replace

import torch

from lightning_mp.errors import LossScaleCollapseError
from lightning_mp.scaling.culprits import Culprits, Optimizers, nonfinite_parameters, raise_on_streak
from lightning_mp.scaling.device_rules import DeviceScale
from lightning_mp.scaling.host_mirror import HostMirror
from lightning_mp.scaling.inf_flags import InfFlagPool, IterationRecord
from lightning_mp.scaling.ledger import StepLedger
from lightning_mp.scaling.modes import Scaling
from lightning_mp.scaling.rules import ScalerSettings, ScaleState, next_state

__all__ = ["HostReplay", "replay_iteration"]


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


class HostReplay:
    """The host's account of the scale: its state and the counters, kept by replaying each closed iteration.

    Args:
        settings: the knobs, for the first state.
        scaling: the scaler's mode, which says what scale a user reads.
        device_scale: the scaler's device tensors, rewritten when the host rules moved the scale.
        flags: the scaler's flag pool.
        optimizers: the scaler's optimizers, by index, for the errors.

    """

    def __init__(
        self,
        settings: ScalerSettings,
        scaling: Scaling,
        device_scale: DeviceScale,
        flags: InfFlagPool,
        optimizers: Optimizers,
    ) -> None:
        self.state = settings.initial_state()
        """The scale and its trackers, as of the last replayed iteration."""
        self.ledger = StepLedger()
        self.waiting_iteration: IterationRecord | None = None
        """On an accelerator, the last iteration, replayed on the host at the next update."""
        self.mirror = HostMirror()
        self._scaling = scaling
        self._device_scale = device_scale
        self._flags = flags
        self._optimizers = optimizers

    def end_iteration(self, record: IterationRecord, settings: ScalerSettings, names: Mapping[int, str]) -> None:
        """Replay ``record`` now where its flags are on the host; else publish them and replay the previous one.

        Args:
            record: the closed iteration.
            settings: the knobs.
            names: ``id(parameter) -> qualified name``, for the errors.

        """
        if not record.on_host:
            record.readers = {i: self.mirror.publish(i, f) for i, f in record.device_flags.items()}
            record.ready = self.mirror.end_iteration(next(iter(record.device_flags.values())).device)
        if record.ready is not None:
            # An accelerator: read the previous iteration now, this one at the next update.
            previous, self.waiting_iteration = self.waiting_iteration, record
            if previous is not None:
                self.replay(previous, settings, names)
            return
        self.replay_waiting_iteration(settings, names)
        self.replay(record, settings, names)

    def replay_waiting_iteration(self, settings: ScalerSettings, names: Mapping[int, str]) -> None:
        """Replay the iteration still waiting for its flags' host copies, if any (waiting for them)."""
        if self.waiting_iteration is not None:
            previous, self.waiting_iteration = self.waiting_iteration, None
            self.replay(previous, settings, names)

    def replay(self, record: IterationRecord, settings: ScalerSettings, names: Mapping[int, str]) -> None:
        """Apply the host rules and the per-optimizer counters to an iteration whose flags can be read now.

        Raises:
            LossScaleCollapseError: when an overflow would push the scale below its floor and
                ``on_min_scale="raise"``.
            NonFiniteStepsError: when one optimizer skipped ``max_consecutive_skips`` steps in a row.

        """
        before = self.state
        self.state = replay_iteration(
            record, before, settings, self.ledger, self._flags, lambda indices: self.culprits(indices, names)
        )
        if record.new_scale is not None:
            self._device_scale.write_scale(self.state, self._scaling.scales_loss)
            return
        if not record.device_ruled:
            self._device_scale.trackers_current = False
            if self.state.scale != before.scale:
                self._device_scale.write_scale(self.state, self._scaling.scales_loss)
        raise_on_streak(
            self.ledger,
            settings.max_consecutive_skips,
            self._optimizers,
            lambda indices: self.culprits(indices, names),
            lambda: self._scaling.loss_scale(self.state.scale),
        )

    def remember_culprits(
        self, index: int, found_inf: torch.Tensor | float, limit: int | None, names: Mapping[int, str]
    ) -> None:
        """Name the non-finite gradients of a skipped step near the streak ``limit``, while they still exist.

        A flag still on an accelerator is left alone: it cannot be read without waiting.
        """
        on_accelerator = isinstance(found_inf, torch.Tensor) and found_inf.device.type != "cpu"
        if not on_accelerator and self.ledger.near_streak_limit(index, limit) and bool(found_inf):
            self.ledger.last_culprits[index] = self.culprits([index], names)

    def culprits(self, indices: list[int], names: Mapping[int, str]) -> Culprits:
        """The parameters of the optimizers ``indices`` whose gradients are not finite."""
        return nonfinite_parameters(self._optimizers, names, indices)
