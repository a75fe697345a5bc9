"""O2: half-precision weights, fp32 master weights for the optimizer, normalisation layers in fp32.

This is Apex's O2 on native torch. The model itself is cast to the half type, so the forward and backward run
entirely in fp16 or bf16 without autocast; the optimizer never sees a half tensor.

Conversion (``convert_module``, in place, before the model moves to its device):

1. Every parameter and floating buffer is cast to the half type, except in normalisation layers (BatchNorm,
   LayerNorm, GroupNorm, InstanceNorm, RMSNorm and any module whose class name ends in ``Norm``, as Apex's
   ``keep_batchnorm_fp32``) and in the subtrees that ``keep_fp32`` matches.
2. The fp32 values the weights had before the cast become the **master weights**: nothing is rounded yet.
3. Hooks make the dtypes meet: a module with half weights casts its floating inputs to the half type; a
   normalisation layer computes in fp32 and hands its output back in the half type; a ``keep_fp32`` module runs in an
   fp32 region and returns fp32 (:mod:`lightning_mp.overrides`); the root module returns fp32 outputs, so that the
   loss, and the scaled loss, are computed in fp32.

The step (the plugin calls these around its optimizer step)::

    connect:               optimizer.param_groups[...] = fp32 masters     (optimizer states are therefore fp32)
    backward:              half gradients land on the half weights        (scaled by the loss scale in fp16)
    prepare_gradients:     master.grad = half_weight.grad.float(); half_weight.grad = None
    unscale_ (the scaler): master grads /= scale, and check them for inf/NaN
    clipping, hooks:       see the fp32 master gradients
    step (the scaler):     optimizer.step() on the masters, or nothing when a gradient is not finite
    after_optimizer_step:  half_weight.copy_(master), unless the step was skipped

A skipped step therefore leaves the masters, the optimizer states and the half weights exactly as they were.
Parameters that stayed fp32 (norms, ``keep_fp32``) are their own masters. A checkpoint stores the fp32 masters in
place of the half weights, so loading it anywhere gives full-precision weights, and resuming restores the masters
exactly.

In O2 the gradients live on the masters: read them from ``optimizer.param_groups``, not from the model's
parameters, whose ``.grad`` is freed once copied.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mp.overrides import Fp32Overrides, Fp32Region, cast_low_precision, has_fp32_region
from lightning_mp.policies.base import PrecisionPolicy

HALF_DTYPES = (torch.float16, torch.bfloat16)
NORMALIZATION_TYPES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.RMSNorm,
)
_NORM_NAME = re.compile(r"Norm(\d[dD])?$")


def is_normalization(module: nn.Module) -> bool:
    """Whether ``module`` is a normalisation layer: a known torch type, or a class whose name ends in ``Norm``."""
    return isinstance(module, NORMALIZATION_TYPES) or _NORM_NAME.search(type(module).__name__) is not None


def check_half_dtype(owner: str, half_dtype: torch.dtype | None) -> torch.dtype:
    """Return ``half_dtype`` if it is fp16 or bf16.

    Raises:
        ValueError: naming the argument, the value and what is allowed.

    """
    if half_dtype not in HALF_DTYPES:
        raise ValueError(
            f"{owner}(half_dtype={half_dtype!r}) is not allowed: half_dtype must be torch.float16 or torch.bfloat16."
        )
    assert half_dtype is not None
    return half_dtype


class MatchParameterDtype:
    """Forward pre-hook: cast floating inputs to the dtype of the module's own weights (half in O2 and O3)."""

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


def convert_to_half(
    module: nn.Module,
    dtype: torch.dtype,
    overrides: Fp32Overrides,
    keep_normalization_fp32: bool = True,
    float_outputs: bool = True,
    keep_batch_normalization_fp32: bool = False,
) -> dict[str, Tensor]:
    """Cast ``module`` to ``dtype`` in place, keeping ``keep_fp32`` subtrees (and normalisation layers) in fp32.

    Args:
        module: the model; converted in place.
        dtype: ``torch.float16`` or ``torch.bfloat16``.
        overrides: the ``keep_fp32`` patterns.
        keep_normalization_fp32: keep normalisation layers in fp32 (O2) or cast them too (O3).
        float_outputs: make the root module return fp32 outputs.
        keep_batch_normalization_fp32: keep batch norms (SyncBatchNorm included) in fp32 even when other
            normalisation layers are cast: their running statistics accumulate over the whole run (O3).

    Returns:
        ``qualified parameter name -> its fp32 values before the cast`` for every parameter that was cast. The
        module no longer references these tensors.

    """
    kept = overrides.kept_modules(module)
    overrides.apply(module)
    fp32_before: dict[str, Tensor] = {}
    for module_name, child in module.named_modules():
        if child in kept:
            continue
        if (keep_normalization_fp32 and is_normalization(child)) or (
            keep_batch_normalization_fp32 and isinstance(child, nn.modules.batchnorm._BatchNorm)
        ):
            if not has_fp32_region(child):
                Fp32Region(restore_output_dtype=True).attach(child)
            continue
        prefix = f"{module_name}." if module_name else ""
        for name, parameter in child.named_parameters(recurse=False):
            if parameter.is_floating_point() and parameter.dtype != dtype:
                fp32_before[prefix + name] = parameter.data
                parameter.data = parameter.data.to(dtype)
                parameter.grad = None
        for name, buffer in child.named_buffers(recurse=False):
            if buffer is not None and buffer.is_floating_point() and buffer.dtype != dtype:
                setattr(child, name, buffer.to(dtype))
        has_floating_weights = any(p.is_floating_point() for p in child.parameters(recurse=False))
        if has_floating_weights and not _has_hook(child._forward_pre_hooks, MatchParameterDtype):
            child.register_forward_pre_hook(MatchParameterDtype(), with_kwargs=True)
    if float_outputs and not _has_hook(module._forward_hooks, FloatOutputs):
        module.register_forward_hook(FloatOutputs())
    return fp32_before


class O2Policy(PrecisionPolicy):
    """Half weights, fp32 masters and optimizer states, fp32 normalisation layers.

    Args:
        half_dtype: ``torch.float16`` or ``torch.bfloat16``.
        keep_fp32: module types, qualified names or ``re:`` patterns whose modules stay fp32.

    Raises:
        ValueError: if ``half_dtype`` is not a half type, or a ``keep_fp32`` entry is invalid.

    """

    opt_level = "O2"
    uses_autocast = False

    def __init__(self, half_dtype: torch.dtype | None, keep_fp32: Sequence[type | str] = ()) -> None:
        super().__init__(check_half_dtype(type(self).__name__, half_dtype), keep_fp32)
        self.overrides = Fp32Overrides(self.keep_fp32)
        self._masters: dict[str, tuple[nn.Parameter, nn.Parameter]] = {}
        """``name -> (half model parameter, fp32 master)``."""
        self._model_parameter_of: dict[Tensor, nn.Parameter] = {}
        """``master -> half model parameter``, for the masters handed to an optimizer."""

    @property
    def masters(self) -> dict[str, nn.Parameter]:
        """The fp32 master weight of every half parameter, by qualified name."""
        return {name: master for name, (_, master) in self._masters.items()}

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Cast the module to the half type in place and keep the fp32 values as masters."""
        assert self.half_dtype is not None
        fp32_before = convert_to_half(module, self.half_dtype, self.overrides, keep_normalization_fp32=True)
        parameters = dict(module.named_parameters())
        # Converting the same model again (fit, then validate) keeps its masters; another model's are dropped.
        self._masters = {name: pair for name, pair in self._masters.items() if parameters.get(name) is pair[0]}
        for name, before in fp32_before.items():
            parameter = parameters[name]
            if parameter.requires_grad:
                self._masters[name] = (parameter, nn.Parameter(before.float()))
        return module

    @override
    def connect(self, module: nn.Module, optimizers: list[Optimizer]) -> list[Optimizer]:
        """Put the fp32 masters in the optimizers' place of the half parameters, with fp32 states."""
        by_parameter = {id(parameter): (name, master) for name, (parameter, master) in self._masters.items()}
        names = {id(parameter): name for name, parameter in module.named_parameters()}
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                params = group["params"]
                for index, parameter in enumerate(params):
                    if parameter in self._model_parameter_of or parameter.dtype not in HALF_DTYPES:
                        continue  # already a master, or an fp32 parameter that is its own master
                    name, master = by_parameter.get(id(parameter), (names.get(id(parameter), ""), None))
                    if master is None:
                        # Frozen at conversion and trainable now: its master starts from the half values.
                        master = nn.Parameter(parameter.detach().float())
                        if name:
                            self._masters[name] = (parameter, master)
                    if master.device != parameter.device:
                        master.data = master.data.to(parameter.device)
                    params[index] = master  # in place: some optimizers keep references to the list
                    self._model_parameter_of[master] = parameter
                    if parameter in optimizer.state:
                        optimizer.state[master] = cast_floating_state(optimizer.state.pop(parameter))
        return optimizers

    @override
    def parameter_names(self, module: nn.Module) -> dict[int, str]:
        """Names for the model's parameters and for the masters that stand in for them."""
        names = super().parameter_names(module)
        names.update({id(master): name for name, (_, master) in self._masters.items()})
        return names

    @override
    def prepare_gradients(self, optimizer: Optimizer) -> None:
        """Move the half gradients into the fp32 master gradients, still scaled; free the half ones."""
        for group in optimizer.param_groups:
            for master in group["params"]:
                parameter = self._model_parameter_of.get(master)
                if parameter is None:
                    continue
                if parameter.grad is None:
                    master.grad = None
                elif master.grad is None:
                    master.grad = parameter.grad.to(torch.float32)
                else:
                    master.grad.copy_(parameter.grad)
                parameter.grad = None

    @override
    def after_optimizer_step(self, optimizer: Optimizer, skipped: bool) -> None:
        """Copy the stepped masters into the half weights; after a skipped step there is nothing to copy."""
        if skipped:
            return
        with torch.no_grad():
            for group in optimizer.param_groups:
                for master in group["params"]:
                    parameter = self._model_parameter_of.get(master)
                    if parameter is not None:
                        parameter.copy_(master)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Store the fp32 masters as the model's weights."""
        state_dict = checkpoint.get("state_dict")
        if state_dict is None:
            return
        for name, (_, master) in self._masters.items():
            if name in state_dict:
                state_dict[name] = master.detach()

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore the masters (and the half weights) from the checkpoint's full-precision weights."""
        state_dict = checkpoint.get("state_dict", {})
        with torch.no_grad():
            for name, (parameter, master) in self._masters.items():
                saved = state_dict.get(name)
                if isinstance(saved, Tensor) and saved.shape == master.shape:
                    master.copy_(saved)
                    parameter.copy_(master)


def cast_floating_state(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state with its floating tensors (moments, not the step count) in fp32."""
    return {
        key: value.float() if isinstance(value, Tensor) and value.is_floating_point() and key != "step" else value
        for key, value in state.items()
    }


__all__ = ["O2Policy", "cast_floating_state", "convert_to_half", "is_normalization"]
