"""The monitors' logging step and logging cadence, computed from public Trainer state, are Lightning's own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader

from lightning_mp import MixedPrecision
from lightning_mp.callbacks import LossScaleMonitor
from lightning_mp.measuring.logging_steps import logging_step, only_accumulates, should_log
from tests.helpers import FEATURES, TinyRegressor, loader, make_trainer, read_events, scalars

BATCHES = 10
"""Batches per epoch: not a multiple of the accumulation used below, so an epoch's last batch steps early."""


class AgreesWithLightning(L.Callback):
    """Records, in every hook that logs, where the public computation and Lightning's private state disagree."""

    def __init__(self) -> None:
        self.disagreements: list[tuple[Any, ...]] = []
        self.checks = 0

    def _compare(self, trainer: L.Trainer, where: str, finished_batch: int | None = None) -> None:
        lightning = (
            trainer.fit_loop.epoch_loop._batches_that_stepped,
            trainer._logger_connector.should_update_logs,
        )
        ours = (logging_step(trainer, finished_batch), should_log(trainer, finished_batch))
        if finished_batch is not None:
            lightning += (trainer.fit_loop.epoch_loop._should_accumulate(),)
            ours += (only_accumulates(trainer, finished_batch),)
        if ours != lightning:
            self.disagreements.append((where, ours, lightning))
        self.checks += 1

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int):
        self._compare(trainer, f"on_train_batch_start {batch_idx}")

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self._compare(trainer, "on_before_optimizer_step")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int):
        self._compare(trainer, f"on_train_batch_end {batch_idx}", finished_batch=batch_idx)


class TwoOptimizers(L.LightningModule):
    """Manual optimization: two optimizers, both stepped on even batches only; the loss logged with self.log."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.first, self.second = nn.Linear(FEATURES, 1), nn.Linear(FEATURES, 1)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = nn.functional.mse_loss(self.first(x) + self.second(x), y)
        self.log("loss", loss)
        self.manual_backward(loss)
        for optimizer in self.optimizers():
            if batch_idx % 2 == 0:
                optimizer.step()
            optimizer.zero_grad()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(self.first.parameters(), lr=0.01), torch.optim.SGD(self.second.parameters(), lr=0.01)]


class LoggedRegressor(TinyRegressor):
    """TinyRegressor that logs its loss with self.log, and returns None (skips) on every fourth batch."""

    def __init__(self, skip_some: bool = False) -> None:
        super().__init__(lr=0.01)
        self.skip_some = skip_some

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss)
        return None if self.skip_some and batch_idx % 4 == 3 else loss


def data() -> DataLoader:
    return loader(n=4 * BATCHES, batch_size=4)


SCENARIOS = {
    "accumulate 3": ({"accumulate_grad_batches": 3, "log_every_n_steps": 2}, LoggedRegressor),
    "accumulate 4, 6 batches": ({"accumulate_grad_batches": 4, "limit_train_batches": 6}, LoggedRegressor),
    "training_step returns None": ({"log_every_n_steps": 3}, lambda: LoggedRegressor(skip_some=True)),
    "max_steps mid-epoch": ({"accumulate_grad_batches": 2, "max_steps": 7, "log_every_n_steps": 2}, LoggedRegressor),
    "manual, two optimizers": ({"log_every_n_steps": 3}, TwoOptimizers),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_logging_step_and_cadence_match_lightnings_own_in_every_hook(scenario: str) -> None:
    """The step, whether to log, and whether a batch only accumulates agree with Lightning's private state."""
    options, model = SCENARIOS[scenario]
    probe = AgreesWithLightning()
    make_trainer(MixedPrecision("bf16-mixed"), callbacks=[probe], **{"max_steps": -1, "max_epochs": 2, **options}).fit(
        model(), data()
    )
    assert probe.checks > 2 * BATCHES // 2 and probe.disagreements == []


def test_after_a_resume_in_an_epoch_the_steps_go_on_as_lightnings(tmp_path: Path) -> None:
    """Resumed mid-epoch with accumulation, every batch's step and cadence are still Lightning's."""
    options = {"accumulate_grad_batches": 3, "log_every_n_steps": 2, "default_root_dir": tmp_path}
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    make_trainer(callbacks=[checkpoints], max_steps=-1, max_epochs=1, enable_checkpointing=True, **options).fit(
        LoggedRegressor(), data()
    )
    probe = AgreesWithLightning()
    make_trainer(callbacks=[probe], max_steps=-1, max_epochs=2, **options).fit(
        LoggedRegressor(), data(), ckpt_path=str(tmp_path / "epoch=0-step=2.ckpt")
    )
    assert probe.checks > BATCHES and probe.disagreements == []


@pytest.mark.parametrize("accumulate", [1, 3])
def test_the_loss_scale_is_logged_at_the_steps_of_the_users_own_metrics(tmp_path: Path, accumulate: int) -> None:
    """LossScaleMonitor's TensorBoard steps are those self.log writes the user's loss at, with or without
    gradient accumulation: one point per optimizer step, on the same x axis."""
    logger = TensorBoardLogger(tmp_path)
    trainer = make_trainer(
        MixedPrecision("16-mixed", init_scale=2.0**8),
        callbacks=[LossScaleMonitor()],
        logger=logger,
        log_every_n_steps=1,
        max_steps=-1,
        max_epochs=2,
        accumulate_grad_batches=accumulate,
    )
    trainer.fit(LoggedRegressor(), data())
    events = read_events(logger.log_dir)
    optimizer_steps = 2 * -(-BATCHES // accumulate)
    assert (
        sorted(scalars(events, "precision/loss_scale"))
        == sorted(scalars(events, "loss"))
        == list(range(optimizer_steps))
    )


def test_under_manual_optimization_the_step_counts_batches_not_optimizer_steps(tmp_path: Path) -> None:
    """With two optimizers stepped on even batches, the loss scale is logged at those batches' steps, as self.log's
    loss is, not at twice the number of optimizer steps."""
    logger = TensorBoardLogger(tmp_path)
    trainer = make_trainer(
        MixedPrecision("16-mixed", init_scale=2.0**8),
        callbacks=[LossScaleMonitor()],
        logger=logger,
        log_every_n_steps=1,
        max_steps=-1,
        max_epochs=1,
    )
    trainer.fit(TwoOptimizers(), data())
    events = read_events(logger.log_dir)
    assert sorted(scalars(events, "loss")) == list(range(BATCHES))
    assert sorted(scalars(events, "precision/loss_scale")) == list(range(0, BATCHES, 2))
