"""Train the FP8 tiny net under strategy="ddp" on 2 CPU processes, the outlier planted on rank 0 only, with the
FP8 monitor's fallback on, and write what each rank decided as JSON.

Run by ``test_telemetry.py`` in a subprocess (``python ddp_fp8_fallback.py --out DIR``) with the repository root on
``PYTHONPATH``. Every rank writes ``DIR/rank<global rank>.json``: the layers it returned to bf16, the type of
``net.fc2`` after training, the statistics it decided on, and the sum of ``net.fc2``'s weight (equal on both ranks
when DDP kept them in step).
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_mp.fp8.telemetry import FallbackRule, FP8Monitor
from tests.fp8.fp8_models import TinyFp8Net, back_to_linear
from tests.helpers import make_trainer

EVERY = 2


class PlantOnRankZero(L.Callback):
    """Plant the outlier on rank 0's model only: rank 1 alone would see no reason to fall back."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        pl_module.outlier = trainer.global_rank == 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    monitor = FP8Monitor(
        every_n_steps=EVERY,
        fallback=FallbackRule(max_underflow=0.001, min_sqnr_db=None, patience=2),
        fallback_fn=back_to_linear,
        log_heatmaps=False,
    )
    trainer = make_trainer(
        devices=2,
        strategy="ddp",
        max_steps=3 * EVERY,
        log_every_n_steps=EVERY,
        logger=TensorBoardLogger(args.out, name="tb"),
        callbacks=[PlantOnRankZero(), monitor],
    )
    model = TinyFp8Net("tensorwise")
    trainer.fit(model)
    result = {
        "fell_back": list(monitor.fell_back),
        "fc2_type": type(model.net.fc2).__name__,
        "fc2_weight_sum": model.net.fc2.weight.detach().double().sum().item(),
    }
    # What each rank decided on: the input underflow share per layer at each logging step.
    result["samples"] = [
        [sample.step, {layer: stats["input"]["underflow_share"] for layer, stats in sample.stats.items()}]
        for sample in monitor.samples
    ]
    (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # Tear gloo down before the interpreter exits: doing it at exit can abort a successful run.
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
