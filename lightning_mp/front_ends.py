"""Which front end converts a model, and on which device its run sets up.

The plugin serves two front ends with one class. A model the Trainer converts is a LightningModule attached to that
Trainer (:func:`attached_trainer`), and the Trainer's strategy knows the run's device (:func:`trainer_device_type`).
Fabric converts a model before it moves it, and tells a plugin nothing of its accelerator: :func:`fabric_device_type`
assumes that a model still on the CPU goes where Fabric's ``accelerator="auto"`` would put it, and the engine
checks at every forward where the model really is (:func:`~lightning_mp.plugin.resolved.follow_device`).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import nn


def attached_trainer(module: nn.Module | None) -> Any:
    """The Trainer a LightningModule is attached to; None for Fabric's modules (and no module)."""
    # Under Fabric, LightningModule.trainer returns a stand-in for the Fabric object rather than None.
    if not isinstance(module, LightningModule) or module.fabric is not None:
        return None
    try:
        return module.trainer
    except RuntimeError:  # not attached to a Trainer
        return None


def is_deepspeed_engine(module: Any) -> bool:
    """Whether ``module`` is a DeepSpeed engine (what Fabric's DeepSpeedStrategy hands a precision plugin).

    Told by the class's name, so that DeepSpeed need not be importable.
    """
    return any(cls.__name__ == "DeepSpeedEngine" for cls in type(module).__mro__)


def trainer_device_type(module: nn.Module) -> str:
    """The device type of the Trainer's strategy; without a Trainer, that of the module's parameters (or the CPU)."""
    trainer = attached_trainer(module)
    if trainer is not None:
        return trainer.strategy.root_device.type
    return _parameter_device_type(module)


def fabric_device_type(module: nn.Module) -> str:
    """The device type a module Fabric converts will run on: where it is, or CUDA for a CPU model where CUDA is."""
    placed = _parameter_device_type(module)
    return placed if placed != "cpu" else ("cuda" if torch.cuda.is_available() else "cpu")


def _parameter_device_type(module: nn.Module) -> str:
    parameter = next(module.parameters(), None)
    return parameter.device.type if parameter is not None else "cpu"


__all__ = ["attached_trainer", "fabric_device_type", "is_deepspeed_engine", "trainer_device_type"]
