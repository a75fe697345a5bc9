"""The sharding-aware inf check and norms (:mod:`lightning_mp.scaling.sharded`), alone and on 2 gloo processes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lightning_mp.scaling.sharded import (
    agree_on_found_inf,
    check_local_shards,
    global_squared_norms,
    local_gradients,
)
from tests.ddp_scripts.launch import free_port, reports, run

SHARDED_CHECK_SCRIPT = Path(__file__).parents[1] / "ddp_scripts" / "sharded_check.py"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_an_empty_gradient_is_skipped_and_an_inf_beside_it_is_found(dtype):
    """A rank's empty shard does not crash the check (torch's inf-norm refuses it), and an inf beside it is found."""
    empty, full = torch.nn.Parameter(torch.zeros(0, 3, dtype=dtype)), torch.nn.Parameter(torch.ones(2, dtype=dtype))
    empty.grad, full.grad = torch.zeros(0, 3, dtype=dtype), torch.tensor([1.0, math.inf], dtype=dtype)
    flag = torch.zeros(())
    assert local_gradients([empty, full]) == [full.grad]
    assert agree_on_found_inf(check_local_shards([empty.grad, full.grad], flag)).item() == 1.0


def test_squared_norms_in_one_process_are_the_local_ones():
    """Outside a process group the global squared norms are each tensor's own, an empty one giving 0."""
    norms = global_squared_norms([torch.tensor([3.0, 4.0]), torch.zeros(0)])
    assert norms.tolist() == [25.0, 0.0]


@pytest.mark.slow
def test_fsdp2_shards_agree_on_every_inf_and_norm(tmp_path):
    """Under FSDP2 on 2 ranks (one shard empty): an inf on either rank makes both skip, in fp32, bf16 and fp16, and
    the norms over all shards equal those of the full gradients."""
    run(["--out", str(tmp_path), "--port", str(free_port())], timeout=60, script=SHARDED_CHECK_SCRIPT)
    ranks = reports(tmp_path, tag="sharded_")
    assert all(rank["sharded"] for rank in ranks)
    for dtype in ("float32", "bfloat16", "float16"):
        zero, one = (rank["dtypes"][dtype] for rank in ranks)
        assert (zero["bias_shard_numel"], one["bias_shard_numel"]) == (1, 0)
        assert zero["clean"] == one["clean"] == zero["unscaled"] == one["unscaled"] == 0.0
        assert zero["unscaled_exactly"] and one["unscaled_exactly"]
        assert (zero["inf_local"], one["inf_local"]) == (0.0, 1.0), "the inf exists in rank 1's shard only"
        assert zero["inf_on_rank_1"] == one["inf_on_rank_1"] == 1.0
        assert zero["nan_on_rank_0"] == one["nan_on_rank_0"] == 1.0
        assert zero["norms"] == one["norms"]
        assert zero["norms"] == pytest.approx(zero["full_norms"], rel=1e-6)
