"""What the opt levels share: the half dtypes, what counts as a normalisation layer, and the in-place cast to half.

Each opt level imports only :mod:`lightning_mp.policies.base` and this module, so no level depends on another.

:func:`convert_to_half` casts a model to fp16 or bf16 in place (O3, lean, and the inference export):

1. Every parameter and floating buffer below or at fp32 is cast to the half type, except in the normalisation layers
   asked to stay fp32 and in the subtrees that ``keep_fp32`` matches; fp64 tensors keep their dtype. Tied weights
   are one tensor with one dtype, so a module that shares a parameter with a kept one is kept too, with a warning:
   keeping one side only would make the first forward mix fp32 and half.
2. Hooks make the dtypes meet: a module with half weights casts its floating inputs to its weights' dtype
   (:class:`MatchParameterDtype`; not ``nn.Embedding``, whose input is indices); a kept normalisation layer
   computes in fp32 and hands its output back in the half type; the root module may return fp32 outputs
   (:class:`FloatOutputs`), so that the loss is computed in fp32. The caller gets the hooks' handles, to remove them
   at teardown. The hooks run at every forward of every module, so they look at plain arguments without a Python
   call each (:func:`~lightning_mp.overrides.cast_arguments`).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_mp.arguments.checks import caller
from lightning_mp.overrides import (
    BATCH_NORMS,
    Fp32Overrides,
    Fp32Region,
    cast_arguments,
    cast_low_precision,
    has_fp32_region,
    has_hooks,
    remember_hooks,
)

__all__ = [
    "BATCH_NORMALIZATION_TYPES",
    "HALF_DTYPES",
    "NORMALIZATION_TYPES",
    "check_half_dtype",
    "convert_to_half",
    "is_normalization",
    "keep_tied_weights_together",
]

HALF_DTYPES = (torch.float16, torch.bfloat16)
BATCH_NORMALIZATION_TYPES: tuple[type[nn.Module], ...] = (*BATCH_NORMS, nn.SyncBatchNorm)
"""The batch norms, whose running statistics average over the whole run."""
NORMALIZATION_TYPES: tuple[type[nn.Module], ...] = (
    *BATCH_NORMALIZATION_TYPES,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.LazyInstanceNorm1d,
    nn.LazyInstanceNorm2d,
    nn.LazyInstanceNorm3d,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.RMSNorm,
)
_NORM_NAME = re.compile(r"Norm(\d[dD])?$")


def is_normalization(module: nn.Module) -> bool:
    """Whether ``module`` is a normalisation layer: a known torch type, or a class whose name ends in ``Norm``."""
    return isinstance(module, NORMALIZATION_TYPES) or _NORM_NAME.search(type(module).__name__) is not None


def check_half_dtype(half_dtype: torch.dtype | None) -> torch.dtype:
    """Return ``half_dtype`` if it is fp16 or bf16.

    Raises:
        ValueError: naming the argument, the value and what is allowed.

    """
    if half_dtype not in HALF_DTYPES:
        raise ValueError(
            f"{caller()}(half_dtype={half_dtype!r}) is not allowed: half_dtype must be torch.float16 or torch.bfloat16."
        )
    assert half_dtype is not None
    return half_dtype


class MatchParameterDtype:
    """Forward pre-hook: cast floating inputs to the dtype of the module's own weights (half in O3).

    Args:
        parameter_name: the module's own floating parameter whose dtype the inputs take. It is looked up by name at
            each call (one attribute read, where scanning the parameters would cost a generator per forward), so a
            parameter replaced later is followed; if it is gone, the first floating parameter is.

    """

    def __init__(self, parameter_name: str) -> None:
        self.parameter_name = parameter_name

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
        weight = getattr(module, self.parameter_name, None)
        if not isinstance(weight, Tensor) or not weight.is_floating_point():
            weight = next((p for p in module.parameters(recurse=False) if p.is_floating_point()), None)
            if weight is None:
                return None
        return cast_arguments(args, kwargs, weight.dtype)


class FloatOutputs:
    """Forward hook: return the module's low-precision floating outputs as fp32."""

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        return cast_low_precision(output, torch.float32)


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


def keep_tied_weights_together(module: nn.Module, overrides: Fp32Overrides) -> Fp32Overrides:
    """``overrides`` widened to every module tied to one it keeps, with a warning naming each and why.

    Tied weights are one tensor, so keeping one side of a tie in fp32 keeps the other side too (O2, O3, lean, and the
    inference export).
    """
    partners = _tied_to_kept(module, overrides)
    for name, why in partners.items():
        rank_zero_warn(
            f"lightning_mp: {name!r} is kept in fp32 too: {why}, and tied weights are one tensor, in one dtype."
        )
    return Fp32Overrides([*overrides.patterns, *partners]) if partners else overrides


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
    overrides = keep_tied_weights_together(module, overrides)
    attached: list[RemovableHandle] = [] if handles is None else handles
    kept = overrides.kept_modules(module)
    overrides.apply(module, attached)
    for child in module.modules():
        if child in kept:
            continue
        if (keep_normalization_fp32 and is_normalization(child)) or (
            keep_batch_normalization_fp32 and isinstance(child, BATCH_NORMALIZATION_TYPES)
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
        weight_name = next((n for n, p in child.named_parameters(recurse=False) if p.is_floating_point()), None)
        # An embedding's input is indices: it has nothing to cast, and the hook would cost calls at every forward.
        if weight_name is None or type(child) is nn.Embedding:
            continue
        if not has_hooks(child, MatchParameterDtype):
            handle = child.register_forward_pre_hook(MatchParameterDtype(weight_name), with_kwargs=True)
            attached += remember_hooks(child, MatchParameterDtype, [handle])
    if float_outputs and not has_hooks(module, FloatOutputs):
        attached += remember_hooks(module, FloatOutputs, [module.register_forward_hook(FloatOutputs())])
