"""Train the same tiny model with MixedPrecision under DDP and under FSDP2 in the same 2 processes; report both.

Run as a user would run a training script (``strategy="ddp"`` re-launches it)::

    python fsdp2_train.py --out DIR --cases 16-mixed:O1,bf16-mixed:O2 [--inject-at 2,5] [--telemetry]
        [--resume-at 4] [--memory] [--counts]

For each case (``precision:opt_level``) the script fits twice, first with ``strategy="ddp"``, then with Lightning's
``ModelParallelStrategy`` and ``fully_shard`` in ``configure_model`` (``mp_policy=plugin.fsdp2_policy()``), from the
same seed and data. The inf is planted after backward on rank 1 only, in the same element of ``first.weight``
(row 8, which FSDP2 stores on rank 1). Options add, per case and strategy:

* ``--telemetry``: the loss-scale and gradient-health monitors and the sentinel, logging to TensorBoard under
  ``DIR/tb/<run>``;
* ``--resume-at N``: under FSDP2, a run that checkpoints at step N (sharded and full), and two runs resumed from
  those checkpoints;
* ``--memory``: the peak tensor bytes of each rank during a training step, from the profiler's allocator events,
  on a wider model with Adam;
* ``--counts``: host syncs per training step, also with Lightning's own ``precision=`` under FSDP2;
* ``--refusals``: the errors of the combinations refused under FSDP2, and the ``keep_fp32`` recipe's run.

Every rank writes ``DIR/fsdp2_rank<rank>.json``: per run, the per-step losses, scales and skip flags, the plugin's
stats and the full parameters at the end (gathered from the shards under FSDP2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from typing_extensions import override

from lightning_mp import MixedPrecision
from lightning_mp.callbacks import GradientHealthMonitor, LossScaleMonitor, PrecisionSentinel
from lightning_mp.policies.sharded import ShardedPrecisionError
from tests.ddp_scripts.launch import leave_process_group
from tests.helpers import (
    BatchCostRecorder,
    ProfiledSteps,
    StepRecorder,
    TinyRegressor,
    loader,
    make_trainer,
    plant_inf_in_rank_ones_part,
    profiled_peak_bytes,
)


class ShardableRegressor(TinyRegressor):
    """The tests' regressor; shards itself with FSDP2 in ``configure_model`` when given a plugin to take the policy
    from, and plants the inf on rank 1 in the same element under both strategies."""

    def __init__(
        self, inject_at: tuple[int, ...], plugin: MixedPrecision | None, optimizer: str, hidden: int, depth: int
    ) -> None:
        super().__init__(inject_at=inject_at, optimizer=optimizer, hidden=hidden)
        self.middle = nn.Sequential(*(nn.Linear(hidden, hidden) for _ in range(depth)))
        self.shard_with = plugin
        self.with_policy = True
        self.keep_recipe = True
        self.losses: list[float] = []

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.middle(torch.relu(self.first(x))))

    @override
    def configure_model(self) -> None:
        if self.shard_with is None:
            return
        policy = {"mp_policy": self.shard_with.fsdp2_policy()} if self.with_policy else {}
        for layer in (self.first, *self.middle):
            fully_shard(layer, **policy)
        # The recipe for a keep_fp32 module: its own fully_shard call, with the fp32 policy.
        kept = self.keep_recipe and "second" in self.shard_with.keep_fp32
        fully_shard(self.second, **({"mp_policy": self.shard_with.fsdp2_policy(keep_fp32=True)} if kept else policy))
        fully_shard(self, **policy)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        return loss

    @override
    def on_after_backward(self) -> None:
        if self.global_rank != 1 or self.global_step not in self.inject_at:
            return
        plant_inf_in_rank_ones_part(self.first.weight.grad)


def full_parameters(module: nn.Module) -> dict[str, list[float]]:
    """Every parameter, whole (gathered from the shards under FSDP2), as lists."""
    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    return {name: tensor.float().flatten().tolist() for name, tensor in sorted(state.items())}


def fit(
    args: argparse.Namespace, case: str, strategy: str, tag: str, ckpt_path: Path | None = None, **extra: Any
) -> dict[str, Any]:
    """One fit of ``case`` under ``strategy`` (``"ddp"`` or ``"fsdp2"``); its report."""
    precision, opt_level = case.split(":")
    L.seed_everything(7, verbose=False)
    lightning_precision = extra.pop("lightning_precision", None)
    keep_fp32 = extra.pop("keep_fp32", ())
    plugin = (
        None
        if lightning_precision
        else MixedPrecision(precision, opt_level=opt_level, init_scale=2.0**8, keep_fp32=keep_fp32)
    )
    sharded = strategy == "fsdp2"
    strategy_options = extra.pop("strategy_options", {})
    width = extra.pop("width", (16, 0))
    model = ShardableRegressor(
        extra.pop("inject_at", args.inject_at),
        (plugin or MixedPrecision("bf16-mixed")) if sharded else None,
        extra.pop("optimizer", "sgd"),
        *width,
    )
    model.with_policy = extra.pop("with_policy", plugin is not None)
    model.keep_recipe = extra.pop("keep_recipe", True)
    recorder = StepRecorder() if plugin is not None else None
    callbacks: list[L.Callback] = [recorder] if recorder is not None else []
    callbacks += extra.pop("callbacks", [])
    logger: Any = False
    quiet = extra.pop("quiet", False)
    if args.telemetry and plugin is not None and not quiet:
        callbacks += [
            LossScaleMonitor(),
            GradientHealthMonitor(),
            PrecisionSentinel(every_n_steps=2, log_heatmaps=False),
        ]
        logger = TensorBoardLogger(args.out, name="tb", version=tag)
    trainer = make_trainer(
        plugin,
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, **strategy_options)
        if sharded
        else "ddp",
        precision=lightning_precision,
        callbacks=callbacks,
        logger=logger,
        log_every_n_steps=1,
        max_steps=args.max_steps,
        **extra,
    )
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    # Later fits run in the processes that exist now: Lightning must not launch others.
    os.environ.setdefault("LOCAL_RANK", str(trainer.local_rank))
    return {
        "losses": model.losses,
        "steps": recorder.steps if recorder is not None else [],
        "stats": dataclasses.asdict(plugin.stats) if plugin is not None else None,
        "scaler_state": plugin.scaler.state_dict() if plugin is not None and plugin.scaler is not None else None,
        "parameters": full_parameters(model),
    }


MEMORY_RUN: dict[str, Any] = {"width": (256, 6), "optimizer": "adam", "inject_at": (), "quiet": True}
"""The ``--memory`` runs: a wider model with Adam, so that weights, gradients and Adam's states outweigh activations."""


def peak_bytes(args: argparse.Namespace, case: str, strategy: str) -> int:
    """The peak tensor bytes of this rank during a training step when a wider model trains with Adam."""

    def measured_fit(steps: ProfiledSteps) -> None:
        fit(args, case, strategy, f"memory-{strategy}", callbacks=[steps], **MEMORY_RUN)

    return profiled_peak_bytes(measured_fit, sharded=strategy == "fsdp2")


def syncs_per_step(args: argparse.Namespace, case: str, strategy: str, **extra: Any) -> list[int]:
    """Host syncs of each training batch (the first, which sets things up, left out)."""
    costs = BatchCostRecorder()
    callbacks = [costs.opener(), costs.closer()]
    fit(
        args,
        case,
        strategy,
        f"counts-{strategy}",
        callbacks=callbacks,
        inject_at=(),
        optimizer="adam",
        quiet=True,
        **extra,
    )
    return [counts.syncs for counts in costs.per_batch[1:]]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", default="16-mixed:O1")
    parser.add_argument("--inject-at", default="2,5")
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--telemetry", action="store_true")
    parser.add_argument("--resume-at", type=int, default=0)
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--counts", action="store_true")
    parser.add_argument("--refusals", action="store_true")
    args = parser.parse_args(argv)
    args.inject_at = tuple(int(step) for step in args.inject_at.split(",") if step)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)

    report: dict[str, Any] = {}
    for case in args.cases.split(","):
        name = case.replace(":", "-")
        report[case] = {strategy: fit(args, case, strategy, f"{name}-{strategy}") for strategy in ("ddp", "fsdp2")}
        if args.resume_at:
            report[case]["resumed"] = resumed_runs(args, case, name)
        if args.memory:
            report[case]["memory"] = {strategy: peak_bytes(args, case, strategy) for strategy in ("ddp", "fsdp2")}
        if args.counts:
            # Lightning's ModelParallelStrategy refuses precision="16-mixed": its own bf16-mixed is the reference.
            report[case]["syncs"] = {
                "plugin": syncs_per_step(args, case, "fsdp2"),
                "lightning": syncs_per_step(args, case, "fsdp2", lightning_precision="bf16-mixed"),
            }
    if args.refusals:
        report["refusals"] = refusals(args)
        report["keep_fp32"] = keep_fp32_recipe(args)
    report["global_rank"] = dist.get_rank()
    (args.out / f"fsdp2_rank{dist.get_rank()}.json").write_text(json.dumps(report))
    leave_process_group()


def resumed_runs(args: argparse.Namespace, case: str, name: str) -> dict[str, Any]:
    """FSDP2 runs resumed at ``--resume-at`` from a sharded and from a full checkpoint of the same run."""
    resumed: dict[str, Any] = {}
    for layout, distributed in (("sharded", True), ("full", False)):
        directory = args.out / "checkpoints" / f"{name}-{layout}"
        checkpoint = ModelCheckpoint(
            dirpath=directory, filename="{step}", every_n_train_steps=args.resume_at, save_top_k=-1
        )
        strategy_options = {"save_distributed_checkpoint": distributed}
        options = {"strategy_options": strategy_options, "enable_checkpointing": True, "quiet": True}
        fit(args, case, "fsdp2", f"{name}-save-{layout}", callbacks=[checkpoint], **options)
        path = directory / f"step={args.resume_at}.ckpt"
        resumed[layout] = fit(args, case, "fsdp2", f"{name}-resume-{layout}", ckpt_path=path, **options)
    return resumed


def refusals(args: argparse.Namespace) -> dict[str, str]:
    """The error of each combination the plugin refuses under FSDP2 (O3, lean; O2 without FSDP2's policy)."""
    errors: dict[str, str] = {}
    refused: dict[str, dict[str, Any]] = {
        "16-mixed:O3": {},
        "bf16-mixed:lean": {},
        "16-mixed:O2 without mp_policy": {"with_policy": False},
        "bf16-mixed:O2 keep_fp32 without its own policy": {"keep_fp32": ["second"], "keep_recipe": False},
    }
    for name, options in refused.items():
        try:
            fit(args, name.split()[0], "fsdp2", f"refused-{name}", quiet=True, **options)
        except ShardedPrecisionError as error:
            errors[name] = str(error)
    return errors


def keep_fp32_recipe(args: argparse.Namespace) -> dict[str, Any]:
    """bf16 O2 with ``keep_fp32=["second"]``, that module sharded with ``plugin.fsdp2_policy(keep_fp32=True)``."""
    return fit(args, "bf16-mixed:O2", "fsdp2", "keep-fp32", quiet=True, keep_fp32=["second"])


if __name__ == "__main__":
    main(sys.argv[1:])
