"""Train the FP8 tests' MLP in FP8 under DDP and then under FSDP2, in the same 2 CPU processes; report both.

Run as a user would run a script (``strategy="ddp"`` re-launches it)::

    python fp8_fsdp2_train.py --out DIR [--recipe tensorwise] [--max-steps 4] [--float8-all-gather]

Under FSDP2 (Lightning's ``ModelParallelStrategy``) the model converts its layers with ``plugin.fp8_convert(self)``
first thing in ``configure_model``, then shards ``net.2``, ``net.4`` and itself with ``plugin.fsdp2_policy()``. Every
rank writes ``DIR/rank<rank>.json``: per strategy, the per-step losses, the FP8 layers seen at each step, and the whole
parameters at the end (gathered from the shards under FSDP2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

from lightning_mp import MixedPrecision
from lightning_mp.fp8 import FP8Settings, fp8_layer_names
from tests.ddp_scripts.launch import leave_process_group
from tests.fp8.plugin_models import TinyMlp, regression_loader
from tests.helpers import make_trainer


class ShardedMlp(TinyMlp):
    def __init__(self, plugin: MixedPrecision) -> None:
        super().__init__()
        self.plugin = plugin

    def configure_model(self) -> None:
        self.plugin.fp8_convert(self)
        for index in (2, 4):
            fully_shard(self.net[index], mp_policy=self.plugin.fsdp2_policy())
        fully_shard(self, mp_policy=self.plugin.fsdp2_policy())


class LayerTypes(L.Callback):
    def __init__(self) -> None:
        self.seen: list[list[str]] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.seen.append(fp8_layer_names(pl_module))


def fit(args: argparse.Namespace, sharded: bool) -> dict[str, Any]:
    plugin = MixedPrecision(
        "bf16-mixed", fp8=FP8Settings(recipe=args.recipe, fsdp_float8_all_gather=args.float8_all_gather and sharded)
    )
    model: TinyMlp = ShardedMlp(plugin) if sharded else TinyMlp()
    types = LayerTypes()
    strategy: Any = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if sharded else "ddp"
    trainer = make_trainer(plugin, devices=2, strategy=strategy, callbacks=[types], max_steps=args.max_steps)
    trainer.fit(model, regression_loader())
    # The FSDP2 fit runs in the processes that exist now: Lightning must not launch others.
    os.environ.setdefault("LOCAL_RANK", str(trainer.local_rank))
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {
        "rank": trainer.global_rank,
        "losses": model.losses,
        "layers": types.seen,
        "parameters": {name: tensor.float().flatten().tolist() for name, tensor in sorted(state.items())},
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--recipe", default="tensorwise")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--float8-all-gather", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    report = {"ddp": fit(args, sharded=False), "fsdp2": fit(args, sharded=True)}
    (args.out / f"rank{report['ddp']['rank']}.json").write_text(json.dumps(report))
    leave_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
