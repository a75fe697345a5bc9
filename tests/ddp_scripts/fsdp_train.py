"""Train a tiny model on 2 CPU processes (gloo) under Lightning's FSDPStrategy or DDP, Trainer or Fabric; report JSON.

Run as a user would run a script, so that the strategy can re-launch it::

    python fsdp_train.py --front trainer|fabric --strategy fsdp|ddp --out DIR [--precision 16-mixed] [--opt-level O1]
        [--inject-rank 1 --inject-at 2,5] [--steps 8] [--clip norm|value|none] [--state-dict-type full|sharded]
        [--telemetry] [--manual]
    python fsdp_train.py --memory --out DIR [--precision 16-mixed] [--opt-level O1]

Lightning runs its FSDPStrategy on GPUs only; ``--strategy fsdp`` runs it on the CPU through the tests'
:class:`~tests.helpers.CPUFSDPStrategy` and :class:`~tests.helpers.CPUFabricFSDPStrategy`, which change only where
FSDP wraps the model. torch FSDP1's full state dict crashes with 2 processes on the CPU, so checkpoints there are
sharded. ``--manual`` gives the Trainer's model manual optimization (``manual_backward``, ``self.clip_gradients``,
``opt.step()``). ``--telemetry`` adds a TensorBoard logger and the four monitors to the Trainer's first fit; the
Trainer's model zeroes one input feature, so that the gradients hold exact zeros for the monitors to count.

An inf is planted after backward on one rank, in the first gradient that rank holds (under FSDP its shard); every
rank must skip that step. Every rank writes ``DIR/<tag>rank<rank>.json``: the per-step loss, scale and skip flag,
the plugin's counters, and the stats of a fresh plugin restored from the run's checkpoint.

``--memory`` instead fits a wider model (:class:`WideRegressor`) with Adam under the Trainer, first under DDP, then
under FSDP (each linear layer a unit of its own) in the same processes, and reports each rank's peak tensor bytes in
a training step under both, from the profiler's allocator events (:func:`tests.helpers.profiled_peak_bytes`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from typing_extensions import override

from lightning_mp import (
    FSDPMixedPrecision,
    GradientHealthMonitor,
    LayerDtypeMonitor,
    LossScaleMonitor,
    MixedPrecision,
    PrecisionSentinel,
)
from tests.ddp_scripts.launch import leave_process_group
from tests.helpers import (
    FEATURES,
    CPUFabricFSDPStrategy,
    CPUFSDPStrategy,
    ProfiledSteps,
    TinyRegressor,
    loader,
    make_trainer,
    profiled_peak_bytes,
)


def plant_inf(module: nn.Module) -> None:
    """Set the first element of the first non-empty gradient this rank holds (under FSDP, its shard) to inf."""
    for parameter in module.parameters():
        if parameter.grad is not None and parameter.grad.numel():
            parameter.grad.view(-1)[0] = float("inf")
            return


class RankInjectingRegressor(TinyRegressor):
    """The tests' tiny regressor, an inf planted on one rank's gradients, and the loss of each step recorded."""

    def __init__(self, inject_rank: int, inject_at: tuple[int, ...]) -> None:
        super().__init__(inject_at=inject_at)
        self.inject_rank = inject_rank
        self.losses: list[float] = []

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        # A feature that is always 0 gives first.weight's gradient exact zeros, for the monitors to count.
        loss = super().training_step((torch.cat([torch.zeros_like(x[:, :1]), x[:, 1:]], dim=1), y), batch_idx)
        self.losses.append(loss.item())
        return loss

    @override
    def on_after_backward(self) -> None:
        if self.global_rank == self.inject_rank and self.global_step in self.inject_at:
            plant_inf(self)


class ManualRankInjectingRegressor(RankInjectingRegressor):
    """:class:`RankInjectingRegressor` with manual optimization: ``manual_backward``, ``self.clip_gradients`` as
    ``--clip`` says, ``opt.step()``."""

    def __init__(self, inject_rank: int, inject_at: tuple[int, ...], clip: str) -> None:
        super().__init__(inject_rank, inject_at)
        self.automatic_optimization = False
        self.clip = clip

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        if self.clip != "none":
            self.clip_gradients(optimizer, gradient_clip_val=1.0, gradient_clip_algorithm=self.clip)
        optimizer.step()
        return loss


class StepRecorderWithStartStats(L.Callback):
    """Record each batch's loss scale and skip flag, and the plugin's counters when a (resumed) fit starts."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, bool]] = []
        self.stats_at_start: dict[str, Any] = {}

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.stats_at_start = trainer.precision_plugin.stats.as_dict()  # type: ignore[attr-defined]

    @override
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        stats = trainer.precision_plugin.stats  # type: ignore[attr-defined]
        self.steps.append((stats.loss_scale, stats.last_step_skipped))


def build_plugin(args: argparse.Namespace, strategy: str | None = None) -> MixedPrecision:
    plugin_class = FSDPMixedPrecision if (strategy or args.strategy) == "fsdp" else MixedPrecision
    return plugin_class(args.precision, opt_level=args.opt_level, init_scale=2.0**8, growth_interval=3)


def build_model(args: argparse.Namespace, inject_at: tuple[int, ...]) -> RankInjectingRegressor:
    if args.manual:
        return ManualRankInjectingRegressor(args.inject_rank, inject_at, args.clip)
    return RankInjectingRegressor(args.inject_rank, inject_at)


def run_trainer(args: argparse.Namespace, inject_at: tuple[int, ...]) -> dict[str, Any]:
    """Fit, save a checkpoint, then resume from it with a fresh plugin for one more step."""

    def trainer(plugin: MixedPrecision, recorder: StepRecorderWithStartStats, max_steps: int) -> L.Trainer:
        strategy: Any = CPUFSDPStrategy(state_dict_type=args.state_dict_type) if args.strategy == "fsdp" else "ddp"
        # Under manual optimization the model clips, through self.clip_gradients.
        automatic_clip = args.clip != "none" and not args.manual
        clip = {"gradient_clip_val": 1.0, "gradient_clip_algorithm": args.clip} if automatic_clip else {}
        if args.telemetry and max_steps == args.steps:
            telemetry = {"logger": TensorBoardLogger(args.out / "tb", name=""), "log_every_n_steps": 1}
            monitors = [GradientHealthMonitor(), LossScaleMonitor(), LayerDtypeMonitor(every_n_steps=1)]
            recorder_and_monitors: list[L.Callback] = [recorder, *monitors, PrecisionSentinel(every_n_steps=1)]
        else:
            telemetry, recorder_and_monitors = {}, [recorder]
        return make_trainer(
            plugin,
            devices=2,
            strategy=strategy,
            max_steps=max_steps,
            callbacks=recorder_and_monitors,
            use_distributed_sampler=False,
            **clip,
            **telemetry,
        )

    plugin, recorder = build_plugin(args), StepRecorderWithStartStats()
    L.seed_everything(7, verbose=False)
    model = build_model(args, inject_at)
    first = trainer(plugin, recorder, args.steps)
    first.fit(model, loader(n=8 * args.steps, seed=first.global_rank))
    checkpoint = args.out / f"{args.tag}trainer.ckpt"
    first.save_checkpoint(checkpoint)
    resumed_plugin, resumed_recorder = build_plugin(args), StepRecorderWithStartStats()
    resumed = trainer(resumed_plugin, resumed_recorder, args.steps + 1)
    resumed.fit(build_model(args, ()), loader(seed=resumed.global_rank), ckpt_path=checkpoint)
    return {
        "global_rank": first.global_rank,
        "losses": model.losses,
        "steps": recorder.steps,
        "stats": plugin.stats.as_dict(),
        "resumed_stats": resumed_recorder.stats_at_start,
    }


def run_fabric(args: argparse.Namespace, inject_at: tuple[int, ...]) -> dict[str, Any]:
    """Train with Fabric, then ``fabric.save`` the model, optimizer and plugin, and load them into a fresh plugin."""
    plugin = build_plugin(args)
    strategy: Any = CPUFabricFSDPStrategy(state_dict_type=args.state_dict_type) if args.strategy == "fsdp" else "ddp"
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin])
    fabric.launch()
    fabric.seed_everything(7, verbose=False)
    module = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, 1))
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9))
    generator = torch.Generator().manual_seed(fabric.global_rank)
    losses: list[float] = []
    steps: list[tuple[float, bool]] = []
    for step in range(args.steps):
        x = torch.randn(8, FEATURES, generator=generator)
        loss = nn.functional.mse_loss(model(x).float(), x.sum(dim=1, keepdim=True))
        fabric.backward(loss)
        if fabric.global_rank == args.inject_rank and step in inject_at:
            plant_inf(module)
        if args.clip == "norm":
            fabric.clip_gradients(model, optimizer, max_norm=10.0, error_if_nonfinite=False)
        elif args.clip == "value":
            fabric.clip_gradients(model, optimizer, clip_val=1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        steps.append((plugin.stats.loss_scale, plugin.stats.last_step_skipped))
    checkpoint = args.out / f"{args.tag}fabric.ckpt"
    fabric.save(checkpoint, {"model": model, "optimizer": optimizer, "precision": plugin})
    resumed = build_plugin(args)
    resumed.setup_for_device("cpu")
    state = {"model": model, "optimizer": optimizer, "precision": resumed}
    fabric.load(checkpoint, state)
    if state["precision"] is not resumed:
        # A sharded checkpoint hands back the entries that are not a module or an optimizer, as saved.
        resumed.load_state_dict(state["precision"])
    return {
        "global_rank": fabric.global_rank,
        "losses": losses,
        "steps": steps,
        "stats": plugin.stats.as_dict(),
        "resumed_stats": resumed.stats.as_dict(),
    }


class WideRegressor(TinyRegressor):
    """The tests' regressor with ``depth`` linear layers of ``hidden`` features between its two, trained with Adam:
    weights, gradients and Adam's states outweigh the activations, as in the models that FSDP is for."""

    def __init__(self, hidden: int = 256, depth: int = 6) -> None:
        super().__init__(optimizer="adam", hidden=hidden)
        self.middle = nn.Sequential(*(nn.Linear(hidden, hidden) for _ in range(depth)))

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.middle(torch.relu(self.first(x))))


def peak_memory(args: argparse.Namespace) -> dict[str, Any]:
    """Each rank's peak tensor bytes in a training step of :class:`WideRegressor`, under DDP and under FSDP."""
    peaks: dict[str, Any] = {}
    rank = 0
    for strategy_name in ("ddp", "fsdp"):
        plugin = build_plugin(args, strategy_name)
        strategy: Any = (
            CPUFSDPStrategy(auto_wrap_policy=plugin.auto_wrap_policy({nn.Linear})) if strategy_name == "fsdp" else "ddp"
        )

        def measured_fit(steps: ProfiledSteps, plugin: MixedPrecision = plugin, strategy: Any = strategy) -> None:
            nonlocal rank
            L.seed_everything(7, verbose=False)
            model = WideRegressor()
            trainer = make_trainer(plugin, devices=2, strategy=strategy, max_steps=4, callbacks=[steps])
            trainer.fit(model, loader(n=32, seed=trainer.global_rank))
            rank = trainer.global_rank
            # The second fit runs in the processes that exist now: Lightning must not launch others.
            os.environ.setdefault("LOCAL_RANK", str(trainer.local_rank))

        peaks[strategy_name] = profiled_peak_bytes(measured_fit, sharded=strategy_name == "fsdp")
    return {"global_rank": rank, "memory": peaks}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--front", choices=["trainer", "fabric"])
    parser.add_argument("--strategy", choices=["fsdp", "ddp"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tag", default="")
    parser.add_argument("--precision", default="16-mixed")
    parser.add_argument("--opt-level", default="O1")
    parser.add_argument("--inject-rank", type=int, default=1)
    parser.add_argument("--inject-at", default="")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--clip", choices=["norm", "value", "none"], default="none")
    parser.add_argument("--state-dict-type", choices=["full", "sharded"], default="full")
    parser.add_argument("--telemetry", action="store_true", help="Trainer: TensorBoard and the four monitors")
    parser.add_argument("--memory", action="store_true", help="Trainer: peak tensor bytes under DDP and FSDP")
    parser.add_argument("--manual", action="store_true", help="Trainer: manual optimization")
    args = parser.parse_args(argv)
    if not args.memory and (args.front is None or args.strategy is None):
        parser.error("--front and --strategy are required, unless --memory is given")
    inject_at = tuple(int(step) for step in args.inject_at.split(",") if step)
    if args.memory:
        report = peak_memory(args)
    else:
        report = run_trainer(args, inject_at) if args.front == "trainer" else run_fabric(args, inject_at)
    (args.out / f"{args.tag}rank{report['global_rank']}.json").write_text(json.dumps(report))
    if dist.is_available() and dist.is_initialized():
        leave_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
