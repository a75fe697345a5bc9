"""The benchmark, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_quick_benchmark_prints_and_writes_the_table(tmp_path: Path):
    """`python -m lightning_mp.bench --quick --out FILE` trains two configurations and prints the Markdown table."""
    out = tmp_path / "bench.md"
    result = subprocess.run(
        [sys.executable, "-m", "lightning_mp.bench", "--quick", "--accelerator", "cpu", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| configuration | median step (ms) |")
    assert [row.split("|")[1].strip() for row in rows[1:]] == ["fp32", "O1-bf16"]
    fp32_row = rows[1].split("|")
    assert fp32_row[6].strip() == "1.00x" and float(fp32_row[-2]) > 0
    assert "avx512_bf16" in result.stdout and "torch " in result.stdout
    assert "[2/2] O1-bf16" in result.stderr
    assert out.read_text() == result.stdout.rstrip("\n") + "\n"


def test_benchmark_refuses_a_bad_flag():
    """A bad flag value is refused with a message naming it."""
    result = subprocess.run(
        [sys.executable, "-m", "lightning_mp.bench", "--steps", "0"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0 and "--steps" in result.stderr
