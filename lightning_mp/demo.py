"""The main job: train a small transformer language model with the plugin and show what mixed precision did.

Run ``python -m lightning_mp.demo``. It trains :class:`~lightning_mp.tasks.TinyTransformerLM` on generated Markov
text with Lightning's progress bar, writes TensorBoard logs under ``./lightning_logs``, and ends with a summary: the
precision chosen and why, steps, skipped steps, the final loss scale and loss, and the command that opens the logs.
With the defaults it finishes in well under two minutes on two CPU cores, and it runs on CUDA when a GPU is there.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_mp.callbacks import GradientHealthMonitor, LayerDtypeMonitor, LossScaleMonitor
from lightning_mp.plugin import MixedPrecision
from lightning_mp.policies import POLICIES
from lightning_mp.tasks import MarkovTextDataModule, TinyTransformerLM


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m lightning_mp.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="auto", choices=["auto", "16-mixed", "bf16-mixed", "32-true"])
    parser.add_argument("--opt-level", default="O1", choices=sorted(POLICIES))
    parser.add_argument("--max-steps", type=int, default=200, help="optimizer steps to train (default 200)")
    parser.add_argument("--accelerator", default="auto", help="cpu, gpu or auto (default)")
    parser.add_argument("--devices", default="1", help="devices to use (default 1)")
    parser.add_argument("--strategy", default="auto", help="auto (default), ddp, ddp_spawn, ...")
    parser.add_argument("--log-dir", default="lightning_logs", help="TensorBoard log directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.max_steps < 1:
        parser.error(f"--max-steps must be >= 1, got {args.max_steps}")
    return args


def monitors() -> list[L.Callback]:
    """The telemetry callbacks the demo attaches: loss scale (also on the progress bar), gradient health, dtypes."""
    return [LossScaleMonitor(prog_bar=True), GradientHealthMonitor(), LayerDtypeMonitor(every_n_steps=100)]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    L.seed_everything(args.seed, verbose=False)
    devices: int | str = int(args.devices) if args.devices.isdigit() else args.devices
    plugin = MixedPrecision(precision=args.precision, opt_level=args.opt_level)
    logger = TensorBoardLogger(args.log_dir, name="demo")
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=devices,
        strategy=args.strategy,
        max_steps=args.max_steps,
        plugins=[plugin],
        logger=logger,
        callbacks=monitors(),
        log_every_n_steps=10,
        val_check_interval=min(100, args.max_steps),
        check_val_every_n_epoch=None,
        limit_val_batches=8,
        enable_checkpointing=False,
    )
    model = TinyTransformerLM()
    trainer.fit(model, datamodule=MarkovTextDataModule(seed=args.seed))
    if trainer.is_global_zero:
        print(summary(trainer, plugin))
    return 0


def summary(trainer: L.Trainer, plugin: MixedPrecision) -> str:
    """The closing report: what ran, what the scaler did, where the logs are."""
    stats = plugin.stats
    metrics = trainer.callback_metrics
    final_loss = metrics.get("train_loss")
    val_loss = metrics.get("val_loss")
    log_dir = trainer.logger.log_dir if trainer.logger is not None else "lightning_logs"
    opt_level = plugin.policy.opt_level if plugin.policy is not None else plugin.opt_level
    lines = [
        "",
        "lightning_mp demo summary",
        f"  precision      : {plugin.precision} (opt level {opt_level}) - {plugin.precision_reason}",
        f"  device         : {plugin.device}",
        f"  optimizer steps: {stats.optimizer_steps}",
        f"  skipped steps  : {stats.skipped_steps} (scale backoffs {stats.scale_backoffs},"
        f" growths {stats.scale_growths})",
        f"  final loss scale: {stats.loss_scale:g}",
        f"  final train loss: {float(final_loss):.4f}" if final_loss is not None else "  final train loss: n/a",
        f"  final val loss : {float(val_loss):.4f} (chance: {TinyTransformerLM.chance_loss():.4f})"
        if val_loss is not None
        else "  final val loss : n/a",
        f"  logs           : {log_dir}",
        "  in TensorBoard : Scalars precision/loss_scale, precision/skipped_steps_total, precision/skip_rate,",
        "                   precision/grad_norm, precision/grad_headroom_log2 (fp16), precision/layers/<dtype>;",
        "                   Text precision/layer_dtypes, precision/overflow; Histogram precision/grad_log2_magnitude",
        f"  open them with : tensorboard --logdir {trainer.logger.save_dir if trainer.logger else 'lightning_logs'}",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
