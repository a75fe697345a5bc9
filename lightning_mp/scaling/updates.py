"""The host's replay of one iteration: count its steps and move the host scale by the rules.

Once the host can read an iteration's inf flags (at once on the CPU, one iteration late on an accelerator), the scaler
hands the iteration's record to :func:`apply_iteration`:

* the flags read as 0 are marked clean in the :class:`~lightning_mp.scaling.inf_flags.InfFlagPool` (their next use
  needs no ``zero_``);
* the :class:`~lightning_mp.scaling.counters.StepCounters` counts the optimizers that stepped and those that skipped;
* a scale set by hand (``update(new_scale)``) replaces the rules for this iteration; otherwise
  :func:`~lightning_mp.scaling.rules.next_state` moves the scale, the counters counts a backoff or a growth, a collapse
  raises :class:`~lightning_mp.errors.LossScaleCollapseError` naming the parameters to blame, and a scale held at its
  floor warns.

:meth:`ScaleUpdates.apply` then writes the new scale to the device where the device did not move it already, and
raises on a streak of skipped steps (:mod:`~lightning_mp.scaling.nonfinite`).

:class:`ScaleUpdates` keeps the host's scale state and counters, and decides when the host reads an iteration. Where
every flag is already on the host (the steps read them, or they live in CPU memory) the iteration is applied at its
update. Where a flag stays on an accelerator, its update publishes a non-blocking copy of each flag
(:mod:`~lightning_mp.scaling.found_inf_copies`) and the iteration waits: the next update applies it, by then without
waiting, and a checkpoint or a pickle applies it first (waiting for the copy). So the host is at most one iteration
behind, and never waits for the device on a steady step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import replace

import torch

from lightning_mp.errors import LossScaleCollapseError
from lightning_mp.scaling.counters import StepCounters
from lightning_mp.scaling.device_rules import DeviceScale
from lightning_mp.scaling.found_inf_copies import FoundInfCopies
from lightning_mp.scaling.inf_flags import InfFlagPool, IterationRecord
from lightning_mp.scaling.modes import Scaling
from lightning_mp.scaling.nonfinite import NonfiniteParameters, Optimizers, nonfinite_parameters, raise_on_streak
from lightning_mp.scaling.rules import ScalerSettings, ScaleState, next_state

__all__ = ["ScaleUpdates", "apply_iteration"]


def apply_iteration(
    record: IterationRecord,
    state: ScaleState,
    settings: ScalerSettings,
    counters: StepCounters,
    flags: InfFlagPool,
    nonfinite: Callable[[list[int]], NonfiniteParameters],
) -> ScaleState:
    """Count ``record`` in ``counters`` and return the host scale state after it.

    Args:
        record: an iteration whose flags the host can read now (waiting for their copies if they are in flight).
        state: the host state before the iteration.
        settings: the settings.
        counters: the counters, updated in place.
        flags: the flag pool, told which flags read as 0.
        nonfinite: names the parameters of the given optimizers whose gradients are not finite.

    Raises:
        LossScaleCollapseError: when an overflow would push the scale below its floor and ``on_min_scale="raise"``.

    """
    verdicts = record.read()
    flags.mark_clean(record, verdicts)
    counters.record_iteration(record.stepped, {index for index, skipped in verdicts.items() if skipped})
    if record.new_scale is not None:
        return replace(state, scale=record.new_scale)
    transition = next_state(state, any(verdicts.values()), settings)
    if transition.event == "collapsed":
        raise LossScaleCollapseError(
            step=counters.optimizer_steps,
            scale=state.scale,
            floor=settings.floor,
            nonfinite_parameters=nonfinite(sorted(verdicts)),
        )
    counters.record_scale_move(state.scale, transition.state.scale)
    if transition.event == "held_at_floor":
        warnings.warn(
            f"The loss scale is at its floor {settings.floor:g} and gradients still overflow: steps keep being skipped."
            " Try precision='bf16-mixed', keep_fp32=[...] for the overflowing layers, or a lower learning rate.",
            RuntimeWarning,
            stacklevel=5,
        )
    return transition.state


class ScaleUpdates:
    """The host's account of the scale: its state and the counters, kept by applying each closed iteration.

    Args:
        settings: the settings, for the first state.
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
        """The scale and its trackers, as of the last applied iteration."""
        self.counters = StepCounters()
        self.waiting_iteration: IterationRecord | None = None
        """On an accelerator, the last iteration, applied on the host at the next update."""
        self.mirror = FoundInfCopies()
        self._scaling = scaling
        self._device_scale = device_scale
        self._flags = flags
        self._optimizers = optimizers

    def end_iteration(self, record: IterationRecord, settings: ScalerSettings, names: Mapping[int, str]) -> None:
        """Apply ``record`` now where its flags are on the host; else publish them and apply the previous one.

        Args:
            record: the closed iteration.
            settings: the settings.
            names: ``id(parameter) -> qualified name``, for the errors.

        """
        if not record.on_host:
            record.readers = {i: self.mirror.publish(i, f) for i, f in record.device_flags.items()}
            record.ready = self.mirror.end_iteration(next(iter(record.device_flags.values())).device)
        if record.ready is not None:
            # An accelerator: read the previous iteration now, this one at the next update.
            previous, self.waiting_iteration = self.waiting_iteration, record
            if previous is not None:
                self.apply(previous, settings, names)
            return
        self.apply_waiting_iteration(settings, names)
        self.apply(record, settings, names)

    def apply_waiting_iteration(self, settings: ScalerSettings, names: Mapping[int, str]) -> None:
        """Apply the iteration still waiting for its flags' host copies, if any (waiting for them)."""
        if self.waiting_iteration is not None:
            previous, self.waiting_iteration = self.waiting_iteration, None
            self.apply(previous, settings, names)

    def apply(self, record: IterationRecord, settings: ScalerSettings, names: Mapping[int, str]) -> None:
        """Apply the host rules and the per-optimizer counters to an iteration whose flags can be read now.

        Raises:
            LossScaleCollapseError: when an overflow would push the scale below its floor and
                ``on_min_scale="raise"``.
            NonFiniteStepsError: when one optimizer skipped ``max_consecutive_skips`` steps in a row.

        """
        before = self.state
        self.state = apply_iteration(
            record, before, settings, self.counters, self._flags, lambda indices: self.nonfinite(indices, names)
        )
        if record.new_scale is not None:
            self._device_scale.write_scale(self.state, self._scaling.scales_loss)
            return
        if not record.device_ruled:
            self._device_scale.trackers_current = False
            if self.state.scale != before.scale:
                self._device_scale.write_scale(self.state, self._scaling.scales_loss)
        raise_on_streak(
            self.counters,
            settings.max_consecutive_skips,
            self._optimizers,
            lambda indices: self.nonfinite(indices, names),
            lambda: self._scaling.loss_scale(self.state.scale),
        )

    def remember_nonfinite(
        self, index: int, found_inf: torch.Tensor | float, limit: int | None, names: Mapping[int, str]
    ) -> None:
        """Name the non-finite gradients of a skipped step near the streak ``limit``, while they still exist.

        A flag still on an accelerator is left alone: it cannot be read without waiting.
        """
        on_accelerator = isinstance(found_inf, torch.Tensor) and found_inf.device.type != "cpu"
        if not on_accelerator and self.counters.near_streak_limit(index, limit) and bool(found_inf):
            self.counters.last_nonfinite[index] = self.nonfinite([index], names)

    def nonfinite(self, indices: list[int], names: Mapping[int, str]) -> NonfiniteParameters:
        """The parameters of the optimizers ``indices`` whose gradients are not finite."""
        return nonfinite_parameters(self._optimizers, names, indices)
