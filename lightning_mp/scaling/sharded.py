"""The loss scaler's inf check and gradient norms when parameters are sharded across ranks (FSDP2, FSDP).

Under DDP every rank holds the whole of every averaged gradient, so checking one's own gradients finds what every
other rank finds. Sharded data parallelism breaks that: after the reduce-scatter each rank holds only its shard of
each gradient, so an inf in one rank's shard is invisible to the others. Skipping must still be unanimous, or the
ranks' weights diverge. The check therefore works in three steps:

1. **Local shards.** FSDP2 (``torch.distributed.fsdp.fully_shard``) turns each parameter, and its gradient, into a
   ``DTensor``; :func:`local_shard` takes the part this rank stores (``DTensor.to_local()``, a view of the same
   storage, so unscaling it in place unscales the gradient). FSDP1's flat shards are plain tensors already.
2. **Empty shards are left out.** A parameter with fewer rows than ranks leaves some ranks an empty shard. It holds
   nothing to check, and torch's inf-norm refuses an empty tensor (``_foreach_norm cannot compute the infinity norm
   on an empty tensor``), so :func:`local_gradients` drops it. A rank whose shards are all empty still joins step 3.
3. **One agreement.** :func:`check_local_shards` sets a 0-d float32 flag on the device from the non-empty shards
   (unscaling them by ``1/S`` when given, as the scaler's fp16 path does, else only reading their inf-norms), and
   :func:`agree_on_found_inf` all-reduces it with ``MAX`` over the process group: every rank skips if any rank found
   an inf. The flag never leaves the device here; the step that reads it makes the only host sync, as under DDP.

Norms for telemetry follow the same idea (:func:`global_squared_norms`): each rank takes the squared 2-norm of its
local shards, one all-reduce ``SUM`` adds them up, and each sum is divided by the number of ranks that hold the same
shard (:func:`shard_copies`), so a replicated tensor is not counted once per rank. The result is the squared norm of
each whole gradient, the value the same run under DDP reports.

Every collective here is issued by every rank, in the same order, whatever its shards hold: no rank can hang.

Example (two ranks, a parameter of 1 row sharded by FSDP2: rank 1's shard is empty)::

    flag = torch.zeros((), device=device)
    check_local_shards(local_gradients(model.parameters()), flag, inv_scale=1 / scale)
    agree_on_found_inf(flag)  # both ranks now hold the same verdict, on the device
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from lightning_mp.scaling import kernels
from lightning_mp.scaling.dtensors import is_sharded, local_shard

__all__ = [
    "agree_on_found_inf",
    "check_local_shards",
    "global_squared_norms",
    "has_sharded_parameters",
    "is_sharded",
    "local_gradients",
    "local_shard",
    "shard_copies",
]


def has_sharded_parameters(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` is a ``DTensor``: the model was sharded (``fully_shard``) or parallelised."""
    return any(is_sharded(parameter) for parameter in module.parameters())


def local_gradients(parameters: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The non-empty local shards of the dense gradients of ``parameters`` (empty shards and ``None`` left out)."""
    shards = (local_shard(parameter.grad) for parameter in parameters if parameter.grad is not None)
    return [shard for shard in shards if shard.numel()]


def check_local_shards(
    grads: Iterable[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Set ``found_inf`` to 1.0 when a local shard in ``grads`` holds an inf or NaN; unscale them when asked.

    One fused kernel per dtype (:func:`lightning_mp.scaling.kernels.check_gradients`); no host sync.

    Args:
        grads: local gradient shards on ``found_inf``'s device (from :func:`local_gradients`); empty ones are skipped.
        found_inf: a 0-d float32 flag, zeroed by the caller; set in place, never cleared.
        inv_scale: ``1/S`` to multiply the shards by (fp16 under a loss scale); None only reads them (bf16, fp32).

    Returns:
        ``found_inf``, for chaining into :func:`agree_on_found_inf`.

    """
    groups: kernels.GradientGroups = defaultdict(lambda: defaultdict(list))
    for grad in grads:
        shard = local_shard(grad)
        if shard.numel():
            groups[shard.device][shard.dtype].append(shard)
    one = torch.ones((), dtype=torch.float32, device=found_inf.device)
    kernels.check_gradients(groups, lambda _device: found_inf, inv_scale, one)
    return found_inf


def agree_on_found_inf(found_inf: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-reduce ``found_inf`` in place with ``MAX`` over ``group`` (default: all ranks), so that all skip together.

    On the device, without a host sync. Does nothing outside a process group of more than one rank. Every rank must
    call it, once per check, in the same order, whether or not it holds any non-empty shard.

    .. warning:: A flag on the CPU under an NCCL-only group (FSDP's ``cpu_offload`` keeps the gradients, and so
        their flag, on the CPU; NCCL reduces GPU tensors only) is reduced through a copy on the current GPU and
        copied back, which synchronises the host, as torch's ``ShardedGradScaler`` does there.
    """
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1):
        return found_inf
    if found_inf.device.type == "cpu" and dist.get_backend(group) == dist.Backend.NCCL:
        on_gpu = found_inf.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(on_gpu, op=dist.ReduceOp.MAX, group=group)
        found_inf.copy_(on_gpu)
        return found_inf
    dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
    return found_inf


def shard_copies(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> int:
    """How many ranks of ``group`` hold the same local part of ``tensor`` as this one.

    A plain tensor is taken as replicated on every rank (DDP); a ``DTensor`` has one distinct part per combination
    of its ``Shard`` mesh coordinates, every other rank of the group holding a copy of one of them.
    """
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if not isinstance(tensor, DTensor):
        return world
    distinct = math.prod(
        tensor.device_mesh.size(dim) for dim, placement in enumerate(tensor.placements) if isinstance(placement, Shard)
    )
    return max(world // distinct, 1)


def global_squared_norms(tensors: list[torch.Tensor], group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The squared 2-norm of each whole tensor in ``tensors`` (sharded or not), as one float32 vector on the device.

    Each rank sums the squares of its local shard (an empty shard gives 0), one all-reduce ``SUM`` over ``group``
    adds the ranks' sums, and each is divided by :func:`shard_copies`. Outside a process group this is the local
    squared norms. Every rank must call it with the same list of tensors (by position), as the all-reduce pairs them.

    Args:
        tensors: gradients or parameters, plain or ``DTensor``, all on one device.
        group: the ranks to reduce over; None means all ranks.

    Returns:
        A float32 vector of ``len(tensors)`` squared norms, the same on every rank.

    """
    shards = [local_shard(tensor) for tensor in tensors]
    device = shards[0].device
    with torch.no_grad():
        squares = torch.stack(
            [shard.float().square().sum() if shard.numel() else torch.zeros((), device=device) for shard in shards]
        )
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=group)
            copies = torch.tensor([shard_copies(tensor, group) for tensor in tensors], dtype=torch.float32)
            squares = squares / copies.to(device)
    return squares
