"""Accuracy parity: O1 and O2 reach O0's validation loss on the package's reference task, in bf16 and in fp16.

The task is :mod:`lightning_mp.tasks` (a tiny transformer learning a seeded Markov chain: next-token classification),
scaled down so that half precision, slow on CPUs without AVX512-BF16, stays quick. Validation loss and top-1 accuracy
are computed with torchmetrics. The test is a short run with a loose bound; the longer run (600 steps) is what
``python docs/generate.py performance`` records for the performance page, and this file runs it as a script too::

    python tests/test_parity.py --steps 600
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor
from torch.nn import functional as F
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from lightning_mp import MixedPrecision
from lightning_mp.tasks import MarkovTextDataModule, TinyTransformerLM
from tests.helpers import make_trainer

# Slow: trains the reference task at every opt level: the fast loop leaves the module out.
pytestmark = pytest.mark.slow

VOCAB = 32
CONFIGS = [("32-true", "O0"), ("bf16-mixed", "O1"), ("bf16-mixed", "O2"), ("16-mixed", "O1"), ("16-mixed", "O2")]


class ParityLM(TinyTransformerLM):
    """The reference language model, validated with torchmetrics: token-weighted mean loss and top-1 accuracy."""

    def __init__(self, **kwargs: int | float) -> None:
        super().__init__(**kwargs)
        self.val_loss = MeanMetric()
        self.val_accuracy = MulticlassAccuracy(num_classes=self.hparams.vocab_size, average="micro")

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        inputs, targets = batch
        logits = self(inputs).float().reshape(-1, self.hparams.vocab_size)
        self.val_loss.update(F.cross_entropy(logits, targets.reshape(-1)), weight=targets.numel())
        self.val_accuracy.update(logits.argmax(-1), targets.reshape(-1))

    def on_validation_epoch_end(self) -> None:
        self.log("val_loss", self.val_loss.compute())
        self.log("val_accuracy", self.val_accuracy.compute())
        self.val_loss.reset()
        self.val_accuracy.reset()


def train_and_validate(
    precision: str, opt_level: str, steps: int, d_model: int = 32, val_batches: int | None = 8
) -> dict[str, float]:
    """Train the reference task from seed 0 for ``steps`` steps and return the validation metrics and skips.

    ``opt_level="Lightning"`` trains under Lightning's own ``precision`` instead of :class:`MixedPrecision` (its
    ``bf16-true``, say, the baseline lean is compared with); it skips no step, and it validates its weights cast to
    fp32 under ``32-true``: under ``bf16-true`` the loss itself would be computed and averaged in bf16.
    """
    L.seed_everything(0, verbose=False)
    model = ParityLM(vocab_size=VOCAB, d_model=d_model, n_heads=2, n_layers=1, seq_len=16, lr=3e-3, warmup_steps=10)
    data = MarkovTextDataModule(seq_len=16, batch_size=8, train_sequences=steps * 8, vocab_size=VOCAB, seed=0)
    options: dict[str, Any] = {"max_steps": steps, "num_sanity_val_steps": 0, "limit_val_batches": val_batches}
    if opt_level == "Lightning":
        make_trainer(precision=precision, **options).fit(model, data)
        model.float()
        for metric in (model.val_loss, model.val_accuracy):  # torchmetrics keeps its states' dtype through .float()
            metric.set_dtype(torch.float32)
        validator = make_trainer(precision="32-true", **options)
        return {**validator.validate(model, data, verbose=False)[0], "skipped_steps": 0}
    plugin = MixedPrecision(precision, opt_level=opt_level)  # type: ignore[arg-type]
    trainer = make_trainer(plugin, **options)
    trainer.fit(model, data)
    metrics = trainer.validate(model, data, verbose=False)[0]
    return {**metrics, "skipped_steps": plugin.stats.skipped_steps}


@pytest.fixture(scope="module")
def results() -> Iterator[dict[tuple[str, str], dict[str, float]]]:
    # One thread: the runs are tiny, and on a shared two-core machine a second thread only adds contention.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield {config: train_and_validate(*config, steps=60) for config in CONFIGS}
    finally:
        torch.set_num_threads(threads)


def test_the_reference_task_learns(results: dict[tuple[str, str], dict[str, float]]) -> None:
    """The fp32 baseline goes well below chance, so the parity comparison is between models that learned."""
    assert results["32-true", "O0"]["val_loss"] < 0.7 * math.log(VOCAB)


@pytest.mark.parametrize("config", CONFIGS[1:], ids=[f"{p}-{o}" for p, o in CONFIGS[1:]])
def test_o1_and_o2_reach_the_o0_validation_loss(
    results: dict[tuple[str, str], dict[str, float]], config: tuple[str, str]
) -> None:
    """O1 and O2, in bf16 and fp16, end within 5% of O0's validation loss and accuracy, with no skipped step."""
    baseline, mixed = results["32-true", "O0"], results[config]
    assert abs(mixed["val_loss"] - baseline["val_loss"]) <= 0.05 * baseline["val_loss"]
    assert abs(mixed["val_accuracy"] - baseline["val_accuracy"]) <= 0.05
    assert mixed["skipped_steps"] == 0


def main() -> None:
    """Print the parity table for a longer run (the numbers docs/performance.md reports)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--d-model", type=int, default=32)
    arguments = parser.parse_args()
    torch.set_num_threads(1)
    rows = {config: train_and_validate(*config, arguments.steps, arguments.d_model, None) for config in CONFIGS}
    baseline = rows["32-true", "O0"]["val_loss"]
    print(f"| precision | opt level | val loss | vs O0 | top-1 accuracy | skipped steps |  ({arguments.steps} steps)")
    print("|---|---|---|---|---|---|")
    for (precision, opt_level), row in rows.items():
        change = (row["val_loss"] - baseline) / baseline
        print(
            f"| {precision} | {opt_level} | {row['val_loss']:.4f} | {change:+.2%} | {row['val_accuracy']:.2%}"
            f" | {int(row['skipped_steps'])} |"
        )


if __name__ == "__main__":
    main()
