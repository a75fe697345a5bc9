"""A loss scale per optimizer: one :class:`~lightning_mp.LossScaler` for each, behind the interface of one.

``MixedPrecision("16-mixed", scale_per_optimizer=True)`` gives every optimizer of the run its own dynamic scale,
growth, backoff and hysteresis (Apex's ``num_losses``; DeepSpeed keeps one scaler per engine). A GAN's
discriminator, whose loss overflows on its own schedule, then backs off only its own scale and skips only its own
step; the generator's scale keeps growing. :class:`PerOptimizerScalers` holds one complete scaler per optimizer and
answers the step engines as one scaler does:

* a call about one optimizer (unscale, step, its phase, its verdict) goes to that optimizer's scaler;
* the loss of a backward is multiplied by the scale of the optimizer whose parameters it trains, which the backward
  names (:meth:`scale`);
* the iteration's update moves the scale of each optimizer that stepped, by its own flags;
* the counters add up over the optimizers, and :attr:`PrecisionStats.loss_scales` lists each scale.

Optimizers are numbered in the order the run first meets them (the Trainer's ``configure_optimizers`` order, or
Fabric's first use), and each keeps its number for the run; checkpoints keep every scaler's state in that order.
A loss's gradients must reach only its optimizer's parameters (``detach`` the other model's output, or toggle the
optimizer, as a GAN does anyway): a gradient made under another optimizer's scale would be unscaled with this one's.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from lightning_mp.scaler import LossScaler
from lightning_mp.scaling.rules import ScalerSettings
from lightning_mp.scaling.stats import PrecisionStats
from lightning_mp.scaling.steps import OptimizerStep, Phase, StepPreparation

__all__ = ["PER_OPTIMIZER_KEY", "PerOptimizerScalers", "PerOptimizerSteps", "RunScaler"]

PER_OPTIMIZER_KEY = "per_optimizer"
"""The key of the list of every optimizer's scaler state in a checkpoint's ``scaler`` entry."""


class PerOptimizerSteps:
    """The step records of every optimizer, each kept by its own scaler (what the engines read of ``steps``)."""

    def __init__(self, scalers: PerOptimizerScalers) -> None:
        self._scalers = scalers

    def of(self, optimizer: torch.optim.Optimizer) -> OptimizerStep:
        """``optimizer``'s record, made at first use."""
        return self._scalers.of(optimizer).steps.of(optimizer)

    def known(self, optimizer: torch.optim.Optimizer) -> OptimizerStep | None:
        """``optimizer``'s record; None where no scaler has met it."""
        scaler = self._scalers.known(optimizer)
        return None if scaler is None else scaler.steps.known(optimizer)

    def records(self) -> list[OptimizerStep]:
        """Every optimizer's record."""
        return [record for scaler in self._scalers.scalers for record in scaler.steps.records()]

    def stepped(self) -> list[OptimizerStep]:
        """The records of the optimizers that stepped since the last update."""
        return [record for scaler in self._scalers.scalers for record in scaler.steps.stepped()]


class PerOptimizerScalers:
    """One loss scaler per optimizer, answering the step engines as one scaler does (module docstring).

    Args:
        settings: every optimizer's scaler settings (dynamic mode).
        device: the device type the scales live on.

    """

    def __init__(self, settings: ScalerSettings, device: str) -> None:
        self.settings = settings
        self.device = device
        self.scalers: list[LossScaler] = [LossScaler.from_settings(settings, device)]
        """The scalers, by optimizer number; the first exists before any optimizer is met."""
        self._numbers: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
        """Each optimizer met (a Lightning or Fabric wrapper is the optimizer it wraps) -> its number."""
        self._preparations: list[StepPreparation] = []
        self._param_names: dict[int, str] = {}
        self._allow_fp16_gradients = False
        self._loaded: list[dict[str, Any]] = []
        """Checkpoint states of optimizers not met yet, applied when their scaler is made."""
        self._updated: list[LossScaler] = []
        self.steps = PerOptimizerSteps(self)
        """Every optimizer's step record, each in its own scaler."""

    # ------------------------------------------------------------------------------------------------ routing

    def register(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Number ``optimizers`` in this order (the Trainer's), where they are not numbered yet."""
        for optimizer in optimizers:
            self.of(optimizer)

    def of(self, optimizer: torch.optim.Optimizer) -> LossScaler:
        """The scaler of ``optimizer`` (or of the optimizer a wrapper wraps), numbered at its first use."""
        key = _inner(optimizer)
        number = self._numbers.get(key)
        if number is None:
            number = len(self._numbers)
            self._numbers[key] = number
            while len(self.scalers) <= number:
                self.scalers.append(self._new_scaler(len(self.scalers)))
        return self.scalers[number]

    def known(self, optimizer: torch.optim.Optimizer) -> LossScaler | None:
        """The scaler of ``optimizer``; None where it was not met yet."""
        number = self._numbers.get(_inner(optimizer))
        return None if number is None else self.scalers[number]

    def number(self, optimizer: torch.optim.Optimizer) -> int:
        """The number of ``optimizer`` in this run (0 for the first met)."""
        self.of(optimizer)
        return self._numbers[_inner(optimizer)]

    def _new_scaler(self, number: int) -> LossScaler:
        scaler = LossScaler.from_settings(self.settings, self.device)
        scaler.param_names = self._param_names
        scaler.allow_fp16_gradients = self._allow_fp16_gradients
        for preparation in self._preparations:
            scaler.attach_preparation(preparation)
        if number < len(self._loaded):
            scaler.load_state_dict(self._loaded[number])
        return scaler

    # ------------------------------------------------------------------------------------------------ one optimizer

    def scale(self, outputs: Any, optimizer: torch.optim.Optimizer) -> Any:
        """Multiply the loss by the scale of ``optimizer``, the optimizer whose parameters it trains."""
        return self.of(optimizer).scale(outputs)

    def step_phase(self, optimizer: torch.optim.Optimizer) -> Phase:
        """Where ``optimizer`` is in this iteration."""
        return self.of(optimizer).step_phase(optimizer)

    def found_inf(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s unscaled gradients hold an inf or NaN (reads the flag: a sync on CUDA)."""
        return self.of(optimizer).found_inf(optimizer)

    def step_verdict(self, optimizer: torch.optim.Optimizer) -> bool | torch.Tensor | None:
        """Whether ``optimizer``'s step is skipped, as the host or the device knows it; None before its unscale."""
        return self.of(optimizer).step_verdict(optimizer)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale ``optimizer``'s gradients by its own scale and check them."""
        self.of(optimizer).unscale_(optimizer)

    def recheck_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Check ``optimizer``'s unscaled gradients again before its step."""
        self.of(optimizer).recheck_gradients(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Step ``optimizer`` unless its gradients hold an inf or NaN."""
        return self.of(optimizer).step(optimizer, *args, **kwargs)

    # ------------------------------------------------------------------------------------------------ every optimizer

    def update(self) -> None:
        """End the iteration: move the scale of each optimizer that stepped, by its own flags."""
        self._updated = [scaler for scaler in self.scalers if scaler.steps.stepped()]
        for scaler in self._updated:
            scaler.update()

    def record_unchecked_step(self, skipped: bool = False) -> None:
        """Not reached: an optimizer that evaluates its closure itself (LBFGS) is refused where the loss is scaled."""
        raise RuntimeError("A step checked outside the scaler has no optimizer to count it for (LBFGS in fp16).")

    def attach_preparation(self, preparation: StepPreparation) -> None:
        """Have ``preparation`` ready every optimizer's gradients (the run's step engine)."""
        self._preparations.append(preparation)
        for scaler in self.scalers:
            scaler.attach_preparation(preparation)

    def detach_preparation(self, preparation: StepPreparation) -> None:
        """Stop using ``preparation``."""
        self._preparations = [known for known in self._preparations if known is not preparation]
        for scaler in self.scalers:
            scaler.detach_preparation(preparation)

    def forget_prepared(self) -> None:
        """A backward made new gradients: every optimizer's are readied again before their next check."""
        for scaler in self.scalers:
            scaler.forget_prepared()

    @property
    def param_names(self) -> dict[int, str]:
        """``id(parameter) -> name``, shared by every optimizer's scaler, for error messages."""
        return self._param_names

    @param_names.setter
    def param_names(self, names: dict[int, str]) -> None:
        self._param_names = names
        for scaler in self.scalers:
            scaler.param_names = names

    @property
    def allow_fp16_gradients(self) -> bool:
        """Whether the gradients may be fp16 themselves (O3)."""
        return self._allow_fp16_gradients

    @allow_fp16_gradients.setter
    def allow_fp16_gradients(self, allowed: bool) -> None:
        self._allow_fp16_gradients = allowed
        for scaler in self.scalers:
            scaler.allow_fp16_gradients = allowed

    # ------------------------------------------------------------------------------------------------ reading

    @property
    def scales_loss(self) -> bool:
        """Whether the loss is multiplied by a scale."""
        return self.scalers[0].scales_loss

    @property
    def mode(self) -> str:
        """Every scaler's mode (dynamic)."""
        return self.scalers[0].mode

    @property
    def max_scale(self) -> float:
        """Every scale's ceiling."""
        return self.scalers[0].max_scale

    @property
    def last_step_skipped(self) -> bool:
        """Whether a step of the last updated iteration was skipped, in any optimizer."""
        return any(scaler.last_step_skipped for scaler in self._updated)

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps asked for, over every optimizer."""
        return sum(scaler.optimizer_steps for scaler in self.scalers)

    def get_scale(self) -> float:
        """The first optimizer's scale (:attr:`PrecisionStats.loss_scales` has each)."""
        return self.scalers[0].get_scale()

    def get_scales(self) -> list[float]:
        """Each optimizer's scale, by optimizer number."""
        return [scaler.get_scale() for scaler in self.scalers]

    @property
    def local_overflow_count(self) -> torch.Tensor | int:
        """This rank's overflows over every optimizer, without a sync."""
        counts = [scaler.local_overflow_count for scaler in self.scalers]
        return sum(counts[1:], start=counts[0])

    def local_overflows(self) -> int:
        """This rank's overflows over every optimizer (a sync under DDP)."""
        return sum(scaler.local_overflows() for scaler in self.scalers)

    def stats(self) -> PrecisionStats:
        """The counters added over the optimizers; ``loss_scale`` is the first's, ``loss_scales`` each one's."""
        return _combined([scaler.stats() for scaler in self.scalers], self.last_step_skipped)

    def stats_with_pending(self) -> PrecisionStats:
        """:meth:`stats` as they will read after the pending update; changes nothing."""
        pending = [scaler for scaler in self.scalers if scaler.steps.stepped()]
        each = [scaler.stats_with_pending() if scaler in pending else scaler.stats() for scaler in self.scalers]
        skipped = any(
            stats.last_step_skipped for scaler, stats in zip(self.scalers, each, strict=True) if scaler in pending
        )
        return _combined(each, skipped if pending else self.last_step_skipped)

    # ------------------------------------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The first optimizer's state (torch's keys and the counters), and every optimizer's in order."""
        states = [scaler.state_dict() for scaler in self.scalers]
        return {**states[0], PER_OPTIMIZER_KEY: states}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore every optimizer's scaler; a state with one scale gives it to every optimizer.

        Raises:
            ValueError: if a state is malformed, as :meth:`LossScaler.load_state_dict` says.

        """
        states = state_dict.get(PER_OPTIMIZER_KEY)
        if states is None:
            single = dict(state_dict)
            states = [single] * max(len(self.scalers), 1)
        elif not isinstance(states, list) or not all(isinstance(state, dict) for state in states):
            raise ValueError(
                f"The checkpoint's loss-scaler state has {PER_OPTIMIZER_KEY!r}={states!r}; expected a list of every"
                " optimizer's scaler state."
            )
        self._loaded = [dict(state) for state in states]
        for scaler, state in zip(self.scalers, self._loaded, strict=False):
            scaler.load_state_dict(state)

    def __getstate__(self) -> dict[str, Any]:
        """Pickle the scalers in order; the optimizers' numbers and the run's engine are met again by a new run."""
        state = {**self.__dict__, "_preparations": [], "_updated": []}
        del state["_numbers"]  # the optimizers are met again by the run that uses the copy
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._numbers = weakref.WeakKeyDictionary()


def _inner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer a Lightning or Fabric wrapper wraps (both expose it as ``optimizer``), or ``optimizer``.

    Numbered by the object, not by its ``param_groups`` list, which ``load_state_dict`` replaces.
    """
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def _combined(each: list[PrecisionStats], last_step_skipped: bool) -> PrecisionStats:
    """One optimizer's counters each, added up; the last step skipped where one of the last update's was."""
    return dataclasses.replace(
        each[0],
        optimizer_steps=sum(stats.optimizer_steps for stats in each),
        skipped_steps=sum(stats.skipped_steps for stats in each),
        last_step_skipped=last_step_skipped,
        scale_backoffs=sum(stats.scale_backoffs for stats in each),
        scale_growths=sum(stats.scale_growths for stats in each),
        consecutive_skips=max(stats.consecutive_skips for stats in each),
        loss_scales=tuple(stats.loss_scale for stats in each),
    )


RunScaler = LossScaler | PerOptimizerScalers
"""What a run scales and checks with: one loss scaler, or one per optimizer."""
