"""Every precision and opt level under every strategy and front end: it trains, or it is refused by name.

Each row runs once (2 CPU processes, gloo; one for the single-device row). A cell that trains must lower its loss
(one repeated batch), keep its weights finite, agree on them across ranks, and compute in the precision asked for (a
middle linear layer's output dtype, or torchao's FP8 layer); a refused cell's error must name the opt level or FP8 and
say what to use instead. Where this machine's torch and Lightning are the ones the committed table was measured
with, the outcomes must be the table's (``docs/performance/support-matrix.json``, shown by the distributed guide).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import lightning
import pytest
import torch

from lightning_mp.fp8.convert import fp8_unavailable
from tests.distributed.support_matrix import ROWS, row_runs_here, run_row, summary

COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "performance" / "support-matrix.json"
COMPUTE_DTYPE = {"32-true": "torch.float32", "16-mixed": "torch.float16", "bf16-mixed": "torch.bfloat16"}


@pytest.mark.slow
@pytest.mark.parametrize(("label", "strategy", "front"), ROWS, ids=[f"{s}-{f}" for _, s, f in ROWS])
def test_every_cell_trains_in_its_precision_or_is_refused_by_name(
    label: str, strategy: str, front: str, tmp_path: Path
) -> None:
    if not row_runs_here(strategy):
        pytest.skip("DeepSpeed is not installed (the deepspeed extra)")
    cells = run_row(strategy, front, tmp_path)
    for cell, record in cells.items():
        precision, opt_level, *fp8 = cell.split(":")
        assert record["outcome"] in ("trained", "refused"), (cell, record)
        if record["outcome"] == "refused":
            named = fp8[0] if fp8 else opt_level
            if fp8 and "torchao" in record["message"] and fp8_unavailable():
                continue  # the FP8 extra is not installed here: its error names the extra to install
            assert named in record["message"] and re.search(r"\b(Use|use)\b", record["message"]), (cell, record)
            continue
        ranks = record["ranks"]
        assert len(ranks) == (1 if strategy == "single" else 2), cell
        assert len({rank["checksum"] for rank in ranks}) == 1, f"{cell}: the ranks diverged"
        for rank in ranks:
            assert rank["finite"], cell
            assert rank["losses"][-1] < rank["losses"][0], f"{cell}: the loss did not fall: {rank['losses']}"
            if fp8:
                assert "Float8" in (rank["layer"] or ""), f"{cell}: FP8 was asked for, the layer is {rank['layer']}"
            elif rank["output_dtype"] is not None:
                assert rank["output_dtype"] == COMPUTE_DTYPE[precision], f"{cell} computed in {rank['output_dtype']}"
    o2, exact = cells.get("bf16-mixed:O2"), cells.get("bf16-mixed:lean-exact")
    if o2 and exact and o2["outcome"] == exact["outcome"] == "trained":
        # lean-exact is O2 with packed masters: the same weights, bit for bit, on every rank.
        assert [rank["checksum"] for rank in exact["ranks"]] == [rank["checksum"] for rank in o2["ranks"]]
    committed = json.loads(COMMITTED.read_text())
    same_versions = (committed["machine"]["torch"], committed["machine"]["lightning"]) == (
        torch.__version__,
        lightning.__version__,
    )
    if same_versions:
        row = next(r for r in committed["rows"] if (r["strategy"], r["front"]) == (strategy, front))
        outcomes = {cell: text.split(":")[0] for cell, text in summary(cells).items()}
        assert outcomes == {cell: text.split(":")[0] for cell, text in row["cells"].items()}
