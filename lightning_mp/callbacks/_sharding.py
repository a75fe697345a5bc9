"""Whether each rank holds only shards of the gradients, for the monitors that must then combine the ranks' views.

Under DDP every rank holds every averaged gradient, so rank zero's view is the whole. Under Lightning's
``FSDPStrategy`` with sharding each rank holds its flat shard only (an empty shard, and a ``None`` gradient, for a
parameter it holds nothing of); under FSDP2 (``fully_shard`` in ``configure_model``) each parameter and gradient is a
``DTensor`` whose local part is this rank's shard. Either way statistics of the gradients are sums over the ranks,
divided by the number of ranks that hold each element.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.strategies import FSDPStrategy
from torch.distributed.fsdp import ShardingStrategy

from lightning_mp.scaling.sharded import is_sharded, shard_copies


def gradient_copies(trainer: pl.Trainer) -> int | None:
    """How many ranks hold each gradient element where the strategy shards them (FSDP); None where each holds all."""
    strategy = trainer.strategy
    if trainer.world_size <= 1:
        return None
    if not isinstance(strategy, FSDPStrategy):
        # FSDP2: the parameters are DTensors (their Shard mesh dimensions say how many ranks share each element).
        sharded = next((p for p in trainer.lightning_module.parameters() if is_sharded(p)), None)
        return None if sharded is None else shard_copies(sharded)
    if strategy.sharding_strategy is ShardingStrategy.NO_SHARD:
        return None
    # Hybrid sharding shards within a node and replicates across the nodes.
    return trainer.num_nodes if "HYBRID" in strategy.sharding_strategy.name else 1


__all__ = ["gradient_copies"]
