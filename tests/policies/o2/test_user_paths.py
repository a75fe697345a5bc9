"""O2 on the paths users take with Lightning's documented recipes: discarding a backward's gradients (every kind of
``zero_grad``), clipping all of a model's gradients, and a GAN without ``toggle_optimizer``. Each run is a real Trainer
or Fabric on a tiny 3-layer MLP, compared with the same recipe in fp32; Lightning's callbacks are in
``test_user_paths_callbacks.py``, tied weights in ``test_user_paths_ties.py``."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_mp import MixedPrecision
from lightning_mp.bench.counting import count_syncs_and_ops
from tests.helpers import make_trainer
from tests.policies.o2.helpers import PRECISIONS
from tests.policies.o2.user_path_helpers import (
    TOLERANCE,
    Regressor,
    assert_same,
    batches,
    fit_weights,
    largest_relative_error,
    mlp,
    plugin,
    weights,
)

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
def test_o2_manual_optimization_steps_with_the_gradient_of_the_backward_after_a_discard(
    precision: str, how: str
) -> None:
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


# ------------------------------------------------------------------------------------------------ clipping and GANs


class ClipsEveryParameter(L.Callback):
    """Clips the norm of all the model's gradients before each step, as many training scripts do."""

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        torch.nn.utils.clip_grad_norm_(pl_module.parameters(), max_norm=1e6)


class HeadOnlyOptimizer(Regressor):
    """The first layer takes gradients but is in no optimizer."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.net[2:].parameters(), lr=self.lr, momentum=0.9)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_clipping_all_model_gradients_works_with_a_layer_in_no_optimizer(precision: str) -> None:
    """``clip_grad_norm_(pl_module.parameters())`` before the step sees dense fp32 gradients on every parameter,
    one that no optimizer holds included, and the run trains like fp32."""
    fp32 = HeadOnlyOptimizer()
    make_trainer(max_steps=-1, max_epochs=1, callbacks=[ClipsEveryParameter()]).fit(fp32)
    model = HeadOnlyOptimizer()
    make_trainer(plugin(precision), max_steps=-1, max_epochs=1, callbacks=[ClipsEveryParameter()]).fit(model)
    assert all(p.grad is None or (p.grad.dtype == torch.float32 and not p.grad.is_sparse) for p in model.parameters())
    assert largest_relative_error(weights(model), weights(fp32)) < TOLERANCE[precision]


class UntoggledGAN(L.LightningModule):
    """A GAN's two optimizers in manual optimization without ``toggle_optimizer``: the generator's backward also
    gives the discriminator gradients, which the discriminator's ``zero_grad`` discards before its own backward."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        features, _ = batch
        opt_g, opt_d = self.optimizers()
        fake = self.generator(features)
        g_loss = F.softplus(-self.discriminator(fake)).float().mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        real, fake = self.discriminator(features), self.discriminator(fake.detach())
        d_loss = (F.softplus(-real) + F.softplus(fake)).float().mean()
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.SGD(self.generator.parameters(), lr=0.05, momentum=0.9),
            torch.optim.SGD(self.discriminator.parameters(), lr=0.05, momentum=0.9),
        ]

    def train_dataloader(self) -> DataLoader:
        return batches()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_gan_without_toggle_optimizer_trains_like_fp32(precision: str) -> None:
    """The discriminator steps with its own loss's gradient only, as in fp32: its zero_grad discards what the
    generator's backward left on it."""
    fp32 = UntoggledGAN()
    make_trainer(max_steps=-1, max_epochs=1).fit(fp32)
    model = UntoggledGAN()
    make_trainer(plugin(precision), max_steps=-1, max_epochs=1).fit(model)
    assert largest_relative_error(weights(model), weights(fp32)) < TOLERANCE[precision]


def test_o2_bf16_sgd_with_momentum_skips_a_nonfinite_step_on_the_device_without_a_host_sync() -> None:
    """O2 in bf16 with SGD and momentum: after the first step, a steady step makes no host sync (the fp32 masters go
    to torch's fused SGD kernel, which skips on the device), and a NaN step leaves weights and momentum untouched."""
    model, mixed = mlp(), MixedPrecision("bf16-mixed", opt_level="O2")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[mixed])
    module, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    loader = list(batches(4))

    def step(features: Tensor, target: Tensor) -> None:
        fabric.backward(F.mse_loss(module(features).float(), target))
        optimizer.step()
        optimizer.zero_grad()

    step(*loader[0])  # the first step with momentum is decided on the host: its buffers do not exist yet
    with count_syncs_and_ops() as counts:
        step(*loader[1])
    assert counts.syncs == 0, counts.sync_ops
    before = weights(model)
    momentum = {id(p): optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()}
    step(loader[2][0] * float("nan"), loader[2][1])
    fabric.backward(F.mse_loss(module(loader[3][0]).float(), loader[3][1]))  # applies the pending update
    assert mixed.stats.skipped_steps == 1
    assert_same(weights(model), before)
    for parameter in model.parameters():
        assert torch.equal(optimizer.state[parameter]["momentum_buffer"], momentum[id(parameter)])
