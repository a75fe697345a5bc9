"""Check FSDP2-sharded gradients with :mod:`lightning_mp.scaling.sharded` on 2 gloo processes; write what each saw.

Run as ``python sharded_check.py --out DIR``: the script starts its two ranks itself (``torch.multiprocessing``).
The model's last layer has one output, so its bias (one element) is sharded into one element on rank 0 and an empty
shard on rank 1. For each gradient dtype (fp32, bf16, fp16) each rank runs four checks, the first three followed by
the all-reduce of the flag: clean gradients, an inf planted in rank 1's shard only, a NaN in rank 0's shard only,
and an unscale by ``1/4`` of clean gradients. It also reports the global squared norms of the gradients and those of
the full (unsharded) gradients. ``DIR/sharded_rank<rank>.json`` holds one rank's results.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import fully_shard

from lightning_mp.scaling.sharded import (
    agree_on_found_inf,
    check_local_shards,
    global_squared_norms,
    has_sharded_parameters,
    local_gradients,
    local_shard,
)
from tests.ddp_scripts.launch import leave_process_group


def _flag_after(model: nn.Module, agree: bool, inv_scale: torch.Tensor | None = None) -> float:
    flag = torch.zeros((), dtype=torch.float32)
    check_local_shards(local_gradients(model.parameters()), flag, inv_scale)
    if agree:
        agree_on_found_inf(flag)
    return flag.item()


def _rank(rank: int, out: Path, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    report: dict = {"dtypes": {}}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 1)).to(dtype)
        fully_shard(model)
        report["sharded"] = has_sharded_parameters(model)
        model(torch.randn(8, 4, dtype=dtype)).float().square().mean().backward()
        bias = model[2].bias
        result = {
            "bias_shard_numel": local_shard(bias.grad).numel(),
            "clean": _flag_after(model, agree=True),
        }
        expected = [p.grad.full_tensor().float().square().sum().item() for p in model.parameters()]
        result["norms"] = global_squared_norms([p.grad for p in model.parameters()]).tolist()
        result["full_norms"] = expected
        before = [local_shard(p.grad).clone() for p in model.parameters()]
        result["unscaled"] = _flag_after(model, agree=True, inv_scale=torch.tensor(0.25))
        result["unscaled_exactly"] = all(
            torch.equal(local_shard(p.grad), b * 0.25) for p, b in zip(model.parameters(), before, strict=True)
        )
        weight = local_shard(model[0].weight.grad)
        if rank == 1:
            weight[0, 0] = float("inf")
        result["inf_local"] = _flag_after(model, agree=False)
        result["inf_on_rank_1"] = _flag_after(model, agree=True)
        weight[0, 0] = 0.0
        if rank == 0:
            weight[0, 0] = float("nan")
        result["nan_on_rank_0"] = _flag_after(model, agree=True)
        report["dtypes"][str(dtype).removeprefix("torch.")] = result
    (out / f"sharded_rank{rank}.json").write_text(json.dumps(report))
    leave_process_group()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    mp.spawn(_rank, args=(args.out, args.port), nprocs=2)


if __name__ == "__main__":
    main(sys.argv[1:])
