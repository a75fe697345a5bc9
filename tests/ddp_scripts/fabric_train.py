"""Train a tiny model with Fabric's DDP (or FSDP2) strategy and MixedPrecision; write what each rank saw to JSON.

Run as a user would run a Fabric script, so that ``strategy="ddp"`` can re-launch it::

    python fabric_train.py --out DIR [--inject-rank 1 --inject-at 2,5] [--steps 8] [--opt-level O2]
        [--optimizer fused-adam] [--clip value] [--precision bf16-mixed] [--strategy fsdp2]

``--strategy fsdp2`` uses Fabric's ``ModelParallelStrategy``, whose ``parallelize_fn`` shards every layer with
``fully_shard(mp_policy=plugin.fsdp2_policy())``; the inf is then planted in rank 1's shard. After training it also
sets up an O2 plugin the same way, which the plugin refuses at the first forward, and reports the error; and an O3
plugin, whose half weights ``parallelize_fn`` shards as they are: it trains three steps and reports what it trained.

After ``fabric.backward`` DDP has averaged the gradients, so an inf planted then exists on one rank only; the loss
scaler's all-reduced inf check must make every rank skip that step. Every rank writes ``DIR/rank<rank>.json``: the
per-step scale and skip flag, the plugin's stats, its own overflow count, and the parameter checksums of all ranks.
The run ends with ``fabric.save`` of the model, the optimizer and the plugin, and a ``fabric.load`` into a fresh
plugin, whose scale is reported too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from lightning_mp import MixedPrecision
from lightning_mp.policies.sharded import ShardedPrecisionError
from lightning_mp.scaling.sharded import local_shard
from tests.ddp_scripts.launch import leave_process_group
from tests.helpers import parameter_checksum


def strategy_for(name: str, plugin: MixedPrecision) -> Any:
    """``"ddp"``, or Fabric's ModelParallelStrategy sharding every layer with the plugin's FSDP2 policy."""
    if name == "ddp":
        return "ddp"

    def shard(module: nn.Module, device_mesh: Any) -> nn.Module:
        mesh = device_mesh["data_parallel"]
        for layer in module:
            if next(layer.parameters(), None) is not None:
                fully_shard(layer, mesh=mesh, mp_policy=plugin.fsdp2_policy())
        fully_shard(module, mesh=mesh, mp_policy=plugin.fsdp2_policy())
        return module

    return ModelParallelStrategy(parallelize_fn=shard, data_parallel_size=2, tensor_parallel_size=1)


def o2_refusal(args: argparse.Namespace) -> str:
    """The error of an O2 plugin on a model that Fabric's ModelParallelStrategy shards after the conversion."""
    os.environ.setdefault("LOCAL_RANK", "0")  # the processes exist: this Fabric must not launch others
    plugin = MixedPrecision(args.precision, opt_level="O2")
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy_for("fsdp2", plugin), plugins=[plugin])
    fabric.launch()
    model = fabric.setup(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    try:
        model(torch.randn(4, 8))
    except ShardedPrecisionError as error:
        return str(error)
    return ""


def o3_sharded_after_setup(args: argparse.Namespace) -> dict[str, Any]:
    """Three steps of an O3 plugin on a model that ModelParallelStrategy shards after the conversion."""
    plugin = MixedPrecision(args.precision, opt_level="O3")
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy_for("fsdp2", plugin), plugins=[plugin])
    fabric.launch()
    fabric.seed_everything(7, verbose=False)
    module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    model = fabric.setup_module(module)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(module.parameters(), lr=0.05))
    initial = parameter_checksum(module)
    generator = torch.Generator().manual_seed(fabric.global_rank)
    for _ in range(3):
        x = torch.randn(8, 8, generator=generator)
        fabric.backward(nn.functional.mse_loss(model(x).float(), x.sum(dim=1, keepdim=True)))
        optimizer.step()
        optimizer.zero_grad()
    checksums: list[str | None] = [None] * fabric.world_size
    dist.all_gather_object(checksums, parameter_checksum(module))
    return {
        "shard_dtypes": sorted({str(local_shard(parameter).dtype) for parameter in module.parameters()}),
        "sharded": all(isinstance(parameter, DTensor) for parameter in module.parameters()),
        "trained": checksums[fabric.global_rank] != initial,
        "checksums": checksums,
        "optimizer_steps": plugin.stats.optimizer_steps,
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--inject-rank", type=int, default=1)
    parser.add_argument("--inject-at", default="")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--opt-level", default="O1")
    parser.add_argument("--precision", default="16-mixed")
    parser.add_argument("--optimizer", choices=["sgd", "fused-adam"], default="sgd")
    parser.add_argument("--clip", choices=["norm", "value"], default="norm")
    parser.add_argument("--strategy", choices=["ddp", "fsdp2"], default="ddp")
    args = parser.parse_args(argv)
    inject_at = {int(step) for step in args.inject_at.split(",") if step}

    plugin = MixedPrecision(args.precision, opt_level=args.opt_level, init_scale=2.0**8, growth_interval=3)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy_for(args.strategy, plugin), plugins=[plugin])
    fabric.launch()
    fabric.seed_everything(7, verbose=False)
    module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    # A sharded model's optimizer steps the shards: the model is set up (sharded) first.
    model = fabric.setup_module(module)
    if args.optimizer == "fused-adam":
        torch_optimizer: torch.optim.Optimizer = torch.optim.Adam(module.parameters(), lr=0.01, fused=True)
    else:
        torch_optimizer = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    optimizer = fabric.setup_optimizers(torch_optimizer)

    generator = torch.Generator().manual_seed(fabric.global_rank)
    steps: list[tuple[int, float, bool]] = []
    for step in range(args.steps):
        x = torch.randn(8, 8, generator=generator)
        loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        fabric.backward(loss)
        if fabric.global_rank == args.inject_rank and step in inject_at:
            local_shard(module[0].weight.grad)[0, 0] = float("inf")
        if args.clip == "value":
            fabric.clip_gradients(model, optimizer, clip_val=1.0)
        else:
            fabric.clip_gradients(model, optimizer, max_norm=10.0, error_if_nonfinite=False)
        optimizer.step()
        optimizer.zero_grad()
        stats = plugin.stats
        steps.append((step, stats.loss_scale, stats.last_step_skipped))

    checksums: list[str | None] = [None] * fabric.world_size
    dist.all_gather_object(checksums, parameter_checksum(module))
    refusal = o2_refusal(args) if args.strategy == "fsdp2" else None
    o3_run = o3_sharded_after_setup(args) if args.strategy == "fsdp2" else None
    checkpoint = args.out / "fabric.ckpt"
    fabric.save(checkpoint, {"model": model, "optimizer": optimizer, "precision": plugin})
    resumed = MixedPrecision(args.precision, opt_level=args.opt_level, init_scale=2.0**8, growth_interval=3)
    resumed.setup_for_device("cpu")
    if args.strategy == "fsdp2":
        # A distributed checkpoint is read through the sharded model (loaded again: the same weights). Fabric's
        # ModelParallelStrategy puts the plugin's saved state in the dict in its place instead of loading it.
        state = {"precision": resumed, "model": model}
        fabric.load(checkpoint, state, strict=False)
        resumed.load_state_dict(state["precision"])
    else:
        fabric.load(checkpoint, {"precision": resumed}, strict=False)
    report = {
        "global_rank": fabric.global_rank,
        "world_size": fabric.world_size,
        "steps": steps,
        "stats": plugin.stats.as_dict(),
        "local_overflows": plugin.local_overflows(),
        "checksums": checksums,
        "resumed_stats": resumed.stats.as_dict(),
        "o2_refusal": refusal,
        "o3_sharded_after_setup": o3_run,
    }
    (args.out / f"rank{fabric.global_rank}.json").write_text(json.dumps(report))
    if dist.is_available() and dist.is_initialized():
        leave_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
