"""The plugin a telemetry callback reads its counters from, found on the Trainer, with a clear error otherwise."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_mp.deepspeed import DeepSpeedMixedPrecision
from lightning_mp.plugin import MixedPrecision


def require_loss_accounting(trainer: pl.Trainer, callback_name: str) -> MixedPrecision | DeepSpeedMixedPrecision:
    """Return the trainer's plugin that keeps loss-scaling counters: MixedPrecision, or its DeepSpeed form.

    Raises:
        MisconfigurationException: if the trainer uses another precision plugin.

    """
    plugin = trainer.precision_plugin
    if isinstance(plugin, DeepSpeedMixedPrecision):
        return plugin
    return require_mixed_precision(trainer, callback_name)


def require_mixed_precision(trainer: pl.Trainer, callback_name: str) -> MixedPrecision:
    """Return the trainer's :class:`~lightning_mp.plugin.MixedPrecision` plugin.

    Raises:
        MisconfigurationException: if the trainer uses another precision plugin.

    """
    plugin = trainer.precision_plugin
    if not isinstance(plugin, MixedPrecision):
        raise MisconfigurationException(
            f"`{callback_name}` reads the counters of `lightning_mp.MixedPrecision`, but the trainer uses"
            f" `{type(plugin).__name__}`. Pass `Trainer(plugins=[MixedPrecision(...)])`"
            + (
                " (under DeepSpeedStrategy only LossScaleMonitor reads DeepSpeedMixedPrecision's counters)."
                if isinstance(plugin, DeepSpeedMixedPrecision)
                else "."
            )
        )
    return plugin
