"""The scaling modes as strategy objects, one per mode, each saying what differs between the modes.

A strategy says how the loss is scaled, what an unscale does to the gradients, which steps skip on the device, whether
the scale moves there and what scale a user may set.

:class:`~lightning_mp.LossScaler` picks one strategy when it is built (:func:`scaling_for`) and asks it wherever the
modes differ; it never asks which mode it runs in.

* :class:`DynamicScaling` (fp16): the loss is multiplied by the scale ``S``; an unscale multiplies the gradients by
  ``1/S`` and checks them in the same kernel; a fused optimizer gets ``S`` as ``grad_scale``; the scale moves by the
  rules of :mod:`~lightning_mp.scaling.rules`, on the device where the flags stay there
  (:mod:`~lightning_mp.scaling.device_rules`); a scale set by hand lies in ``[floor, max_scale]``.
* :class:`StaticScaling`: the same with a scale that only the user moves (``update(new_scale)``), to any normal
  float32.
* :class:`CheckOnlyScaling` (bf16, fp32): nothing is scaled and the scale reads 1.0; the gradients are only read
  (their inf-norms checked). Adam, AdamW, SGD and Adagrad step through torch's fused kernel of the same rule, which
  skips on the device (:mod:`~lightning_mp.scaling.fused_steps`); in one process an optimizer that cannot skip there has
  its norms kept for its step to read on the host, with no flag at all. No scale can be set.
* :class:`UncheckedScaling` (``skip_nonfinite=False``, bf16 and fp32 only): nothing is scaled or checked and every
  step is taken, as in Lightning's ``"bf16-mixed"`` and ``"32-true"``.

The strategies are stateless: the host :class:`~lightning_mp.scaling.rules.ScaleState`, the device tensors
(:class:`~lightning_mp.scaling.device_rules.DeviceScale`) and the flags stay with the scaler and its step states
(:mod:`~lightning_mp.scaling.steps`), which hand them in.

Under DDP every mode that checks all-reduces each flag (max) right after the check, so every rank takes the same
decision; a rank without gradients still joins with a zero flag (:mod:`~lightning_mp.scaling.sharded`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from typing_extensions import override

from lightning_mp.arguments.checks import caller, check_number
from lightning_mp.scaling import fused_steps, kernels, sharded
from lightning_mp.scaling.device_rules import DeviceScale
from lightning_mp.scaling.devices import distributed
from lightning_mp.scaling.inf_flags import InfFlagPool, IterationRecord
from lightning_mp.scaling.rules import (
    FLOAT32_MAX,
    STATIC_SCALE_FLOOR,
    ScalerSettings,
    ScaleState,
    float32_within,
)

__all__ = [
    "CheckOnlyScaling",
    "DynamicScaling",
    "GradientCheck",
    "Scaling",
    "StaticScaling",
    "UncheckedScaling",
    "scaling_for",
]

FlagsPerDevice = dict[torch.device, torch.Tensor]


@dataclass(frozen=True)
class GradientCheck:
    """One unscale or check of one optimizer's gradients, as the step states ask the mode for it."""

    optimizer: torch.optim.Optimizer
    parameters: list[torch.Tensor]
    """The tensors whose gradients the step applies (O2: the fp32 masters)."""
    index: int
    """The optimizer's index in the scaler."""
    unscales: bool
    """False for torch's check before a fused step, which leaves the unscaling to the kernel."""
    device_scale: DeviceScale
    """The scaler's device tensors, allocated."""
    flags: InfFlagPool
    """Where the zeroed flags come from."""
    record: IterationRecord
    """The iteration, where a verdict that needs no flag is kept."""
    allow_fp16: bool
    """Whether fp16 gradients may be unscaled (the opt level keeps them, O3)."""


class Scaling(ABC):
    """What one scaling mode decides, asked by :class:`~lightning_mp.LossScaler` and its step states."""

    scales_loss: ClassVar[bool]
    """Whether the loss is multiplied at all."""

    @abstractmethod
    def scale(self, outputs: Any, device_scale: DeviceScale, state: ScaleState) -> Any:
        """``outputs`` (a tensor, or an iterable of tensors) as the backward should see them."""

    @abstractmethod
    def check_gradients(self, check: GradientCheck) -> FlagsPerDevice:
        """Unscale (when ``check.unscales``) and check the gradients of ``check``; return each device's inf flag."""

    @abstractmethod
    def fused_grad_scale(self, device_scale: DeviceScale, user_scale: torch.Tensor | None) -> torch.Tensor | None:
        """The ``grad_scale`` a fused optimizer gets when nothing unscaled its gradients yet."""

    def move_on_device(  # noqa: B027 (only dynamic scaling moves a scale on the device)
        self, record: IterationRecord, device_scale: DeviceScale, state: ScaleState, settings: ScalerSettings
    ) -> None:
        """Move the device scale by the rules at the end of ``record``, where its flags stay on the device."""

    @abstractmethod
    def checked_new_scale(self, new_scale: float | torch.Tensor, settings: ScalerSettings) -> float:
        """A scale set by hand (``update(new_scale)``), validated and rounded to a float32."""

    @abstractmethod
    def loss_scale(self, scale: float) -> float:
        """The loss scale a user reads, for the host scale ``scale``."""

    @staticmethod
    def _flags_from_kernel(
        groups: kernels.GradientGroups, multiplier: torch.Tensor | None, check: GradientCheck
    ) -> FlagsPerDevice:
        """Run the check kernel over ``groups``; under DDP all-reduce each flag, so that every rank agrees."""
        device_scale, flags, record, index = check.device_scale, check.flags, check.record, check.index
        assert device_scale.one is not None and device_scale.scale is not None
        per_device = kernels.check_gradients(
            groups, lambda device: flags.zeroed_flag(index, device, record), multiplier, device_scale.one
        )
        if distributed():
            if not per_device:
                # Every rank must join the all-reduce, even one whose optimizer has no gradient this iteration.
                home = device_scale.scale.device
                per_device[home] = flags.zeroed_flag(index, home, record)
            # Under DDP and under sharding alike (FSDP2's gradients are checked by their local shards).
            for flag in per_device.values():
                flags.count_local_overflow(flag)
                sharded.agree_on_found_inf(flag)
        return per_device


class DynamicScaling(Scaling):
    """fp16's loss scaling: the scale moves by the rules after every iteration."""

    scales_loss = True

    @override
    def scale(self, outputs: Any, device_scale: DeviceScale, state: ScaleState) -> Any:
        if isinstance(outputs, torch.Tensor):
            if device_scale.scale is None:
                device_scale.allocate(state, outputs.device, True)
            assert device_scale.scale is not None
            return outputs * device_scale.scale.to(device=outputs.device, non_blocking=True)
        # As torch's GradScaler: one copy of the scale per device, shared by the outputs on it.
        copies: dict[torch.device, torch.Tensor] = {}

        def apply_scale(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if device_scale.scale is None:
                    device_scale.allocate(state, value.device, True)
                assert device_scale.scale is not None
                copy = copies.get(value.device)
                if copy is None:
                    copy = copies[value.device] = device_scale.scale.to(
                        device=value.device, non_blocking=True, copy=True
                    )
                return value * copy
            if isinstance(value, Iterable):
                scaled = map(apply_scale, value)
                return type(value)(scaled) if isinstance(value, (list, tuple)) else scaled
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply_scale(outputs)

    @override
    def check_gradients(self, check: GradientCheck) -> FlagsPerDevice:
        groups = kernels.gradient_groups(check.parameters, check.unscales and not check.allow_fp16)
        multiplier = check.device_scale.inv_scale if check.unscales else check.device_scale.one
        return self._flags_from_kernel(groups, multiplier, check)

    @override
    def fused_grad_scale(self, device_scale: DeviceScale, user_scale: torch.Tensor | None) -> torch.Tensor | None:
        # The kernel unscales: it divides the gradients by the scale (times the user's own grad_scale).
        scale = device_scale.scale
        assert scale is not None
        return scale if user_scale is None else scale * user_scale

    @override
    def move_on_device(
        self, record: IterationRecord, device_scale: DeviceScale, state: ScaleState, settings: ScalerSettings
    ) -> None:
        if not record.on_host and record.new_scale is None:
            device_scale.update(state, list(record.device_flags.values()), settings)
            record.device_ruled = True

    @override
    def checked_new_scale(self, new_scale: float | torch.Tensor, settings: ScalerSettings) -> float:
        return _within(new_scale, settings.floor, settings.max_scale)

    @override
    def loss_scale(self, scale: float) -> float:
        return scale


class StaticScaling(DynamicScaling):
    """A fixed loss scale: scaled and unscaled like fp16's, moved only by hand."""

    move_on_device = Scaling.move_on_device

    @override
    def checked_new_scale(self, new_scale: float | torch.Tensor, settings: ScalerSettings) -> float:
        return _within(new_scale, STATIC_SCALE_FLOOR, FLOAT32_MAX)


class CheckOnlyScaling(Scaling):
    """bf16's and fp32's check: nothing scaled, the gradients read for inf and NaN, a non-finite step skipped."""

    scales_loss = False

    @override
    def scale(self, outputs: Any, device_scale: DeviceScale, state: ScaleState) -> Any:
        return outputs

    @override
    def check_gradients(self, check: GradientCheck) -> FlagsPerDevice:
        groups = kernels.gradient_groups(check.parameters, False)
        if fused_steps.skips_safely_on_device(check.optimizer, check.parameters):
            # The step goes to torch's fused kernel of its rule, which reads the flag and skips on the device.
            check.record.skip_on_device.add(check.index)
            return self._flags_from_kernel(groups, None, check)
        check.record.skip_on_device.discard(check.index)
        if not distributed():
            norms = kernels.single_group_norms(groups)
            if norms is not None:
                # The step decides on the host anyway: it reads these norms (its one sync), and no flag is kept.
                check.record.norms[check.index] = norms
                return {}
        return self._flags_from_kernel(groups, None, check)

    @override
    def fused_grad_scale(self, device_scale: DeviceScale, user_scale: torch.Tensor | None) -> torch.Tensor | None:
        return user_scale

    @override
    def checked_new_scale(self, new_scale: float | torch.Tensor, settings: ScalerSettings) -> float:
        raise ValueError(f"{caller()}(new_scale={new_scale!r}) is not allowed: check mode scales nothing.")

    @override
    def loss_scale(self, scale: float) -> float:
        return 1.0


class UncheckedScaling(CheckOnlyScaling):
    """``skip_nonfinite=False``: nothing scaled, nothing checked, every step taken."""

    @override
    def check_gradients(self, check: GradientCheck) -> FlagsPerDevice:
        check.record.host_flags[check.index] = 0.0
        return {}


def _within(new_scale: float | torch.Tensor, low: float, high: float) -> float:
    value = check_number("new_scale", new_scale, at_least=low, at_most=high)
    return float32_within(value, low, high)


_STRATEGIES: dict[tuple[str, bool], type[Scaling]] = {
    ("dynamic", True): DynamicScaling,
    ("static", True): StaticScaling,
    ("check", True): CheckOnlyScaling,
    ("check", False): UncheckedScaling,
}


def scaling_for(settings: ScalerSettings) -> Scaling:
    """The strategy of ``settings.mode`` and ``settings.skip_nonfinite``.

    Raises:
        ValueError: for ``skip_nonfinite=False`` with a mode that scales the loss: its overflows must be skipped.

    """
    strategy = _STRATEGIES.get((settings.mode, settings.skip_nonfinite))
    if strategy is None:
        raise ValueError(
            f"{caller()}(mode={settings.mode!r}, skip_nonfinite=False) is not allowed: a scaled step whose gradients"
            " overflowed must be skipped. Use skip_nonfinite=False with mode='check' (bf16, fp32)."
        )
    return strategy()
