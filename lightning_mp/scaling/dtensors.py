"""Which tensors are sharded across ranks, and the part of one this rank stores.

FSDP2 (``torch.distributed.fsdp.fully_shard``) and tensor parallelism turn each parameter, and its gradient, into a
``DTensor``; every rank stores only its part of it. The loss scaler's kernels (:mod:`~lightning_mp.scaling.kernels`)
read that part, and :mod:`~lightning_mp.scaling.sharded` makes the ranks agree on what they found.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["is_sharded", "local_shard"]


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (a parameter or gradient that FSDP2 or tensor parallelism distributed)."""
    return isinstance(tensor, DTensor)


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank stores: ``to_local()`` of a ``DTensor`` (same storage), else ``tensor``."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
