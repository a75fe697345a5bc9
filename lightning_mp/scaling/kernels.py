"""The loss scaler's gradient kernels: unscale and check an optimizer's gradients in a fixed number of ops.

:func:`check_gradients` groups an optimizer's gradients by device and dtype and runs one fused kernel per group:

* scaled (fp16 under a loss scale): torch's ``_amp_foreach_non_finite_check_and_unscale_`` multiplies the gradients
  by the preallocated ``1/S`` and sets the group's inf flag when one holds an inf or a NaN. CUDA's kernel refuses
  bf16 (:data:`UNSCALE_KERNEL_DTYPES`), so scaled bf16 gradients are multiplied first, then checked by their norms;
* check mode (bf16, fp32; nothing scaled): the gradients are only read. One ``_foreach_norm`` takes the inf-norm of
  every gradient (:func:`inf_norms`), and the same kernel, multiplying by one, sets the flag from those norms;
* check mode in one process, with an optimizer that cannot skip its step on the device, on one device and dtype: no
  flag at all. The norms are stacked (one op, as the flag check was) and the step reads them on the host, the one
  sync it makes anyway, so nothing kept between iterations is touched.

Sparse gradients are coalesced, then checked by their values: duplicate indices are summed first, as torch's own
``unscale_`` does for fp16 ones and as the optimizer's sparse update adds them, so a sum that overflows is caught.
:func:`recheck_norms` reads gradients changed after the check (clipping with a NaN threshold) for the step's
verdict.

Private names: :mod:`lightning_mp._private_names` lists them, with the reason for each.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable

import torch

from lightning_mp.scaling.dtensors import local_shard

UNSCALE_KERNEL_DTYPES = frozenset({torch.float16, torch.float32, torch.float64})
"""The dtypes CUDA's ``_amp_foreach_non_finite_check_and_unscale_`` takes (``AT_DISPATCH_FLOATING_TYPES_AND_HALF`` in
torch's ``aten/src/ATen/native/cuda/AmpKernels.cu``): bf16 is refused there, although the CPU kernel accepts it."""

GradientGroups = dict[torch.device, dict[torch.dtype, list[torch.Tensor]]]


def inf_norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The inf-norm of each tensor (all of one dtype), in a dtype CUDA's check kernel takes: one kernel, no cast.

    bf16 norms come out in float32; other dtypes keep theirs: torch refuses to narrow float64 norms to float32, and
    the norms of complex tensors are already real (complex64's are float32).
    """
    dtype = torch.float32 if tensors[0].dtype is torch.bfloat16 else None
    return list(torch._foreach_norm(tensors, math.inf, dtype=dtype))


def gradient_groups(parameters: list[torch.Tensor], refuse_fp16: bool) -> GradientGroups:
    """The gradients of ``parameters`` (a sparse one by its values) grouped by device, then dtype.

    A sharded gradient (a ``DTensor``, under FSDP2) is this rank's local shard (:mod:`~lightning_mp.scaling.dtensors`).
    Empty gradients are left out: they hold nothing to unscale or check, and torch's inf-norm refuses an empty tensor
    (a zero-element parameter, or a rank's empty shard of a sharded one).

    Raises:
        ValueError: when ``refuse_fp16`` and a gradient is fp16, as torch's ``unscale_`` refuses to unscale those.

    """
    groups: GradientGroups = defaultdict(lambda: defaultdict(list))
    for param in parameters:
        grad = param.grad
        if grad is None:
            continue
        if refuse_fp16 and grad.dtype == torch.float16:
            raise ValueError("Attempting to unscale FP16 gradients.")
        if grad.is_sparse:
            if not grad.is_coalesced():
                param.grad = grad = grad.coalesce()
            grad = grad.values()
        grad = local_shard(grad)
        if grad.numel():
            groups[grad.device][grad.dtype].append(grad)
    return groups


def single_group_norms(groups: GradientGroups) -> torch.Tensor | None:
    """The stacked inf-norms of the gradients when they share one device and one dtype; else None."""
    if len(groups) != 1:
        return None
    (per_dtype,) = groups.values()
    if len(per_dtype) != 1:
        return None
    (tensors,) = per_dtype.values()
    return torch.stack(inf_norms(tensors))


def check_gradients(
    groups: GradientGroups,
    flag_on: Callable[[torch.device], torch.Tensor],
    inv_scale: torch.Tensor | None,
    one: torch.Tensor,
) -> dict[torch.device, torch.Tensor]:
    """Unscale (when ``inv_scale`` is given) and check ``groups``; return the inf flag set on each device.

    Args:
        groups: the gradients, from :func:`gradient_groups`.
        flag_on: a zeroed inf flag on the given device (the scaler's flag pool).
        inv_scale: ``1/S`` to multiply the gradients by; None in check mode, which only reads them.
        one: a float32 one, for the check of the norms.

    """
    per_device: dict[torch.device, torch.Tensor] = {}
    for device, per_dtype in groups.items():
        flag = per_device[device] = flag_on(device)
        for dtype, tensors in per_dtype.items():
            if inv_scale is not None and dtype in UNSCALE_KERNEL_DTYPES:
                torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, inv_scale.to(device))
                continue
            if inv_scale is not None:
                # bf16 gradients under a loss scale: CUDA's unscale kernel refuses them, so multiply, then check.
                torch._foreach_mul_(tensors, inv_scale.to(device))
            # Check mode reads the gradients: inf-norms in one kernel (float32, which every device's check kernel
            # takes), then the flag from those norms.
            torch._amp_foreach_non_finite_check_and_unscale_(inf_norms(tensors), flag, one.to(device))
    return per_device


def combined_flag(per_device: dict[torch.device, torch.Tensor]) -> torch.Tensor | None:
    """One flag for all devices (their maximum), on the first device; None when there is none."""
    if not per_device:
        return None
    home = next(iter(per_device.values()))
    if len(per_device) == 1:
        return home
    return torch.stack([f.to(home.device, non_blocking=True) for f in per_device.values()]).amax()


def recheck_norms(parameters: list[torch.Tensor], home: torch.device | None) -> list[torch.Tensor]:
    """The inf-norms of the non-empty gradients of ``parameters`` as float32, one tensor per device, on ``home``."""
    grads: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for param in parameters:
        if param.grad is not None:
            grad = param.grad.coalesce().values() if param.grad.is_sparse else local_shard(param.grad)
            if grad.numel():
                grads[grad.device].append(grad)
    return [
        torch.stack(torch._foreach_norm(tensors, math.inf)).float().to(home or device, non_blocking=True)
        for device, tensors in grads.items()
    ]
