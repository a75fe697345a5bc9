"""Train the tiny LM under strategy="ddp" on 2 CPU processes and write each rank's per-batch costs as JSON.

Run by ``test_telemetry_costs.py`` in a subprocess, once without and once with the three monitors and the sentinel::

    python ddp_monitor_costs.py --out DIR [--monitors]

with the repository root on ``PYTHONPATH`` (``tests/ddp_scripts/launch.py``'s ``clean_environment`` puts it there).

Every rank writes ``DIR/rank<global rank>.json``: for each batch the host syncs, the dispatched ops and the
collectives (``c10d`` ops) counted by :mod:`lightning_mp.bench.counting`.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_mp import MixedPrecision
from lightning_mp.callbacks import GradientHealthMonitor, LayerDtypeMonitor, LossScaleMonitor, PrecisionSentinel
from tests.helpers import BatchCostRecorder, TinyLanguageModel, make_trainer

LOG_EVERY = 3
MAX_STEPS = 6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--monitors", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    recorder = BatchCostRecorder()
    monitors = [
        LossScaleMonitor(),
        GradientHealthMonitor(),
        LayerDtypeMonitor(every_n_steps=LOG_EVERY),
        PrecisionSentinel(every_n_steps=LOG_EVERY),
    ]
    trainer = make_trainer(
        MixedPrecision("16-mixed"),
        devices=2,
        strategy="ddp",
        max_steps=MAX_STEPS,
        log_every_n_steps=LOG_EVERY,
        logger=TensorBoardLogger(args.out, name="tb"),
        callbacks=[recorder.opener(), *(monitors if args.monitors else []), recorder.closer()],
    )
    trainer.fit(TinyLanguageModel(optimizer="sgd"))
    batches = [
        {
            "syncs": counts.syncs,
            "ops": counts.ops,
            "collectives": sum(n for name, n in counts.ops_by_name.items() if name.startswith("c10d")),
            "sync_ops": counts.sync_ops,
        }
        for counts in recorder.per_batch
    ]
    (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(batches))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # Tear gloo down before the interpreter exits: doing it at exit can abort a successful run.
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
