"""The FP8 tests' tiny model: three linear layers (dims divisible by 16) turned into torchao Float8Linear layers,
with an optional planted outlier, and a function that returns one of them to a plain Linear."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

OUTLIER = 1e4
"""The planted outlier: one feature of a layer's input this many times larger than it would be."""


def mlp() -> nn.Sequential:
    return nn.Sequential(
        OrderedDict(fc1=nn.Linear(16, 32), act1=nn.ReLU(), fc2=nn.Linear(32, 32), act2=nn.Tanh(), fc3=nn.Linear(32, 16))
    )


class TinyFp8Net(L.LightningModule):
    """``net.fc1 -> ReLU -> net.fc2 -> tanh -> net.fc3`` trained on a regression, its linears in FP8 under ``recipe``
    (None keeps them plain); with ``outlier``, the first feature of ``net.fc2``'s input is :data:`OUTLIER` times
    larger."""

    def __init__(self, recipe: str | None = "tensorwise", outlier: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = mlp()
        self.outlier = outlier
        if recipe is not None:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            convert_to_float8_training(self.net, config=Float8LinearConfig.from_recipe_name(recipe))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return forward_with_outlier(self.net, x, self.outlier)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return data_loader()


def forward_with_outlier(net: nn.Module, x: torch.Tensor, outlier: bool) -> torch.Tensor:
    """Run :func:`mlp`'s layers, scaling the first feature of ``fc2``'s input by :data:`OUTLIER` if ``outlier``."""
    hidden = net.act1(net.fc1(x))
    if outlier:
        hidden = torch.cat([hidden[..., :1] * OUTLIER, hidden[..., 1:]], dim=-1)
    return net.fc3(net.act2(net.fc2(hidden)))


def data_loader(batches: int = 8) -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(16 * batches, 16, generator=generator)
    return DataLoader(TensorDataset(x, torch.randn(16 * batches, 16, generator=generator)), batch_size=16)


def back_to_linear(model: nn.Module, name: str, reason: str) -> None:
    """Replace the layer ``name`` with a plain ``nn.Linear`` holding the same parameter objects."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    old = getattr(parent, child)
    new = nn.Linear(old.in_features, old.out_features, bias=old.bias is not None)
    new.weight, new.bias = old.weight, old.bias
    setattr(parent, child, new)
