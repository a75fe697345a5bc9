"""Train a tiny model with MixedPrecision under a distributed strategy and write what each rank saw to JSON files.

Run as a user would run a script, so that ``strategy="ddp"`` can re-launch it (``launch.py`` puts the repository
root on ``PYTHONPATH``, for ``tests.helpers``)::

    python train.py --strategy ddp --out DIR [--inject-rank 1 --inject-at 2,5] [--max-steps 8]

Every rank writes ``DIR/rank<global rank>.json`` at the end of training: the per-step scale and skip flag, the
plugin's counters, this rank's own overflow count and the parameter checksums of all ranks, gathered with
``all_gather_object``. Files are the only way back from ``ddp_spawn`` and ``ddp_notebook`` workers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from typing_extensions import override

from lightning_mp import MixedPrecision
from lightning_mp.callbacks import GradientHealthMonitor, LayerDtypeMonitor, LossScaleMonitor
from tests.helpers import TinyRegressor, loader, make_trainer, parameter_checksum


class RankInjectingRegressor(TinyRegressor):
    """The tests' tiny regressor, with the inf planted on one rank only and the loss logged with ``sync_dist``."""

    def __init__(self, inject_rank: int, inject_at: tuple[int, ...], optimizer: str = "sgd") -> None:
        super().__init__(inject_at=inject_at, optimizer=optimizer)
        self.inject_rank = inject_rank

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    @override
    def on_after_backward(self) -> None:
        # After backward DDP has already averaged the gradients: the inf exists on this rank only.
        if self.global_rank == self.inject_rank:
            super().on_after_backward()

    @override
    def teardown(self, stage: str) -> None:
        # Lightning leaves the process group up after fit, and the workers of ddp_spawn and ddp_notebook exit right
        # after it: gloo torn down by the interpreter's exit can abort a successful run ("terminate called without an
        # active exception"). This hook runs in every process, after the last collective of the fit.
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    @override
    def configure_optimizers(self) -> Any:
        fused = {"fused-sgd": torch.optim.SGD, "fused-adamw": torch.optim.AdamW}.get(self.optimizer_name)
        if fused is None:
            return super().configure_optimizers()
        momentum = {"momentum": 0.9} if fused is torch.optim.SGD else {}
        return fused(self.parameters(), lr=self.lr, fused=True, **momentum)


class ReducedBytes:
    """What DDP's reducer all-reduced: the bytes of its gradient buckets and their dtypes."""

    def __init__(self) -> None:
        self.bytes = 0
        self.dtypes: set[str] = set()


def count_and_allreduce(state: ReducedBytes, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: count the bucket's bytes, then all-reduce it as DDP does without a hook."""
    buffer = bucket.buffer()
    state.bytes += buffer.numel() * buffer.element_size()
    state.dtypes.add(str(buffer.dtype))
    return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]


# DDP compares a hook's annotations with the classes themselves; this module's annotations are postponed (strings).
count_and_allreduce.__annotations__.update({"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]})


class Recorder(L.Callback):
    """Records the scale and the skip flag after every step; writes this rank's report at the end of training."""

    def __init__(self, out: Path, tag: str = "", step_delay: float = 0.0, count_reduced_bytes: bool = False) -> None:
        self.out = out
        self.reduced = ReducedBytes() if count_reduced_bytes else None
        self.tag = tag
        self.step_delay = step_delay
        self.steps: list[tuple[int, float, bool]] = []
        self.step_checksums: list[str] = []
        self.first_scale: float | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.first_scale = trainer.precision_plugin.stats.loss_scale
        if self.reduced is not None:
            trainer.strategy.model.register_comm_hook(self.reduced, count_and_allreduce)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        stats = trainer.precision_plugin.stats
        self.steps.append((trainer.global_step, stats.loss_scale, stats.last_step_skipped))
        self.step_checksums.append(parameter_checksum(pl_module))
        if self.step_delay:
            # A slow run, so that a test can signal it mid-training: progress.txt says how far it got. It is
            # replaced whole, never truncated and rewritten, so a reader never sees it empty.
            (self.out / "progress.tmp").write_text(str(trainer.global_step))
            os.replace(self.out / "progress.tmp", self.out / "progress.txt")
            time.sleep(self.step_delay)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        plugin = trainer.precision_plugin
        checksums = [parameter_checksum(pl_module)]
        if dist.is_available() and dist.is_initialized():
            checksums = [None] * dist.get_world_size()
            dist.all_gather_object(checksums, parameter_checksum(pl_module))
        report = {
            "global_rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "node_rank": trainer.node_rank,
            "pid": os.getpid(),
            "strategy": type(trainer.strategy).__name__,
            "first_scale": self.first_scale,
            "steps": self.steps,
            "step_checksums": self.step_checksums,
            "stats": dataclasses.asdict(plugin.stats),
            "scaler_state": plugin.scaler.state_dict() if plugin.scaler is not None else None,
            "local_overflows": plugin.scaler.local_overflows() if plugin.scaler is not None else None,
            "checksums": checksums,
            "is_global_zero": trainer.is_global_zero,
            "reduced_bytes": self.reduced.bytes if self.reduced is not None else None,
            "reduced_dtypes": sorted(self.reduced.dtypes) if self.reduced is not None else None,
        }
        path = self.out / f"{self.tag}rank{trainer.global_rank}.json"
        path.write_text(json.dumps(report))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--precision", default="16-mixed")
    parser.add_argument("--opt-level", default="O1")
    parser.add_argument("--inject-rank", type=int, default=1)
    parser.add_argument("--inject-at", default="")
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adam", "fused-adam", "fused-adamw", "fused-sgd"])
    parser.add_argument("--gradient-clip-val", type=float, default=None)
    parser.add_argument("--gradient-clip-algorithm", default="norm", choices=["norm", "value"])
    parser.add_argument("--init-scale", type=float, default=2.0**8)
    parser.add_argument("--growth-interval", type=int, default=3)
    parser.add_argument("--hysteresis", type=int, default=1)
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--resume", type=Path, default=None)
    parser.add_argument(
        "--then-resume-from",
        default="",
        help="after the run, train a fresh model in the same processes from this checkpoint of it (e.g. step=8)",
    )
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds to sleep after every step")
    parser.add_argument("--save-on-exception", action="store_true", help="save last.ckpt on SIGTERM and errors")
    parser.add_argument("--telemetry", action="store_true", help="TensorBoard logger and the three monitors")
    parser.add_argument("--count-reduced-bytes", action="store_true", help="count the bytes DDP all-reduces")
    args = parser.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    fit(args, args.resume, tag="")
    if args.then_resume_from:
        # Starting two processes costs more than the training itself: the resumed run reuses them. Setting
        # LOCAL_RANK tells Lightning that the processes exist already, so the launching process starts no others.
        os.environ.setdefault("LOCAL_RANK", "0")
        args.checkpoint_every = 0
        fit(args, args.out / "checkpoints" / f"{args.then_resume_from}.ckpt", tag="resumed_")


def fit(args: argparse.Namespace, ckpt_path: Path | None, tag: str) -> None:
    L.seed_everything(7, verbose=False)
    inject_at = tuple(int(step) for step in args.inject_at.split(",") if step)
    model = RankInjectingRegressor(args.inject_rank, inject_at, args.optimizer)

    plugin = MixedPrecision(
        args.precision,
        opt_level=args.opt_level,
        init_scale=args.init_scale,
        growth_interval=args.growth_interval,
        hysteresis=args.hysteresis,
    )
    callbacks: list[L.Callback] = [Recorder(args.out, tag, args.step_delay, args.count_reduced_bytes)]
    logger: Any = False
    if args.telemetry:
        callbacks += [LossScaleMonitor(), GradientHealthMonitor(), LayerDtypeMonitor(every_n_steps=4)]
        logger = TensorBoardLogger(args.out, name="tb", version=0)
    if args.checkpoint_every:
        callbacks.append(
            ModelCheckpoint(
                dirpath=args.out / "checkpoints",
                filename="{step}",
                every_n_train_steps=args.checkpoint_every,
                save_top_k=-1,
            )
        )
    if args.save_on_exception:
        # Lightning turns SIGTERM into a SIGTERMException after the current batch; only a ModelCheckpoint with
        # save_on_exception=True writes a checkpoint then.
        callbacks.append(ModelCheckpoint(dirpath=args.out / "checkpoints", save_last=True, save_on_exception=True))
    # Everything ddp_spawn and ddp_notebook send to their workers must pickle.
    pickle.dumps((plugin, callbacks))
    trainer = make_trainer(
        plugin,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=args.strategy,
        callbacks=callbacks,
        logger=logger,
        log_every_n_steps=1,
        max_steps=args.max_steps,
        gradient_clip_val=args.gradient_clip_val,
        gradient_clip_algorithm=args.gradient_clip_algorithm,
        enable_checkpointing=bool(args.checkpoint_every or args.save_on_exception),
    )
    trainer.fit(model, loader(), ckpt_path=ckpt_path)


if __name__ == "__main__":
    main(sys.argv[1:])
