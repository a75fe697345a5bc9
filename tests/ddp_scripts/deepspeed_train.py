"""Train with DeepSpeedMixedPrecision under DeepSpeed on 2 CPU processes; a NaN on one rank at one step.

Run as a user would run a training script (Lightning re-launches it for rank 1)::

    python deepspeed_train.py --out DIR --precision bf16-mixed|16-mixed --stage 1|2|3

Each rank writes ``DIR/rank<r>.json``: the plugin's counters, the engine's skipped steps, the learning rate, and a
checksum of its weights.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from lightning_mp import DeepSpeedMixedPrecision
from tests.ddp_scripts.launch import leave_process_group
from tests.deepspeed_helpers import CPUDeepSpeedStrategy, deepspeed_on_cpu, deepspeed_trainer
from tests.helpers import parameter_checksum
from tests.test_deepspeed import Regression, loader


class NaNOnRankOne(Regression):
    """The NaN of :class:`Regression` on rank 1 only: DeepSpeed must skip the step on both ranks."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.global_rank != 1:
            self.planted = True
        return super().training_step(batch, batch_idx)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--stage", type=int, default=2)
    args = parser.parse_args(argv)
    deepspeed_on_cpu()
    plugin = DeepSpeedMixedPrecision(args.precision)
    trainer = deepspeed_trainer(plugin, CPUDeepSpeedStrategy(stage=args.stage), devices=2)
    trainer.fit(NaNOnRankOne(), loader())
    engine = trainer.strategy.model
    report = {
        "skipped_steps": plugin.stats.skipped_steps,
        "optimizer_steps": plugin.stats.optimizer_steps,
        "engine_skipped_steps": engine.skipped_steps,
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "finite": all(bool(torch.isfinite(p).all()) for p in engine.module.parameters()),
        "checksum": parameter_checksum(engine.module),
    }
    (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))
    leave_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
