"""The lean tests' shared pieces: a tiny classifier with a norm, its data, readers of the optimizer's state, and the
Fabric run lean-exact is compared with O2 on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecision
from lightning_mp.stochastic_rounding import COMPENSATION_KEY, STATE_KEY

ELEMENTWISE_STATES = ("exp_avg", "exp_avg_sq", "momentum_buffer", COMPENSATION_KEY)


class LeanNet(LightningModule):
    """Linear, LayerNorm, ReLU and a head, with a per-step scheduler; optionally an inf gradient at chosen steps."""

    def __init__(self, optimizer: str = "adamw", norm: bool = True, inject_at: tuple[int, ...] = ()) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32) if norm else nn.Identity(), nn.ReLU())
        self.head = nn.Linear(32, 4)
        self.optimizer_name = optimizer
        self.inject_at = set(inject_at)
        self.losses: list[float] = []

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        features, target = batch
        loss = F.cross_entropy(self(features).float(), target)
        self.losses.append(loss.item())
        return loss

    def on_after_backward(self) -> None:
        if self.global_step in self.inject_at:
            self.body[0].weight.grad[0, 0] = float("inf")

    def configure_optimizers(self) -> Any:
        optimizers = {
            "adamw": lambda: torch.optim.AdamW(self.parameters(), lr=3e-2),
            "adamw-fused": lambda: torch.optim.AdamW(self.parameters(), lr=3e-2, fused=True),
            "adam": lambda: torch.optim.Adam(self.parameters(), lr=3e-2, weight_decay=1e-3),
            "sgd": lambda: torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, nesterov=True),
            "rmsprop": lambda: torch.optim.RMSprop(self.parameters(), lr=1e-2),
        }
        optimizer = optimizers[self.optimizer_name]()
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.97**step)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def classification_loader(batches: int = 4) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(8 * batches, 8, generator=generator)
    target = (features[:, :4].argmax(dim=1)).long()
    return DataLoader(TensorDataset(features, target), batch_size=8, shuffle=False)


def optimizer_tensors(trainer: Trainer) -> dict[str, Tensor]:
    optimizer = trainer.optimizers[0]
    state = optimizer.state_dict()
    tensors = {
        f"{index}.{key}": value
        for index, entry in state["state"].items()
        for key, value in entry.items()
        if isinstance(value, Tensor)
    }
    tensors["generator"] = state[STATE_KEY]["generators"]["cpu"]
    return tensors


class RecordStep(Callback):
    """Keep copies of the weights and the optimizer state around one chosen batch."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.before: dict[str, Tensor] = {}
        self.after: dict[str, Tensor] = {}

    def _snapshot(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Tensor]:
        weights = {name: value.clone() for name, value in pl_module.state_dict().items()}
        state = trainer.optimizers[0].state_dict()
        weights.update({f"{i}.{k}": v.clone() for i, s in state["state"].items() for k, v in s.items()})
        return weights

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.batch:
            self.before = self._snapshot(trainer, pl_module)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.batch:
            self.after = self._snapshot(trainer, pl_module)


def persistent_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of weights, gradients and elementwise optimizer states."""
    total = 0
    for parameter in model.parameters():
        total += parameter.nbytes + (parameter.grad.nbytes if parameter.grad is not None else 0)
        total += sum(value.nbytes for key, value in optimizer.state[parameter].items() if key in ELEMENTWISE_STATES)
    return total


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw-foreach": lambda params: torch.optim.AdamW(params, lr=1e-2, foreach=True),
    "adamw-single-tensor": lambda params: torch.optim.AdamW(params, lr=1e-2, foreach=False),
    "adamw-fused": lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True),
    "adam-amsgrad": lambda params: torch.optim.Adam(params, lr=1e-2, amsgrad=True, weight_decay=1e-3),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05),
    "sgd-nesterov": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True),
    "sgd-fused": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, fused=True),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.05),
}
"""Each optimizer form lean-exact must match O2 with, bit for bit."""

CHUNK_NUMEL = 600
"""A ``master_chunk_numel`` that cuts :func:`fabric_run`'s model into several chunks, one weight (1024 elements)
larger than a chunk."""

AfterStep = Callable[[], Any]


def fabric_run(
    opt_level: str,
    optimizer: str | Callable[[Any], torch.optim.Optimizer],
    steps: int = 12,
    accumulate: int = 2,
    master_chunk_numel: int | None = None,
    prepare: Callable[[torch.optim.Optimizer], list[AfterStep]] | None = None,
    accelerator: str = "cpu",
) -> dict[str, Any]:
    """Fabric training with accumulation and clipping; a NaN gradient planted at step 5, which the plugin skips.

    ``prepare`` gets the optimizer before the first step (to register hooks, build a scheduler) and returns what to
    call after each step. The batches are drawn on the CPU and moved to ``accelerator``'s device.
    """
    chunking = {} if master_chunk_numel is None else {"master_chunk_numel": master_chunk_numel}
    plugin = MixedPrecision("bf16-mixed", opt_level=opt_level, **chunking)
    fabric = L.Fabric(accelerator=accelerator, devices=1, plugins=[plugin])
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )
    build = OPTIMIZERS[optimizer] if isinstance(optimizer, str) else optimizer
    module, opt = fabric.setup(model, build(model.parameters()))
    after_step = [] if prepare is None else prepare(opt.optimizer)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        for micro in range(accumulate):
            features, target = torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator)
            features, target = fabric.to_device((features, target))
            with fabric.no_backward_sync(module, enabled=micro < accumulate - 1):
                loss = F.cross_entropy(module(features).float(), target) / accumulate
                fabric.backward(loss)
            losses.append(loss.detach())
        if step == 5:
            model[3].weight.grad[0, 0] = float("nan")
        fabric.clip_gradients(module, opt, max_norm=0.5)
        opt.step()
        for call in after_step:
            call()
        opt.zero_grad()
    result = {
        "losses": torch.stack(losses),
        "weights": {name: value.clone() for name, value in module.state_dict().items()},
        "bf16": [p.detach().clone() for p in model.parameters()],
        "state": opt.state_dict()["state"],
        "skipped": plugin.stats.skipped_steps,
    }
    plugin.teardown()
    return result


def assert_same_run(run: dict[str, Any], reference: dict[str, Any]) -> None:
    """Two :func:`fabric_run` results agree bit for bit: losses, fp32 and bf16 weights, optimizer states, skips."""
    assert run["skipped"] == reference["skipped"]
    assert torch.equal(run["losses"], reference["losses"])
    for name, value in reference["weights"].items():
        assert run["weights"][name].dtype == value.dtype == torch.float32, name
        assert torch.equal(run["weights"][name], value), name
    for a, b in zip(run["bf16"], reference["bf16"], strict=True):
        assert torch.equal(a, b)
    assert run["state"].keys() == reference["state"].keys()
    for index, entries in reference["state"].items():
        assert entries.keys() == run["state"][index].keys(), index
        for key, value in entries.items():
            other = run["state"][index][key]
            assert torch.equal(other, value) if isinstance(value, Tensor) else other == value, (index, key)
