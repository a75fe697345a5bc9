"""The benchmark: an honest quick run in-process, paired ratios with their spread, and loud warnings under load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_mp.bench import cli as bench_cli
from lightning_mp.bench.comparison import paired_ratios, resolution, unresolved_comparisons
from lightning_mp.bench.machine import load_warnings, matmul_rates
from lightning_mp.bench.timing import RunResult

# Slow: the benchmark's own timed runs: the fast loop leaves the module out.
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]


def test_quick_benchmark_runs_in_process_and_reports_paired_spread(tmp_path: Path, capsys) -> None:
    """`--quick` trains fp32 and O1-bf16 in this process, adds paired repeats until resolved, and gives the spread."""
    out = tmp_path / "bench.md"
    argv = ["--quick", "--accelerator", "cpu", "--repeats", "1", "--max-repeats", "2", "--out", str(out)]
    assert bench_cli.main(argv) == 0
    captured = capsys.readouterr()
    rows = [line for line in captured.out.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| configuration | median step (ms) |") and "CPU share | run-queue wait |" in rows[0]
    assert [row.split("|")[1].strip() for row in rows[1:]] == ["fp32", "O1-bf16"]
    bf16_vs_fp32 = rows[2].split("|")[6].strip()
    assert bf16_vs_fp32.endswith(")") and "x (" in bf16_vs_fp32  # the median paired ratio and its range
    difference = next(line for line in captured.out.splitlines() if line.startswith("- O1-bf16 vs fp32:"))
    assert "over 2 repeat(s)" in difference and "resolved" in difference
    assert "not resolved after 1 repeats: O1-bf16 vs fp32; adding repeat 2" in captured.err
    assert f"with {torch.get_num_threads()} thread(s), as in training" in captured.out
    assert "Load average (1, 5, 15 min):" in captured.out and "all runs in this one process" in captured.out
    assert "avx512_bf16" in captured.out and "torch " in captured.out
    assert "[4] " in captured.err and "2 alternating repeats" in captured.out
    assert out.read_text() == captured.out.rstrip("\n") + "\n"


def test_worker_mode_writes_a_result_that_reads_back_with_its_load_measurements(tmp_path: Path) -> None:
    """`--worker NAME` (what each full-benchmark process runs) writes step, CPU and run-queue times as JSON."""
    result_file = tmp_path / "fp32.json"
    threads_before = torch.get_num_threads()
    argv = ["--worker", "fp32", "--result-file", str(result_file), "--accelerator", "cpu", "--size", "tiny"]
    assert bench_cli.main([*argv, "--steps", "3", "--warmup", "1", "--threads", "1"]) == 0
    result = RunResult(**json.loads(result_file.read_text()))
    assert result.configuration == "fp32" and len(result.step_seconds) == len(result.step_cpu_seconds) == 3
    assert result.threads == 1 and result.cpu_share > 0
    assert result.wait_share is None or 0 <= result.wait_share <= 1
    assert torch.get_num_threads() == threads_before


def run(name: str, repeat: int, median_ms: float) -> RunResult:
    return RunResult(name, [median_ms / 1e3] * 3, 1.0, 100.0, 90.0, None, [median_ms / 1e3] * 3, 1, repeat)


def test_ratios_are_paired_by_repeat() -> None:
    """Each repeat's reference median over the configuration's median is one paired speed-up."""
    results = [run("fp32", 0, 10), run("O1-bf16", 0, 20), run("O1-bf16", 1, 40), run("fp32", 1, 10)]
    assert paired_ratios(results, "fp32", "O1-bf16") == [0.5, 0.25]


def test_unresolved_comparisons_name_what_needs_more_repeats() -> None:
    """Pairs on both sides of 1.00x leave a comparison unresolved; pairs that agree resolve it."""
    straddling = [run("fp32", 0, 10), run("O1-bf16", 0, 20), run("fp32", 1, 10), run("O1-bf16", 1, 5)]
    assert unresolved_comparisons(straddling, ["fp32", "O1-bf16"]) == ["O1-bf16 vs fp32"]
    agreeing = [run("fp32", 0, 10), run("O1-bf16", 0, 20), run("fp32", 1, 10), run("O1-bf16", 1, 30)]
    assert unresolved_comparisons(agreeing, ["fp32", "O1-bf16"]) == []


@pytest.mark.parametrize(
    ("ratios", "verdict"),
    [
        ([0.05, 0.04, 0.06], "resolved: slower"),
        ([1.2, 1.5, 1.1], "resolved: faster"),
        ([0.21, 5.26, 0.38], "NOT resolved: the paired ratios straddle 1.00x"),
        ([1.88], "NOT resolved: one pair has no spread"),
    ],
)
def test_a_difference_is_resolved_only_when_every_pair_agrees(ratios: list[float], verdict: str) -> None:
    """A single pair, or pairs on both sides of 1.00x, never count as a measured difference."""
    assert resolution(ratios) == verdict


def test_load_warnings_fire_on_a_busy_machine_and_stay_quiet_on_an_idle_one() -> None:
    """A high load before the start, or runs that waited for a core, each give a loud WARNING."""
    assert load_warnings((0.2, 0.1, 0.1), (1.1, 0.4, 0.2), {"fp32": 0.6}, cores=2, wait_shares={"fp32": 0.03}) == []
    busy = load_warnings((6.5, 3.0, 1.0), (6.4, 3.1, 1.0), {"fp32": 0.2}, cores=2, wait_shares={"fp32": 0.64})
    assert len(busy) == 2 and all(line.startswith("WARNING") for line in busy)
    assert "load average 6.50 on 2 cores" in busy[0] and "fp32 64%" in busy[1]
    without_schedstat = load_warnings((0.2, 0.1, 0.1), (1.0, 0.4, 0.2), {"fp32": 0.3}, cores=2)
    assert len(without_schedstat) == 1 and "fp32 30%" in without_schedstat[0]


def test_matmul_rates_use_the_given_threads_and_restore_torchs() -> None:
    """Matrix-product rates are measured with the training's thread count, and torch's setting is restored."""
    before = torch.get_num_threads()
    rates = matmul_rates("cpu", n=32, threads=1, rounds=1)
    assert set(rates) == {"fp32", "bf16", "fp16"} and all(rate > 0 for rate in rates.values())
    assert torch.get_num_threads() == before


@pytest.mark.parametrize(("flag", "value"), [("--steps", "0"), ("--threads", "0"), ("--repeats", "0")])
def test_benchmark_refuses_a_bad_flag(flag: str, value: str, capsys) -> None:
    """A bad flag value is refused with a message naming it."""
    with pytest.raises(SystemExit):
        bench_cli.parse_args([flag, value])
    assert flag in capsys.readouterr().err


def test_benchmark_refuses_two_reports_at_once(capsys) -> None:
    """--counts with --memory is refused with a message naming both, instead of silently running only one."""
    with pytest.raises(SystemExit):
        bench_cli.parse_args(["--counts", "--memory"])
    assert "--counts and --memory" in capsys.readouterr().err
