"""The FP8 mode under real DDP on the CPU (gloo, 2 processes): ranks agree, and a fallback asked by one rank is taken by
both."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torchao")

from tests.ddp_scripts.launch import reports, run

SCRIPT = Path(__file__).parents[1] / "ddp_scripts" / "fp8_train.py"


@pytest.mark.slow
def test_ddp_fp8_ranks_agree_and_fall_back_together(tmp_path):
    """Under DDP every rank trains the same FP8 layers to the same weights, and a fallback only rank 1 asks for
    happens on both ranks at the same step, with rank 1's reason where it asked."""
    run(["--out", str(tmp_path), "--max-steps", "6", "--fallback-at", "3"], timeout=240, script=SCRIPT)
    ranks = reports(tmp_path)
    assert [rank["rank"] for rank in ranks] == [0, 1] and ranks[0]["world_size"] == 2
    for rank in ranks:
        assert rank["layers"] == [["net.2", "net.4"]] * 3 + [["net.4"]] * 3
    assert ranks[0]["fell"] == {"net.2": "another rank asked for it"}
    assert ranks[1]["fell"] == {"net.2": "rank 1's underflow share 0.4 > 0.1"}
    assert ranks[0]["fell_back"].keys() == ranks[1]["fell_back"].keys() == {"net.2"}
    per_rank = ranks[0]["checksums"]
    assert per_rank == ranks[1]["checksums"] and per_rank[0] == per_rank[1], "the parameters differ across ranks"
    assert len(set(per_rank[0])) == 6, "some step left the parameters unchanged"
