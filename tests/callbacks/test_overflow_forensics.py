"""Overflow forensics: a skipped step names its non-finite parameters, in automatic and manual optimization alike."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecision
from lightning_mp.callbacks import GradientHealthMonitor
from tests.helpers import BatchCostRecorder, make_trainer, read_events

INJECT_AT = (1, 3)


class ZeroGradOrderRegressor(LightningModule):
    """Manual optimization in either zero_grad order; an inf is written into ``head.weight``'s gradient at steps."""

    def __init__(self, zero_grad_first: bool, inject_at: tuple[int, ...] = INJECT_AT) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.hidden = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)
        self.zero_grad_first = zero_grad_first
        self.inject_at = inject_at
        self.batches = 0

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        optimizer = self.optimizers()
        if self.zero_grad_first:
            optimizer.zero_grad()
        features, target = batch
        self.manual_backward(nn.functional.mse_loss(self.head(torch.relu(self.hidden(features))), target))
        if batch_idx in self.inject_at:
            self.head.weight.grad[0, 0] = float("inf")
        optimizer.step()
        if not self.zero_grad_first:
            optimizer.zero_grad()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(24, 8, generator=generator), torch.randn(24, 1, generator=generator))
        return DataLoader(data, batch_size=4)


def fit_manual(tmp_path, zero_grad_first: bool, callbacks: list, name: str = "run") -> TensorBoardLogger:
    logger = TensorBoardLogger(tmp_path, name=name)
    trainer = make_trainer(
        MixedPrecision("16-mixed", init_scale=2.0**8),
        max_steps=5,
        logger=logger,
        log_every_n_steps=50,
        callbacks=callbacks,
    )
    trainer.fit(ZeroGradOrderRegressor(zero_grad_first))
    return logger


@pytest.mark.parametrize("zero_grad_first", [False, True], ids=["step-then-zero_grad", "zero_grad-first"])
def test_manual_optimization_names_the_nonfinite_parameter_in_either_zero_grad_order(tmp_path, zero_grad_first):
    """With backward, opt.step(), opt.zero_grad() (Lightning's documented order) or zero_grad first, each skip
    names head.weight in the warning and in the precision/overflow text."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logger = fit_manual(tmp_path, zero_grad_first, [GradientHealthMonitor(warn_every_n_skips=1)])
    messages = [str(w.message) for w in caught if "were not finite" in str(w.message)]
    assert len(messages) == len(INJECT_AT)
    assert all("Non-finite gradients: head.weight [1, 16]." in message for message in messages)
    entries = read_events(logger.log_dir).Tensors("precision/overflow/text_summary")
    assert len(entries) == len(INJECT_AT)
    assert all(b"`head.weight` | [1, 16]" in entry.tensor_proto.string_val[0] for entry in entries)


def test_the_nonfinite_parameters_are_read_in_one_transfer_on_a_skipped_step_only(tmp_path):
    """Naming the bad parameters adds exactly one host sync to a skipped step, whatever the parameter count, and none to
    a clean step."""
    plain, monitored = BatchCostRecorder(), BatchCostRecorder()
    fit_manual(tmp_path, False, [plain.opener(), plain.closer()], name="plain")
    fit_manual(tmp_path, False, [monitored.opener(), GradientHealthMonitor(), monitored.closer()], name="monitored")
    for batch, (before, after) in enumerate(zip(plain.per_batch, monitored.per_batch, strict=True)):
        assert after.syncs - before.syncs == int(batch in INJECT_AT), (batch, after.sync_ops)
