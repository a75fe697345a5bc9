"""scale_per_optimizer: a GAN whose discriminator overflows backs off and skips only its own scale and steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import LossScaleMonitor, MixedPrecision
from tests.helpers import make_trainer, read_events, scalars

PLANTED = (1, 3)
"""The steps whose discriminator gradient gets an inf."""


def data() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(64, 8, generator=torch.Generator().manual_seed(0))), batch_size=8)


class Gan(L.LightningModule):
    """A generator and a discriminator in manual optimization; the discriminator's gradient overflows at PLANTED.

    The discriminator's backward names its optimizer; the generator's relies on ``toggle_optimizer``.
    """

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.automatic_optimization = False
        self.discriminator_weights: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real = batch[0]
        opt_g, opt_d = self.optimizers()
        fake = self.generator(torch.randn(real.shape[0], 4))
        step = self.trainer.global_step // 2
        real_score = self.discriminator(real).float()
        fake_score = self.discriminator(fake.detach()).float()
        loss_d = nn.functional.softplus(-real_score).mean() + nn.functional.softplus(fake_score).mean()
        self.manual_backward(loss_d, for_optimizer=opt_d)
        if step in PLANTED:
            self.discriminator[0].weight.grad[0, 0] = float("inf")
        self.discriminator_weights.append(self.discriminator[0].weight.detach().clone())
        opt_d.step()
        opt_d.zero_grad()
        self.toggle_optimizer(opt_g)
        loss_g = nn.functional.softplus(-self.discriminator(fake).float()).mean()
        self.manual_backward(loss_g)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)

    def configure_optimizers(self) -> Any:
        return (
            torch.optim.Adam(self.generator.parameters(), lr=1e-3),
            torch.optim.Adam(self.discriminator.parameters(), lr=1e-3),
        )


def _plugin(**kwargs: Any) -> MixedPrecision:
    return MixedPrecision("16-mixed", scale_per_optimizer=True, init_scale=2.0**8, growth_interval=2, **kwargs)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_each_optimizer_has_its_own_scale_and_only_the_overflowing_one_skips_and_backs_off(
    tmp_path: Path, opt_level: str
) -> None:
    """The discriminator's two overflows skip two of its steps and halve its scale twice; the generator steps every
    time and its scale grows undisturbed; both scales are logged under their own tag."""
    model = Gan()
    plugin = _plugin(opt_level=opt_level)
    logger = TensorBoardLogger(tmp_path, name="", version="")
    trainer = make_trainer(plugin, max_steps=12, logger=logger, log_every_n_steps=1, callbacks=[LossScaleMonitor()])
    trainer.fit(model, data())
    generator_scaler, discriminator_scaler = plugin.scalers
    assert generator_scaler.skipped_steps == 0 and generator_scaler.optimizer_steps == 6
    assert discriminator_scaler.skipped_steps == len(PLANTED) and discriminator_scaler.scale_backoffs == len(PLANTED)
    # Six clean iterations with growth_interval=2 grow the generator's scale three times: 256 -> 2048.
    assert generator_scaler.get_scale() == 2.0**11
    assert discriminator_scaler.get_scale() < generator_scaler.get_scale()
    stats = plugin.stats
    assert stats.loss_scales == (generator_scaler.get_scale(), discriminator_scaler.get_scale())
    assert (stats.optimizer_steps, stats.skipped_steps) == (12, len(PLANTED))
    # A skipped discriminator step left its weights as they were.
    weights = model.discriminator_weights
    for step in PLANTED:
        assert torch.equal(weights[step], weights[step + 1])
    events = read_events(tmp_path)
    logged_generator = scalars(events, "precision/loss_scale/optimizer_0")
    logged_discriminator = scalars(events, "precision/loss_scale/optimizer_1")
    assert logged_generator[max(logged_generator)] == generator_scaler.get_scale()
    assert logged_discriminator[max(logged_discriminator)] == discriminator_scaler.get_scale()


def test_a_resumed_run_continues_every_scale_exactly(tmp_path: Path) -> None:
    """Each optimizer's scale, trackers and counters ride in the checkpoint: a resumed run ends where one run does."""
    straight = _plugin()
    make_trainer(straight, max_steps=12).fit(Gan(), data())
    first = _plugin()
    checkpoints = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    make_trainer(first, max_steps=6, callbacks=[checkpoints], enable_checkpointing=True).fit(Gan(), data())
    resumed = _plugin()
    make_trainer(resumed, max_steps=12).fit(Gan(), data(), ckpt_path=tmp_path / "last.ckpt")
    assert [s.state_dict() for s in resumed.scalers] == [s.state_dict() for s in straight.scalers]
    assert resumed.stats == straight.stats


def test_a_manual_backward_that_names_no_optimizer_is_refused() -> None:
    """With two optimizers and nothing toggled, a backward cannot know whose scale to use: the error says how."""

    class Unnamed(Gan):
        def training_step(self, batch: Any, batch_idx: int) -> None:
            self.manual_backward(self.discriminator(batch[0]).float().mean())

    with pytest.raises(ValueError, match=r"for_optimizer=opt.*toggle_optimizer"):
        make_trainer(_plugin(), max_steps=1).fit(Unnamed(), data())


def test_fabric_scales_each_loss_by_the_optimizer_it_names() -> None:
    """Under Fabric each backward names its optimizer; a planted overflow skips and backs off only that one."""
    plugin = _plugin()
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    first, second = nn.Linear(8, 8), nn.Linear(8, 1)
    first, opt_first = fabric.setup(first, torch.optim.SGD(first.parameters(), lr=0.1))
    second, opt_second = fabric.setup(second, torch.optim.SGD(second.parameters(), lr=0.1))
    for step in range(4):
        x = torch.randn(4, 8)
        fabric.backward(first(x).float().pow(2).mean(), for_optimizer=opt_first)
        fabric.backward(second(x).float().pow(2).mean() * (1e8 if step == 1 else 1.0), for_optimizer=opt_second)
        opt_first.step()
        opt_second.step()
        opt_first.zero_grad()
        opt_second.zero_grad()
    with pytest.raises(ValueError, match=r"fabric.backward\(loss, for_optimizer=optimizer\)"):
        fabric.backward(first(torch.randn(4, 8)).float().mean())
    first_scaler, second_scaler = plugin.scalers
    assert (first_scaler.skipped_steps, second_scaler.skipped_steps) == (0, 1)
    assert second_scaler.get_scale() < first_scaler.get_scale()
    plugin.teardown()


def test_one_scale_is_the_default_and_for_optimizer_changes_nothing_there() -> None:
    """Without the setting one scale serves every optimizer, as torch's GradScaler; naming an optimizer is allowed."""
    plugin = MixedPrecision("16-mixed", init_scale=2.0**8)
    make_trainer(plugin, max_steps=4).fit(Gan(), data())
    assert len(plugin.scalers) == 1 and plugin.stats.loss_scales == ()


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [({"loss_scale": 128.0}, "loss_scale=128.0"), ({"scaler": torch.amp.GradScaler("cpu")}, "scaler=...")],
)
def test_a_scale_per_optimizer_with_a_fixed_or_given_scaler_is_refused(kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=rf"scale_per_optimizer=True, {named}\) is not allowed"):
        MixedPrecision("16-mixed", scale_per_optimizer=True, **kwargs)
