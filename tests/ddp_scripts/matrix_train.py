"""Train every precision and opt level under one strategy and front end on 2 CPU processes; report each cell.

Run as a user would run a training script (the strategy re-launches it, or spawns its workers)::

    python matrix_train.py --out DIR --strategy single|ddp|ddp_spawn|fsdp|fsdp2|deepspeed1|deepspeed2|deepspeed3
        --front trainer|fabric [--cells A,B]

``single`` is one process on one device; the others run 2 processes. ``deepspeed<stage>`` runs Lightning's
DeepSpeedStrategy at that ZeRO stage with :class:`~lightning_mp.DeepSpeedMixedPrecision`.

A cell is ``precision:opt_level`` or ``bf16-mixed:O1:<fp8 recipe>`` (:data:`CELLS`). Each is fitted for
:data:`STEPS` steps of AdamW on a small regression MLP whose middle layers FP8 can take, from the same seed on every
rank (each rank its own data). The cell either trains, and every rank writes ``DIR/<cell>.rank<r>.json`` with its
losses, whether its weights stayed finite, a checksum of them, and the dtypes its middle linear layer computed with;
or it is refused, and rank zero writes the error's type and message instead.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_mp import DeepSpeedMixedPrecision, FSDPMixedPrecision, MixedPrecision
from tests.ddp_scripts.launch import leave_process_group
from tests.deepspeed_helpers import CPUDeepSpeedStrategy, CPUFabricDeepSpeedStrategy, deepspeed_on_cpu
from tests.helpers import CPUFabricFSDPStrategy, CPUFSDPStrategy, parameter_checksum

CELLS = (
    "32-true:O0",
    "16-mixed:O1",
    "16-mixed:O2",
    "16-mixed:O3",
    "bf16-mixed:O1",
    "bf16-mixed:O2",
    "bf16-mixed:O3",
    "bf16-mixed:lean",
    "bf16-mixed:lean-kahan",
    "bf16-mixed:lean-exact",
    "bf16-mixed:O1:tensorwise",
)
"""The columns of the support table: every opt level in fp16 and bf16 where it exists, and FP8."""
STEPS = 8


def plugin_for(cell: str, strategy: str, front: str) -> Any:
    """The plugin of ``cell``: the FSDP form under FSDPStrategy and the DeepSpeed form under DeepSpeedStrategy, as
    the docs say to pass."""
    precision, opt_level, *fp8 = cell.split(":")
    kwargs: dict[str, Any] = {"opt_level": opt_level, "fp8": fp8[0] if fp8 else None}
    if precision == "16-mixed":
        kwargs["init_scale"] = 2.0**8
    if strategy.startswith("deepspeed"):
        return DeepSpeedMixedPrecision(precision, **kwargs)
    form = FSDPMixedPrecision if strategy == "fsdp" else MixedPrecision
    return form(precision, **kwargs)


def network() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1)
    )  # fmt: skip


def data(rank: int) -> DataLoader:
    """One batch of this rank's, repeated: the loss of a model that learns falls at every step."""
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(8, 16, generator=generator).repeat(STEPS, 1)
    y = x[:, :4].sum(dim=1, keepdim=True)
    return DataLoader(TensorDataset(x, y), batch_size=8)


class Seen:
    """The dtypes the middle linear layer computed with (its weight, its output), and whether it ran FP8."""

    def __init__(self) -> None:
        self.weight: str | None = None
        self.output: str | None = None
        self.layer: str | None = None

    def hook(self, module: nn.Module, args: Any, output: Any) -> None:
        weight = getattr(module, "weight", None)
        local = weight.to_local() if hasattr(weight, "to_local") else weight
        self.weight = str(local.dtype) if isinstance(local, torch.Tensor) else None
        self.output = str(output.dtype) if isinstance(output, torch.Tensor) else None
        self.layer = type(module).__name__


def report(
    out: Path, cell: str, rank: int, losses: list[float], module: nn.Module, seen: Seen, root: nn.Module
) -> None:
    """Write this rank's report of a cell that trained; ``root`` holds the FSDP1 units, whose full weights are read."""
    if _has_fsdp1(root):
        outermost = next(unit for unit in root.modules() if isinstance(unit, FullyShardedDataParallel))
        state = get_model_state_dict(outermost, options=StateDictOptions(full_state_dict=True))
        parameters = [state[name] for name in sorted(state)]
        checksum = hashlib.sha256(b"".join(p.detach().float().numpy().tobytes() for p in parameters)).hexdigest()
    else:
        parameters = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in module.parameters()]
        checksum = parameter_checksum(module)
    finite = all(bool(torch.isfinite(p).all()) for p in parameters)
    record = {
        "outcome": "trained",
        "losses": losses,
        "finite": finite,
        "checksum": checksum,
        "weight_dtype": seen.weight,
        "output_dtype": seen.output,
        "layer": seen.layer,
    }
    (out / f"{cell}.rank{rank}.json").write_text(json.dumps(record))


def _has_fsdp1(root: nn.Module) -> bool:
    return any(isinstance(module, FullyShardedDataParallel) for module in root.modules())


def refused(out: Path, cell: str, error: BaseException) -> None:
    message = str(error).strip().splitlines()[-1] if "ProcessRaisedException" in type(error).__name__ else str(error)
    record = {"outcome": "refused", "error": type(error).__name__, "message": message}
    (out / f"{cell}.rank0.json").write_text(json.dumps(record))


class MatrixModel(L.LightningModule):
    """The network as a LightningModule: AdamW, a report at the end of fit, FSDP2 sharding in configure_model."""

    def __init__(self, out: Path, cell: str, plugin: MixedPrecision, shard: bool) -> None:
        super().__init__()
        self.net = network()
        self.out, self.cell, self.plugin, self.shard = out, cell, plugin, shard
        self.losses: list[float] = []
        self.seen = Seen()

    @override
    def configure_model(self) -> None:
        if not self.shard:
            return
        for layer in self.net:
            if next(layer.parameters(), None) is not None:
                fully_shard(layer, mp_policy=self.plugin.fsdp2_policy())
        fully_shard(self, mp_policy=self.plugin.fsdp2_policy())

    @override
    def on_fit_start(self) -> None:
        self.net[2].register_forward_hook(self.seen.hook)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x).float(), y)
        self.losses.append(loss.item())
        return loss

    @override
    def on_train_end(self) -> None:
        if getattr(self.trainer.strategy, "zero_stage_3", False):  # each rank holds a shard: gather the weights
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(self.parameters())):
                report(self.out, self.cell, self.global_rank, self.losses, self, self.seen, self.trainer.model)
            return
        report(self.out, self.cell, self.global_rank, self.losses, self, self.seen, self.trainer.model)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    @override
    def train_dataloader(self) -> DataLoader:
        return data(self.global_rank)


def devices(strategy: str) -> int:
    return 1 if strategy == "single" else 2


def trainer_strategy(strategy: str) -> Any:
    if strategy == "single":
        return "auto"
    if strategy == "fsdp":
        return CPUFSDPStrategy()
    if strategy == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    if strategy.startswith("deepspeed"):
        return CPUDeepSpeedStrategy(stage=int(strategy.removeprefix("deepspeed")))
    return strategy


def run_trainer(args: argparse.Namespace, cell: str) -> None:
    plugin = plugin_for(cell, args.strategy, args.front)
    model = MatrixModel(args.out, cell, plugin, shard=args.strategy == "fsdp2")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices(args.strategy),
        strategy=trainer_strategy(args.strategy),
        plugins=[plugin],
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)


def fabric_strategy(strategy: str, plugin: MixedPrecision) -> Any:
    if strategy == "single":
        return "auto"
    if strategy == "fsdp":
        return CPUFabricFSDPStrategy()
    if strategy.startswith("deepspeed"):
        stage = int(strategy.removeprefix("deepspeed"))
        return CPUFabricDeepSpeedStrategy(stage=stage, **plugin.strategy_arguments())
    if strategy == "fsdp2":

        def shard(module: nn.Module, device_mesh: Any) -> nn.Module:
            mesh = device_mesh["data_parallel"]
            for layer in module:
                if next(layer.parameters(), None) is not None:
                    fully_shard(layer, mesh=mesh, mp_policy=plugin.fsdp2_policy())
            return fully_shard(module, mesh=mesh, mp_policy=plugin.fsdp2_policy())

        return FabricModelParallelStrategy(parallelize_fn=shard, data_parallel_size=2, tensor_parallel_size=1)
    return strategy


def run_fabric(args: argparse.Namespace, cell: str) -> None:
    plugin = plugin_for(cell, args.strategy, args.front)
    strategy = fabric_strategy(args.strategy, plugin)
    fabric = Fabric(accelerator="cpu", devices=devices(args.strategy), strategy=strategy, plugins=[plugin])
    fabric.launch()
    if args.strategy != "single":
        os.environ.setdefault("LOCAL_RANK", "0")  # the processes exist: the next cell's Fabric must not launch others
    module = network()
    seen = Seen()
    if args.strategy == "fsdp2":
        model = fabric.setup_module(module)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(module.parameters(), lr=1e-2))
    else:
        model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
    module[2].register_forward_hook(seen.hook)  # after setup, which may replace the layer (FP8)
    losses = []
    for x, y in data(fabric.global_rank):
        loss = nn.functional.mse_loss(model(x).float(), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if getattr(strategy, "zero_stage_3", False):  # each rank holds a shard: gather the weights
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            report(args.out, cell, fabric.global_rank, losses, module, seen, model)
    else:
        report(args.out, cell, fabric.global_rank, losses, module, seen, model)
    plugin.teardown()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--strategy",
        choices=["single", "ddp", "ddp_spawn", "fsdp", "fsdp2", "deepspeed1", "deepspeed2", "deepspeed3"],
        required=True,
    )
    parser.add_argument("--front", choices=["trainer", "fabric"], required=True)
    parser.add_argument("--cells", default=",".join(CELLS))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.strategy.startswith("deepspeed"):
        deepspeed_on_cpu()
    run = run_trainer if args.front == "trainer" else run_fabric
    for cell in args.cells.split(","):
        try:
            run(args, cell)
        except Exception as error:
            rank = int(os.environ.get("LOCAL_RANK", "0"))
            if rank == 0:
                refused(args.out, cell, error)
    if args.strategy not in ("single", "ddp_spawn"):
        leave_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
