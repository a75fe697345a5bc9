"""Print whether this torch's FSDP2 averages gradients over gloo (``averages``) or sums them (``sums``).

torch 2.8's ``fully_shard`` reduce-scatters fp32 and bf16 gradients with ``ReduceOp.AVG``, which its gloo backend
computes as a sum (pytorch/pytorch#162338): on CPU processes every gradient comes out multiplied by the world size.
Two gloo processes shard one linear layer and compare its gradient with the mean of theirs.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def _rank(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    layer = torch.nn.Linear(4, 2, bias=False)
    torch.nn.init.ones_(layer.weight)
    fully_shard(layer, mesh=init_device_mesh("cpu", (2,)))
    layer(torch.full((1, 4), float(rank + 1))).sum().backward()
    gradient = layer.weight.grad.full_tensor()
    if rank == 0:
        # Each rank's gradient is its input, 1 and 2: their mean is 1.5, their sum 3.
        print("averages" if torch.allclose(gradient, torch.full_like(gradient, 1.5)) else "sums", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(_rank, args=(int(sys.argv[1]),), nprocs=2)
