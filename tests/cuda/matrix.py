"""The run matrix that the CUDA suite and the CPU kernel-dtype guard both drive: one tiny model, two front ends.

Every valid precision and opt level, three optimizers (fused AdamW, foreach AdamW, SGD with momentum) and the
Trainer or Fabric; each run plants an inf gradient at step :data:`INF_STEP`, which must be skipped. The same bodies
run on ``"cpu"`` (the fast loop proves the test logic) and on ``"cuda"`` (``pytest -m cuda tests/cuda``). The
matrix, the model, the optimizers and the planted inf are the GPU proof's (:mod:`lightning_mp.bench.smoke_matrix`),
so that the proof's smoke run and this suite train the same cases.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader

from lightning_mp import MixedPrecision
from lightning_mp.bench.smoke_matrix import (
    FRONT_ENDS,
    INF_STEP,
    OPTIMIZER_FAMILIES,
    PRECISION_LEVELS,
    make_network,
    make_optimizer,
    plant_inf,
)
from tests.helpers import make_trainer, regression_data

__all__ = [
    "CUDA",
    "FRONT_ENDS",
    "INF_STEP",
    "OPTIMIZERS",
    "PRECISION_LEVELS",
    "STEPS",
    "NormalizedRegressor",
    "assert_trained_and_skipped",
    "make_network",
    "make_optimizer",
    "make_plugin",
    "on_device",
    "plant_inf",
    "train",
    "train_with_fabric",
    "train_with_trainer",
]

OPTIMIZERS = OPTIMIZER_FAMILIES
STEPS = 5

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is False")


def on_device(device: str, *marks: Any) -> Any:
    """A ``device`` parameter: ``"cuda"`` carries the ``cuda`` marker and skips without a GPU; CPU gets ``marks``."""
    if device == "cuda":
        return pytest.param("cuda", marks=[pytest.mark.cuda, CUDA], id="cuda")
    return pytest.param("cpu", marks=list(marks), id="cpu")


class NormalizedRegressor(L.LightningModule):
    """:func:`make_network` as a LightningModule with one of :data:`OPTIMIZERS`, planting an inf at ``inf_step``."""

    def __init__(self, optimizer: str, inf_step: int | None = INF_STEP) -> None:
        super().__init__()
        self.network = make_network()
        self.optimizer_name = optimizer
        self.inf_step = inf_step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def on_after_backward(self) -> None:
        if self.global_step == self.inf_step:
            plant_inf(self.network)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.optimizer_name, self.parameters())


def make_plugin(precision: str, opt_level: str, **kwargs: Any) -> MixedPrecision:
    """The plugin under test; fp16 starts at a scale the tiny model never overflows, so only the planted step skips."""
    if precision == "16-mixed" and "scaler" not in kwargs:
        kwargs.setdefault("init_scale", 2.0**8)
    return MixedPrecision(precision, opt_level=opt_level, **kwargs)  # type: ignore[arg-type]


def train_with_trainer(
    device: str,
    precision: str,
    opt_level: str,
    optimizer: str,
    compile_backend: str | None = None,
    plugin: MixedPrecision | None = None,
    **trainer: Any,
) -> tuple[nn.Module, MixedPrecision]:
    """Fit :class:`NormalizedRegressor` for :data:`STEPS` steps on ``device``; the trained network and the plugin.

    ``plugin`` replaces the one built from ``precision`` and ``opt_level``.
    """
    plugin = plugin or make_plugin(precision, opt_level)
    model = NormalizedRegressor(optimizer)
    fitted = torch.compile(model, backend=compile_backend) if compile_backend else model
    options: dict[str, Any] = {"accelerator": device, "max_steps": STEPS}
    options.update(trainer)
    make_trainer(plugin, **options).fit(fitted, DataLoader(regression_data(), batch_size=8))
    return model.network, plugin


def train_with_fabric(
    device: str,
    precision: str,
    opt_level: str,
    optimizer: str,
    compile_backend: str | None = None,
    plugin: MixedPrecision | None = None,
) -> tuple[nn.Module, MixedPrecision]:
    """The same run under ``Fabric(accelerator=device)``, the plugin given no device; the network and the plugin."""
    plugin = plugin or make_plugin(precision, opt_level)
    fabric = Fabric(accelerator=device, devices=1, plugins=[plugin])
    network = make_network()
    module = torch.compile(network, backend=compile_backend) if compile_backend else network
    model, opt = fabric.setup(module, make_optimizer(optimizer, network.parameters()))
    for step, (x, y) in zip(range(STEPS), DataLoader(regression_data(), batch_size=8), strict=False):
        x, y = fabric.to_device((x, y))
        fabric.backward(nn.functional.mse_loss(model(x).float(), y))
        if step == INF_STEP:
            plant_inf(network)
        opt.step()
        opt.zero_grad()
    plugin.teardown()
    return network, plugin


def train(front_end: str, *args: Any, **kwargs: Any) -> tuple[nn.Module, MixedPrecision]:
    """:func:`train_with_trainer` or :func:`train_with_fabric`."""
    return (train_with_trainer if front_end == "trainer" else train_with_fabric)(*args, **kwargs)


def assert_trained_and_skipped(network: nn.Module, plugin: MixedPrecision) -> None:
    """Every weight and running statistic finite; the planted step, and no other, skipped."""
    for name, tensor in [*network.named_parameters(), *network.named_buffers()]:
        assert torch.isfinite(tensor.float()).all(), f"{name} is not finite"
    # The state dict waits for the last iteration's flag, which on a GPU the host reads one iteration late.
    counters = plugin.state_dict()["scaler"]["counters"]
    assert (counters["optimizer_steps"], counters["skipped_steps"]) == (STEPS, 1)
