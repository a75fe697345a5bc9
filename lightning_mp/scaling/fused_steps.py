"""Skipping an optimizer step on the device: torch's fused-step protocol, and the switch to a fused kernel.

torch's fused optimizers (Adam, AdamW, SGD, Adagrad with ``fused=True``, or any optimizer that declares
``_step_supports_amp_scaling``) read two attributes during ``step``: ``found_inf``, the inf flag, and
``grad_scale``, the scale to divide the gradients by when nothing unscaled them yet. The kernel then skips the update
on the device when the flag is set, so the host never reads it (:func:`step_with_protocol`).

In check mode (bf16, fp32) Adam, AdamW, SGD and Adagrad in their foreach or single-tensor form are **handed to
torch's fused kernel of the same update rule** (:func:`has_fused_form`): for that one step their param groups read
``fused=True`` (:func:`configured_fused`), they get the flag as ``found_inf``, and the kernel skips on the device.
No host sync, where reading the flag cost one per step. The user's optimizer object, its ``param_groups`` (restored
after the step), its state layout and its checkpoints stay those of the form the user chose; two things differ. The
trajectory is the fused kernel's: the same rule evaluated in another order, so single roundings differ (within a few
float32 roundings of the weights, tested). And ``state["step"]``, which the foreach and single-tensor forms keep on
the CPU, moves once to the parameter's device as the fused kernel needs it (:func:`place_steps_for_fused`); torch
loads a checkpoint's step count onto either device for every form, so checkpoints resume both ways.

Two alternatives were measured on the CPU (``lightning_mp.bench.counting``, foreach AdamW on a 30-tensor LM): the
fused step
adds 0 syncs and runs the update in 5 ops against foreach's 11; a device-side select of the old or the new weights
and states would cost 253 ops and 2x the state's memory, and still read the CPU step count on the host.

Fused SGD's first step with momentum cannot be skipped on the device (:func:`skips_safely_on_device`); it, and every
optimizer without a fused form, is decided on the host. So are SGD and Adagrad on sharded (FSDP2) parameters:
``DTensor`` runs Adam's and AdamW's fused kernels, not theirs. And so is SGD over fp16 or bf16 parameters where
torch's fused SGD kernel leaves them unchanged (some torch releases on the CPU; :mod:`lightning_mp._compat` says
which, by a probe): handed to it, O3's half weights would never move while every step counted as taken.
Each check reads the tensors the step applies, not the groups' parameters where they differ: O2's fp32 masters,
which stand in for its half model parameters inside the step, go to the fused SGD kernel like any fp32 weight.

Private names: :mod:`lightning_mp._private_names` lists them, with the reason for each.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from lightning_mp._compat import FUSED_ADAGRAD_TAKES_FOUND_INF, fused_sgd_updates_half
from lightning_mp.scaling.sharded import is_sharded
from lightning_mp.stochastic_rounding import steps_bf16_parameters_itself

_FUSED_FORMS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)
"""torch optimizers whose fused kernel applies the same update rule as their foreach and single-tensor forms."""
_FUSED_DEVICE_TYPES = ("cpu", "cuda")
_SHARDED_FUSED_FORMS = (torch.optim.Adam, torch.optim.AdamW)
"""The optimizers whose fused kernel takes sharded parameters (``DTensor`` has a sharding rule for Adam's and AdamW's
fused kernels, none for SGD's and Adagrad's)."""


def supports_fused_protocol(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` declares torch's fused-step protocol (it reads ``found_inf`` and ``grad_scale``)."""
    return getattr(optimizer, "_step_supports_amp_scaling", False)


def has_fused_form(optimizer: torch.optim.Optimizer, stepped: Sequence[torch.Tensor] | None = None) -> bool:
    """Whether torch's fused kernel of ``optimizer``'s own update rule can take its step (and skip it on the device).

    ``stepped`` are the tensors the step applies, where they are not the groups' parameters: O2's fp32 masters,
    which stand in for the half model parameters inside the step, are what the kernel updates (default: the groups'
    parameters).

    Only the exact torch classes (a subclass may override ``step``), not configured ``fused`` already, not
    ``differentiable``, with dense floating gradients of their parameter's dtype on a CPU or CUDA device: the cases
    the fused kernels accept. Complex parameters and sparse gradients stay with the optimizer's own form, and so do
    sharded (FSDP2) parameters of SGD and Adagrad, whose fused kernels ``DTensor`` does not run, and SGD's fp16 and
    bf16 parameters where its fused kernel does not update them (:func:`~lightning_mp._compat.fused_sgd_updates_half`).
    """
    if type(optimizer) not in _FUSED_FORMS:
        return False
    sharded_allowed = type(optimizer) in _SHARDED_FUSED_FORMS
    # torch < 2.12 has Adagrad's fused kernel on the CPU only (lightning_mp._compat).
    cpu_only = type(optimizer) is torch.optim.Adagrad and not FUSED_ADAGRAD_TAKES_FOUND_INF
    device_types = ("cpu",) if cpu_only else _FUSED_DEVICE_TYPES
    is_sgd = type(optimizer) is torch.optim.SGD
    if any(group.get("fused") or group.get("differentiable") for group in optimizer.param_groups):
        return False
    if stepped is None:
        stepped = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    for parameter in stepped:
        grad = parameter.grad
        if grad is None:
            continue
        if (
            grad.is_sparse
            or not parameter.is_floating_point()
            or parameter.device.type not in device_types
            or (grad.dtype, grad.device) != (parameter.dtype, parameter.device)
            or (is_sharded(parameter) and not sharded_allowed)
            or (is_sgd and not fused_sgd_steps(optimizer, parameter))
        ):
            return False
    return True


def fused_sgd_steps(optimizer: torch.optim.Optimizer, parameter: torch.Tensor) -> bool:
    """Whether torch's fused SGD kernel, handed ``optimizer``'s step, would update ``parameter``.

    fp16 and bf16 parameters not in some torch releases (:func:`~lightning_mp._compat.fused_sgd_updates_half`), unless
    the kernel never sees them: lean's stochastic rounding steps bf16 parameters itself, in fp32.
    """
    if parameter.dtype not in (torch.float16, torch.bfloat16):
        return True
    if parameter.dtype is torch.bfloat16 and steps_bf16_parameters_itself(optimizer):
        return True
    return fused_sgd_updates_half(parameter.device.type, parameter.dtype)


def skips_safely_on_device(optimizer: torch.optim.Optimizer, stepped: Sequence[torch.Tensor] | None = None) -> bool:
    """Whether ``optimizer`` can skip its step on the device, told through ``found_inf``, and leave its state intact.

    True for fused optimizers (:func:`supports_fused_protocol`) and for those with a fused form
    (:func:`has_fused_form`). Fused SGD with momentum allocates its momentum buffers uninitialised on its first step
    and fills them inside the kernel, which returns early on ``found_inf``: a first step skipped on the device would
    leave garbage buffers that wreck every later step (torch's own GradScaler included). That one step is decided on
    the host instead.
    """
    if not (supports_fused_protocol(optimizer) or has_fused_form(optimizer, stepped)):
        return False
    if not isinstance(optimizer, torch.optim.SGD):
        return True
    return all(
        group["momentum"] == 0 or optimizer.state.get(parameter, {}).get("momentum_buffer") is not None
        for group in optimizer.param_groups
        for parameter in group["params"]
        if parameter.grad is not None
    )


def place_steps_for_fused(optimizer: torch.optim.Optimizer) -> None:
    """Move step counters to where the fused kernels keep them: a float32 on the parameter's device.

    The foreach and single-tensor forms keep ``state["step"]`` on the CPU; on a CPU run nothing moves. On an
    accelerator each counter moves once, at the first step handed to the fused kernel. torch's ``load_state_dict``
    accepts a counter on either device for every form, so checkpoints load both ways.
    """
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            state = optimizer.state.get(parameter)
            step = state.get("step") if state is not None else None
            if isinstance(step, torch.Tensor) and (step.device, step.dtype) != (parameter.device, torch.float32):
                optimizer.state[parameter]["step"] = step.to(device=parameter.device, dtype=torch.float32)


@contextlib.contextmanager
def configured_fused(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Run ``optimizer`` as its fused form for the duration of the block; its param_groups then read as before.

    SGD and Adagrad note on the optimizer, at their first fused step, that they checked a parameter for the fused
    kernel (a floating tensor on a supported device), and skip that check at their later fused steps. The note is
    left: :func:`has_fused_form` checks the same of every parameter before each fused step, and an optimizer's
    ``state_dict``, pickle and deep copy leave it out (they keep ``defaults``, ``state`` and ``param_groups``).
    """
    groups = optimizer.param_groups
    configured = [(group.get("foreach"), group.get("fused")) for group in groups]
    for group in groups:
        group["foreach"], group["fused"] = False, True
    try:
        yield
    finally:
        for group, (foreach, fused) in zip(groups, configured, strict=True):
            group["foreach"], group["fused"] = foreach, fused


def step_with_protocol(
    optimizer: torch.optim.Optimizer,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Run ``optimizer.step`` with torch's protocol attributes set for that one step, as torch's GradScaler does."""
    # torch's fused-step protocol: attributes torch.optim does not declare, set for one step.
    optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    try:
        return optimizer.step(*args, **kwargs)
    finally:
        # As torch's GradScaler does: the protocol's attributes live only for the duration of the step.
        del optimizer.grad_scale  # type: ignore[attr-defined]
        del optimizer.found_inf  # type: ignore[attr-defined]


def step_on_device(
    optimizer: torch.optim.Optimizer,
    found_inf: torch.Tensor,
    grad_scale: torch.Tensor | None,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Hand ``found_inf`` to ``optimizer``'s fused kernel (its own, or its fused form's): it skips on the device."""
    if supports_fused_protocol(optimizer):
        return step_with_protocol(optimizer, grad_scale, found_inf, *args, **kwargs)
    place_steps_for_fused(optimizer)
    with configured_fused(optimizer):
        return step_with_protocol(optimizer, grad_scale, found_inf, *args, **kwargs)
