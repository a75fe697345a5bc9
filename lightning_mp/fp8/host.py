"""What FP8 needs of the plugin that runs it: the one way up from :mod:`lightning_mp.fp8` to the plugin.

``fp8/`` sits below the plugin: the plugin builds a run's :class:`~lightning_mp.fp8.mode.Fp8Mode` and calls it, and
nothing in ``fp8/`` imports :mod:`lightning_mp.plugin`. Two pieces of FP8 still need the plugin of a Trainer run:
:class:`~lightning_mp.fp8.telemetry.FP8Monitor` and :func:`~lightning_mp.fp8.convert.fallback_layer` return layers to
bf16 through it, so that one collective agrees every rank and the plugin's checkpoint keeps the decision. They ask for
no class, only for the two members of :class:`Fp8Host`, which :class:`~lightning_mp.MixedPrecision` has: its FP8
settings, and its ``fallback_layers``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from torch import nn

from lightning_mp.fp8.settings import FP8Settings
from lightning_mp.front_ends import attached_trainer


@runtime_checkable
class Fp8Host(Protocol):
    """A precision plugin that runs FP8: :class:`~lightning_mp.MixedPrecision` with ``fp8``."""

    fp8_settings: FP8Settings | None
    """The run's FP8 settings; None where the plugin runs no FP8."""

    def fallback_layers(self, model: nn.Module, requests: Mapping[str, str]) -> dict[str, str]:
        """Return layers to bf16, agreed by every rank; ``layer -> reason`` for those that fell back now."""
        ...


def fp8_host(plugin: object) -> Fp8Host | None:
    """``plugin`` if it runs FP8 (an :class:`Fp8Host` with FP8 settings), else None."""
    if isinstance(plugin, Fp8Host) and plugin.fp8_settings is not None:
        return plugin
    return None


def fp8_host_of(model: nn.Module) -> Fp8Host | None:
    """The FP8 plugin of the Trainer ``model`` is attached to; None under Fabric, for a bare model, or without FP8."""
    trainer = attached_trainer(model)
    return fp8_host(trainer.precision_plugin) if trainer is not None else None


__all__ = ["Fp8Host", "fp8_host", "fp8_host_of"]
