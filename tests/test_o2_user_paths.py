"""O2 on the paths users take with Lightning's documented recipes: discarding a backward's gradients (every kind of
``zero_grad``), callbacks that match the optimizer's parameters to the model's, and tied weights with ``keep_fp32`` on
one side. Each run is a real Trainer or Fabric on a tiny 3-layer MLP, compared with the same recipe in fp32."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    EMAWeightAveraging,
    LearningRateMonitor,
    ModelSummary,
    StochasticWeightAveraging,
)
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecision
from tests.helpers import make_trainer

PRECISIONS = ["bf16-mixed", "16-mixed"]
BATCHES = 8


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


# ------------------------------------------------------------------------------------------------ discarded gradients


class StepsEveryOtherBatch(Regressor):
    """Lightning's "step every N batches" recipe: the other batches run the closure (training_step, zero_grad,
    backward) alone, so their gradients are discarded by the next closure's zero_grad. ``inf_at`` plants an inf in
    the loss of those batches."""

    def __init__(self, inf_at: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.inf_at = inf_at

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        return loss * float("inf") if batch_idx in self.inf_at else loss

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        if batch_idx % 2 == 1:
            optimizer.step(closure=optimizer_closure)
        else:
            optimizer_closure()


def fit_weights(model: L.LightningModule, precision: str, opt_level: str = "O2", **kwargs: Any) -> dict[str, Tensor]:
    trainer = make_trainer(plugin(precision, opt_level), max_steps=-1, max_epochs=1, **kwargs)
    trainer.fit(model)
    return weights(model)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_stepping_every_other_batch_trains_like_fp32_within_o1s_error(precision: str) -> None:
    """Lightning's "step every N batches" recipe at O2 steps with the stepping batch's gradient only, as in fp32: the
    weights stay as close to fp32's as O1's do."""
    fp32 = fit_weights(StepsEveryOtherBatch(), "32-true")
    o1 = fit_weights(StepsEveryOtherBatch(), precision, "O1")
    o2 = fit_weights(StepsEveryOtherBatch(), precision, "O2")
    assert largest_relative_error(o2, fp32) <= 2 * largest_relative_error(o1, fp32) + 1e-6


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_an_inf_in_a_discarded_backward_skips_no_step(precision: str) -> None:
    """An inf in a backward whose gradients the next closure's zero_grad discards skips no step, as in fp32 and O1."""
    model = StepsEveryOtherBatch(inf_at=(2, 4))
    trainer = make_trainer(plugin(precision), max_steps=-1, max_epochs=1)
    trainer.fit(model)
    assert trainer.precision_plugin.stats.skipped_steps == 0  # type: ignore[attr-defined]
    assert_same(weights(model), fit_weights(StepsEveryOtherBatch(), precision))


def discard_by(how: str, model: nn.Module, optimizer: Any, features: Tensor) -> None:
    """Discard the gradients of the backwards so far, as a user would.

    ``model.zero_grad()`` comes after a forward without gradients (a metric computed between the backwards), after
    which O2's model shows its fp32 masters rather than the half weights that hold the gradients.
    """
    if how == "optimizer.zero_grad()":
        optimizer.zero_grad()
    elif how == "optimizer.zero_grad(set_to_none=False)":
        optimizer.zero_grad(set_to_none=False)
    else:
        with torch.no_grad():
            model(features)
        model.zero_grad()


DISCARDS = ["optimizer.zero_grad()", "optimizer.zero_grad(set_to_none=False)", "model.zero_grad()"]


class DiscardsAFirstBackward(Regressor):
    """Manual optimization: ``manual_backward(first); <discard>; manual_backward(second); opt.step()``. The first
    loss is another batch's, a hundred times larger (or inf with ``inf_first``); ``discard=None`` leaves it out."""

    def __init__(self, discard: str | None, inf_first: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.discard = discard
        self.inf_first = inf_first

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        if self.discard is not None:
            features, target = batch
            first = 100 * F.mse_loss(self(features.flip(0)).float(), target)
            self.manual_backward(first * float("inf") if self.inf_first else first)
            discard_by(self.discard, self, optimizer, features)
        self.manual_backward(self.loss(batch))
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("how", DISCARDS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_manual_optimization_steps_with_the_gradient_of_the_backward_after_a_discard(precision: str, how: str) -> None:
    """``manual_backward(l1); discard; manual_backward(l2); opt.step()`` steps exactly as ``manual_backward(l2)`` alone
    does: the discarded gradient reaches no weight."""
    expected = fit_weights(DiscardsAFirstBackward(None), precision)
    assert_same(fit_weights(DiscardsAFirstBackward(how), precision), expected)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_manual_optimization_skips_no_step_for_an_inf_in_a_discarded_backward(precision: str) -> None:
    """An inf in a backward that ``optimizer.zero_grad()`` discards skips no step and reaches no weight."""
    model = DiscardsAFirstBackward("optimizer.zero_grad()", inf_first=True)
    trainer = make_trainer(plugin(precision), max_steps=-1, max_epochs=1)
    trainer.fit(model)
    assert trainer.precision_plugin.stats.skipped_steps == 0  # type: ignore[attr-defined]
    assert_same(weights(model), fit_weights(DiscardsAFirstBackward(None), precision))


def fabric_weights(precision: str, discard: str | None, inf_first: bool = False) -> tuple[dict[str, Tensor], int]:
    """A Fabric loop of ``backward(first); <discard>; backward(second); step``: the weights and the skipped steps."""
    mixed = plugin(precision)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[mixed])
    net = mlp()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = fabric.setup(net, optimizer)
    for features, target in batches():
        if discard is not None:
            first = 100 * F.mse_loss(model(features.flip(0)).float(), target)
            fabric.backward(first * float("inf") if inf_first else first)
            discard_by(discard, model, optimizer, features)
        fabric.backward(F.mse_loss(model(features).float(), target))
        optimizer.step()
        optimizer.zero_grad()
    assert mixed is not None
    skipped = mixed.stats.skipped_steps
    mixed.teardown()
    return weights(net), skipped


@pytest.mark.parametrize("how", DISCARDS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_fabric_steps_with_the_gradient_of_the_backward_after_a_discard(precision: str, how: str) -> None:
    """Under Fabric, a backward discarded by the wrapped optimizer's or the model's zero_grad reaches no weight."""
    expected, _ = fabric_weights(precision, None)
    actual, _ = fabric_weights(precision, how)
    assert_same(actual, expected)


def test_o2_fabric_skips_no_step_for_an_inf_in_a_discarded_backward() -> None:
    """Under Fabric, an inf in a backward that zero_grad discards skips no step."""
    actual, skipped = fabric_weights("16-mixed", "optimizer.zero_grad()", inf_first=True)
    expected, _ = fabric_weights("16-mixed", None)
    assert skipped == 0
    assert_same(actual, expected)
