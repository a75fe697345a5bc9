"""Logger plumbing shared by the telemetry callbacks.

The three monitors follow the conventions of Lightning's ``LearningRateMonitor`` and ``DeviceStatsMonitor``:

- they need a logger, and say so in ``setup`` when there is none;
- they log at ``trainer.fit_loop.epoch_loop._batches_that_stepped``, the step at which ``self.log`` writes, so their
  curves line up with the user's own metrics;
- they respect ``log_every_n_steps`` through the trainer's ``should_update_logs``;
- they write from rank zero only.

Scalars go to every logger. Text (Markdown) goes only to :class:`~lightning.pytorch.loggers.TensorBoardLogger`, whose
``SummaryWriter`` renders it; other loggers cannot show it, so it is skipped for them rather than failing.

Private names: :mod:`lightning_mp._private_names` lists them, with the reason for each.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_mp._validation import plain_scalar
from lightning_mp.plugin import MixedPrecision

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


def require_mixed_precision(trainer: pl.Trainer, callback_name: str) -> MixedPrecision:
    """Return the trainer's :class:`~lightning_mp.plugin.MixedPrecision` plugin.

    Raises:
        MisconfigurationException: if the trainer uses another precision plugin.

    """
    plugin = trainer.precision_plugin
    if not isinstance(plugin, MixedPrecision):
        raise MisconfigurationException(
            f"`{callback_name}` reads the counters of `lightning_mp.MixedPrecision`, but the trainer uses"
            f" `{type(plugin).__name__}`. Pass `Trainer(plugins=[MixedPrecision(...)])`."
        )
    return plugin


def logging_step(trainer: pl.Trainer) -> int:
    """The step at which Lightning's ``self.log`` writes during training."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def should_log(trainer: pl.Trainer) -> bool:
    """Whether this batch is a logging step under ``Trainer(log_every_n_steps=...)``."""
    return trainer._logger_connector.should_update_logs


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
