"""Logger plumbing shared by the telemetry callbacks, the FP8 monitor's included.

The monitors follow the conventions of Lightning's ``LearningRateMonitor`` and ``DeviceStatsMonitor``:

- they need a logger, and say so in ``setup`` when there is none;
- they log at the step at which ``self.log`` writes, so their curves line up with the user's own metrics
  (:func:`logging_step`);
- they respect ``log_every_n_steps`` as the Trainer applies it (:func:`should_log`);
- they write from rank zero only.

The step ``self.log`` writes a batch's metrics at is the number of earlier batches after which the optimizer stepped.
Lightning keeps that count privately; it is computed here from the Trainer's public state. Under automatic
optimization each such batch steps the one optimizer once, so the count is ``trainer.global_step`` until the batch's
own step, and one less after it when the batch stepped (:func:`only_accumulates` says whether it did). Under manual
optimization Lightning refuses gradient accumulation and counts every batch, however many optimizer steps it takes,
so the count is the number of batches completed (the fit loop's batch progress). ``tests/callbacks/test_logging.py``
checks the result against Lightning's own count in every hook. It differs in two places only: a batch the dataloader
yields as ``None`` under automatic optimization (Lightning warns about it) takes no optimizer step but counts for
Lightning; and in ``on_train_start`` after a resume in the middle of an epoch, Lightning's count is one behind until
its epoch loop starts, where this is already the step of the first batch to come.

Scalars go to every logger. Text (Markdown) goes only to :class:`~lightning.pytorch.loggers.TensorBoardLogger`, whose
``SummaryWriter`` renders it; other loggers cannot show it, so it is skipped for them rather than failing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_mp.arguments.checks import plain_scalar

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter


def validate_positive_int(name: str, value: object) -> int:
    """Return ``value`` as a Python int if it is an integer of at least 1 (numpy and 0-d tensor integers too).

    Raises:
        ValueError: naming the argument, the value and what is allowed.

    """
    number = plain_scalar(value)
    if isinstance(number, bool) or not isinstance(number, int) or number < 1:
        raise ValueError(f"`{name}` must be an integer >= 1, got {value!r}.")
    return number


def validate_bool(name: str, value: object) -> bool:
    """Return ``value`` as a Python bool if it is ``True`` or ``False`` (numpy and 0-d tensor booleans too).

    1, 0 and "yes" are refused.

    Raises:
        ValueError: naming the argument, the value and what is allowed.

    """
    flag = plain_scalar(value)
    if not isinstance(flag, bool):
        raise ValueError(f"`{name}` must be True or False, got {value!r}.")
    return flag


def require_logger(trainer: pl.Trainer, callback_name: str) -> None:
    """Fail early, as Lightning's own monitors do, when there is nowhere to log to.

    Raises:
        MisconfigurationException: if the trainer has no logger.

    """
    if not trainer.loggers:
        raise MisconfigurationException(
            f"Cannot use `{callback_name}` callback with `Trainer(logger=False)`: it logs through the trainer's"
            " loggers. Pass a logger, for example `Trainer(logger=TensorBoardLogger('logs'))`."
        )


def only_accumulates(trainer: pl.Trainer, batch_idx: int) -> bool:
    """Whether training batch ``batch_idx`` (of its epoch) only accumulates gradients: the optimizer steps later.

    Lightning's rule: the optimizer steps after every ``accumulate_grad_batches``-th batch of an epoch and after the
    epoch's last batch, unless the strategy accumulates gradients itself (DeepSpeed).
    """
    if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
        return False
    is_last = batch_idx + 1 == trainer.num_training_batches or trainer.is_last_batch
    return not is_last or trainer.strategy.handles_gradient_accumulation


def logging_step(trainer: pl.Trainer, finished_batch: int | None = None) -> int:
    """The step at which Lightning's ``self.log`` writes the current training batch's metrics (module docstring).

    Args:
        trainer: the Trainer, in a training hook or ``on_train_start``.
        finished_batch: the hook's ``batch_idx`` in ``on_train_batch_end``, after the batch's optimizer step; None
            in the hooks before it.

    """
    if not trainer.lightning_module.automatic_optimization:
        return trainer.fit_loop.epoch_loop.batch_progress.total.completed
    if finished_batch is not None and not only_accumulates(trainer, finished_batch):
        return trainer.global_step - 1
    return trainer.global_step


def should_log(trainer: pl.Trainer, finished_batch: int | None = None) -> bool:
    """Whether the current batch is a logging step under ``Trainer(log_every_n_steps=...)``, as Lightning decides.

    ``finished_batch`` as in :func:`logging_step`.
    """
    # Trainer.log_every_n_steps is public, but the logger connector assigns it outside __init__, where mypy does not
    # see it.
    every_n_steps: int = trainer.log_every_n_steps  # type: ignore[attr-defined]
    if every_n_steps == 0:
        return False
    return (logging_step(trainer, finished_batch) + 1) % every_n_steps == 0 or trainer.should_stop


def log_scalars(trainer: pl.Trainer, metrics: Mapping[str, float], step: int) -> None:
    """Write scalars to every logger, from rank zero."""
    if not trainer.is_global_zero or not metrics:
        return
    for logger in trainer.loggers:
        logger.log_metrics(dict(metrics), step=step)


def tensorboard_writers(trainer: pl.Trainer) -> list[SummaryWriter]:
    """The ``SummaryWriter`` of each TensorBoard logger; empty off rank zero or without one."""
    if not trainer.is_global_zero:
        return []
    return [logger.experiment for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]


def log_text(trainer: pl.Trainer, tag: str, markdown: str, step: int) -> None:
    """Write Markdown to every TensorBoard logger; loggers that cannot show text are skipped."""
    for writer in tensorboard_writers(trainer):
        writer.add_text(tag, markdown, global_step=step)
