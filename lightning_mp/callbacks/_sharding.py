"""How many ranks hold each gradient element, for the monitors that combine the ranks' views of the gradients.

Under DDP every rank holds every averaged gradient, so rank zero's view is the whole. Under Lightning's
``FSDPStrategy`` with sharding each rank holds its flat shard only (an empty shard, and a ``None`` gradient, for a
parameter it holds nothing of); under ``ModelParallelStrategy`` (``fully_shard`` or ``parallelize_module`` in
``configure_model``) a parameter is a ``DTensor`` whose local part is what this rank holds. Either way statistics of
the gradients are sums over the ranks, in which each tensor counts once per rank that holds the same part of it, so
each tensor's share of the sums is divided by its own number of copies: under tensor parallelism a column- or
row-parallel weight is split over the ranks (one copy of each part), while a ``Replicate()`` DTensor or a plain
parameter beside it (a norm, a bias) is held whole by every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch.distributed.fsdp import ShardingStrategy

from lightning_mp.scaling.sharded import has_sharded_parameters, shard_copies

CopiesOf = Callable[[torch.Tensor], int]
"""``copies_of(parameter)``: how many ranks hold the same local part of the parameter's gradient as this one."""


def gradient_copies(trainer: pl.Trainer) -> CopiesOf | None:
    """``copies_of(parameter)``, where the ranks hold different parts of the gradients; None where each holds all.

    The ranks hold different parts under FSDP, FSDP2 and tensor parallelism; each holds every gradient whole under DDP
    and in one process.
    """
    strategy = trainer.strategy
    if trainer.world_size <= 1:
        return None
    if not isinstance(strategy, FSDPStrategy):
        # ModelParallelStrategy: each DTensor's Shard mesh dimensions say how many ranks share its local part; a plain
        # parameter is held whole by every rank.
        return shard_copies if has_sharded_parameters(trainer.lightning_module) else None
    if strategy.sharding_strategy is ShardingStrategy.NO_SHARD:
        return None
    # Hybrid sharding shards within a node and replicates across the nodes.
    copies = trainer.num_nodes if "HYBRID" in strategy.sharding_strategy.name else 1
    return lambda _parameter: copies


__all__ = ["CopiesOf", "gradient_copies"]
