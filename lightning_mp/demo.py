"""The first run: dynamic fp16 loss scaling at work on a small transformer, on any machine, in well under a minute.

Run ``python -m lightning_mp.demo``. It trains a small :class:`~lightning_mp.tasks.TinyTransformerLM` on generated
Markov text with :class:`~lightning_mp.MixedPrecision` in real fp16 (``torch.autocast`` and a dynamic loss scaler,
on the CPU as on a GPU), and shows the three things a loss scaler does:

1. **The scale grows.** It starts at ``--init-scale`` and doubles after every ``--growth-interval`` steps without an
   overflow (torch's default interval is 2000 steps; the demo uses 10 so that the growth shows in a short run).
2. **An overflow is caught and skipped.** At step ``--spike-at-step`` the demo plants a loss spike: the loss is
   multiplied by ``2**40`` for one step, as a bad batch might do. In fp32 that is a finite number, but its
   gradients overflow fp16's range (65504). The scaler finds the inf, skips that optimizer step, so the weights
   never see it, and halves the scale. (Only fp16 overflows there, so the spike is planted only in fp16.)
3. **It is reported.** The summary says what happened and why, and TensorBoard logs hold each event: the scale,
   the skipped steps, the overflow's non-finite parameters, the gradient health and the dtype of every layer.

The model is small (one layer, width 32), because most CPUs emulate fp16 matrix products, far more slowly than
fp32: on a 2-core CPU the demo takes about half a minute. ``--precision bf16-mixed`` or ``auto`` shows the other
path (no scaler needed) where the hardware runs bf16 natively.

The summary lists only the TensorBoard tags that the run really wrote: it reads them back from the event files. Its
last line says what ``--precision auto`` would pick on this hardware, and why.

The callbacks come from :func:`demo_callbacks`, the one place to add a monitor to the demo.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import Tensor
from typing_extensions import override

from lightning_mp.callbacks import GradientHealthMonitor, LayerDtypeMonitor, LossScaleMonitor, PrecisionSentinel
from lightning_mp.plugin import MixedPrecision
from lightning_mp.plugin.hardware import choose_precision
from lightning_mp.policies import POLICIES
from lightning_mp.tasks import MarkovTextDataModule, TinyTransformerLM

LOSS_SPIKE = 2.0**40
"""The planted loss spike: finite in fp32, but its gradients overflow fp16 at any loss scale >= 1."""

TAG_EXPLANATIONS: dict[str, str] = {
    "precision/loss_scale": "the loss scale: doubles after growth_interval clean steps, halves on an overflow",
    "precision/skipped_steps_total": "optimizer steps skipped because a gradient was inf or NaN",
    "precision/skip_rate": "skipped steps over steps, since the previous log",
    "precision/scale_backoffs_total": "how often the scale was halved",
    "precision/scale_growths_total": "how often the scale was doubled",
    "precision/rank_overflows_total": "overflows seen by each rank's own gradients, summed over ranks",
    "precision/grad_norm": "the true (unscaled) gradient norm the optimizer sees",
    "precision/grad_zero_fraction": "share of gradient elements that are exactly zero (underflow shows here)",
    "precision/grad_headroom_log2": "doublings of the scale left before the largest gradient overflows fp16",
    "precision/grad_log2_magnitude": "histogram of log2 |scaled gradient|: where gradients sit in fp16's range",
    "precision/overflow/text_summary": "on each skipped step, the parameters whose gradients were inf or NaN",
    "precision/layer_dtypes/text_summary": "table of every layer's output dtype under autocast",
    "precision/layers/": "number of layers whose output has that dtype",
    "precision_sentinel/activation_headroom_log2": "heatmap, layers by steps: doublings left before fp16 overflows",
    "precision_sentinel/grad_underflow_share": "heatmap, layers by steps: share of gradients that are exactly zero",
    "precision_sentinel/stale_update_share": "heatmap, layers by steps: share of updates rounded away (below ulp/2)",
    "precision_sentinel/min_activation_headroom_log2": "the smallest activation headroom of any layer, per sample",
    "precision_sentinel/total_grad_underflow_share": "share of all gradient elements that are exactly zero",
    "precision_sentinel/max_stale_update_share": "the largest per-layer share of updates rounded away",
    "train_loss": "training loss",
    "val_loss": "validation loss",
}


class SpikedLM(TinyTransformerLM):
    """:class:`~lightning_mp.tasks.TinyTransformerLM` with one planted loss spike.

    Args:
        spike_at_step: the step (``global_step``, as the logs count it) whose loss is multiplied by
            :data:`LOSS_SPIKE`; 0 for none.
        **kwargs: passed to :class:`~lightning_mp.tasks.TinyTransformerLM`.

    """

    def __init__(self, spike_at_step: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.spike_at_step = spike_at_step

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.spike_at_step and self.global_step == self.spike_at_step:
            return loss * LOSS_SPIKE
        return loss


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line's flags; a bad flag exits with argparse's usage message, naming it."""
    parser = argparse.ArgumentParser(prog="python -m lightning_mp.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="16-mixed", choices=["16-mixed", "auto", "bf16-mixed", "32-true"])
    parser.add_argument("--opt-level", default="O1", choices=sorted(POLICIES))
    parser.add_argument("--max-steps", type=int, default=100, help="optimizer steps to train (default 100)")
    parser.add_argument("--init-scale", type=float, default=2.0**8, help="first fp16 loss scale (default 256)")
    parser.add_argument("--growth-interval", type=int, default=10, help="clean steps before the scale doubles")
    parser.add_argument("--spike-at-step", type=int, default=50, help="plant a loss spike at this step (0: none)")
    parser.add_argument("--accelerator", default="auto", help="cpu, gpu or auto (default)")
    parser.add_argument("--devices", default="1", help="devices to use (default 1)")
    parser.add_argument("--strategy", default="auto", help="auto (default), ddp, ddp_spawn, ...")
    parser.add_argument("--log-dir", default="lightning_logs", help="TensorBoard log directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for flag, minimum in (("max_steps", 1), ("growth_interval", 1), ("spike_at_step", 0)):
        if getattr(args, flag) < minimum:
            parser.error(f"--{flag.replace('_', '-')} must be >= {minimum}, got {getattr(args, flag)}")
    if args.opt_level == "O0" and args.precision in ("16-mixed", "bf16-mixed"):
        parser.error(
            f"--opt-level O0 is the fp32 baseline: use it with --precision 32-true or auto, not {args.precision}"
        )
    if not 0 < args.init_scale < math.inf:
        parser.error(f"--init-scale must be a finite number > 0, got {args.init_scale}")
    return args


def demo_callbacks() -> list[L.Callback]:
    """The demo's callbacks: loss scale (also on the progress bar), gradient health, layer dtypes, the sentinel."""
    return [
        LossScaleMonitor(prog_bar=True),
        GradientHealthMonitor(),
        LayerDtypeMonitor(every_n_steps=50),
        PrecisionSentinel(),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Train the demo model as ``argv`` asks, then print what the loss scaler did; returns the exit status."""
    args = parse_args(argv)
    started = time.perf_counter()
    L.seed_everything(args.seed, verbose=False)
    devices: int | str = int(args.devices) if args.devices.isdigit() else args.devices
    plugin = MixedPrecision(
        precision=args.precision,
        opt_level=args.opt_level,
        init_scale=args.init_scale,
        growth_interval=args.growth_interval,
    )
    logger = TensorBoardLogger(args.log_dir, name="demo")
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=devices,
        strategy=args.strategy,
        max_steps=args.max_steps,
        plugins=[plugin],
        logger=logger,
        callbacks=demo_callbacks(),
        log_every_n_steps=5,
        val_check_interval=min(50, args.max_steps),
        check_val_every_n_epoch=None,
        limit_val_batches=4,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    # The spike only tells a story where fp16 can overflow; in bf16 or fp32 it would just be a bad step.
    spike_at_step = args.spike_at_step if args.precision == "16-mixed" else 0
    model = SpikedLM(spike_at_step=spike_at_step, d_model=32, n_heads=2, n_layers=1, seq_len=32, warmup_steps=10)
    data = MarkovTextDataModule(seq_len=32, batch_size=16, train_sequences=1024, seed=args.seed)
    trainer.fit(model, datamodule=data)
    if trainer.is_global_zero:
        logger.experiment.flush()
        print(summary(trainer, plugin, args, spike_at_step, time.perf_counter() - started))
    return 0


def logged_tags(log_dir: str | Path) -> list[str]:
    """Every tag in the TensorBoard event files under ``log_dir``, as TensorBoard names them (sorted)."""
    guidance = {"scalars": 1, "tensors": 1, "histograms": 1, "images": 1}
    accumulator = EventAccumulator(str(log_dir), size_guidance=guidance)
    accumulator.Reload()
    tags = accumulator.Tags()
    return sorted({tag for kind in ("scalars", "histograms", "tensors", "images") for tag in tags.get(kind, [])})


def _next_step(plugin: MixedPrecision) -> str:
    """What to run next on this hardware: the precision "auto" would pick here, and why."""
    device = plugin.device or "cpu"
    auto, why = choose_precision(device, plugin.opt_level)
    if plugin.requested_precision == "auto":
        return "python -m lightning_mp.demo (fp16 with loss scaling, as on any machine)"
    return f"python -m lightning_mp.demo --precision auto ({auto} here: {why})"


def _times(count: int) -> str:
    return "once" if count == 1 else f"{count} times"


def _explain(tag: str) -> str:
    if tag in TAG_EXPLANATIONS:
        return TAG_EXPLANATIONS[tag]
    prefix = next((prefix for prefix in TAG_EXPLANATIONS if prefix.endswith("/") and tag.startswith(prefix)), None)
    return TAG_EXPLANATIONS[prefix] if prefix else "see the callback's documentation"


def summary(
    trainer: L.Trainer, plugin: MixedPrecision, args: argparse.Namespace, spike_at_step: int, seconds: float
) -> str:
    """The closing report: each line says what happened and why, then the TensorBoard tags the run wrote."""
    stats = plugin.stats
    metrics = trainer.callback_metrics
    val_loss = metrics.get("val_loss")
    opt_level = plugin.policy.opt_level if plugin.policy is not None else plugin.opt_level
    policy = (POLICIES[opt_level].__doc__ or "").strip().splitlines()[0].rstrip(".")
    scaled = plugin.half_dtype is torch.float16
    if spike_at_step:
        spike = f", 1 of them the loss spike planted at step {spike_at_step} (its fp16 gradients overflowed)"
    elif scaled:
        spike = " (no spike planted)"
    else:
        spike = " (only fp16 overflows, so no spike was planted)"
    if scaled:
        scale = (
            f"{args.init_scale:g} -> {stats.loss_scale:g}: doubled {_times(stats.scale_growths)} (after each"
            f" {args.growth_interval} clean steps), halved {_times(stats.scale_backoffs)} (on each overflow)"
        )
    else:
        scale = f"{stats.loss_scale:g}: {plugin.precision} needs no loss scaling"
    val_text = f"{float(val_loss):.3f}" if val_loss is not None else "n/a"
    logged_to = trainer.logger.log_dir if trainer.logger is not None else None
    log_dir = Path(logged_to or args.log_dir)
    tags = [tag for tag in logged_tags(log_dir) if tag.startswith("precision/") or tag in TAG_EXPLANATIONS]
    width = max([len(tag) for tag in tags] + [1])
    lines = [
        "",
        "lightning_mp demo summary",
        f"  precision       : {plugin.precision}, opt level {opt_level} ({policy}); why: {plugin.precision_reason}",
        f"  device          : {plugin.device}",
        f"  optimizer steps : {stats.optimizer_steps} (steps attempted, skipped ones included)",
        f"  skipped steps   : {stats.skipped_steps} (a step whose gradients hold inf or NaN is skipped: the weights are"
        f" left alone){spike}",
        f"  loss scale      : {scale}",
        f"  val loss        : {val_text} (chance is {TinyTransformerLM.chance_loss():.3f}: lower means it learned)",
        f"  time            : {seconds:.1f} s",
        f"  logs            : {log_dir}",
        "  in TensorBoard  : (tags this run wrote)",
        *(f"    {tag:<{width}}  {_explain(tag)}" for tag in tags),
        f"  open them with  : tensorboard --logdir {trainer.logger.save_dir if trainer.logger else args.log_dir}",
        f"  try next        : {_next_step(plugin)}",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
