"""Shared test helpers: tiny models (half precision is slow on CPUs without AVX512) and a quiet Trainer."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

# The test models are tiny: one thread runs them faster than two, and leaves the second core to the DDP workers and
# subprocesses that some tests start.
torch.set_num_threads(1)


def make_trainer(plugin: Any = None, **kwargs: Any) -> L.Trainer:
    """A single-CPU Trainer without checkpoints, progress bar or summary, unless overridden."""
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


def regression_data(n: int = 64, features: int = 8, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=generator)
    y = x @ torch.randn(features, 1, generator=generator) + 0.1 * torch.randn(n, 1, generator=generator)
    return TensorDataset(x, y)


def loader(n: int = 64, batch_size: int = 8, seed: int = 0) -> DataLoader:
    return DataLoader(regression_data(n, seed=seed), batch_size=batch_size, shuffle=False)


class TinyRegressor(L.LightningModule):
    """Two linear layers; optional injection of an inf gradient into ``first.weight`` at chosen global steps."""

    def __init__(
        self,
        lr: float = 0.05,
        inject_at: tuple[int, ...] = (),
        optimizer: str = "sgd",
        scheduler: bool = False,
    ) -> None:
        super().__init__()
        self.first = nn.Linear(8, 16)
        self.second = nn.Linear(16, 1)
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


@pytest.fixture
def tiny_loader() -> DataLoader:
    return loader()
