"""DeepSpeedMixedPrecision on a CUDA GPU with Lightning's own DeepSpeedStrategy (no CPU shims): DeepSpeed's fp16
engine and bf16 optimizer skip the planted NaN, the plugin counts it and the learning rate is held."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy

from lightning_mp import DeepSpeedMixedPrecision
from tests.cuda.matrix import CUDA
from tests.deepspeed_helpers import deepspeed_trainer
from tests.test_deepspeed import LR, Regression, loader

pytestmark = [CUDA, pytest.mark.cuda]


@pytest.mark.parametrize(("precision", "stage"), [("16-mixed", 2), ("bf16-mixed", 2), ("bf16-mixed", 3)])
def test_deepspeed_on_a_gpu_counts_its_skips_and_holds_the_learning_rate(
    precision: str, stage: int, tmp_path: Path
) -> None:
    pytest.importorskip("deepspeed")
    plugin = DeepSpeedMixedPrecision(precision)
    trainer = deepspeed_trainer(plugin, DeepSpeedStrategy(stage=stage), accelerator="cuda", default_root_dir=tmp_path)
    trainer.fit(Regression(), loader())
    engine: Any = trainer.strategy.model
    stats = plugin.stats
    assert stats.skipped_steps == engine.skipped_steps >= 1
    applied = stats.optimizer_steps - stats.skipped_steps
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(LR * 0.5**applied)
    assert all(torch.isfinite(p).all() for p in engine.module.parameters() if p.numel())
