"""What O2's user-path tests share: a tiny 3-layer MLP regressor, its batches, and comparisons of trained weights."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecision
from tests.helpers import make_trainer

BATCHES = 8

TOLERANCE = {"bf16-mixed": 4e-2, "16-mixed": 1e-3}
"""The largest relative error of trained weights against fp32 allowed at O2: O1 on the same callback runs measures at
most 2.2e-2 in bf16 and 3e-4 in fp16 (O2 measures the same)."""


def batches(count: int = BATCHES) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(count * 8, 8, generator=generator)
    target = features @ torch.randn(8, 2, generator=generator)
    return DataLoader(TensorDataset(features, target), batch_size=8)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))


def plugin(precision: str, opt_level: str = "O2", **kwargs: Any) -> MixedPrecision | None:
    """The plugin for a run; None for the fp32 reference, which runs with Lightning's own fp32."""
    if precision == "32-true":
        return None
    if precision == "16-mixed":
        kwargs.setdefault("init_scale", 2.0**10)  # no overflow of the scale itself: the planted infs alone skip
    return MixedPrecision(precision, opt_level=opt_level, **kwargs)  # type: ignore[arg-type]


def weights(model: nn.Module) -> dict[str, Tensor]:
    return {name: value.detach().float().clone() for name, value in model.state_dict().items()}


def largest_relative_error(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> float:
    """The largest ``|actual - expected| / |expected|`` over the tensors, each measured by its norm."""
    return max(float((actual[name] - value).norm() / value.norm()) for name, value in expected.items())


def assert_same(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=0, atol=0, msg=name)


def holds_each_tensor_once(optimizer: torch.optim.Optimizer) -> bool:
    held = [id(p) for group in optimizer.param_groups for p in group["params"]]
    return len(held) == len(set(held))


class Regressor(L.LightningModule):
    """The 3-layer MLP with SGD (momentum 0.9), trained on a seeded regression problem."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.net = mlp()
        self.lr = lr

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def loss(self, batch: Any) -> Tensor:
        features, target = batch
        return F.mse_loss(self(features).float(), target)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return batches()


def fit_weights(model: L.LightningModule, precision: str, opt_level: str = "O2", **kwargs: Any) -> dict[str, Tensor]:
    trainer = make_trainer(plugin(precision, opt_level), max_steps=-1, max_epochs=1, **kwargs)
    trainer.fit(model)
    return weights(model)
