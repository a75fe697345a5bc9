"""What a step knows of each optimizer: one record per optimizer, with explicit phases, and torch's protocol.

torch's contract for one iteration: each optimizer is unscaled at most once (explicitly, or inside its ``step``),
then steps once, and ``update`` closes the iteration. :class:`StepStates` keeps that contract for every optimizer the
loss scaler sees, in one :class:`OptimizerStep` record each, and decides each step. The engines (the Trainer's and
Fabric's) read and write the same records through the scaler; no other object keeps per-optimizer state of a step.

An optimizer's phase moves so:

=========  ================================================================  ==========  ==========================
phase      event                                                             next phase  caller
=========  ================================================================  ==========  ==========================
READY      the first unscale or check of its gradients in the iteration      PREPARED    ``unscale_``, ``step``
           (the :class:`StepPreparation` readies them first: O2 copies
           its half gradients to its fp32 masters)
PREPARED   a backward makes new gradients                                    READY       the engine's backward
PREPARED   ``unscale_`` (or ``step``'s own unscale): gradients unscaled      UNSCALED    ``unscale_``, ``step``
           and checked, the verdict known on the host or on the device
UNSCALED   ``step``: taken, handed to a fused kernel, or skipped             STEPPED     ``step``
STEPPED    the preparation closes the iteration first (Fabric's pending      READY       ``unscale_``, ``step``
           scale update) before a second step of the optimizer
any        ``update``: the scale moves, the iteration closes                 READY       ``update``
=========  ================================================================  ==========  ==========================

``unscale_`` of an UNSCALED or STEPPED optimizer and ``step`` of a STEPPED one raise torch's ``RuntimeError``s. The
record also keeps what the engines need of the same step: whether the optimizer's own ``step()`` ran (a host skip
runs none), whether its gradients were finite when clipping read them, its verdict
(:mod:`~lightning_mp.scaling.verdict`, kept past the update for the learning-rate schedulers) and whether the engine
connected it to the opt level.

A record is found by the optimizer's ``param_groups`` list, which Lightning's and Fabric's wrappers share with the
optimizer they wrap: ``scaler.unscale_(lightning_optimizer)`` and the plugin's step of the optimizer inside are one
optimizer here. Each record has an index (the order of first sight) by which the scaler counts skips and streaks and
names the optimizer in its errors. Records hold the optimizer weakly, so a plugin reused for another model keeps
nothing alive; a pickled scaler keeps no record.

A step goes one of three ways (:mod:`~lightning_mp.scaling.fused_steps`): an optimizer that declares torch's fused
protocol gets the found_inf flag (and, when nothing unscaled it yet, the scale as ``grad_scale``) and skips on the
device; one the mode hands off steps through torch's fused kernel of its rule, which skips on the device too; any
other reads its verdict on the host and is skipped there when it is set. The flags themselves live in the iteration's
:class:`~lightning_mp.scaling.inf_flags.IterationRecord`, which the scale update applies once it can read them.
"""

from __future__ import annotations

import enum
import inspect
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from lightning_mp.scaling import fused_steps, kernels
from lightning_mp.scaling.device_rules import DeviceScale
from lightning_mp.scaling.inf_flags import InfFlagPool, IterationRecord
from lightning_mp.scaling.modes import GradientCheck, Scaling
from lightning_mp.scaling.rules import ScaleState
from lightning_mp.scaling.verdict import StepVerdict

__all__ = ["UNCHECKED", "OptimizerStep", "OwnParameters", "Phase", "StepPreparation", "StepStates"]

UNCHECKED = -1
"""The optimizer index of steps taken without a check (LBFGS): never skipped, never in a streak."""

Remember = Callable[[int, torch.Tensor | float], None]
"""Told of each skipped step: the optimizer index and its verdict (a CPU flag, or the host's float)."""


class Phase(enum.Enum):
    """Where an optimizer is in the iteration (the module docstring's table)."""

    READY = "ready"
    PREPARED = "prepared"
    UNSCALED = "unscaled"
    STEPPED = "stepped"


class StepPreparation(Protocol):
    """What readies an optimizer's gradients for the scaler: the step engine under the plugin, else nothing."""

    def prepare_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Ready ``optimizer``'s gradients, before the scaler first unscales or checks them in an iteration."""

    def step_parameters(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The tensors whose ``.grad`` the step of ``optimizer`` applies."""
        ...

    def gradients_changed(self, optimizer: torch.optim.Optimizer) -> None:
        """The scaler unscaled (or clipping changed) the gradients of :meth:`step_parameters`."""


class OwnParameters:
    """A scaler by hand: the gradients are the optimizer's parameters' own, and nothing readies them."""

    def prepare_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Nothing to ready."""

    def step_parameters(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The parameters of ``optimizer``'s groups."""
        return [p for group in optimizer.param_groups for p in group["params"]]

    def gradients_changed(self, optimizer: torch.optim.Optimizer) -> None:
        """Nothing to do."""


OWN_PARAMETERS = OwnParameters()


@dataclass(eq=False)
class OptimizerStep:
    """What the step knows of one optimizer (the module docstring's table)."""

    optimizer: weakref.ReferenceType[torch.optim.Optimizer]
    index: int
    """The scaler's index of the optimizer: the order in which it was first seen."""
    phase: Phase = Phase.READY
    found_inf_per_device: dict[Any, Any] = field(default_factory=dict)
    """Device -> its found_inf flag in this iteration, as torch's protocol getter returns it."""
    kernel_ran: bool = False
    """Whether the optimizer's own ``step()`` ran in this iteration (a step skipped on the host runs none)."""
    finite_when_clipped: bool = False
    """Whether its gradients were finite when clipping read them in this iteration (before clipping them)."""
    verdict: StepVerdict | None = None
    """The verdict of its last step; kept past the update, for the schedulers that ask."""
    connected: bool = False
    """Whether the step engine has connected it to the opt level."""

    @property
    def decided_on_device(self) -> bool:
        """Whether its last step ran its kernel with the flag on the device, which skips unseen by the host."""
        return self.kernel_ran and self.verdict is not None and self.verdict.flag is not None

    def next_iteration(self) -> None:
        """The iteration closed: back to READY, with nothing of the step kept but its verdict."""
        self.phase = Phase.READY
        self.found_inf_per_device = {}
        self.kernel_ran = False
        self.finite_when_clipped = False


class StepStates:
    """The records of the optimizers one loss scaler sees, and the decisions of their steps.

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
        """The iteration in progress: its found_inf flags, by optimizer index."""
        self.flags = InfFlagPool()
        self.preparation: StepPreparation = OWN_PARAMETERS
        """What readies each optimizer's gradients and names the tensors that hold them."""
        self._records: dict[int, OptimizerStep] = {}
        """``id(optimizer.param_groups)`` -> its record."""
        self._by_index: list[OptimizerStep] = []

    def __getstate__(self) -> dict[str, Any]:
        """Records hold optimizers and the preparation holds a run: a pickled scaler keeps neither."""
        return {**self.__dict__, "preparation": OWN_PARAMETERS, "_records": {}, "_by_index": []}

    # ------------------------------------------------------------------------------------------------ records

    def of(self, optimizer: torch.optim.Optimizer) -> OptimizerStep:
        """``optimizer``'s record, made now if it has none (a new optimizer gets the next index).

        An optimizer whose ``param_groups`` list was replaced since (``load_state_dict``) keeps its record.
        """
        key = id(optimizer.param_groups)
        record = self._records.get(key)
        if record is not None:
            known = record.optimizer()
            if known is not None and known.param_groups is optimizer.param_groups:
                return record
        for existing in self._by_index:
            if existing.optimizer() is optimizer:
                self._records = {k: r for k, r in self._records.items() if r is not existing}
                self._records[key] = existing
                return existing
        record = OptimizerStep(weakref.ref(optimizer), len(self._by_index))
        self._records[key] = record
        self._by_index.append(record)
        return record

    def known(self, optimizer: torch.optim.Optimizer) -> OptimizerStep | None:
        """``optimizer``'s record if it has one; makes none."""
        record = self._records.get(id(optimizer.param_groups))
        return record if record is not None and record.optimizer() is not None else None

    def at(self, index: int) -> torch.optim.Optimizer | None:
        """The optimizer of index ``index``, or None when there is none or it no longer exists."""
        return self._by_index[index].optimizer() if 0 <= index < len(self._by_index) else None

    def __len__(self) -> int:
        """The number of optimizers seen."""
        return len(self._by_index)

    def records(self) -> list[OptimizerStep]:
        """Every record, in index order."""
        return list(self._by_index)

    def phase(self, optimizer: torch.optim.Optimizer) -> Phase:
        """``optimizer``'s phase in this iteration."""
        record = self.known(optimizer)
        return Phase.READY if record is None else record.phase

    def stepped(self) -> list[OptimizerStep]:
        """The records of the optimizers that stepped (or skipped) in this iteration."""
        return [record for record in self._by_index if record.phase is Phase.STEPPED]

    def step_parameters(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The tensors whose gradients ``optimizer``'s step applies, as the preparation names them."""
        return self.preparation.step_parameters(optimizer)

    # ------------------------------------------------------------------------------------------------ transitions

    def close(self) -> IterationRecord:
        """``update``: end the iteration, every record back to READY; return its record and start the next one."""
        record, self.record = self.record, IterationRecord()
        self.flags.next_iteration()
        for step in self._by_index:
            step.next_iteration()
        return record

    def prepare(self, optimizer: torch.optim.Optimizer) -> OptimizerStep:
        """READY (or STEPPED, see the table) -> PREPARED: have the preparation ready ``optimizer``'s gradients."""
        record = self.of(optimizer)
        if record.phase in (Phase.READY, Phase.STEPPED):
            self.preparation.prepare_step(optimizer)
            if record.phase is Phase.READY:  # the preparation may have closed the iteration: READY again
                record.phase = Phase.PREPARED
        return record

    def forget_prepared(self) -> None:
        """A backward made new gradients: PREPARED -> READY, so the next unscale or check readies them again."""
        for record in self._by_index:
            if record.phase is Phase.PREPARED:
                record.phase = Phase.READY

    def verdict(self, optimizer: torch.optim.Optimizer) -> bool | torch.Tensor | None:
        """A bool where the host knows whether the step is skipped, else the device flag; None before the check."""
        record = self.known(optimizer)
        if record is None:
            return None
        flags, index = self.record, record.index
        if index in flags.host_flags or index in flags.norms:
            return bool(flags.verdict_from_norms(index))
        return flags.device_flags.get(index)

    def found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[Any, Any]:
        """The found_inf flag of each device for ``optimizer`` in this iteration (torch's protocol getter)."""
        record = self.known(optimizer)
        return record.found_inf_per_device if record is not None else {}

    def recheck(self, optimizer: torch.optim.Optimizer) -> None:
        """Fold a new check of ``optimizer``'s gradients into its verdict (after its unscale, before its step)."""
        record = self.known(optimizer)
        if record is not None:
            self.record.recheck(record.index, self.step_parameters(optimizer))

    def record_unchecked_step(self, skipped: bool) -> None:
        """Count a step checked outside the scaler (LBFGS), skipped or not."""
        self.record.stepped.add(UNCHECKED)
        self.record.host_flags[UNCHECKED] = float(skipped)

    def check(
        self, optimizer: torch.optim.Optimizer, unscales: bool, state: ScaleState, allow_fp16: bool
    ) -> dict[Any, Any]:
        """PREPARED -> UNSCALED: check ``optimizer``'s gradients for inf/NaN, unscaling them on the way (``unscales``).

        Returns each device's found_inf flag. The scaler's ``unscale_`` and torch's check before a fused step
        (``_check_inf_per_device``, which unscales nothing) are this one transition.

        Raises:
            RuntimeError: when ``optimizer`` was already unscaled or stepped in this iteration.

        """
        record = self.prepare(optimizer)
        if record.phase is Phase.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if record.phase is Phase.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        parameters = self.step_parameters(optimizer)
        device_scale = self.device_scale
        if device_scale.scale is None:
            device = next((p.device for p in parameters if p.grad is not None), torch.device(self.device_type))
            device_scale.allocate(state, device, self.scaling.scales_loss)
        check = GradientCheck(
            optimizer, parameters, record.index, unscales, device_scale, self.flags, self.record, allow_fp16
        )
        per_device = self.scaling.check_gradients(check)
        record.phase, record.found_inf_per_device = Phase.UNSCALED, per_device
        combined = kernels.combined_flag(per_device) if per_device else None
        if combined is not None:
            self.record.device_flags[record.index] = combined
        if unscales and self.scaling.scales_loss:
            self.preparation.gradients_changed(optimizer)
        return per_device

    def step(self, optimizer: torch.optim.Optimizer, scaler: Any, remember: Remember, *args: Any, **kwargs: Any) -> Any:
        """-> STEPPED: run ``optimizer.step()`` through the scaler ``scaler`` unless a gradient holds an inf or a NaN.

        Raises:
            RuntimeError: when ``optimizer`` already stepped in this iteration.

        """
        record = self.of(optimizer)
        if record.phase is Phase.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        unscaled = record.phase is Phase.UNSCALED
        if fused_steps.supports_fused_protocol(optimizer):
            return self._fused_protocol_step(optimizer, record, unscaled, scaler, remember, *args, **kwargs)
        if not unscaled:
            scaler.unscale_(optimizer)
        index = record.index
        self.record.stepped.add(index)
        record.phase = Phase.STEPPED
        flag = self.record.device_flags.get(index)
        if flag is not None and index in self.record.skip_on_device:
            remember(index, flag)
            return fused_steps.step_on_device(optimizer, flag, None, *args, **kwargs)
        if self._host_verdict(index, flag, remember):
            return None
        return optimizer.step(*args, **kwargs)

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
        record: OptimizerStep,
        unscaled: bool,
        scaler: Any,
        remember: Remember,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """Step an optimizer that declares ``_step_supports_amp_scaling``, exactly as torch's ``GradScaler.step``."""
        index = record.index
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
            record.phase = Phase.STEPPED
            return output
        user_scale = getattr(optimizer, "grad_scale", None)
        grad_scale = user_scale
        if not unscaled:
            # The kernel unscales: the gradients are only checked here, and it divides them by the scale.
            scaler._check_inf_per_device(optimizer)
            grad_scale = self.scaling.fused_grad_scale(self.device_scale, user_scale)
        record.phase = Phase.STEPPED
        flag = self.record.device_flags.get(index)
        if flag is not None and fused_steps.skips_safely_on_device(optimizer):
            remember(index, flag)
            return fused_steps.step_on_device(optimizer, flag, grad_scale, *args, **kwargs)
        if self._host_verdict(index, flag, remember):
            return None
        return fused_steps.step_with_protocol(optimizer, grad_scale, flag, *args, **kwargs)
