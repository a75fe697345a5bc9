"""The model, data and plugin O2's tests share: a small classifier (Linear, LayerNorm, ReLU, Linear) that records the
dtypes its weights had in the step, its loader (:func:`net_loader`) and an O2 plugin; the tests fit them with
:func:`tests.helpers.fit`."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecision

HALF = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
PRECISIONS = ["bf16-mixed", "16-mixed"]
STEPS = 4


def net_loader(steps: int = STEPS) -> DataLoader:
    """:class:`Net`'s data: ``steps`` seeded batches of 8 features and 4 classes."""
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(steps * 8, 8, generator=generator)
    target = torch.randint(0, 4, (steps * 8,), generator=generator)
    return DataLoader(TensorDataset(features, target), batch_size=8)


class Net(L.LightningModule):
    """Linear, LayerNorm, ReLU, Linear with Adam; records the dtypes the weights had inside training_step."""

    def __init__(self, optimizer: str = "adam", inf_at: tuple[int, ...] = ()) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))
        self.optimizer = optimizer
        self.inf_at = inf_at
        self.dtypes_in_step: dict[str, torch.dtype] = {}
        self.output_dtype: torch.dtype | None = None

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.dtypes_in_step = {name: p.dtype for name, p in self.named_parameters()}
        features, target = batch
        logits = self(features)
        self.output_dtype = logits.dtype
        loss = F.cross_entropy(logits, target)
        return loss * float("inf") if batch_idx in self.inf_at else loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        features, target = batch
        self.log("val_loss", F.cross_entropy(self(features), target))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        factories = {
            "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
            "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
            "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
            "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        }
        return factories[self.optimizer](self.parameters())

    def train_dataloader(self) -> DataLoader:
        return net_loader()

    def val_dataloader(self) -> DataLoader:
        return net_loader(1)


def o2(precision: str = "bf16-mixed", **kwargs: Any) -> MixedPrecision:
    if precision == "16-mixed":
        kwargs.setdefault("init_scale", 2.0**10)
    return MixedPrecision(precision, opt_level="O2", **kwargs)  # type: ignore[arg-type]


def snapshot(model: nn.Module) -> dict[str, Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


class StartWeights(L.Callback):
    """Records the model's state_dict when training starts (after setup and checkpoint restore)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.weights = snapshot(pl_module)


def converted(precision: str = "bf16-mixed") -> tuple[Net, MixedPrecision, torch.optim.Optimizer]:
    """A Net converted by an O2 plugin outside any loop, with its optimizer connected (the Trainer's order), and its
    half weights in place, as a training forward leaves them for the backward."""
    model = Net()
    plugin = o2(precision)
    plugin.setup_for_device("cpu")
    plugin.convert_module(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plugin.connect(model, [optimizer], [])
    assert list(model.parameters()) == optimizer.param_groups[0]["params"]  # setup ends showing the masters
    with plugin.forward_context():
        pass
    return model, plugin, optimizer
