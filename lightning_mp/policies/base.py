"""The seam between the plugin and an opt level.

An opt level decides how the module is prepared before training (O3 casts its weights to half, O2 gives them half model
parameters and keeps fp32 master parameters), whether the forward runs under autocast, what else surrounds the forward
and the backward (O2 puts its half weights in place), what happens around each optimizer step (O2 moves the gradients to
the masters, and the stepped masters back into the half weights), and what it must release when training ends. The
plugin asks the policy at each of those points instead of branching on the level, so a new level is one new module.

Where each hook runs::

    convert_module(module)                     # Trainer/Fabric setup, before the module moves and is wrapped
    connect(module, optimizers)                # once the optimizers exist (O3 checks their eps; Kahan buffers)
    with forward_context(), autocast:          # every training/validation/test/predict step, Fabric's forward
        step ...
    with backward_context():                   # around every backward
        backward
    prepare_step(optimizer)                    # O2: fp32 copies of the gradients on the masters
    unscale, clipping, step                    # the plugin's step engine, on step_parameters(optimizer)
    gradients_changed(optimizer)                   # O2: the true gradients written back into the half gradients
    before_closure(optimizer)                  # LBFGS re-evaluating its closure: O2 writes the moved masters
    after_optimizer_step(optimizer, skipped)   # O2: name weights beyond fp16 after a skip
    state_dict() / load_state_dict(state)      # the level's own state in the plugin's checkpoint entry
    teardown()                                 # end of fit/validate/test/predict, also after an exception

Hooks a level attaches to the model in ``convert_module`` go in :attr:`PrecisionPolicy.hook_handles`, and the base
``teardown`` removes them: after fit, validate, test or predict (also a failed one), the model holds no hook and no
object of this package, so ``to_torchscript``, ``torch.export`` and ``torch.save`` see a plain torch model. The next
stage's ``convert_module`` attaches them again.

A resumed optimizer state may hold buffers the level does not use: a ``lean-kahan`` checkpoint resumed under
another level carries a Kahan compensation buffer per weight, which nothing would read again but every checkpoint
would keep. ``connect`` drops them, with a warning, from the state the optimizer holds and from any state loaded
into it later (the Trainer restores optimizer states after ``connect``; Fabric's ``load`` comes before it).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_mp.stochastic_rounding import COMPENSATION_KEY


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
    half_weights: ClassVar[bool] = False
    """Whether the model's own weights are half (O3, lean): Lightning then sees the run as ``16-true``/``bf16-true``."""
    computes_with_half_weights: ClassVar[bool] = False
    """Whether the forward computes with weights stored in a half type (O2's model parameters, O3's and lean's own
    weights): fp32 would leave the level nothing to do, so ``precision="auto"`` picks a half type for it even where
    the device only emulates bf16."""
    packs_masters: ClassVar[bool] = False
    """Whether the masters are kept packed beside the half weights (``lean-exact``): a sharding strategy keeps fp32
    shards as the masters already, so the level's sharded form packs nothing."""
    kahan: ClassVar[bool] = False
    """Whether each weight keeps a Kahan compensation buffer in its optimizer state (``lean-kahan``)."""

    def __init__(self, half_dtype: torch.dtype | None, keep_fp32: Sequence[type | str] = ()) -> None:
        self.half_dtype = half_dtype
        self.keep_fp32 = list(keep_fp32)
        self.hook_handles: list[RemovableHandle] = []
        """The hooks this level attached to the model and its optimizers; :meth:`teardown` removes them."""
        self.optimizers_connect_late = False
        """Whether optimizers are connected at their first step, after a checkpoint may have loaded their states
        (Fabric's ``load``): a level whose optimizer states torch would round then keeps them in its own state."""

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Prepare the module before it is moved to the device and wrapped. Must work in place."""
        return module

    def connect(self, module: nn.Module, optimizers: list[Optimizer]) -> list[Optimizer]:
        """Check or adapt the optimizers once they exist; drop Kahan buffers of a resumed state the level won't use.

        Subclasses call this first.
        """
        if not self.kahan:
            forget = functools.partial(drop_kahan_compensation, opt_level=self.opt_level)
            for optimizer in optimizers:
                forget(optimizer)
                self.hook_handles.append(optimizer.register_load_state_dict_post_hook(forget))
        return optimizers

    def parameter_names(self, module: nn.Module) -> dict[int, str]:
        """``id(tensor) -> name`` for every tensor an optimizer steps, for error messages."""
        return {id(parameter): name for name, parameter in module.named_parameters()}

    def master_dtype(self, parameter: Tensor) -> torch.dtype | None:
        """The dtype of the master copy this level keeps beside ``parameter`` for the optimizer (O2: fp32); None."""
        return None

    def master_param(self, parameter: Tensor) -> Tensor:
        """The tensor holding ``parameter``'s value in the optimizer's precision (O2: its fp32 master), else itself."""
        return parameter

    def forward_context(self) -> AbstractContextManager:
        """What surrounds every eager forward, around the plugin's autocast (a compiled region traces none)."""
        return contextlib.nullcontext()

    def backward_context(self) -> AbstractContextManager:
        """What surrounds every backward (``manual_backward``, the Trainer's automatic backward, ``fabric.backward``).

        In manual optimization this is inside the forward context; in automatic optimization, after it.
        """
        return contextlib.nullcontext()

    def step_parameters(self, optimizer: Optimizer) -> list[Tensor]:
        """The tensors whose ``.grad`` the step of ``optimizer`` applies: its parameters (O2: their fp32 masters).

        The loss scaler unscales and checks their gradients, and the plugin's clipping clips them.
        """
        return [p for group in optimizer.param_groups for p in group["params"]]

    def prepare_step(self, optimizer: Optimizer) -> None:
        """Called once per step, before the gradients of ``optimizer`` are unscaled, clipped or stepped.

        Again only where a backward ran since; also once after each closure evaluation of an optimizer that
        evaluates its closure itself (LBFGS).
        """

    def gradients_changed(self, optimizer: Optimizer) -> None:
        """Called after the gradients of :meth:`step_parameters` were unscaled, and again after clipping them."""

    def before_closure(self, optimizer: Optimizer) -> None:
        """Called before an optimizer that evaluates its closure in its step (LBFGS) evaluates it."""

    def after_optimizer_step(self, optimizer: Optimizer, skipped: bool) -> None:
        """Called after the optimizer step, or after it was skipped."""

    def step_raised(self, optimizer: Optimizer) -> None:
        """Called when ``optimizer.step()`` raised (in a step hook or in the optimizer), before the error goes on."""

    def state_dict(self) -> dict[str, Any]:
        """State this level must save beyond the model and optimizer states (the plugin's checkpoint entry)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""

    def teardown(self) -> None:
        """Release every reference to the model and remove the level's hooks: training has ended, normally or not."""
        for handle in self.hook_handles:
            handle.remove()
        self.hook_handles = []


def drop_kahan_compensation(optimizer: Optimizer, opt_level: str) -> None:
    """Remove the Kahan compensation buffers from ``optimizer``'s state, warning once if there were any."""
    states = [state for state in optimizer.state.values() if COMPENSATION_KEY in state]
    if not states:
        return
    for state in states:
        del state[COMPENSATION_KEY]
    rank_zero_warn(
        f"lightning_mp: the state of {type(optimizer).__name__} held Kahan compensation buffers for {len(states)}"
        f" parameters (from an opt_level='lean-kahan' run); opt_level={opt_level!r} does not use them, so they are"
        " dropped. Resume with opt_level='lean-kahan' to keep them."
    )
