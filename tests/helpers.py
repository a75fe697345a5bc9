"""The tests' shared helpers: one tiny model, one Trainer builder and one TensorBoard event reader.

Import them with ``from tests.helpers import ...`` (pytest's configuration puts the repository root on ``sys.path``
under every import mode; a script started in a subprocess needs the root on ``PYTHONPATH``).

The models are tiny on purpose: half precision is slow on CPUs without AVX512, and the whole suite runs on 2 cores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from tensorboard.backend.event_processing import event_accumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

FEATURES = 8
"""Input features of :class:`TinyRegressor` and of :func:`regression_data`."""


def make_trainer(plugin: Any = None, **kwargs: Any) -> L.Trainer:
    """A single-CPU Trainer of 8 steps without logger, checkpoints, progress bar or summary, unless overridden."""
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "max_steps": 8,
    }
    options.update(kwargs)
    if plugin is not None:
        options["plugins"] = [plugin]
    return L.Trainer(**options)


def regression_data(n: int = 64, features: int = FEATURES, seed: int = 0) -> TensorDataset:
    """A seeded linear regression problem with a little noise."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=generator)
    y = x @ torch.randn(features, 1, generator=generator) + 0.1 * torch.randn(n, 1, generator=generator)
    return TensorDataset(x, y)


def loader(n: int = 64, batch_size: int = 8, seed: int = 0) -> DataLoader:
    """A deterministic loader over :func:`regression_data`."""
    return DataLoader(regression_data(n, seed=seed), batch_size=batch_size, shuffle=False)


class TinyRegressor(L.LightningModule):
    """Two linear layers; optionally an inf gradient injected into ``first.weight`` at chosen global steps.

    Args:
        lr: the learning rate.
        inject_at: global steps whose ``first.weight`` gradient gets an inf after backward (an overflow).
        optimizer: ``"sgd"`` (with momentum) or ``"adam"``.
        scheduler: add a ``StepLR`` that steps every batch.
        hidden: the width of the hidden layer.

    """

    def __init__(
        self,
        lr: float = 0.05,
        inject_at: tuple[int, ...] = (),
        optimizer: str = "sgd",
        scheduler: bool = False,
        hidden: int = 16,
    ) -> None:
        super().__init__()
        self.first = nn.Linear(FEATURES, hidden)
        self.second = nn.Linear(hidden, 1)
        self.lr = lr
        self.inject_at = set(inject_at)
        self.optimizer_name = optimizer
        self.use_scheduler = scheduler
        self.seen_grad_scales: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def on_after_backward(self) -> None:
        if self.global_step in self.inject_at:
            self.first.weight.grad[0, 0] = float("inf")

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "adam":
            optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        else:
            optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        if not self.use_scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def read_events(log_dir: str | Path) -> event_accumulator.EventAccumulator:
    """Every scalar, tensor (text) and histogram event under ``log_dir``, loaded in full (no sampling)."""
    accumulator = event_accumulator.EventAccumulator(
        str(log_dir),
        size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0, event_accumulator.HISTOGRAMS: 0},
    )
    accumulator.Reload()
    return accumulator


def scalars(events: event_accumulator.EventAccumulator, tag: str) -> dict[int, float]:
    """The values logged under the scalar ``tag``, by step; empty when the tag was never logged."""
    if tag not in events.Tags()["scalars"]:
        return {}
    return {event.step: event.value for event in events.Scalars(tag)}


def texts(events: event_accumulator.EventAccumulator, tag: str) -> dict[int, str]:
    """The strings logged with ``SummaryWriter.add_text(tag, ...)``, by step; empty when the tag was never logged."""
    text_tag = f"{tag}/text_summary"
    if text_tag not in events.Tags()["tensors"]:
        return {}
    return {event.step: event.tensor_proto.string_val[0].decode() for event in events.Tensors(text_tag)}
