"""Loss Scale Monitor
==================

Logs the dynamic loss scale and the overflow counters of :class:`~lightning_mp.MixedPrecision`.

In fp16 the loss is multiplied by a scale before backward so that small gradients do not underflow to zero. When a
gradient overflows to inf or NaN, the optimizer step is skipped and the scale is multiplied by ``backoff_factor``;
after ``growth_interval`` clean steps it is multiplied by ``growth_factor``. A healthy run shows a scale that
saw-tooths around a plateau and a skip rate near zero. A scale that keeps falling, or a skip rate that climbs,
means the model no longer fits fp16's range: the run is silently not learning on those steps.

Everything is read from ``plugin.stats``, a host-side snapshot the plugin refreshes after every optimizer step, so
this callback never synchronises with the device on a single process.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.types import STEP_OUTPUT
from typing_extensions import override

from lightning_mp.callbacks._logging import (
    log_scalars,
    logging_step,
    require_logger,
    require_mixed_precision,
    should_log,
)


class LossScaleMonitor(Callback):
    r"""Log the loss scale, the skipped steps and the scale's backoffs and growths.

    **Logged metrics** (at the trainer's logging step, every ``log_every_n_steps``):

    - ``precision/loss_scale``: the scale the next backward will use; 1.0 where nothing is scaled (bf16, fp32).
    - ``precision/skipped_steps_total``: optimizer steps skipped because a gradient was inf or NaN, since the start.
    - ``precision/skip_rate``: skipped steps over optimizer steps in the window since the previous log.
    - ``precision/scale_backoffs_total`` and ``precision/scale_growths_total``: how often the scale moved.
    - ``precision/rank_overflows_total``: overflows seen by each rank's own gradients, summed over the ranks. In a
      single process it equals the skipped steps; under DDP it exceeds them when several ranks overflowed on the
      same step, and with one run per rank it tells which rank overflows.

    A skipped step is always logged at the step where it happened, even between logging intervals, so that no skip
    is invisible in TensorBoard.

    **Distributed training.** The plugin all-reduces the found-inf flag before it decides to skip, so every rank
    skips the same steps and holds the same counters. The totals are therefore reduced across ranks with a maximum,
    not a sum: a step skipped on all ranks counts once, which is the number of optimizer updates the model lost.
    ``precision/rank_overflows_total`` is the one total summed over ranks. These reductions cost two small collectives
    per logging step; everything is written once, from rank zero.

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
        if not isinstance(prog_bar, bool):
            raise ValueError(f"`prog_bar` must be True or False, got {prog_bar!r}.")
        self.prog_bar = prog_bar
        self._seen_optimizer_steps = 0
        self._seen_skipped_steps = 0
        self._window_start_optimizer_steps = 0
        self._window_start_skipped_steps = 0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        require_logger(trainer, type(self).__name__)
        require_mixed_precision(trainer, type(self).__name__)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Counters restored from a checkpoint belong to earlier windows, not to the first one of this run.
        stats = require_mixed_precision(trainer, type(self).__name__).stats
        self._seen_optimizer_steps = self._window_start_optimizer_steps = stats.optimizer_steps
        self._seen_skipped_steps = self._window_start_skipped_steps = stats.skipped_steps

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: STEP_OUTPUT,
        batch: Any,
        batch_idx: int,
    ) -> None:
        plugin = require_mixed_precision(trainer, type(self).__name__)
        stats = plugin.stats
        stepped = stats.optimizer_steps > self._seen_optimizer_steps
        skipped = stats.skipped_steps > self._seen_skipped_steps
        self._seen_optimizer_steps = stats.optimizer_steps
        self._seen_skipped_steps = stats.skipped_steps
        if not stepped:
            # Accumulating gradients: nothing changed since the last batch.
            return

        if self.prog_bar:
            pl_module.log("loss_scale", stats.loss_scale, prog_bar=True, logger=False, on_step=True, on_epoch=False)

        if not (should_log(trainer) or skipped):
            return

        skipped_total, backoffs_total, growths_total = self._reduce_over_ranks(
            trainer, (stats.skipped_steps, stats.scale_backoffs, stats.scale_growths), "max"
        )
        (rank_overflows_total,) = self._reduce_over_ranks(trainer, (plugin.local_overflows(),), "sum")
        window_steps = stats.optimizer_steps - self._window_start_optimizer_steps
        window_skips = stats.skipped_steps - self._window_start_skipped_steps
        self._window_start_optimizer_steps = stats.optimizer_steps
        self._window_start_skipped_steps = stats.skipped_steps

        log_scalars(
            trainer,
            {
                "precision/loss_scale": stats.loss_scale,
                "precision/skipped_steps_total": skipped_total,
                "precision/skip_rate": window_skips / window_steps,
                "precision/scale_backoffs_total": backoffs_total,
                "precision/scale_growths_total": growths_total,
                "precision/rank_overflows_total": rank_overflows_total,
            },
            step=logging_step(trainer),
        )

    @staticmethod
    def _reduce_over_ranks(trainer: pl.Trainer, counters: tuple[int, ...], reduce_op: str) -> tuple[int, ...]:
        if trainer.world_size == 1:
            return counters
        values = torch.tensor(counters, dtype=torch.int64, device=trainer.strategy.root_device)
        return tuple(int(value) for value in trainer.strategy.reduce(values, reduce_op=reduce_op).tolist())
