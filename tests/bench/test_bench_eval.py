"""``python -m lightning_mp.bench --eval``: evaluation time and memory per eval_precision, from real validate runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_mp.bench.cli import main, parse_args
from lightning_mp.bench.evaluation import EVAL_PRECISIONS, TRAINED_LEVELS


def test_eval_flag_reports_every_precision_with_the_bytes_of_its_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One row per trained level and eval precision; a -true copy of O1's weights costs 2 bytes per weight, O2's
    masters serve 32-true and 16-mixed without a copy, and every evaluation adds some activation bytes."""
    out = tmp_path / "eval.md"
    assert main(["--eval", "--size", "tiny", "--repeats", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert out.read_text() == printed.rstrip("\n") + "\n"
    rows = {
        (cells[1], cells[2]): cells
        for line in printed.splitlines()
        if line.startswith("| O")
        for cells in [[cell.strip() for cell in line.split("|")]]
    }
    assert len(rows) == len(TRAINED_LEVELS) * len(EVAL_PRECISIONS)
    assert float(rows[("O1 bf16-mixed", "16-true")][-2]) > 0
    assert float(rows[("O1 bf16-mixed", "16-true")][-2]) == float(rows[("O1 bf16-mixed", "bf16-true")][-2])
    for eval_precision in ("32-true", "16-mixed", "as training"):
        assert float(rows[("O2 bf16-mixed", eval_precision)][-2]) == 0
    assert all(float(cells[-3]) > 0 for cells in rows.values())
    assert rows[("O1 bf16-mixed", "as training")][4].startswith("1.00")


def test_eval_is_a_report_of_its_own_on_the_cpu() -> None:
    """--eval defaults to the small model, and refuses to be combined with another report."""
    assert parse_args(["--eval", "--accelerator", "cpu"]).size == "small"
    with pytest.raises(SystemExit):
        parse_args(["--eval", "--memory", "--accelerator", "cpu"])
