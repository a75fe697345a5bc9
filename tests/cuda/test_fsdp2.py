"""FSDP2 (Lightning's ModelParallelStrategy, ``fully_shard``) on one GPU against the same model under DDP there.

The CPU suite runs the 2-process comparisons (``tests/distributed/test_fsdp2.py``, gloo); here NCCL and CUDA's
kernels run the same model sharded over one device, where the shards are whole and FSDP2's casts, the sharded inf check
and the all-reduce of the flag all still run. Both runs use a one-process group, torn down after each fit.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from typing_extensions import override

from lightning_mp import MixedPrecision
from lightning_mp.scaling.sharded import local_shard
from tests.cuda.matrix import on_device
from tests.ddp_scripts.fsdp2_train import ShardableRegressor, StepRecorder
from tests.helpers import fit, loader

INJECT_AT = (2, 5)


class InjectingOnEveryRank(ShardableRegressor):
    """The FSDP2 test model, with the inf planted in this (only) rank's shard of ``first.weight``."""

    @override
    def on_after_backward(self) -> None:
        if self.global_step in self.inject_at:
            local_shard(self.first.weight.grad)[0, 0] = float("inf")


def fit_sharded_or_ddp(device: str, precision: str, opt_level: str, sharded: bool) -> dict[str, Any]:
    """The seeded injecting model fitted on ``device`` in a one-process group, under FSDP2 (``sharded``) or DDP,
    the group torn down after: its losses, the recorded steps and the plugin's stats."""
    torch.manual_seed(7)
    plugin = MixedPrecision(precision, opt_level=opt_level, init_scale=2.0**8)
    model = InjectingOnEveryRank(INJECT_AT, plugin if sharded else None, "sgd", 16, 0)
    recorder = StepRecorder()
    strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1) if sharded else "ddp"
    try:
        fit(model, plugin, loader(), accelerator=device, strategy=strategy, callbacks=[recorder])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return {"losses": model.losses, "steps": recorder.steps, "stats": dataclasses.asdict(plugin.stats)}


@pytest.mark.parametrize("device", [on_device("cuda")])
@pytest.mark.parametrize(("precision", "opt_level"), [(p, o) for p in ("16-mixed", "bf16-mixed") for o in ("O1", "O2")])
def test_fsdp2_on_one_gpu_trains_like_ddp(device: str, precision: str, opt_level: str) -> None:
    """Sharded with plugin.fsdp2_policy() on one GPU, the model skips the same steps with the same scales and
    counters as under DDP, and its losses stay within 1e-3."""
    sharded = fit_sharded_or_ddp(device, precision, opt_level, sharded=True)
    unsharded = fit_sharded_or_ddp(device, precision, opt_level, sharded=False)
    assert sharded["steps"] == unsharded["steps"]
    assert [step - 1 for step, _, skipped in sharded["steps"] if skipped] == list(INJECT_AT)
    assert sharded["stats"] == unsharded["stats"]
    assert sharded["losses"] == pytest.approx(unsharded["losses"], abs=1e-3)
