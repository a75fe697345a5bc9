"""Train the FP8 tests' MLP in FP8 under ``strategy="ddp"`` on 2 CPU processes; rank 1 alone asks for a fallback.

Run as a user would run a script (``launch.py`` puts the repository root on ``PYTHONPATH``)::

    python fp8_train.py --out DIR [--recipe tensorwise] [--max-steps 6] [--fallback-at 3]

At step ``--fallback-at`` every rank calls the plugin's ``fallback_layers``, rank 1 with ``net.2`` and rank 0 with
nothing, as a telemetry callback whose statistics differ across ranks would. Every rank writes ``DIR/rank<rank>.json``:
the FP8 layers at each step, the layers that fell back with their reasons, and every rank's parameter checksums after
each step, gathered with ``all_gather_object``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from lightning_mp import MixedPrecision
from lightning_mp.fp8 import fp8_layer_names
from tests.ddp_scripts.launch import leave_process_group
from tests.fp8.plugin_models import TinyMlp, regression_loader
from tests.helpers import make_trainer


def checksum(module: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for parameter in module.parameters():
        digest.update(parameter.detach().float().numpy().tobytes())
    return digest.hexdigest()


class Report(L.Callback):
    def __init__(self, out: Path, fallback_at: int) -> None:
        self.out, self.fallback_at = out, fallback_at
        self.layers: list[list[str]] = []
        self.checksums: list[str] = []
        self.fell: dict[str, str] = {}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
        if trainer.global_step == self.fallback_at:
            requests = {"net.2": "rank 1's underflow share 0.4 > 0.1"} if trainer.global_rank == 1 else {}
            self.fell = trainer.precision_plugin.fallback_layers(pl_module, requests)
        self.layers.append(fp8_layer_names(pl_module))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.checksums.append(checksum(pl_module))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, self.checksums)
        report = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "layers": self.layers,
            "fell": self.fell,
            "fell_back": trainer.precision_plugin.fp8_fell_back,
            "checksums": everyone,
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--recipe", default="tensorwise")
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--fallback-at", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model = TinyMlp()
    plugin = MixedPrecision("bf16-mixed", fp8=args.recipe)
    report = Report(args.out, args.fallback_at)
    trainer = make_trainer(plugin, devices=2, strategy="ddp", callbacks=[report], max_steps=args.max_steps)
    # Each rank reads its own half of every batch, as a DistributedSampler would give it.
    trainer.fit(model, regression_loader())
    leave_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
