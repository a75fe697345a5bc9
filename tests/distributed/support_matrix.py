"""The precision x strategy table: every opt level under every strategy and front end, trained or refused by name.

:func:`run_row` runs ``tests/ddp_scripts/matrix_train.py`` for one row (a strategy and a front end) on 2 CPU
processes (one for the single-device row) and reads each cell's report. ``tests/distributed/test_support_matrix.py``
checks every cell, and ``python docs/generate.py performance --only support-matrix`` writes the table the
distributed guide shows from the same runs.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from tests.ddp_scripts.launch import clean_environment, free_port, run
from tests.ddp_scripts.matrix_train import CELLS

MATRIX_SCRIPT = Path(__file__).resolve().parents[1] / "ddp_scripts" / "matrix_train.py"
ROWS = (
    ("single device", "single", "trainer"),
    ("single device", "single", "fabric"),
    ("DDP", "ddp", "trainer"),
    ("DDP", "ddp", "fabric"),
    ("DDP spawn", "ddp_spawn", "trainer"),
    ("FSDPStrategy (FSDP1)", "fsdp", "trainer"),
    ("FSDPStrategy (FSDP1)", "fsdp", "fabric"),
    ("ModelParallelStrategy (FSDP2)", "fsdp2", "trainer"),
    ("ModelParallelStrategy (FSDP2)", "fsdp2", "fabric"),
    ("DeepSpeedStrategy, ZeRO 1", "deepspeed1", "trainer"),
    ("DeepSpeedStrategy, ZeRO 2", "deepspeed2", "trainer"),
    ("DeepSpeedStrategy, ZeRO 3", "deepspeed3", "trainer"),
    ("DeepSpeedStrategy, ZeRO 1", "deepspeed1", "fabric"),
    ("DeepSpeedStrategy, ZeRO 2", "deepspeed2", "fabric"),
    ("DeepSpeedStrategy, ZeRO 3", "deepspeed3", "fabric"),
)
"""Each row: its label, the script's ``--strategy`` and ``--front``. The DeepSpeed rows run where DeepSpeed is
installed (the ``deepspeed`` extra), with ``DeepSpeedMixedPrecision`` (under Fabric, its strategy built from the
plugin's ``strategy_arguments()``)."""


def row_runs_here(strategy: str) -> bool:
    """Whether this machine can run the row: the DeepSpeed rows need DeepSpeed."""
    return not strategy.startswith("deepspeed") or importlib.util.find_spec("deepspeed") is not None


def run_row(strategy: str, front: str, out: Path) -> dict[str, dict[str, Any]]:
    """Every cell of one row: ``cell -> {"outcome", ...}``, a trained cell with ``"ranks"``: each rank's report."""
    env = clean_environment(MASTER_PORT=str(free_port()), DS_ACCELERATOR="cpu")
    run(["--out", str(out), "--strategy", strategy, "--front", front], timeout=600, env=env, script=MATRIX_SCRIPT)
    cells: dict[str, dict[str, Any]] = {}
    for cell in CELLS:
        reports = [json.loads(path.read_text()) for path in sorted(out.glob(f"{cell}.rank*.json"))]
        if not reports:
            cells[cell] = {"outcome": "missing"}
        elif reports[0]["outcome"] == "refused":
            cells[cell] = reports[0]
        else:
            cells[cell] = {"outcome": "trained", "ranks": reports}
    return cells


def summary(cells: dict[str, dict[str, Any]]) -> dict[str, str]:
    """``cell -> "trains"`` or ``"refused: <error type>: <message>"``: what the docs' table shows."""
    return {
        cell: "trains"
        if record["outcome"] == "trained"
        else f"{record['outcome']}: {record.get('error', '')}: {record.get('message', '')}"
        for cell, record in cells.items()
    }
