"""The FP8 plugin tests' tiny model and data: an MLP whose two middle linears FP8 can take, on a noisy regression."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecision

NOISE = 1.0
"""The targets' noise: the loss a perfect model reaches is NOISE**2 per output, as an LM's loss has its entropy."""


def mlp(width: int = 64) -> nn.Sequential:
    """``net.0`` (first, kept) -> ``net.2`` -> ``net.4`` (FP8) -> ``net.6`` (last, kept)."""
    return nn.Sequential(
        nn.Linear(16, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
        nn.Linear(width, 4),
    )  # fmt: skip


class LossRecorder(L.LightningModule):
    """Seeded before the subclass builds its layers, trained with AdamW at ``lr``; keeps every training loss."""

    def __init__(self, lr: float = 3e-3, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lr = lr
        self.losses: list[float] = []

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class TinyMlp(LossRecorder):
    """The MLP trained with AdamW on :func:`regression_loader`; records every training loss."""

    def __init__(self, lr: float = 3e-3, seed: int = 0) -> None:
        super().__init__(lr, seed)
        self.net = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x).float(), y)
        self.losses.append(loss.item())
        return loss


def fabric_setup(
    model: nn.Module, fp8: Any = "tensorwise", lr: float = 3e-3
) -> tuple[L.Fabric, MixedPrecision, nn.Module, Optimizer]:
    """``fabric.setup`` of ``model`` and an AdamW built before it, on one CPU with a bf16-mixed plugin of ``fp8``:
    the Fabric, the plugin, the module Fabric returned and its optimizer."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    plugin = MixedPrecision("bf16-mixed", fp8=fp8)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    wrapped, optimizer = fabric.setup(model, optimizer)
    return fabric, plugin, wrapped, optimizer


def teacher_regression_data(n: int = 9600, seed: int = 0) -> TensorDataset:
    """Targets of a fixed random teacher MLP, plus Gaussian noise of standard deviation :data:`NOISE`."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=generator)
    teacher = torch.randn(16, 4, generator=generator) / 4
    y = torch.sin(2 * x @ teacher) + NOISE * torch.randn(n, 4, generator=generator)
    return TensorDataset(x, y)


def regression_loader(n: int = 9600, batch_size: int = 32) -> DataLoader:
    return DataLoader(teacher_regression_data(n), batch_size=batch_size, shuffle=False)


def fp32_loss(model: nn.Module, n: int = 512) -> float:
    """The mean-squared error of ``model`` over the whole data set, in fp32 without autocast."""
    x, y = teacher_regression_data(n).tensors
    with torch.no_grad():
        return nn.functional.mse_loss(model(x).float(), y).item()
