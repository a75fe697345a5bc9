"""The gate every optimizer step of an iteration passes: torch's GradScaler protocol, per optimizer.

torch's contract for one iteration: each optimizer is unscaled at most once (explicitly, or inside its ``step``),
then steps once, and ``update`` closes the iteration. :class:`StepGate` keeps that contract and decides each step:

* it keeps each optimizer's stage (prepared, unscaled, stepped) and raises torch's errors when the contract is broken;
* before it first unscales or checks an optimizer's gradients in an iteration it asks its
  :class:`StepPreparation` to ready them (under :class:`~lightning_mp.MixedPrecision` the step engine, whose opt
  level may keep the gradients the step applies elsewhere: O2's fp32 masters), and it checks the gradients of the
  tensors the preparation names, so a user's own ``unscale_`` and the engine's reach the same gradients;
* an unscale has the scaler's mode (:mod:`~lightning_mp.scaling.modes`) check the gradients and keeps the flag it
  set, one per optimizer (several devices are combined into one), in the iteration's
  :class:`~lightning_mp.scaling.inf_flags.IterationRecord`;
* a step goes one of three ways (:mod:`~lightning_mp.scaling.hand_off`): an optimizer that declares torch's fused
  protocol gets the flag (and, when nothing unscaled it yet, the scale as ``grad_scale``) and skips on the device;
  one the mode hands off steps through torch's fused kernel of its rule, which skips on the device too; any other
  reads its verdict on the host and is skipped there when it is set;
* a skipped step read on the host tells the scaler, which names the culprits near the streak limit.

The gate holds device tensors and optimizer references only: a pickled scaler gets an empty one.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from lightning_mp.scaling import hand_off, kernels
from lightning_mp.scaling.device_rules import DeviceScale
from lightning_mp.scaling.inf_flags import InfFlagPool, IterationRecord
from lightning_mp.scaling.modes import Scaling
from lightning_mp.scaling.optimizers import OptimizerRegistry
from lightning_mp.scaling.rules import ScaleState

__all__ = ["UNCHECKED", "OptimizerStage", "OwnParameters", "StepGate", "StepPreparation"]

UNCHECKED = -1
"""The optimizer index of steps taken without a check (LBFGS): never skipped, never in a streak."""

Remember = Callable[[int, torch.Tensor | float], None]
"""Told of each skipped step: the optimizer index and its verdict (a CPU flag, or the host's float)."""


class StepPreparation(Protocol):
    """What readies an optimizer's gradients for the gate: the step engine under the plugin, else nothing."""

    def prepare_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Ready ``optimizer``'s gradients, before the gate first unscales or checks them in an iteration."""

    def step_parameters(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The tensors whose ``.grad`` the step of ``optimizer`` applies."""
        ...

    def after_unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """The gate unscaled the gradients of :meth:`step_parameters`."""


class OwnParameters:
    """A scaler by hand: the gradients are the optimizer's parameters' own, and nothing readies them."""

    def prepare_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Nothing to ready."""

    def step_parameters(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The parameters of ``optimizer``'s groups."""
        return [p for group in optimizer.param_groups for p in group["params"]]

    def after_unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Nothing to do."""


OWN_PARAMETERS = OwnParameters()


@dataclass
class OptimizerStage:
    """Where one optimizer is in the iteration (torch's contract: unscale at most once, then step once)."""

    stage: Literal["prepared", "unscaled", "stepped"]
    found_inf_per_device: dict[Any, Any] = field(default_factory=dict)
    """Device -> its inf flag, as torch's protocol getter returns it."""


class StepGate:
    """The stages, flags and verdicts of one iteration's optimizer steps.

    Args:
        scaling: the scaler's mode.
        device_scale: the scaler's device tensors, allocated here at the first unscale.
        device_type: where they go when the optimizer has no gradient to say.

    """

    def __init__(self, scaling: Scaling, device_scale: DeviceScale, device_type: str) -> None:
        self.scaling = scaling
        self.device_scale = device_scale
        self.device_type = device_type
        self.record = IterationRecord()
        """The iteration in progress."""
        self.stages: dict[int, OptimizerStage] = {}
        """``id(optimizer)`` -> its stage in this iteration, for the optimizers that unscaled or stepped."""
        self.flags = InfFlagPool()
        self.optimizers = OptimizerRegistry()
        self.preparation: StepPreparation = OWN_PARAMETERS
        """What readies each optimizer's gradients and names the tensors that hold them."""

    def __getstate__(self) -> dict[str, Any]:
        """A run's preparation (its step engine) is not pickled: a copy readies nothing until a run attaches one."""
        return {**self.__dict__, "preparation": OWN_PARAMETERS}

    def step_parameters(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The tensors whose gradients ``optimizer``'s step applies, as the preparation names them."""
        return self.preparation.step_parameters(optimizer)

    def close(self) -> IterationRecord:
        """End the iteration: return its record and start the next one."""
        record, self.record = self.record, IterationRecord()
        self.flags.next_iteration()
        self.stages = {}
        return record

    def is_unscaled(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` was unscaled in this iteration (and has not stepped yet)."""
        stage = self.stages.get(id(optimizer))
        return stage is not None and stage.stage == "unscaled"

    def prepare(self, optimizer: torch.optim.Optimizer) -> None:
        """Have the preparation ready ``optimizer``'s gradients, once per iteration and backward.

        An optimizer that stepped since the last update is asked again: the preparation may close the iteration
        (Fabric's engine applies a scale update left pending), after which it starts a new one.
        """
        stage = self.stages.get(id(optimizer))
        if stage is None or stage.stage == "stepped":
            self.preparation.prepare_step(optimizer)
            if id(optimizer) not in self.stages:
                self.stages[id(optimizer)] = OptimizerStage("prepared")

    def forget_prepared(self) -> None:
        """A backward made new gradients: the next unscale or check readies them again."""
        self.stages = {key: stage for key, stage in self.stages.items() if stage.stage != "prepared"}

    def adopt_unscale(self, wrapper: Any, optimizer: torch.optim.Optimizer) -> None:
        """Record an unscale made through ``wrapper``, which shares ``optimizer``'s ``param_groups``, as its own."""
        if wrapper.param_groups is optimizer.param_groups and self.is_unscaled(wrapper):
            self.stages[id(optimizer)] = self.stages.pop(id(wrapper))

    def verdict(self, optimizer: torch.optim.Optimizer) -> bool | torch.Tensor | None:
        """A bool where the host knows whether the step is skipped, else the device flag; None before the check."""
        index = self.optimizers.known_index(optimizer)
        if index is None:
            return None
        record = self.record
        if index in record.host_flags or index in record.norms:
            return bool(record.verdict_from_norms(index))
        return record.device_flags.get(index)

    def found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[Any, Any]:
        """The inf flag of each device found for ``optimizer`` in this iteration (torch's protocol getter)."""
        stage = self.stages.get(id(optimizer))
        return stage.found_inf_per_device if stage is not None else {}

    def recheck(self, optimizer: torch.optim.Optimizer) -> None:
        """Fold a new check of ``optimizer``'s gradients into its verdict (after its unscale, before its step)."""
        index = self.optimizers.known_index(optimizer)
        if index is not None:
            self.record.recheck(index, self.step_parameters(optimizer))

    def record_unchecked_step(self, skipped: bool) -> None:
        """Count a step checked outside the scaler (LBFGS), skipped or not."""
        self.record.stepped.add(UNCHECKED)
        self.record.host_flags[UNCHECKED] = float(skipped)

    def unscale(
        self, optimizer: torch.optim.Optimizer, unscales: bool, state: ScaleState, allow_fp16: bool
    ) -> dict[Any, Any]:
        """Unscale (when ``unscales``) and check ``optimizer``'s gradients; return each device's flag.

        Raises:
            RuntimeError: when ``optimizer`` was already unscaled or stepped in this iteration.

        """
        self.prepare(optimizer)
        stage = self.stages.get(id(optimizer))
        if stage is not None and stage.stage == "unscaled":
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if stage is not None and stage.stage == "stepped":
            raise RuntimeError("unscale_() is being called after step().")
        parameters = self.step_parameters(optimizer)
        device_scale = self.device_scale
        if device_scale.scale is None:
            device = next((p.device for p in parameters if p.grad is not None), torch.device(self.device_type))
            device_scale.allocate(state, device, self.scaling.scales_loss)
        index = self.optimizers.index(optimizer)
        per_device = self.scaling.check_gradients(
            optimizer, parameters, index, unscales, device_scale, self.flags, self.record, allow_fp16
        )
        self.stages[id(optimizer)] = OptimizerStage("unscaled", per_device)
        combined = kernels.combined_flag(per_device) if per_device else None
        if combined is not None:
            self.record.device_flags[index] = combined
        if unscales and self.scaling.scales_loss:
            self.preparation.after_unscale(optimizer)
        return per_device

    def step(self, optimizer: torch.optim.Optimizer, scaler: Any, remember: Remember, *args: Any, **kwargs: Any) -> Any:
        """Run ``optimizer.step()`` through the scaler ``scaler`` unless its gradients hold an inf or a NaN.

        Raises:
            RuntimeError: when ``optimizer`` already stepped in this iteration.

        """
        stage = self.stages.get(id(optimizer))
        if stage is not None and stage.stage == "stepped":
            raise RuntimeError("step() has already been called since the last update().")
        if stage is not None and stage.stage == "prepared":
            stage = None  # readied, not unscaled: the step unscales (or its fused kernel does)
        if hand_off.supports_fused_protocol(optimizer):
            return self._fused_protocol_step(optimizer, stage, scaler, remember, *args, **kwargs)
        if stage is None:
            scaler.unscale_(optimizer)
        index = self.optimizers.index(optimizer)
        self.record.stepped.add(index)
        self._mark_stepped(optimizer)
        flag = self.record.device_flags.get(index)
        if flag is not None and self.scaling.hands_off(optimizer):
            remember(index, flag)
            return hand_off.step_on_device(optimizer, flag, None, *args, **kwargs)
        if self._host_verdict(index, flag, remember):
            return None
        return optimizer.step(*args, **kwargs)

    def _mark_stepped(self, optimizer: torch.optim.Optimizer) -> None:
        stage = self.stages.setdefault(id(optimizer), OptimizerStage("stepped"))
        stage.stage = "stepped"

    def _host_verdict(self, index: int, flag: torch.Tensor | None, remember: Remember) -> float:
        """Optimizer ``index``'s verdict read on the host (1.0: skip); a skip is told to ``remember``."""
        record = self.record
        if index in record.norms:
            found_inf = record.verdict_from_norms(index)  # check mode's one host read
        elif flag is None:
            if self.scaling.scales_loss:
                # As torch's GradScaler: a scaled step whose optimizer had no gradient to unscale is a mistake (a
                # backward that never reached its parameters, a step before any backward).
                raise AssertionError("No inf checks were recorded for this optimizer.")
            # No gradient at all, and nothing scaled: torch's optimizers skip such parameters, nothing to check.
            found_inf = record.host_flags[index] = 0.0
        else:
            found_inf = record.host_flags[index] = float(flag.item())
        if found_inf:
            remember(index, found_inf)
        return found_inf

    def _fused_protocol_step(
        self,
        optimizer: torch.optim.Optimizer,
        stage: OptimizerStage | None,
        scaler: Any,
        remember: Remember,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """Step an optimizer that declares ``_step_supports_amp_scaling``, exactly as torch's ``GradScaler.step``."""
        index = self.optimizers.index(optimizer)
        self.record.stepped.add(index)
        if "grad_scaler" in inspect.signature(optimizer.step).parameters:
            warnings.warn(
                "GradScaler is going to stop passing itself as a keyword argument to the passed optimizer. In the"
                " near future GradScaler registers `grad_scale: Tensor` and `found_inf: Tensor` to the passed"
                " optimizer and let the optimizer use them directly.",
                FutureWarning,
                stacklevel=4,
            )
            # torch's Optimizer.step declares no grad_scaler; this optimizer's own step does.
            output = optimizer.step(*args, **kwargs, grad_scaler=scaler)  # type: ignore[call-overload]
            self._mark_stepped(optimizer)
            return output
        user_scale = getattr(optimizer, "grad_scale", None)
        grad_scale = user_scale
        if stage is None:
            # The kernel unscales: the gradients are only checked here, and it divides them by the scale.
            scaler._check_inf_per_device(optimizer)
            grad_scale = self.scaling.fused_grad_scale(self.device_scale, user_scale)
        self._mark_stepped(optimizer)
        flag = self.record.device_flags.get(index)
        if flag is not None and hand_off.skips_safely_on_device(optimizer):
            remember(index, flag)
            return hand_off.step_on_device(optimizer, flag, grad_scale, *args, **kwargs)
        if self._host_verdict(index, flag, remember):
            return None
        return hand_off.step_with_protocol(optimizer, grad_scale, flag, *args, **kwargs)
