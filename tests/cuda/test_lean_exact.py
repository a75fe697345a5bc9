"""lean-exact on the GPU: O2's results bit for bit with torch's CUDA optimizer kernels (fused, foreach, single-tensor).

The CPU runs the same comparison in ``tests/policies/test_lean_exact.py``; here the masters are rebuilt, stepped by
torch's CUDA kernels (the fused ones read the scaler's inf flag on the device) and packed again on the device.
"""

from __future__ import annotations

import pytest

from tests.cuda.matrix import on_device
from tests.policies.lean_helpers import CHUNK_NUMEL, assert_same_run, fabric_run


@pytest.mark.parametrize("device", [on_device("cuda")])
@pytest.mark.parametrize("optimizer", ["adamw-fused", "adamw-foreach", "adamw-single-tensor", "sgd-fused", "adagrad"])
def test_lean_exact_is_o2_bit_for_bit_on_the_gpu(device: str, optimizer: str) -> None:
    """Losses, fp32 weights, bf16 weights and optimizer states after 12 steps with accumulation, clipping and a
    planted NaN equal O2's on the same GPU, with the step cut into chunks of masters."""
    o2 = fabric_run("O2", optimizer, accelerator=device)
    exact = fabric_run("lean-exact", optimizer, master_chunk_numel=CHUNK_NUMEL, accelerator=device)
    assert exact["skipped"] == o2["skipped"] == 1
    assert_same_run(exact, o2)
