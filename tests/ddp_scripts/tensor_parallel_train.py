"""Train one tiny model under DDP and under tensor parallelism in the same 2 processes, with the monitors; report both.

Run as a user would run a training script (``strategy="ddp"`` re-launches it)::

    python tensor_parallel_train.py --out DIR --cases 32-true:O0,16-mixed:O1

For each case (``precision:opt_level``) the script fits twice from the same seed: first under ``strategy="ddp"``
(8 samples per rank and step), then under Lightning's ``ModelParallelStrategy(data_parallel_size=1,
tensor_parallel_size=2)`` (both ranks take the same 16 samples per step: the union of DDP's two batches). Under
tensor parallelism ``configure_model`` makes ``up`` column-parallel (its weight and bias ``Shard`` DTensors) and
``down`` row-parallel (its weight a ``Shard`` DTensor, its bias a ``Replicate`` one); the LayerNorm and ``head``
stay plain tensors that both ranks hold whole. So the ranks hold some gradients in halves and others in two copies.

``down.bias`` steps with a learning rate far below half an ulp of its values: all its updates are stale, the rest
of ``down`` moves, and the sentinel's stale share of ``down`` weighs a sharded against a replicated tensor.
In fp16, an inf is planted after backward on rank 1 at ``--inject-at`` steps, in row 8 of ``up.weight`` (the first
row of rank 1's part under tensor parallelism).

The gradient-health monitor (every step) and the sentinel (every 2 steps) log to TensorBoard under
``DIR/tb/<precision>-<opt level>-<ddp|tp>``. Every rank writes ``DIR/tp_rank<rank>.json``: per case and strategy,
the losses, the plugin's scale and skip flag after every batch, and its stats.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from typing_extensions import override

from lightning_mp import MixedPrecision
from lightning_mp.callbacks import GradientHealthMonitor, PrecisionSentinel
from tests.ddp_scripts.launch import leave_process_group
from tests.helpers import FEATURES, StepRecorder, loader, make_trainer, plant_inf_in_rank_ones_part

DDP_BATCH = 8


class TensorParallelRegressor(L.LightningModule):
    """``up`` and ``down`` split over the ranks under tensor parallelism; a LayerNorm and ``head`` held whole."""

    def __init__(self, tensor_parallel: bool, inject_at: tuple[int, ...]) -> None:
        super().__init__()
        self.up = nn.Linear(FEATURES, 16)
        self.down = nn.Linear(16, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 1)
        self.tensor_parallel = tensor_parallel
        self.inject_at = inject_at
        self.losses: list[float] = []

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.down(torch.relu(self.up(x)))))

    @override
    def configure_model(self) -> None:
        if self.tensor_parallel:
            plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
            parallelize_module(self, self.device_mesh["tensor_parallel"], plan)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        # A feature that is always zero leaves its column of up.weight without gradient: exact zeros to count.
        x = x * (torch.arange(FEATURES) > 0)
        loss = nn.functional.mse_loss(self(x).float(), y)
        self.losses.append(loss.item())
        return loss

    @override
    def on_after_backward(self) -> None:
        if self.global_rank != 1 or self.global_step not in self.inject_at:
            return
        plant_inf_in_rank_ones_part(self.up.weight.grad)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        # torch's optimizers refuse DTensors and plain tensors in one group: the split layers step in their own.
        split = [*self.up.parameters(), self.down.weight]
        whole = [*self.norm.parameters(), *self.head.parameters()]
        groups = [{"params": split}, {"params": whole}, {"params": [self.down.bias], "lr": 1e-12}]
        return torch.optim.Adam(groups, lr=1e-3)


def fit(args: argparse.Namespace, case: str, strategy: str) -> dict[str, Any]:
    """One fit of ``case`` under ``strategy`` (``"ddp"`` or ``"tp"``); its report."""
    precision, opt_level = case.split(":")
    L.seed_everything(7, verbose=False)
    plugin = MixedPrecision(precision, opt_level=opt_level, init_scale=2.0**8)
    tensor_parallel = strategy == "tp"
    model = TensorParallelRegressor(tensor_parallel, args.inject_at if precision == "16-mixed" else ())
    recorder = StepRecorder()
    trainer = make_trainer(
        plugin,
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2) if tensor_parallel else "ddp",
        callbacks=[recorder, GradientHealthMonitor(), PrecisionSentinel(every_n_steps=2, log_heatmaps=False)],
        logger=TensorBoardLogger(args.out, name="tb", version=f"{case.replace(':', '-')}-{strategy}"),
        log_every_n_steps=1,
        max_steps=args.max_steps,
    )
    trainer.fit(model, loader(batch_size=2 * DDP_BATCH if tensor_parallel else DDP_BATCH))
    # Later fits run in the processes that exist now: Lightning must not launch others.
    os.environ.setdefault("LOCAL_RANK", str(trainer.local_rank))
    return {"losses": model.losses, "steps": recorder.steps, "stats": dataclasses.asdict(plugin.stats)}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", default="32-true:O0")
    parser.add_argument("--inject-at", default="2,5")
    parser.add_argument("--max-steps", type=int, default=8)
    args = parser.parse_args(argv)
    args.inject_at = tuple(int(step) for step in args.inject_at.split(",") if step)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")

    cases = args.cases.split(",")
    report = {case: {strategy: fit(args, case, strategy) for strategy in ("ddp", "tp")} for case in cases}
    (args.out / f"tp_rank{dist.get_rank()}.json").write_text(json.dumps(report))
    leave_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
