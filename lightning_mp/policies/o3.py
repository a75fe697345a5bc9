"""O3: pure half precision. Every weight, norms included, is fp16 or bf16; no master weights, no autocast.

The one exception is batch normalisation (BatchNorm, SyncBatchNorm): its running mean and variance are averages
accumulated over the whole run, which half precision rounds away, so batch norms stay fp32, as with Apex's
``keep_batchnorm_fp32``.

O3 is a speed and memory baseline, as in Apex: the optimizer steps the half weights directly and keeps its states
in the half type, so small updates can round away and training may stall or diverge. The policy warns about it.
Only ``keep_fp32`` subtrees stay fp32, running in fp32 regions (:mod:`lightning_mp.overrides`).

Conversion (:func:`convert_to_half`, in place, before the model moves to its device):

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

fp16 gradients are unscaled and checked in place, so the loss scaler accepts them (``allow_fp16_gradients``). Loss
scaling is off unless asked for with a static ``MixedPrecision(loss_scale=...)``; non-finite steps are still
skipped.

Private torch names used: ``nn.modules.batchnorm._BatchNorm`` (the common base of the batch norms and
SyncBatchNorm, without the instance norms); ``nn.Module._forward_pre_hooks`` and ``_forward_hooks`` (read only, so
that converting a model twice attaches its hooks once: ``nn.Module`` offers no public way to list hooks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_mp.overrides import Fp32Overrides, Fp32Region, cast_low_precision, has_fp32_region
from lightning_mp.policies.base import PrecisionPolicy
from lightning_mp.policies.o2 import check_half_dtype, is_normalization


class MatchParameterDtype:
    """Forward pre-hook: cast floating inputs to the dtype of the module's own weights (half in O3)."""

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        weight = next((p for p in module.parameters(recurse=False) if p.is_floating_point()), None)
        if weight is None:
            return args, kwargs
        return _cast_floating((args, kwargs), weight.dtype)


class FloatOutputs:
    """Forward hook: return the module's low-precision floating outputs as fp32."""

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        return cast_low_precision(output, torch.float32)


def _cast_floating(data: Any, dtype: torch.dtype) -> Any:
    return apply_to_collection(data, Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)


def _has_hook(hooks: dict[int, Any], kind: type) -> bool:
    return any(isinstance(hook, kind) for hook in hooks.values())


def _castable(tensor: Tensor | None, dtype: torch.dtype) -> bool:
    return tensor is not None and tensor.is_floating_point() and tensor.dtype not in (dtype, torch.float64)


def _tied_to_kept(model: nn.Module, overrides: Fp32Overrides) -> dict[str, str]:
    """The modules that share a parameter with a module ``overrides`` keeps, mapped to why they must stay fp32 too.

    Tied weights (an embedding and the output layer that reuses its matrix) are one tensor, so they have one dtype:
    keeping one side in fp32 keeps the other in fp32 too, or the first forward of either side mixes dtypes. Ties
    through several modules are followed to the end.
    """
    owners: dict[int, list[tuple[str, str]]] = {}
    for module_name, module in model.named_modules():
        for parameter_name, parameter in module.named_parameters(recurse=False):
            owners.setdefault(id(parameter), []).append((module_name, parameter_name))
    tied = [names for names in owners.values() if len(names) > 1]
    partners: dict[str, str] = {}
    while True:
        kept = {id(module) for module in Fp32Overrides([*overrides.patterns, *partners]).kept_modules(model)}
        found = {
            name: f"'{name}.{parameter}' is tied to '{kept_name}.{kept_parameter}', which stays fp32"
            for names in tied
            for kept_name, kept_parameter in names
            if id(model.get_submodule(kept_name)) in kept
            for name, parameter in names
            if id(model.get_submodule(name)) not in kept and name not in partners
        }
        if not found:
            return partners
        partners.update(found)


def convert_to_half(
    module: nn.Module,
    dtype: torch.dtype,
    overrides: Fp32Overrides,
    keep_normalization_fp32: bool = True,
    float_outputs: bool = True,
    keep_batch_normalization_fp32: bool = False,
    handles: list[RemovableHandle] | None = None,
) -> None:
    """Cast ``module`` to ``dtype`` in place, keeping ``keep_fp32`` subtrees (and normalisation layers) in fp32.

    fp64 parameters and buffers keep their dtype.

    Args:
        module: the model; converted in place.
        dtype: ``torch.float16`` or ``torch.bfloat16``.
        overrides: the ``keep_fp32`` patterns.
        keep_normalization_fp32: keep normalisation layers in fp32 (inference export) or cast them too (O3).
        float_outputs: make the root module return fp32 outputs.
        keep_batch_normalization_fp32: keep batch norms (SyncBatchNorm included) in fp32 even when other
            normalisation layers are cast: their running statistics accumulate over the whole run (O3).
        handles: if given, the handles of the hooks attached now are appended to it, for the caller to remove them
            (training removes them at teardown; an exported inference model keeps them).

    """
    partners = _tied_to_kept(module, overrides)
    for name, why in partners.items():
        rank_zero_warn(
            f"lightning_mp: {name!r} is kept in fp32 too: {why}, and tied weights are one tensor, in one dtype."
        )
    if partners:
        overrides = Fp32Overrides([*overrides.patterns, *partners])
    attached: list[RemovableHandle] = [] if handles is None else handles
    kept = overrides.kept_modules(module)
    overrides.apply(module, attached)
    for child in module.modules():
        if child in kept:
            continue
        if (keep_normalization_fp32 and is_normalization(child)) or (
            keep_batch_normalization_fp32 and isinstance(child, nn.modules.batchnorm._BatchNorm)
        ):
            if not has_fp32_region(child):
                attached += Fp32Region(restore_output_dtype=True).attach(child)
            continue
        for parameter in child.parameters(recurse=False):
            if _castable(parameter, dtype):
                parameter.data = parameter.data.to(dtype)
                parameter.grad = None
        for name, buffer in child.named_buffers(recurse=False):
            if _castable(buffer, dtype):
                setattr(child, name, buffer.to(dtype))
        has_floating_weights = any(p.is_floating_point() for p in child.parameters(recurse=False))
        if has_floating_weights and not _has_hook(child._forward_pre_hooks, MatchParameterDtype):
            attached.append(child.register_forward_pre_hook(MatchParameterDtype(), with_kwargs=True))
    if float_outputs and not _has_hook(module._forward_hooks, FloatOutputs):
        attached.append(module.register_forward_hook(FloatOutputs()))


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
    """The optimizer steps half gradients, which the loss scaler must accept."""

    def __init__(self, half_dtype: torch.dtype | None, keep_fp32: Sequence[type | str] = ()) -> None:
        super().__init__(check_half_dtype(type(self).__name__, half_dtype), keep_fp32)
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
        """Raise every ``eps`` that is 0 in the half type to its smallest normal number, with a warning."""
        optimizers = super().connect(module, optimizers)
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


__all__ = ["O3Policy", "convert_to_half", "vanishing_eps_groups"]
