"""O3: pure half precision. Every weight, norms included, is fp16 or bf16; no master weights, no autocast.

The one exception is batch normalisation (BatchNorm, SyncBatchNorm): its running mean and variance are averages
accumulated over the whole run, which half precision rounds away, so batch norms stay fp32, as with Apex's
``keep_batchnorm_fp32``.

O3 is a speed and memory baseline, as in Apex: the optimizer steps the half weights directly and keeps its states
in the half type, so small updates can round away and training may stall or diverge. The policy warns about it.
Only ``keep_fp32`` subtrees stay fp32, running in fp32 regions (:mod:`lightning_mp.overrides`).

Conversion (:func:`~lightning_mp.policies.casting.convert_to_half`, in place, before the model moves to its
device):

1. Every parameter and floating buffer below or at fp32 is cast to the half type, except in batch norms and in the
   subtrees that ``keep_fp32`` matches; fp64 tensors keep their dtype.
   Tied weights are one tensor with one dtype, so a module that shares a parameter with a kept one is kept too,
   with a warning: keeping one side only would make the first forward mix fp32 and half.
2. Hooks make the dtypes meet: a module with half weights casts its floating inputs to the half type; a kept
   normalisation layer computes in fp32 and hands its output back in the half type; the root module returns fp32
   outputs, so that the loss is computed in fp32. Teardown removes them: after fit the model is a plain half model,
   as Lightning's ``16-true``/``bf16-true`` leave it, that takes inputs in its weights' dtype.

An optimizer's ``eps`` lives in the weights' dtype too. Adam's default ``1e-8`` is 0 in fp16, so a parameter whose
gradient and moments are 0 would be updated by 0/0 = NaN on the first clean step. ``connect`` therefore raises
every ``eps`` that is 0 in its parameters' half type to that type's smallest normal number
(``torch.finfo(dtype).tiny``, 6.1e-5 in fp16) and warns, naming the optimizer and the value.

An optimizer built before the conversion (Fabric's ``setup(model, optimizer)``) may already hold states in fp32:
Adagrad creates its sums when it is built. ``connect`` casts each such state to its parameter's half type, as
torch's ``Optimizer.load_state_dict`` does; step counters stay as they are.

In some torch releases the CPU kernel of ``SGD(fused=True)`` leaves fp16 and bf16 parameters of 8 to 32 elements or
more unchanged (:mod:`lightning_mp._compat`, which probes the running torch). There ``connect`` refuses an SGD
built with ``fused=True`` over O3's half weights, naming the argument: training would go on with weights that never
move. Other SGDs are stepped in their own form there (:mod:`lightning_mp.scaling.fused_steps`).

fp16 gradients are unscaled and checked in place, so the loss scaler accepts them (``allow_fp16_gradients``). Loss
scaling is off unless asked for with a static ``MixedPrecision(loss_scale=...)``; non-finite steps are still
skipped.

Private names: :mod:`lightning_mp._private_names` lists them, with the reason for each.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mp.arguments.checks import arguments_of
from lightning_mp.overrides import Fp32Overrides
from lightning_mp.policies.base import PrecisionPolicy
from lightning_mp.policies.casting import check_half_dtype, convert_to_half
from lightning_mp.scaling.fused_steps import fused_sgd_steps


def vanishing_eps_groups(optimizer: Optimizer) -> list[tuple[int, float, torch.dtype]]:
    """``(group index, eps, half dtype)`` of every parameter group whose ``eps`` is 0 in its parameters' half type."""
    found = []
    for index, group in enumerate(optimizer.param_groups):
        eps = group.get("eps")
        if not isinstance(eps, (int, float)) or eps <= 0:
            continue
        half = {p.dtype for p in group["params"] if p.dtype in (torch.float16, torch.bfloat16)}
        for dtype in sorted(half, key=str):
            if float(torch.tensor(eps, dtype=dtype)) == 0.0:
                found.append((index, float(eps), dtype))
                break
    return found


def cast_states_to_half_parameters(optimizer: Optimizer) -> None:
    """Cast the floating states of ``optimizer``'s half parameters to their dtype (not ``step``), as torch's load does.

    An optimizer built before the model was cast holds fp32 states for what are now half parameters (Adagrad's
    ``sum``); fused kernels refuse the mix, and the others would keep O3's states in fp32.
    """
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            state = optimizer.state.get(parameter)
            if not state or parameter.dtype not in (torch.float16, torch.bfloat16):
                continue
            for key, value in state.items():
                if (
                    key != "step"
                    and torch.is_tensor(value)
                    and value.is_floating_point()
                    and value.dtype != parameter.dtype
                ):
                    state[key] = value.to(parameter.dtype)


def refuse_fused_sgd_that_skips_half_weights(optimizer: Optimizer) -> None:
    """Raise if ``optimizer`` is an ``SGD(fused=True)`` whose fused kernel would leave its half parameters unchanged.

    Raises:
        ValueError: naming ``fused=True``, the dtype and device, and the fix.

    """
    if not isinstance(optimizer, torch.optim.SGD):
        return
    for group in optimizer.param_groups:
        if not group.get("fused"):
            continue
        for parameter in group["params"]:
            if not fused_sgd_steps(optimizer, parameter):
                raise ValueError(
                    f"lightning_mp O3: torch.optim.SGD(fused=True) is not allowed over {parameter.dtype} weights on"
                    f" {parameter.device.type!r} with torch {torch.__version__}: its fused kernel there leaves"
                    " every full vector block of a half-precision parameter unchanged (pytorch issue 191763), so"
                    " the weights would not move while each step counted as taken. Build the SGD with"
                    " fused=False (or leave fused unset), or use a torch release with the fix."
                )


def _refuse_before_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    refuse_fused_sgd_that_skips_half_weights(optimizer)


class O3Policy(PrecisionPolicy):
    """Half weights everywhere except ``keep_fp32``; no masters; a baseline that may not converge.

    Args:
        half_dtype: ``torch.float16`` or ``torch.bfloat16``.
        keep_fp32: module types, qualified names or ``re:`` patterns whose modules stay fp32.

    Raises:
        ValueError: if ``half_dtype`` is not a half type, or a ``keep_fp32`` entry is invalid.

    """

    opt_level = "O3"
    uses_autocast = False
    scales_by_default = False
    half_gradients: ClassVar[bool] = True
    half_weights: ClassVar[bool] = True
    computes_with_half_weights: ClassVar[bool] = True
    """The optimizer steps half gradients, which the loss scaler must accept."""

    def __init__(self, half_dtype: torch.dtype | None, keep_fp32: Sequence[type | str] = ()) -> None:
        with arguments_of(type(self).__name__):
            half_dtype = check_half_dtype(half_dtype)
        super().__init__(half_dtype, keep_fp32)
        self.overrides = Fp32Overrides(self.keep_fp32)
        rank_zero_warn(
            f"lightning_mp: opt_level='O3' trains pure {self.half_dtype} weights without fp32 master weights. It is a"
            " speed baseline and may not converge; use opt_level='O2' or 'O1' for real training."
        )

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Cast every weight and floating buffer outside ``keep_fp32`` and batch norms to the half type, in place."""
        assert self.half_dtype is not None
        convert_to_half(
            module,
            self.half_dtype,
            self.overrides,
            keep_normalization_fp32=False,
            keep_batch_normalization_fp32=True,
            handles=self.hook_handles,
        )
        return module

    @override
    def connect(self, module: nn.Module, optimizers: list[Optimizer]) -> list[Optimizer]:
        """Raise every ``eps`` that is 0 in the half type to its smallest normal number, with a warning.

        Raises:
            ValueError: for an ``SGD(fused=True)`` over half weights where torch's fused SGD kernel does not update
                them (:func:`~lightning_mp._compat.fused_sgd_updates_half`); also at the first step after a group
                with such weights was added.

        """
        optimizers = super().connect(module, optimizers)
        for optimizer in optimizers:
            refuse_fused_sgd_that_skips_half_weights(optimizer)
            cast_states_to_half_parameters(optimizer)
            if isinstance(optimizer, torch.optim.SGD):
                # Checked again before every step: a group added later (add_param_group) may bring half weights.
                self.hook_handles.append(optimizer.register_step_pre_hook(_refuse_before_step))
        for optimizer in optimizers:
            for index, eps, dtype in vanishing_eps_groups(optimizer):
                corrected = torch.finfo(dtype).tiny
                optimizer.param_groups[index]["eps"] = corrected
                rank_zero_warn(
                    f"lightning_mp O3: {type(optimizer).__name__} param group {index} has eps={eps:g}, which is 0 in"
                    f" {dtype}: a parameter with zero moments would be updated by 0/0 = NaN. Using eps={corrected:g}"
                    f" ({dtype}'s smallest normal number) instead; pass eps >= {corrected:g} to choose it yourself."
                )
        return optimizers


__all__ = [
    "O3Policy",
    "cast_states_to_half_parameters",
    "refuse_fused_sgd_that_skips_half_weights",
    "vanishing_eps_groups",
]
