"""Helpers the telemetry tests share: a tiny language model, a per-batch cost recorder and an event-file reader.

A module of its own rather than a ``conftest.py``: the tests' root ``conftest`` module name is taken, and the DDP
script imports these helpers too.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from tensorboard.backend.event_processing import event_accumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp.counting import StepCounts, count_syncs_and_ops


class TinyLanguageModel(pl.LightningModule):
    """Embedding, two small Transformer layers and a head: about 30 parameter tensors, like a real LM's layout."""

    def __init__(self, vocab: int = 32, width: int = 16, optimizer: str = "adamw") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        self.optimizer_name = optimizer

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        logits = self.head(self.body(self.embed(tokens)))
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.01)
        return torch.optim.AdamW(self.parameters(), lr=1e-3, foreach=True)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 32, (64, 8), generator=generator)
        return DataLoader(TensorDataset(tokens, tokens.roll(1, dims=1)), batch_size=4)


class BatchCostRecorder(pl.Callback):
    """Count host syncs and dispatched ops from the start to the end of every training batch.

    Put it first and last in ``callbacks`` (the same instance twice is not allowed, so pass ``opener`` and
    ``closer``): the callbacks in between, and the whole step, are inside the counted region.
    """

    def __init__(self) -> None:
        self.per_batch: list[StepCounts] = []
        self._region: contextlib.ExitStack | None = None

    def opener(self) -> pl.Callback:
        recorder = self

        class _Open(pl.Callback):
            def on_train_batch_start(self, *args: Any) -> None:
                recorder._region = contextlib.ExitStack()
                recorder.per_batch.append(recorder._region.enter_context(count_syncs_and_ops()))

        return _Open()

    def closer(self) -> pl.Callback:
        recorder = self

        class _Close(pl.Callback):
            def on_train_batch_end(self, *args: Any) -> None:
                assert recorder._region is not None
                recorder._region.close()
                recorder._region = None

        return _Close()


def read_events(log_dir: str | Path) -> event_accumulator.EventAccumulator:
    """Every scalar, tensor, histogram and image of a TensorBoard run directory."""
    accumulator = event_accumulator.EventAccumulator(
        str(log_dir),
        size_guidance={
            event_accumulator.SCALARS: 0,
            event_accumulator.TENSORS: 0,
            event_accumulator.HISTOGRAMS: 0,
            event_accumulator.IMAGES: 0,
        },
    )
    accumulator.Reload()
    return accumulator
