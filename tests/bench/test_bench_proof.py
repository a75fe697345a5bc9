"""The GPU proof: its CPU smoke run writes a report that renders back, and a part past its box is cut, not fatal."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_mp.bench import cli as bench_cli
from lightning_mp.bench.configurations import CONFIGURATIONS
from lightning_mp.bench.proof import PARTS, parse_proof_args
from lightning_mp.bench.proof_boxes import Part, run_parts
from lightning_mp.bench.proof_figures import FIGURES, Target, fp8_skip_reason, judge, skipped_figure
from lightning_mp.bench.proof_report import NOT_GPU, render_markdown
from lightning_mp.bench.smoke_matrix import PRECISION_LEVELS
from lightning_mp.bench.timing import RunResult, RunSpec, run_configuration
from lightning_mp.bench.workloads import WORKLOADS
from lightning_mp.fp8.convert import fp8_layer_names

# Slow: the GPU proof's CPU runs: the fast loop leaves the module out.
pytestmark = pytest.mark.slow

SMOKE_BUDGET_SECONDS = 55


def test_cpu_smoke_run_writes_a_json_and_markdown_report_within_its_budget(tmp_path: Path) -> None:
    """`gpu-proof --device cpu --smoke` ends within its budget with a report whose Markdown is its JSON's rendering."""
    command = [sys.executable, "-m", "lightning_mp.bench", "gpu-proof", "--device", "cpu", "--smoke"]
    start = time.monotonic()
    completed = subprocess.run(
        [*command, "--budget", str(SMOKE_BUDGET_SECONDS), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    took = time.monotonic() - start
    assert completed.returncode == 0, completed.stderr[-3000:]
    (json_path,) = tmp_path.glob("*-cpu-smoke.json")
    report = json.loads(json_path.read_text())
    # The command counts its budget from its own process start, imports included, and keeps a reserve for the report.
    assert report["wall_seconds"] <= SMOKE_BUDGET_SECONDS
    # Around it: this test's launch and the interpreter's exit, which a loaded machine stretches.
    assert took < SMOKE_BUDGET_SECONDS + 15
    assert json_path.with_suffix(".md").read_text() == render_markdown(report)
    assert [part["name"] for part in report["parts"]] == [part.name for part in PARTS]
    statuses = {part["name"]: part["status"] for part in report["parts"]}
    # On a busy machine a part may be cut; none may fail or crash, and FSDP on one GPU needs a GPU.
    assert set(statuses.values()) <= {"passed", "cut", "skipped"}, statuses
    assert statuses["fsdp"] == "skipped"
    assert report["stamp"]["torch"] == torch.__version__ and report["gpu_figures"] is False
    markdown = json_path.with_suffix(".md").read_text()
    assert f"**{NOT_GPU}**" in markdown
    smoke_part, tests_part, _, figures_part = report["parts"]
    if smoke_part["status"] == "passed":
        cases = [r for r in smoke_part["records"] if r["kind"] == "smoke"]
        assert len(cases) == len(PRECISION_LEVELS) * 3 * 2
        assert all(case["outcome"] == "passed" and case["skipped_steps"] == 1 for case in cases)
    if tests_part["status"] == "passed":
        outcomes = {r["outcome"] for r in tests_part["records"]}
        assert outcomes == {"passed", "skipped"}  # the CPU cases pass, the CUDA ones skip
    for figure in (r for r in figures_part["records"] if r["kind"] == "figure"):
        if "skipped" in figure:  # the FP8 figure, where torchao is not installed
            assert f"Skipped: {figure['skipped']}" in markdown
            continue
        assert figure["stamp"]["device"] == "cpu" and f"{NOT_GPU}: measured on the CPU" in markdown
        assert all(target["verdict"] in ("met", "MISSED", "not measured") for target in figure["targets"])


def gpu_report(gpu: str, parts: list[dict] | None = None) -> dict:
    """A full-mode report of a run on ``gpu`` (driver 550.54, torch 2.13.0, CUDA 12.8, Lightning 2.6.6)."""
    return {
        "command": "python -m lightning_mp.bench gpu-proof --out x",
        "date": "2026-01-31",
        "device": "cuda",
        "smoke": False,
        "gpu_figures": True,
        "budget_seconds": 540.0,
        "wall_seconds": 12.0,
        "stamp": {
            "device": "cuda",
            "gpu": gpu,
            "driver": "550.54",
            "torch": "2.13.0",
            "cuda": "12.8",
            "lightning": "2.6.6",
            "lightning_mp": "0.1.0",
            "python": "3.11.7",
        },
        "parts": parts or [],
    }


def test_render_writes_the_markdown_of_a_json_report_again(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`gpu-proof --render FILE.json` regenerates FILE.md from the JSON alone."""
    report = gpu_report("NVIDIA H100")
    json_path = tmp_path / "2026-01-31-nvidia-h100.json"
    json_path.write_text(json.dumps(report))
    assert bench_cli.main(["gpu-proof", "--render", str(json_path)]) == 0
    markdown = json_path.with_suffix(".md").read_text()
    assert markdown == render_markdown(report)
    assert "GPU NVIDIA H100 (driver 550.54), torch 2.13.0, CUDA 12.8, Lightning 2.6.6" in markdown
    assert NOT_GPU not in markdown


OUTCOMES_SUITE = """
import pytest

def test_passes():
    assert True

def test_fails():
    assert 1 == 2, "one is not two"

@pytest.mark.skip(reason="not on this machine")
def test_skipped():
    pass

@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")

def test_errors(broken):
    pass
"""


def test_outcome_log_records_each_outcome_with_its_message(tmp_path: Path) -> None:
    """The pytest plugin writes one JSON line per test: passed, failed, skipped or error, with the reason."""
    (tmp_path / "test_outcomes.py").write_text(OUTCOMES_SUITE)
    log = tmp_path / "outcomes.jsonl"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "lightning_mp.bench.outcome_log"]
    completed = subprocess.run(
        [*command, "--outcome-log", str(log), "test_outcomes.py"], cwd=tmp_path, capture_output=True, text=True
    )
    assert completed.returncode == 1, completed.stdout[-2000:]
    records = {r["nodeid"].split("::")[1]: r for r in map(json.loads, log.read_text().splitlines())}
    assert {name: r["outcome"] for name, r in records.items()} == {
        "test_passes": "passed",
        "test_fails": "failed",
        "test_skipped": "skipped",
        "test_errors": "error",
    }
    assert "one is not two" in records["test_fails"]["message"]
    assert records["test_skipped"]["message"] == "Skipped: not on this machine"
    assert "fixture broke" in records["test_errors"]["message"]


def _writes_a_record_then_sleeps(records: Path, deadline: float, done: list) -> list[str]:
    script = 'import sys, time; open(sys.argv[1], \'a\').write(\'{"kind": "smoke", "outcome": "passed"}\\n\')'
    return [sys.executable, "-c", f"{script}; time.sleep(60)", str(records)]


def _writes_a_record(records: Path, deadline: float, done: list) -> list[str]:
    script = 'import sys; open(sys.argv[1], \'a\').write(\'{"kind": "test", "outcome": "passed"}\\n\')'
    return [sys.executable, "-c", script, str(records)]


def test_a_part_past_its_time_box_is_cut_and_the_next_part_still_runs(tmp_path: Path) -> None:
    """A child still running at the end of its box is killed and reported cut, keeping its records; the next runs."""
    parts = [(Part("slow", "sleeps past its box", 0.5), _writes_a_record_then_sleeps)]
    parts.append((Part("after", "runs after the cut", 0.5), _writes_a_record))
    start = time.monotonic()
    done = run_parts(parts, budget_seconds=8.0, scratch=tmp_path)
    assert time.monotonic() - start < 8.0
    assert [(part["name"], part["status"]) for part in done] == [("slow", "cut"), ("after", "passed")]
    assert done[0]["records"] == [{"kind": "smoke", "outcome": "passed"}]
    assert "killed at the end of its time box" in done[0]["reason"]
    assert done[1]["records"] == [{"kind": "test", "outcome": "passed"}]


def test_a_part_is_skipped_with_its_reason_and_its_time_passes_on(tmp_path: Path) -> None:
    """A part whose builder gives a reason is skipped with it, and no child starts."""
    parts = [(Part("absent", "has nothing to run", 0.5), lambda records, deadline, done: "nothing here")]
    parts.append((Part("after", "runs after the skip", 0.5), _writes_a_record))
    done = run_parts(parts, budget_seconds=20.0, scratch=tmp_path)
    assert (done[0]["status"], done[0]["reason"]) == ("skipped", "nothing here")
    assert done[1]["status"] == "passed" and done[1]["box_seconds"] > 10


def _run(name: str, repeat: int, step_ms: float, peak_mib: float = 100.0, syncs: float | None = None) -> RunResult:
    return RunResult(name, [step_ms / 1e3] * 3, 1.0, peak_mib, 0.0, repeat=repeat, syncs_per_step=syncs)


def test_targets_are_met_or_missed_from_the_paired_runs() -> None:
    """A step target compares paired medians repeat by repeat; a sync target compares the counts."""
    results = [_run("lightning-bf16", 0, 100), _run("O1-bf16", 0, 101), _run("O1-bf16", 1, 104)]
    results.append(_run("lightning-bf16", 1, 100))
    within = judge(Target("step", "O1-bf16", "lightning-bf16", 1.02), results, on_gpu=True)
    assert within["verdict"] == "MISSED" and within["measured"] == pytest.approx(1.025)
    assert "over 2 repeat(s)" in within["detail"]
    assert judge(Target("step", "O1-bf16", "lightning-bf16", 1.03), results, on_gpu=True)["verdict"] == "met"
    syncs = [_run("lightning-fp16", 0, 10, syncs=1.0), _run("O1-fp16", 0, 10, syncs=0.0)]
    assert judge(Target("syncs", "O1-fp16", "lightning-fp16"), syncs, on_gpu=True)["verdict"] == "met"
    memory = [_run("fp32", 0, 10, peak_mib=1000), _run("lean-bf16", 0, 10, peak_mib=600)]
    assert judge(Target("peak", "lean-bf16", "fp32", 0.55), memory, on_gpu=True)["verdict"] == "MISSED"
    assert judge(Target("peak", "lean-bf16", "fp32", 0.55), memory, on_gpu=False)["verdict"] == "not measured"


def test_bad_budget_is_refused_naming_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`--budget 0` exits with argparse's usage error naming --budget and the value."""
    with pytest.raises(SystemExit):
        bench_cli.main(["gpu-proof", "--budget", "0", "--out", str(tmp_path)])
    assert "--budget must be a number of seconds above 0, got 0.0" in capsys.readouterr().err


FP8_SKIP = fp8_skip_reason("cpu")


@pytest.mark.skipif(FP8_SKIP is not None, reason=f"the FP8 mode cannot run here: {FP8_SKIP}")
def test_the_fp8_figure_runs_the_fp8_mode_and_bare_torchao_on_the_same_layers() -> None:
    """The FP8 figure's tiny shape converts layers in both FP8 setups, and bare torchao on the layers the FP8 mode
    chooses computes the FP8 mode's very losses (so its step-time target compares like with like), unlike bf16."""
    figure = next(figure for figure in FIGURES if figure.name == "fp8-lm-1b")
    spec = RunSpec(workload=figure.workload, size="tiny", warmup=1, steps=2)
    losses = {name: run_configuration(name, spec) for name in ("O1-bf16", "fp8-tensorwise", "torchao-tensorwise")}
    assert all(result.error is None for result in losses.values()), {n: r.error for n, r in losses.items()}
    assert losses["fp8-tensorwise"].final_loss == losses["torchao-tensorwise"].final_loss
    assert losses["fp8-tensorwise"].final_loss != losses["O1-bf16"].final_loss
    network = WORKLOADS[figure.workload].tiny.build()
    CONFIGURATIONS["torchao-tensorwise"].prepare_network(network)  # type: ignore[misc]
    # The first and the last linear layer stay bf16 by default; the others of the tiny shape run FP8.
    assert len(fp8_layer_names(network)) == sum(isinstance(m, torch.nn.Linear) for m in network.modules()) - 2 > 0


def test_a_figure_that_cannot_run_is_reported_skipped_with_its_reason() -> None:
    """Without torchao or an FP8 GPU the FP8 figure is listed as skipped, with the reason, and judges no target."""
    figure = next(figure for figure in FIGURES if figure.needs_fp8)
    report = gpu_report("NVIDIA A100")
    reason = "needs compute capability >= 8.9; NVIDIA A100 has 8.0"
    record = {**skipped_figure(figure, reason), "stamp": report["stamp"]}
    part = {"name": "figures", "title": "the paired figures", "status": "passed", "reason": "", "box_seconds": 1.0}
    part |= {"wall_seconds": 1.0, "exit_code": 0, "log_tail": [], "records": [record]}
    markdown = render_markdown({**report, "parts": [part]})
    assert f"#### {figure.name}: {figure.title}\n\nSkipped: needs compute capability >= 8.9; NVIDIA A100 has 8.0" in (
        markdown
    )
    assert "## Targets" not in markdown


def test_the_figures_flag_names_the_figures_the_part_measures(capsys: pytest.CaptureFixture) -> None:
    """`--figures` takes figure names only, so that a slot can be spent on the FP8 figure alone."""
    args = parse_proof_args(["--out", "x", "--device", "cpu", "--figures", "fp8-lm-1b"])
    assert args.figures == ["fp8-lm-1b"]
    with pytest.raises(SystemExit):
        parse_proof_args(["--out", "x", "--figures", "fp8"])
    assert "invalid choice: 'fp8'" in capsys.readouterr().err
