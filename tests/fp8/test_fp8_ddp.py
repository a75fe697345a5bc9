"""The FP8 mode under real DDP on the CPU (gloo, 2 processes): ranks agree, and a fallback asked by one rank is taken by
both."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_mp.fp8.convert import fp8_unavailable

if fp8_unavailable() is not None:  # torchao below its torch floor may fail to import with other errors than ImportError
    pytest.skip(f"the FP8 mode {fp8_unavailable()}", allow_module_level=True)
pytest.importorskip("torchao")

from tests.ddp_scripts.launch import reports, run

SCRIPT = Path(__file__).parents[1] / "ddp_scripts" / "fp8_train.py"
FSDP2_SCRIPT = SCRIPT.with_name("fp8_fsdp2_train.py")


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


@pytest.mark.slow
@pytest.mark.parametrize("float8_all_gather", [False, True])
def test_fsdp2_fp8_trains_like_ddp_fp8_on_every_rank(tmp_path, float8_all_gather):
    """FP8 under FSDP2 (converted before fully_shard), with or without torchao's float8 all-gather, trains the same
    FP8 layers to the same weights as under DDP, on both ranks."""
    arguments = ["--out", str(tmp_path), "--max-steps", "4"]
    run([*arguments, *(["--float8-all-gather"] if float8_all_gather else [])], timeout=300, script=FSDP2_SCRIPT)
    ranks = reports(tmp_path)
    for rank in ranks:
        assert rank["ddp"]["layers"] == rank["fsdp2"]["layers"] == [["net.2", "net.4"]] * 4
        assert rank["fsdp2"]["losses"] == pytest.approx(rank["ddp"]["losses"], rel=1e-3)
        for name, values in rank["ddp"]["parameters"].items():
            assert rank["fsdp2"]["parameters"][name] == pytest.approx(values, rel=1e-3, abs=1e-4), name
    assert ranks[0]["fsdp2"]["parameters"] == ranks[1]["fsdp2"]["parameters"]
