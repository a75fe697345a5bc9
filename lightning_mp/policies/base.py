"""The seam between the plugin and an opt level.

An opt level decides how the module is prepared before training (O3 casts its weights to half, O2 chooses which
weights compute in half), whether the forward runs under autocast, what else surrounds the forward (O2 puts half
copies of the weights in place), and what it must release when training ends. The plugin asks the policy at each of
those points instead of branching on the level, so a new level is one new module.

Where each hook runs::

    convert_module(module)                     # Trainer/Fabric setup, before the module moves and is wrapped
    connect(module, optimizers)                # once the optimizers exist (O3 checks their eps)
    with forward_context(), autocast:          # every training/validation/test/predict step, Fabric's forward
        step ...
    backward, unscale, clipping, step          # the plugin's step engine, on the module's own parameters
    after_backward()                           # O2: the fp32 parameters back in place (manual optimization)
    after_optimizer_step(optimizer, skipped)   # O2: name weights beyond fp16's range after a skip
    state_dict() / load_state_dict(state)      # the level's own state in the plugin's checkpoint entry
    teardown()                                 # end of fit/validate/test/predict, also after an exception
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from contextlib import AbstractContextManager
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
        """Prepare the module before it is moved to the device and wrapped. Must work in place."""
        return module

    def connect(self, module: nn.Module, optimizers: list[Optimizer]) -> list[Optimizer]:
        """Check or adapt the optimizers once they exist."""
        return optimizers

    def parameter_names(self, module: nn.Module) -> dict[int, str]:
        """``id(tensor) -> name`` for every tensor an optimizer steps, to name culprits in error messages."""
        return {id(parameter): name for name, parameter in module.named_parameters()}

    def forward_context(self) -> AbstractContextManager:
        """What surrounds every forward, around the plugin's autocast; entered and left once per step."""
        return contextlib.nullcontext()

    def after_backward(self) -> None:
        """Called after every backward under the Trainer, before ``on_after_backward``.

        In manual optimization this is inside the forward context; in automatic optimization, after it.
        """

    def after_optimizer_step(self, optimizer: Optimizer, skipped: bool) -> None:
        """Called after the optimizer step, or after it was skipped."""

    def state_dict(self) -> dict[str, Any]:
        """State this level must save beyond the model and optimizer states (the plugin's checkpoint entry)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""

    def teardown(self) -> None:
        """Release every reference to the model: training has ended, normally or not."""
