"""The Fabric tests' shared run: a tiny model, a CPU Fabric that sets it up with its optimizer, and one step."""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_mp import MixedPrecision


def make_model(seed: int = 0) -> nn.Module:
    """A seeded two-layer MLP from 8 features to 1."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def setup(plugin: MixedPrecision, model: nn.Module | None = None, optimizer: str = "sgd", **fabric_kwargs: Any):
    """A CPU Fabric with ``plugin``, and the model and its optimizer set up by it."""
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin], **fabric_kwargs)
    model = model if model is not None else make_model()
    if optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    fabric_model, fabric_optimizer = fabric.setup(model, opt)
    return fabric, fabric_model, fabric_optimizer


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded batch of 8 inputs and targets for :func:`make_model`."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(8, 8, generator=generator), torch.randn(8, 1, generator=generator)


def train_step(fabric: Fabric, model: nn.Module, optimizer: Any, seed: int, inject: bool = False) -> torch.Tensor:
    x, y = batch(seed)
    loss = nn.functional.mse_loss(model(x), y)
    fabric.backward(loss)
    if inject:
        next(model.parameters()).grad.view(-1)[0] = float("inf")
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()
