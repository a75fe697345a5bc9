"""Logs the dynamic loss scale and the overflow counters of :class:`~lightning_mp.MixedPrecision`.

In fp16 the loss is multiplied by a scale before backward so that small gradients do not underflow to zero. When a
gradient overflows to inf or NaN, the optimizer step is skipped and the scale is multiplied by ``backoff_factor``;
after ``growth_interval`` clean steps it is multiplied by ``growth_factor``. A healthy run shows a scale that
saw-tooths around a plateau and a skip rate near zero. A scale that keeps falling, or a skip rate that climbs,
means the model no longer fits fp16's range: the run is silently not learning on those steps.

Everything is read from ``plugin.stats``, a host-side snapshot the plugin refreshes after every optimizer step, so
this callback never synchronises with the device on a single process.

**Progress bar.** ``self.log("loss_scale", ..., prog_bar=True)`` would turn the float into a tensor on the model's
device (a host-to-device copy) and Lightning would read it back with ``.item()`` for the bar, on every step. Instead
the callback writes the Python float straight into ``trainer.progress_bar_metrics``, the dictionary the progress
bar's ``get_metrics`` shows: no tensor, no copy, no synchronisation. Lightning runs user callbacks before its
progress bar, so the bar shows the scale after this batch's step.

**Cost under DDP**: one collective per logging step, and no synchronisation of its own. The four counters are
stacked into one vector (this rank's overflow count stays a device tensor until then) and gathered from every rank
with a single ``all_gather``; the result is read back in the one transfer the monitors share per batch
(:mod:`lightning_mp.measuring.host_reads`), and the maxima and the sum are taken on the host.

The scaler's device overflow counter comes from the plugin's read-only :attr:`~lightning_mp.MixedPrecision.scaler_view`.

**Under DeepSpeedStrategy** the callback reads :class:`~lightning_mp.deepspeed.DeepSpeedMixedPrecision`'s counters,
which come from DeepSpeed's engine, under the same tags. DeepSpeed decides a step's overflow over all ranks at once,
so ``precision/rank_overflows_total`` counts each skipped step once (on rank 0).

Private names: :mod:`lightning_mp._private_names` lists them, with the reason for each.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_mp.callbacks._plugin_lookup import require_loss_accounting
from lightning_mp.measuring.host_reads import host_reads
from lightning_mp.measuring.logging_steps import (
    log_scalars,
    logging_step,
    require_logger,
    should_log,
    validate_bool,
)
from lightning_mp.measuring.monitors import TelemetryCallback
from lightning_mp.plugin import MixedPrecision


class LossScaleMonitor(TelemetryCallback):
    r"""Log the loss scale, the skipped steps and the scale's backoffs and growths.

    **Logged metrics** (at the trainer's logging step, every ``log_every_n_steps``):

    - ``precision/loss_scale``: the scale the next backward will use; 1.0 where nothing is scaled (bf16, fp32).
    - ``precision/skipped_steps_total``: optimizer steps skipped because a gradient was inf or NaN, since the start.
    - ``precision/skip_rate``: skipped steps over optimizer steps in the window since the previous log.
    - ``precision/scale_backoffs_total`` and ``precision/scale_growths_total``: how often the scale moved.
    - ``precision/rank_overflows_total``: overflows seen by each rank's own gradients, summed over the ranks. In a
      single process it equals the skipped steps; under DDP it exceeds them when several ranks overflowed on the
      same step, and with one run per rank it tells which rank overflows.
    - ``precision/loss_scale/optimizer_<number>``: with ``scale_per_optimizer=True``, each optimizer's scale, by
      the order the run met the optimizers (``precision/loss_scale`` is then the first's).

    A skipped step is always logged at the step where it happened, even between logging intervals, so that no skip
    is invisible in TensorBoard.

    **Distributed training.** The plugin all-reduces the found-inf flag before it decides to skip, so every rank
    skips the same steps and holds the same counters. The totals are therefore reduced across ranks with a maximum,
    not a sum: a step skipped on all ranks counts once, which is the number of optimizer updates the model lost.
    ``precision/rank_overflows_total`` is the one total summed over ranks. All four are gathered in one collective per
    logging step; everything is written once, from rank zero.

    .. warning:: Under DDP a logging step synchronises the host once, to read the gathered counters. A single process
        never synchronises, and the progress bar never does.

    Args:
        prog_bar: also show the loss scale on Lightning's progress bar, as ``loss_scale``.

    Raises:
        MisconfigurationException:
            If the ``Trainer`` has no logger, or does not use :class:`~lightning_mp.MixedPrecision`.

    Example::

        from lightning import Trainer
        from lightning_mp import MixedPrecision
        from lightning_mp.callbacks import LossScaleMonitor

        trainer = Trainer(plugins=[MixedPrecision("16-mixed")], callbacks=[LossScaleMonitor(prog_bar=True)])

    """

    def __init__(self, prog_bar: bool = False) -> None:
        self.prog_bar = validate_bool("prog_bar", prog_bar)
        self._seen_optimizer_steps = 0
        self._seen_skipped_steps = 0
        self._window_start_optimizer_steps = 0
        self._window_start_skipped_steps = 0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        require_logger(trainer, type(self).__name__)
        require_loss_accounting(trainer, type(self).__name__)
        host_reads(trainer).join(self)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Counters restored from a checkpoint belong to earlier windows, not to the first one of this run.
        stats = require_loss_accounting(trainer, type(self).__name__).stats
        self._seen_optimizer_steps = self._window_start_optimizer_steps = stats.optimizer_steps
        self._seen_skipped_steps = self._window_start_skipped_steps = stats.skipped_steps

    @override
    def batch_ended(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_idx: int) -> None:
        plugin = require_loss_accounting(trainer, type(self).__name__)
        stats = plugin.stats
        stepped = stats.optimizer_steps > self._seen_optimizer_steps
        skipped = stats.skipped_steps > self._seen_skipped_steps
        self._seen_optimizer_steps = stats.optimizer_steps
        self._seen_skipped_steps = stats.skipped_steps
        if stepped and self.prog_bar:
            trainer.progress_bar_metrics["loss_scale"] = stats.loss_scale
        # Accumulating gradients, nothing changed since the last batch; or not a step to log.
        if not stepped or not (should_log(trainer, finished_batch=batch_idx) or skipped):
            host_reads(trainer).submit(trainer, self)
            return

        window_steps = stats.optimizer_steps - self._window_start_optimizer_steps
        window_skips = stats.skipped_steps - self._window_start_skipped_steps
        self._window_start_optimizer_steps = stats.optimizer_steps
        self._window_start_skipped_steps = stats.skipped_steps
        step = logging_step(trainer, finished_batch=batch_idx)
        shared_counters = (stats.skipped_steps, stats.scale_backoffs, stats.scale_growths)

        def log(per_rank: list[float]) -> None:
            skipped_total, backoffs_total, growths_total, rank_overflows_total = _reduce_over_ranks(
                per_rank, len(shared_counters) + 1
            )
            log_scalars(
                trainer,
                {
                    "precision/loss_scale": stats.loss_scale,
                    "precision/skipped_steps_total": skipped_total,
                    "precision/skip_rate": window_skips / window_steps,
                    "precision/scale_backoffs_total": backoffs_total,
                    "precision/scale_growths_total": growths_total,
                    "precision/rank_overflows_total": rank_overflows_total,
                    **{
                        f"precision/loss_scale/optimizer_{number}": scale
                        for number, scale in enumerate(stats.loss_scales)
                    },
                },
                step=step,
            )

        if trainer.world_size == 1:
            # One process: its own overflows are the skipped steps, and reading a device counter would synchronise.
            host_reads(trainer).submit(trainer, self)
            log([*shared_counters, stats.skipped_steps])
            return
        local_overflows = (
            plugin.scaler_view.local_overflows
            if isinstance(plugin, MixedPrecision)
            else plugin.local_overflows(trainer)  # DeepSpeed decides over all ranks: rank 0 counts each skip
        )
        gathered = _gather_counters(trainer, shared_counters, local_overflows)
        host_reads(trainer).submit(trainer, self, gathered, log)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        host_reads(trainer).leave(self)


def _gather_counters(
    trainer: pl.Trainer, shared_counters: tuple[int, ...], local_overflows: torch.Tensor | int
) -> torch.Tensor:
    """Every rank's counters, ``shared_counters`` then this rank's overflows, gathered in one collective.

    The result stays on the device, shaped ``(world_size * (len(shared_counters) + 1),)``; nothing is read here.
    """
    device = trainer.strategy.root_device
    local = torch.as_tensor(local_overflows, dtype=torch.float64, device=device).reshape(1)
    # Counters stay far below 2**53, so float64 carries them exactly.
    counters = torch.cat([torch.tensor(shared_counters, dtype=torch.float64).to(device, non_blocking=True), local])
    return trainer.strategy.all_gather(counters).reshape(-1)


def _reduce_over_ranks(per_rank: list[float], width: int) -> tuple[int, ...]:
    """Maxima of the shared counters over the ranks, and the sum of the last column (each rank's own overflows).

    Example:
        >>> _reduce_over_ranks([2.0, 1.0, 0.0, 2.0, 2.0, 1.0, 0.0, 0.0], width=4)
        (2, 1, 0, 2)

    """
    rows = [per_rank[start : start + width] for start in range(0, len(per_rank), width)]
    maxima = [int(max(row[column] for row in rows)) for column in range(width - 1)]
    return (*maxima, int(sum(row[-1] for row in rows)))
