"""The GPU-sized workloads of `python -m lightning_mp.bench`, exercised on the CPU through their tiny shapes.

A GPU is not needed to check that each workload builds, trains a timed step under the baselines and the package's
setups, counts host syncs and reports its columns, nor that a crashing configuration becomes a row of the table.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lightning_mp import MixedPrecision
from lightning_mp.bench import cli as bench_cli
from lightning_mp.bench.cli import run_spec
from lightning_mp.bench.comparison import run_worker
from lightning_mp.bench.configurations import (
    CONFIGURATIONS,
    GPU_WORKLOAD_CONFIGURATIONS,
    Configuration,
    default_configurations,
    float32_matmul,
)
from lightning_mp.bench.report import ReportContext, difference_lines, report, summarize, target_lines
from lightning_mp.bench.timing import RunResult, RunSpec, run_configuration, step_units
from lightning_mp.bench.workloads import GPU_WORKLOADS, WORKLOADS, auto_size

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def tiny_spec(workload: str, **overrides) -> RunSpec:
    return RunSpec(workload=workload, size="tiny", warmup=1, steps=1, sync_steps=1, **overrides)


def table_rows(text: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("|")]


@pytest.mark.slow
@pytest.mark.parametrize("workload", GPU_WORKLOADS)
@pytest.mark.parametrize("configuration", ["lightning-bf16", "O1-bf16"])
def test_each_gpu_workload_trains_a_timed_step_in_its_tiny_shape(workload: str, configuration: str) -> None:
    """Every GPU workload's tiny shape trains under Lightning's bf16 and O1, timed, with its host syncs counted."""
    result = run_configuration(configuration, tiny_spec(workload))
    assert result.error is None
    assert len(result.step_seconds) == 1 and result.step_seconds[0] > 0
    assert math.isfinite(result.final_loss)
    assert result.syncs_per_step is not None and result.syncs_per_step >= 0


def test_full_shapes_have_the_sizes_users_compare_with() -> None:
    """The LM has about 219M parameters, ResNet-50 torchvision's 25,557,032, and the inputs are the named sizes."""
    with torch.device("meta"):
        parameters = {name: sum(p.numel() for p in WORKLOADS[name].full.build().parameters()) for name in WORKLOADS}
    assert 210e6 < parameters["lm-200m"] < 230e6
    assert parameters["resnet50"] == 25_557_032
    assert step_units(RunSpec(workload="lm-200m", size="full")) == (8 * 1024, "tokens")
    assert step_units(RunSpec(workload="lm-small", size="full")) == (16 * 128, "tokens")
    assert step_units(RunSpec(workload="resnet50", size="full", batch_size=256)) == (256, "images")


def test_resnet_trains_in_channels_last() -> None:
    """ResNet-50's convolution weights and its images are channels_last, as users train it on a GPU."""
    shape = WORKLOADS["resnet50"].tiny
    network = shape.build()
    images, labels = shape.batch(torch.device("cpu"), torch.Generator().manual_seed(0))
    first_convolution = next(module for module in network.modules() if isinstance(module, torch.nn.Conv2d))
    assert first_convolution.weight.is_contiguous(memory_format=torch.channels_last)
    assert images.is_contiguous(memory_format=torch.channels_last)
    assert network(images).shape == (shape.batch_size, shape.num_classes) and labels.shape == (shape.batch_size,)


@pytest.mark.slow
@pytest.mark.parametrize(("workload", "unit"), [("lm-small", "tokens"), ("resnet50", "images")])
def test_gpu_workload_report_has_throughput_peak_and_sync_columns(
    workload: str, unit: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The report of a GPU workload gives step time, tokens or images per second, peak vs fp32 and syncs per step."""
    argv = ["--workload", workload, "--accelerator", "cpu", "--in-process", "--steps", "1", "--warmup", "1"]
    assert bench_cli.main([*argv, "--repeats", "1", "--sync-steps", "1", "--configs", "fp32", "O1-bf16"]) == 0
    out = capsys.readouterr().out
    header, _, *rows = table_rows(out)
    assert header[:2] == ["configuration", "median step (ms)"] and f"{unit}/s" in header
    assert header[-2:] == ["peak vs fp32", "host syncs / step"]
    assert [row[0] for row in rows] == ["fp32", "O1-bf16"] and rows[0][-2] == "1.000"
    assert all(float(row[-1]) >= 0 for row in rows)
    assert f"({workload}), size 'tiny'" in out and "torch " in out and "lightning " in out


@pytest.mark.slow
def test_a_crashing_configuration_is_a_table_row_and_the_others_still_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A configuration that raises shows "crash: <error>" in its row, is not retried, and the benchmark goes on."""
    broken = Configuration(
        "broken", "an opt level that does not exist", lambda: {"plugins": [MixedPrecision(opt_level="O9")]}, "broken"
    )
    monkeypatch.setitem(CONFIGURATIONS, "broken", broken)
    argv = ["--workload", "lm-small", "--accelerator", "cpu", "--in-process", "--steps", "1", "--warmup", "1"]
    assert bench_cli.main([*argv, "--repeats", "2", "--sync-steps", "0", "--configs", "broken", "fp32"]) == 0
    captured = capsys.readouterr()
    rows = {row[0]: row for row in table_rows(captured.out)[2:]}
    assert rows["broken"][1].startswith("crash: ValueError: ") and "O9" in rows["broken"][1]
    assert float(rows["fp32"][1]) > 0
    assert captured.err.count("broken (repeat") == 1


@pytest.mark.slow
def test_a_worker_process_that_fails_gives_a_crash_result(tmp_path: Path) -> None:
    """A worker process that exits with an error becomes a crashed result naming the error, not an exception."""
    unwritable = tmp_path / "missing-directory" / "result.json"
    result = run_worker("fp32", tiny_spec("lm-small"), threads=1, result_file=unwritable)
    assert result.error is not None and "exit code 1" in result.error and "FileNotFoundError" in result.error
    assert result.step_seconds == []


def test_cpu_defaults_are_unchanged_and_gpu_defaults_cover_the_baselines() -> None:
    """On the CPU the Markov model runs the same six setups; the GPU workloads add TF32, bf16-true and four monitors."""
    args = bench_cli.parse_args(["--accelerator", "cpu"])
    assert args.workload == ["markov"] and args.configs is None
    assert default_configurations("cpu") == [
        "fp32",
        "lightning-bf16",
        "O1-bf16",
        "O2-bf16",
        "lean-bf16",
        "O1-bf16+monitors",
    ]
    assert set(GPU_WORKLOAD_CONFIGURATIONS) >= {
        "fp32",
        "fp32-tf32",
        "lightning-fp16",
        "lightning-bf16",
        "lightning-bf16-true",
        "O1-fp16",
        "O1-bf16",
        "O2-fp16",
        "O2-bf16",
        "lean-bf16",
        "O1-fp16+monitors",
    }
    assert "fp32-tf32" not in default_configurations("cpu", GPU_WORKLOAD_CONFIGURATIONS)


def test_strict_fp32_turns_tf32_off_for_the_run_and_restores_torchs_setting() -> None:
    """fp32 runs with TF32 off and fp32-tf32 with it on; torch's own setting comes back after each run."""
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    for name, inside in (("fp32", ("highest", False)), ("fp32-tf32", ("high", True))):
        with float32_matmul(CONFIGURATIONS[name].float32_matmul):
            assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == inside
        assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == before


def test_markov_and_gpu_workloads_in_one_command_each_get_their_own_size() -> None:
    """`--workload markov lm-small` on the CPU runs the Markov model at its auto size and lm-small's tiny shape."""
    args = bench_cli.parse_args(["--workload", "markov", "lm-small", "--accelerator", "cpu", "--batch-size", "3"])
    markov, small = run_spec(args, "markov"), run_spec(args, "lm-small")
    assert markov.size == auto_size("cpu") and markov.sync_steps == 0
    assert small.size == "tiny" and small.sync_steps == 10 and step_units(small) == (3 * 8, "tokens")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workload", "resnet50", "--size", "small"], "--size small"),
        (["--workload", "markov", "--size", "full"], "--size full"),
        (["--workload", "markov", "--batch-size", "4"], "--batch-size 4"),
        (["--workload", "resnet50", "--batch-size", "0"], "--batch-size must be >= 1"),
        (["--workload", "lm-small", "--memory"], "--memory"),
        (["--sync-steps", "-1"], "--sync-steps must be >= 0"),
    ],
)
def test_benchmark_refuses_flags_that_do_not_fit_the_workload(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A size, batch size or report that does not fit the workload is refused with a message naming the flag."""
    with pytest.raises(SystemExit):
        bench_cli.parse_args(["--accelerator", "cpu", *argv])
    assert message in capsys.readouterr().err


def runs(name: str, median_ms: float, syncs: float) -> list[RunResult]:
    return [
        RunResult(name, [median_ms / 1e3] * 3, 1.0, 100.0, 90.0, None, [median_ms / 1e3] * 3, 1, repeat, None, syncs)
        for repeat in range(2)
    ]


def test_launch_bound_targets_allow_more_and_crashed_setups_take_part_in_no_comparison() -> None:
    """The launch-bound LM lets the monitors add 10% and O1 3%; a crashed setup is in no difference or target line."""
    results = [
        *runs("lightning-fp16", 10.0, 1.0),
        *runs("O1-fp16", 10.25, 1.0),
        *runs("O1-fp16+monitors", 11.0, 1.5),
        RunResult.crashed("lightning-bf16", "NotImplementedError: bf16"),
        *runs("O1-bf16", 10.0, 0.0),
    ]
    summaries = summarize(results, units_per_step=100)
    assert summaries["lightning-bf16"].error == "NotImplementedError: bf16"
    assert summaries["O1-bf16"].vs_builtin is None and summaries["O1-fp16"].vs_builtin == pytest.approx(10 / 10.25)
    launch_bound = target_lines(summaries, "gpu", WORKLOADS["lm-small"].budgets)
    assert any(
        line.startswith("O1-fp16+monitors: monitors cost at most 10%") and "met" in line for line in launch_bound
    )
    assert any(line.startswith("O1-fp16 at most 3% slower") and line.endswith("met") for line in launch_bound)
    assert "O1-fp16 host syncs per step no more than Lightning's built-in: 1.00 against 1.00 -> met" in launch_bound
    large = target_lines(summaries, "gpu", WORKLOADS["lm-200m"].budgets)
    assert any(line.startswith("O1-fp16+monitors: monitors cost at most 3%") and "MISSED" in line for line in large)
    assert any(line.startswith("O1-fp16 at most 2% slower") and "MISSED" in line for line in large)
    assert not any("lightning-bf16" in line for line in [*launch_bound, *difference_lines(summaries)])


def test_a_setup_that_crashed_in_one_repeat_keeps_its_figures_and_the_report_says_so() -> None:
    """A run that crashes after others finished leaves the finished figures in the table and a loud line below it."""
    results = [*runs("fp32", 20.0, 0.0), *runs("O1-fp16", 10.0, 1.0)[:1]]
    results.append(RunResult.crashed("O1-fp16", "OutOfMemoryError: CUDA out of memory", repeat=1))
    summaries = summarize(results, units_per_step=100)
    context = ReportContext("a model", "tokens", "cpu", 1, 3, 2, ["CPU: test"], {"fp32": 1.0}, 32, ((0, 0, 0),) * 2, 1)
    text = report(summaries, context, {})
    row = next(line for line in text.splitlines() if line.startswith("| O1-fp16 |"))
    assert row.split("|")[2].strip() == "10.0"
    assert "**O1-fp16 crashed in 1 run(s) (repeat 2: OutOfMemoryError: CUDA out of memory)" in text
