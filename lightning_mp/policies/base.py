"""The seam between the plugin and an opt level.

An opt level decides four things: how the module is converted before training (O2 casts weights to half), whether
the forward runs under autocast, what happens to gradients around the optimizer step (O2 keeps fp32 master weights
and moves gradients and weights between the two copies), and what a checkpoint holds. The plugin asks the policy at
each of those points instead of branching on the level, so a new level is one new module.

The plugin's optimizer step, and where each hook runs::

    closure()                                  # forward (autocast if uses_autocast) and scaled backward
    policy.prepare_gradients(optimizer)        # O2: half model gradients -> fp32 master gradients
    loss_scaler.unscale_(optimizer)            # fused inf check and unscale of the optimizer's gradients
    on_before_optimizer_step hooks, clipping   # they see true gradients
    loss_scaler.step(optimizer)                # skipped when a gradient is inf/NaN
    loss_scaler.update()
    policy.after_optimizer_step(optimizer, skipped)   # O2: fp32 masters -> half model weights
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn
from torch.optim import Optimizer


class PrecisionPolicy:
    """One opt level. The base class is the identity at every hook; subclasses override what they change.

    Args:
        half_dtype: ``torch.float16`` or ``torch.bfloat16``; None for fp32 training.
        keep_fp32: module types, qualified names or ``re:`` patterns whose modules stay in fp32.

    """

    opt_level: ClassVar[str] = ""
    uses_autocast: ClassVar[bool] = False
    scales_by_default: ClassVar[bool] = True
    """Whether fp16 training at this level uses dynamic loss scaling unless told otherwise."""
    half_gradients: ClassVar[bool] = False
    """Whether the gradients the scaler unscales are themselves fp16 (O3): torch refuses those unless allowed."""

    def __init__(self, half_dtype: torch.dtype | None, keep_fp32: Sequence[type | str] = ()) -> None:
        self.half_dtype = half_dtype
        self.keep_fp32 = list(keep_fp32)

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Convert the module before it is moved to the device and wrapped. Must work in place."""
        return module

    def connect(self, module: nn.Module, optimizers: list[Optimizer]) -> list[Optimizer]:
        """Adapt the optimizers once they exist (O2 points them at fp32 master weights)."""
        return optimizers

    def parameter_names(self, module: nn.Module) -> dict[int, str]:
        """``id(tensor) -> name`` for every tensor an optimizer steps, to name culprits in error messages."""
        return {id(parameter): name for name, parameter in module.named_parameters()}

    def prepare_gradients(self, optimizer: Optimizer) -> None:
        """Called after backward and before the gradients are unscaled."""

    def after_optimizer_step(self, optimizer: Optimizer, skipped: bool) -> None:
        """Called after the optimizer step, or after it was skipped."""

    def state_dict(self) -> dict[str, Any]:
        """State this level must save beyond the model and optimizer states."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Adjust the whole checkpoint before it is written (O2 stores the fp32 masters as the weights)."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Inspect or adjust a checkpoint before Lightning restores from it."""
