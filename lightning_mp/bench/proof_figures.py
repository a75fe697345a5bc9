"""The GPU proof's figures: paired runs of each setup against its baseline, and each target met or missed.

A :class:`Figure` is a workload (:data:`~lightning_mp.bench.workloads.WORKLOADS`), the configurations it runs
(:data:`~lightning_mp.bench.configurations.CONFIGURATIONS`) and its :class:`Target` s. :func:`run_figure` trains
every configuration in this one process with :func:`~lightning_mp.bench.timing.run_configuration`, in paired,
alternating repeats: repeat 1 in the listed order, repeat 2 in reverse, so that a GPU that warms up or throttles
favours no configuration. A run is not started when the figure's deadline would pass before it ends (estimated by
the configuration's previous run, or the slowest run so far); the figure is then marked cut, and its targets use
the repeats that finished.

The targets (:data:`FIGURES`):

- the 219M-parameter LM (seq 1024, batch 8, fused AdamW): O1 bf16 within 2% of Lightning's ``bf16-mixed``;
  O2 bf16 at most 0.95x O1's step time and 0.92x its peak memory; lean at most 0.55x fp32's peak memory at no
  more than 1.05x ``bf16-true``'s step time;
- ResNet-50 (batch 256, ``channels_last``, foreach AdamW): O1 within 2% of ``bf16-mixed`` and of ``16-mixed``;
- host syncs per step (``torch.cuda.set_sync_debug_mode("warn")`` on CUDA, :mod:`lightning_mp.bench.counting` on the
  CPU) of every package setup no more than Lightning's built-in at the same precision (lean: also no more than
  ``bf16-true``), with fused and with foreach AdamW, on the launch-bound LM; counts are deterministic, so one run
  each;
- the four monitors, logging every 10 steps, on the LM (+3% at most) and on the launch-bound LM (+10%), on the
  mean step, which includes the logging steps;
- FP8 on the 1B-parameter LM (seq 2048, fused AdamW, each block compiled), last, as the least urgent: the FP8 mode's
  ``"tensorwise"`` at least 1.15x bf16 O1's tokens/s (a step time at most 0.87x) and within 2% of bare torchao on
  the same layers; its peak memory no higher than O1's; :class:`~lightning_mp.fp8.telemetry.FP8Monitor` sampling
  every 50 steps at most +2% on the mean step; host syncs per non-logging step no more than bare torchao's, with and
  without the monitor; ``"rowwise"`` reported beside them. It needs torchao and, on CUDA, compute capability 8.9 or
  more: without either it is skipped with the reason. Its 1B model takes minutes to compile and run, more than a
  full proof leaves it: ``--figures fp8-lm-1b`` runs it alone.

A step-time ratio is the median over the repeats of the configuration's median step over its reference's in the
same repeat (:func:`~lightning_mp.bench.comparison.paired_ratios`, inverted); a peak-memory ratio compares the
medians of ``torch.cuda.max_memory_allocated``. On the CPU the peak is the process's resident set, which only
grows within one process, so the memory targets are not judged there; no CPU figure is a GPU figure.

``--smoke`` runs a few configurations of four figures (:attr:`Figure.smoke_configurations`), each for two steps:
enough to prove every kind of target's path, not to measure anything.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lightning_mp.arguments.checks import arguments_of
from lightning_mp.bench.comparison import paired_ratios, resolution
from lightning_mp.bench.configurations import CONFIGURATIONS, FP32
from lightning_mp.bench.report import summarize
from lightning_mp.bench.timing import RunResult, RunSpec, run_configuration, step_units
from lightning_mp.bench.workloads import WORKLOADS, OptimizerKind

TargetKind = Literal["step", "mean-step", "peak", "syncs"]


@dataclass(frozen=True)
class Target:
    """A bound on ``configuration``'s figure over ``reference``'s: a ratio at most ``limit`` (syncs: a count)."""

    kind: TargetKind
    configuration: str
    reference: str
    limit: float = 1.0

    def describe(self) -> str:
        """The target in words."""
        if self.kind == "syncs":
            return f"{self.configuration} host syncs/step <= {self.reference}'s"
        what = {"step": "median step", "mean-step": "mean step", "peak": "peak memory"}[self.kind]
        return f"{self.configuration} {what} <= {self.limit:g}x {self.reference}'s"


@dataclass(frozen=True)
class Figure:
    """One figure: a workload, the configurations it runs and the targets they must meet.

    Attributes:
        name: the figure's name in the report.
        title: what it shows, in words.
        workload: a key of :data:`~lightning_mp.bench.workloads.WORKLOADS`.
        configurations: the configurations, in the order of the first repeat.
        targets: what the figure checks.
        batch_size: replaces the workload's batch size (None: its own).
        optimizer: replaces the workload's AdamW implementation (None: its own).
        repeats: alternating repeats of every configuration.
        warmup: untimed steps per run.
        steps: timed steps per run.
        sync_steps: steps after the timed ones that count host syncs.
        share: the figure's share of the figures part's time.

    """

    name: str
    title: str
    workload: str
    configurations: tuple[str, ...]
    targets: tuple[Target, ...]
    batch_size: int | None = None
    optimizer: OptimizerKind | None = None
    repeats: int = 2
    warmup: int = 3
    steps: int = 10
    sync_steps: int = 0
    share: float = 1.0
    smoke_configurations: tuple[str, ...] = ()
    """The configurations ``--smoke`` runs (empty: the figure is left out of smoke runs)."""
    compile_blocks: bool = False
    """Compile each transformer block on CUDA (the CPU's smoke runs stay eager: compiling there only costs time)."""
    needs_fp8: bool = False
    """Runs the FP8 mode: skipped, with the reason, where torchao or an FP8-capable device is missing."""


_SYNC_CONFIGURATIONS = (
    FP32,
    "lightning-bf16",
    "O1-bf16",
    "O2-bf16",
    "lightning-bf16-true",
    "lean-bf16",
    "lightning-fp16",
    "O1-fp16",
    "O2-fp16",
)
_SYNC_TARGETS = (
    *(Target("syncs", name, CONFIGURATIONS[name].builtin) for name in ("O1-bf16", "O2-bf16", "lean-bf16")),
    # lean keeps bf16 weights as bf16-true does: its step-time reference, so its sync reference too.
    Target("syncs", "lean-bf16", "lightning-bf16-true"),
    *(Target("syncs", name, CONFIGURATIONS[name].builtin) for name in ("O1-fp16", "O2-fp16")),
)


def _sync_figure(optimizer: OptimizerKind) -> Figure:
    return Figure(
        f"syncs-{optimizer}",
        f"host syncs per step, {optimizer} AdamW, launch-bound LM",
        "lm-small",
        _SYNC_CONFIGURATIONS,
        _SYNC_TARGETS,
        optimizer=optimizer,
        repeats=1,
        warmup=2,
        steps=1,
        sync_steps=10,
        share=0.1,
        smoke_configurations=("lightning-bf16", "O1-bf16") if optimizer == "fused" else (),
    )


def _monitor_figure(workload: str) -> Figure:
    budget = WORKLOADS[workload].budgets.monitors_percent
    return Figure(
        f"monitors-{workload}",
        f"the four monitors' cost, logging every 10 steps, {WORKLOADS[workload].description}",
        workload,
        ("O1-fp16", "O1-fp16+monitors"),
        (Target("mean-step", "O1-fp16+monitors", "O1-fp16", 1 + budget / 100),),
        steps=20,
        share=0.15 if workload == "lm-200m" else 0.1,
        smoke_configurations=("O1-fp16", "O1-fp16+monitors") if workload == "lm-small" else (),
    )


FIGURES: tuple[Figure, ...] = (
    Figure(
        "lm-200m",
        "219M-parameter LM (seq 1024, batch 8, fused AdamW): O1, O2 and lean against Lightning",
        "lm-200m",
        (FP32, "lightning-bf16", "O1-bf16", "O2-bf16", "lightning-bf16-true", "lean-bf16"),
        (
            Target("step", "O1-bf16", "lightning-bf16", 1.02),
            Target("step", "O2-bf16", "O1-bf16", 0.95),
            Target("peak", "O2-bf16", "O1-bf16", 0.92),
            Target("peak", "lean-bf16", FP32, 0.55),
            Target("step", "lean-bf16", "lightning-bf16-true", 1.05),
        ),
        optimizer="fused",
        share=0.3,
        smoke_configurations=("lightning-bf16", "O1-bf16", "O2-bf16"),
    ),
    Figure(
        "resnet50",
        "ResNet-50 (batch 256, channels_last, data on the device, foreach AdamW): O1 against Lightning",
        "resnet50",
        ("lightning-bf16", "O1-bf16", "lightning-fp16", "O1-fp16"),
        (Target("step", "O1-bf16", "lightning-bf16", 1.02), Target("step", "O1-fp16", "lightning-fp16", 1.02)),
        batch_size=256,
        optimizer="foreach",
        share=0.15,
    ),
    _sync_figure("fused"),
    _sync_figure("foreach"),
    _monitor_figure("lm-200m"),
    _monitor_figure("lm-small"),
    Figure(
        "fp8-lm-1b",
        "1B-parameter LM (seq 2048, batch 4, fused AdamW, each block compiled): FP8 against bf16 O1 and bare torchao",
        "lm-1b",
        ("O1-bf16", "fp8-tensorwise", "torchao-tensorwise", "fp8-tensorwise+monitor", "fp8-rowwise"),
        (
            Target("step", "fp8-tensorwise", "O1-bf16", 0.87),
            Target("step", "fp8-tensorwise", "torchao-tensorwise", 1.02),
            Target("peak", "fp8-tensorwise", "O1-bf16", 1.0),
            Target("mean-step", "fp8-tensorwise+monitor", "fp8-tensorwise", 1.02),
            Target("syncs", "fp8-tensorwise", "torchao-tensorwise"),
            Target("syncs", "fp8-tensorwise+monitor", "torchao-tensorwise"),
        ),
        optimizer="fused",
        # 50 timed steps hold one of the monitor's samples; the sync steps after them hold none.
        steps=50,
        sync_steps=5,
        share=0.1,
        smoke_configurations=("O1-bf16", "fp8-tensorwise", "torchao-tensorwise", "fp8-tensorwise+monitor"),
        compile_blocks=True,
        needs_fp8=True,
    ),
)
"""The figures the GPU proof measures, in the order it measures them."""


def fp8_skip_reason(device: str) -> str | None:
    """Why the FP8 figure cannot run on ``device`` here (torchao missing or too old, a GPU without FP8), or None."""
    from lightning_mp.fp8.convert import check_fp8_device, fp8_unavailable

    reason = fp8_unavailable()
    if reason is not None:
        return reason
    try:
        with arguments_of("gpu-proof"):
            check_fp8_device("tensorwise", device)
    except RuntimeError as error:
        return str(error)
    return None


def skipped_figure(figure: Figure, reason: str) -> dict[str, Any]:
    """The record of a figure that was not run, and why."""
    return {"kind": "figure", "name": figure.name, "title": figure.title, "skipped": reason, "cut": False}


def figure_spec(figure: Figure, device: str, smoke: bool) -> RunSpec:
    """What every run of ``figure`` trains: the full shape on CUDA, the tiny one on the CPU; few steps in smoke."""
    on_gpu = device == "cuda"
    return RunSpec(
        workload=figure.workload,
        size="full" if on_gpu else "tiny",
        accelerator="gpu" if on_gpu else "cpu",
        warmup=min(figure.warmup, 1) if smoke else figure.warmup,
        steps=min(figure.steps, 2) if smoke else figure.steps,
        sync_steps=min(figure.sync_steps, 2) if smoke else figure.sync_steps,
        # The tiny shape's batch stays tiny: the batch size is part of what makes the full shape full.
        batch_size=figure.batch_size if on_gpu else None,
        optimizer=figure.optimizer,
        compile_blocks=figure.compile_blocks and on_gpu,
    )


def run_figure(figure: Figure, device: str, smoke: bool, deadline: float) -> dict[str, Any]:
    """Run ``figure``'s configurations in paired, alternating repeats until done or ``deadline``; its record.

    ``deadline`` is a ``time.time()``. The record holds every run, the pooled rows of
    :func:`~lightning_mp.bench.report.summarize` and each target's verdict; ``cut`` says that runs were left out.
    """
    spec = figure_spec(figure, device, smoke)
    names = list(figure.smoke_configurations if smoke else figure.configurations)
    results: list[RunResult] = []
    seconds: dict[str, float] = {}
    cut = False
    for repeat in range(figure.repeats):
        for name in names if repeat % 2 == 0 else reversed(names):
            # A configuration's first run is the guide to its next; before that, the slowest run so far.
            if time.time() + seconds.get(name, max(seconds.values(), default=0.0)) > deadline:
                cut = True
                break
            start = time.perf_counter()
            results.append(run_configuration(name, spec, repeat=repeat))
            seconds[name] = time.perf_counter() - start
        if cut:
            break
    units, unit = step_units(spec)
    rows = summarize(results, units) if results else {}
    return {
        "kind": "figure",
        "name": figure.name,
        "title": figure.title,
        "workload": figure.workload,
        "shape": spec.shape().describe(),
        "optimizer": spec.optimizer or WORKLOADS[figure.workload].optimizer,
        "warmup": spec.warmup,
        "steps": spec.steps,
        "sync_steps": spec.sync_steps,
        "repeats_planned": figure.repeats,
        "repeats_done": _complete_repeats(results, names),
        "unit": unit,
        "cut": cut,
        "rows": [_row(summary) for summary in rows.values()],
        "targets": [judge(target, results, device == "cuda") for target in figure.targets if _ran(target, names)],
    }


def _complete_repeats(results: Sequence[RunResult], names: Sequence[str]) -> int:
    """Repeats in which every configuration ran (crashed runs count: they ran)."""
    done = {(r.configuration, r.repeat) for r in results}
    return sum(all((name, repeat) in done for name in names) for repeat in {r.repeat for r in results})


def _ran(target: Target, names: Sequence[str]) -> bool:
    return target.configuration in names and target.reference in names


def _row(summary: Any) -> dict[str, Any]:
    if summary.error is not None:
        return {"configuration": summary.name, "error": summary.error}
    return {
        "configuration": summary.name,
        "median_ms": summary.median_seconds * 1e3,
        "mean_ms": summary.mean_seconds * 1e3,
        "units_per_second": summary.units_per_second,
        "peak_mib": summary.peak_memory_mib,
        "syncs_per_step": summary.syncs_per_step,
        "final_loss": summary.final_loss,
        "runs": len(summary.run_medians_seconds),
        "crashes": summary.crashes,
    }


def judge(target: Target, results: Sequence[RunResult], on_gpu: bool) -> dict[str, Any]:
    """``target``'s measured value and verdict (``"met"``, ``"MISSED"`` or ``"not measured"``, with the reason)."""
    verdict: dict[str, Any] = {"target": target.describe(), "limit": target.limit, "measured": None, "detail": ""}
    ran = [r for r in results if r.error is None]
    mine = [r for r in ran if r.configuration == target.configuration]
    theirs = [r for r in ran if r.configuration == target.reference]
    if not mine or not theirs:
        return {**verdict, "verdict": "not measured", "detail": "a run of the pair crashed or was cut"}
    if target.kind == "peak":
        if not on_gpu:
            return {**verdict, "verdict": "not measured", "detail": "peak RSS in one process is no peak per run"}
        measured = statistics.median(r.peak_memory_mib for r in mine) / statistics.median(
            r.peak_memory_mib for r in theirs
        )
        met = measured <= target.limit
    elif target.kind == "syncs":
        counted = [r.syncs_per_step for r in (mine[0], theirs[0])]
        if counted[0] is None or counted[1] is None:
            return {**verdict, "verdict": "not measured", "detail": "host syncs were not counted"}
        measured = counted[0]
        met = counted[0] <= counted[1]
        verdict["detail"] = f"{counted[0]:.2f} against {counted[1]:.2f}"
    else:
        ratios = _paired_step_ratios(results, target)
        if not ratios:
            return {**verdict, "verdict": "not measured", "detail": "no repeat ran both"}
        measured = statistics.median(ratios)
        met = measured <= target.limit
        verdict["detail"] = f"paired {min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} repeat(s), " + resolution(
            [1 / ratio for ratio in ratios]
        )
    return {**verdict, "measured": measured, "verdict": "met" if met else "MISSED"}


def _paired_step_ratios(results: Sequence[RunResult], target: Target) -> list[float]:
    """Per repeat, the configuration's step time over the reference's: medians, or means for ``mean-step``."""
    if target.kind == "step":
        return [1 / speedup for speedup in paired_ratios(results, target.reference, target.configuration)]
    means = {(r.configuration, r.repeat): statistics.fmean(r.step_seconds) for r in results if r.step_seconds}
    return [
        means[target.configuration, repeat] / means[target.reference, repeat]
        for repeat in sorted({r.repeat for r in results})
        if (target.configuration, repeat) in means and (target.reference, repeat) in means
    ]
