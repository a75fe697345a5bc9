"""The Markdown report of the timing benchmark: the table, the paired differences, the targets and the warnings.

Pure functions of the measurements (:class:`~lightning_mp.bench.timing.RunResult`), so that they can be tested
without training anything. :func:`summarize` pools each configuration's runs: the median step of all its timed
steps, the mean (which also counts the occasional expensive logging step), the median of the paired speed-ups
against strict fp32 and against its reference at the same precision (Lightning's built-in plugin) with their range.
A configuration that crashed keeps its row, which says ``crash: <error>``, and takes part in no comparison.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_mp.bench.comparison import paired_ratios, resolution
from lightning_mp.bench.configurations import CONFIGURATIONS, FP32
from lightning_mp.bench.machine import load_warnings
from lightning_mp.bench.timing import CRASH, RunResult
from lightning_mp.bench.workloads import TimeBudgets

DEFAULT_BUDGETS = TimeBudgets()


@dataclass
class Summary:
    """One configuration's measurements pooled over its repeats.

    ``error`` is set, and the measurements are NaN, where every run crashed; ``crashes`` lists the errors of the runs
    that crashed, by repeat, also where others finished.
    """

    name: str
    median_seconds: float
    mean_seconds: float
    units_per_second: float
    peak_memory_mib: float
    training_memory_mib: float
    final_loss: float
    run_medians_seconds: list[float]
    step_count: int
    cpu_share: float = float("nan")
    wait_share: float | None = None
    vs_fp32: float | None = None
    vs_builtin: float | None = None
    paired_vs_fp32: list[float] = field(default_factory=list)
    paired_vs_builtin: list[float] = field(default_factory=list)
    syncs_per_step: float | None = None
    error: str | None = None
    crashes: list[str] = field(default_factory=list)


def summarize(results: Sequence[RunResult], units_per_step: int) -> dict[str, Summary]:
    """Pool the runs of each configuration and compute the ratios to fp32 and to Lightning's built-in.

    ``units_per_step`` is the tokens or images of one step, for the throughput.
    """
    summaries: dict[str, Summary] = {}
    for name in dict.fromkeys(result.configuration for result in results):
        runs = [result for result in results if result.configuration == name and result.error is None]
        crashes = [
            f"repeat {result.repeat + 1}: {result.error}"
            for result in results
            if result.configuration == name and result.error is not None
        ]
        if not runs:
            error = next(result.error for result in results if result.configuration == name)
            nan = float("nan")
            summaries[name] = Summary(name, nan, nan, nan, nan, nan, nan, [], 0, error=error, crashes=crashes)
            continue
        syncs = [run.syncs_per_step for run in runs if run.syncs_per_step is not None]
        seconds = [s for run in runs for s in run.step_seconds]
        median = statistics.median(seconds)
        wait_shares = [run.wait_share for run in runs if run.wait_share is not None]
        summaries[name] = Summary(
            name=name,
            median_seconds=median,
            mean_seconds=statistics.fmean(seconds),
            units_per_second=units_per_step / median,
            peak_memory_mib=statistics.median(run.peak_memory_mib for run in runs),
            training_memory_mib=statistics.median(run.peak_memory_mib - run.pre_fit_memory_mib for run in runs),
            final_loss=statistics.median(run.final_loss for run in runs),
            run_medians_seconds=[statistics.median(run.step_seconds) for run in runs],
            step_count=len(seconds),
            cpu_share=min(run.cpu_share for run in runs),
            wait_share=max(wait_shares) if len(wait_shares) == len(runs) else None,
            syncs_per_step=statistics.median(syncs) if syncs else None,
            crashes=crashes,
        )
    for summary in summaries.values():
        if summary.error is not None:
            continue
        if FP32 in summaries and summaries[FP32].error is None:
            summary.paired_vs_fp32 = paired_ratios(results, FP32, summary.name)
            summary.vs_fp32 = statistics.median(summary.paired_vs_fp32)
        builtin = CONFIGURATIONS[summary.name].builtin
        if builtin in summaries and summaries[builtin].error is None:
            summary.paired_vs_builtin = paired_ratios(results, builtin, summary.name)
            summary.vs_builtin = statistics.median(summary.paired_vs_builtin)
    return summaries


def _ratio(value: float | None, paired: Sequence[float] = ()) -> str:
    if value is None:
        return "-"
    if len(paired) < 2:
        return f"{value:.2f}x"
    return f"{value:.2f}x ({min(paired):.2f}-{max(paired):.2f})"


def markdown_table(
    summaries: dict[str, Summary], accelerator: str, unit: str = "tokens", gpu_workload: bool = False
) -> str:
    """The results as a Markdown table, one row per configuration; a crashed one says ``crash: <error>``.

    ``unit`` names the throughput column (``tokens`` or ``images``). A GPU workload's table adds the peak memory
    over strict fp32's and the host syncs per step.
    """
    memory = "peak CUDA alloc (MiB)" if accelerator == "gpu" else "peak RSS (MiB)"
    training = "peak over pre-fit (MiB)"
    header = (
        f"| configuration | median step (ms) | mean step (ms) | run medians (ms) | {unit}/s | vs fp32 (paired range)"
        f" | vs Lightning built-in (paired range) | {memory} | {training} | final loss | CPU share | run-queue wait |"
    )
    columns = 12
    if gpu_workload:
        header += " peak vs fp32 | host syncs / step |"
        columns += 2
    lines = [header, "|---|" + "---:|" * (columns - 1)]
    fp32 = summaries.get(FP32)
    for s in summaries.values():
        if s.error is not None:
            error = s.error.replace("|", "\\|")
            lines.append(f"| {s.name} | {CRASH}{error} |" + " - |" * (columns - 2))
            continue
        spread = f"{min(s.run_medians_seconds) * 1e3:.1f}-{max(s.run_medians_seconds) * 1e3:.1f}"
        row = (
            f"| {s.name} | {s.median_seconds * 1e3:.1f} | {s.mean_seconds * 1e3:.1f} | {spread}"
            f" | {s.units_per_second:,.0f}"
            f" | {_ratio(s.vs_fp32, s.paired_vs_fp32)} | {_ratio(s.vs_builtin, s.paired_vs_builtin)}"
            f" | {s.peak_memory_mib:,.0f} | {s.training_memory_mib:,.1f} | {s.final_loss:.4f} | {s.cpu_share:.0%}"
            f" | {'n/a' if s.wait_share is None else format(s.wait_share, '.0%')} |"
        )
        if gpu_workload:
            peak_ratio = (
                "-" if fp32 is None or fp32.error is not None else f"{s.peak_memory_mib / fp32.peak_memory_mib:.3f}"
            )
            syncs = "-" if s.syncs_per_step is None else f"{s.syncs_per_step:.2f}"
            row += f" {peak_ratio} | {syncs} |"
        lines.append(row)
    return "\n".join(lines)


def target_lines(summaries: dict[str, Summary], accelerator: str, budgets: TimeBudgets = DEFAULT_BUDGETS) -> list[str]:
    """Each target with its measured value, for the configurations that ran without crashing.

    ``budgets`` says what the monitors and O1 may add to a step (more on the launch-bound LM).
    """
    ran = {name: summary for name, summary in summaries.items() if summary.error is None}
    lines = []

    def verdict(met: bool) -> str:
        return "met" if met else "MISSED"

    def time_cost(claim: str, name: str, reference: str, budget: float, judge_mean: bool, note: str = "") -> str:
        """``claim`` with the extra step time of ``name`` over ``reference``, median and mean, against ``budget``."""
        a, b = ran[name], ran[reference]
        median = (a.median_seconds / b.median_seconds - 1) * 100
        mean = (a.mean_seconds / b.mean_seconds - 1) * 100
        met = median <= budget and (mean <= budget or not judge_mean)
        return f"{claim}: {median:+.1f}% on the median, {mean:+.1f}% on the mean{note} -> {verdict(met)}"

    for monitored, bare in (("O1-bf16+monitors", "O1-bf16"), ("O1-fp16+monitors", "O1-fp16")):
        if {monitored, bare} <= ran.keys():
            budget = budgets.monitors_percent
            claim = f"{monitored}: monitors cost at most {budget:g}% of step time"
            lines.append(time_cost(claim, monitored, bare, budget, judge_mean=True))
    for o1, builtin in (("O1-bf16", "lightning-bf16"), ("O1-fp16", "lightning-fp16")):
        if {o1, builtin} <= ran.keys():
            gap = budgets.builtin_gap_percent
            claim = f"{o1} at most {gap:g}% slower than Lightning's built-in"
            lines.append(time_cost(claim, o1, builtin, gap, judge_mean=False, note=" (negative is faster)"))
        o1_syncs = ran[o1].syncs_per_step if o1 in ran else None
        builtin_syncs = ran[builtin].syncs_per_step if builtin in ran else None
        if o1_syncs is not None and builtin_syncs is not None:
            lines.append(
                f"{o1} host syncs per step no more than Lightning's built-in: {o1_syncs:.2f} against"
                f" {builtin_syncs:.2f} -> {verdict(o1_syncs <= builtin_syncs)}"
            )
    if {"O2-bf16", FP32} <= ran.keys():
        speedup = ran["O2-bf16"].vs_fp32
        assert speedup is not None
        lines.append(f"O2 bf16 at least 2.0x as fast as fp32: {speedup:.2f}x -> {verdict(speedup >= 2.0)}")
        o2, fp32 = ran["O2-bf16"], ran[FP32]
        if accelerator == "gpu":
            cut = (1 - o2.peak_memory_mib / fp32.peak_memory_mib) * 100
            lines.append(f"O2 cuts peak memory by at least 40%: {cut:.0f}% -> {verdict(cut >= 40)}")
        else:
            cut = (1 - o2.training_memory_mib / fp32.training_memory_mib) * 100 if fp32.training_memory_mib else 0.0
            whole = (1 - o2.peak_memory_mib / fp32.peak_memory_mib) * 100
            lines.append(
                f"O2 cuts peak memory by at least 40%: {cut:.0f}% of the memory training adds, {whole:.0f}% of the"
                f" whole process's peak RSS -> {verdict(cut >= 40)}"
            )
    return lines


@dataclass(frozen=True)
class ReportContext:
    """What the report says about the runs besides their measurements.

    Attributes:
        model: the model in words (its class, size and shape).
        unit: what a step processes, ``"tokens"`` or ``"images"``.
        accelerator: ``"cpu"`` or ``"gpu"``.
        warmup: untimed steps per run.
        steps: timed steps per run.
        repeats: alternating repeats that ran.
        machine: lines naming the machine (:func:`~lightning_mp.bench.machine.machine_description`).
        rates: matrix-product GFLOP/s per dtype.
        matmul_size: the matrix products' size.
        load: the load averages at the start and at the end.
        threads: torch threads of the runs.
        in_process: whether the runs shared this process.
        gpu_workload: a GPU-sized workload (adds peak over fp32 and host syncs to the table).
        budgets: what the targets let the monitors and O1 add to a step.
        sync_steps: the steps in which host syncs were counted (0: not counted).

    """

    model: str
    unit: str
    accelerator: str
    warmup: int
    steps: int
    repeats: int
    machine: list[str]
    rates: dict[str, float]
    matmul_size: int
    load: tuple[tuple[float, ...], tuple[float, ...]]
    threads: int
    in_process: bool = False
    gpu_workload: bool = False
    budgets: TimeBudgets = DEFAULT_BUDGETS
    sync_steps: int = 0


def report(summaries: dict[str, Summary], context: ReportContext, breakdowns: dict[str, dict[str, Any]]) -> str:
    """The whole Markdown report: machine, load and its warnings, sizes, table, resolved differences, targets."""
    rate_text = ", ".join(f"{label} {rate:,.1f}" for label, rate in context.rates.items())
    ran = {name: summary for name, summary in summaries.items() if summary.error is None}
    cpu_shares = {name: summary.cpu_share for name, summary in ran.items()}
    wait_shares = {name: summary.wait_share for name, summary in ran.items()}
    loud = load_warnings(context.load[0], context.load[1], cpu_shares, os.cpu_count() or 1, wait_shares)
    where = "all runs in this one process" if context.in_process else "each run in its own process"
    size = context.matmul_size
    parts = [
        "### lightning_mp benchmark",
        "",
        *(f"**{line}**" + "\n" for line in loud),
        *(f"- {line}" for line in context.machine),
        f"- Matrix product {size}x{size} with {context.threads} thread(s), as in training, GFLOP/s: {rate_text}",
        f"- Load average (1, 5, 15 min): {_load_text(context.load[0])} at the start, {_load_text(context.load[1])} at"
        " the end; per configuration in the table: CPU share (CPU time over wall time x threads, the lowest run) and"
        " run-queue wait (time ready to run but waiting for a core, over runnable time, the highest run)",
        f"- Model: {context.model}; {context.warmup} warm-up and {context.steps} timed steps per run,"
        f" {context.repeats} alternating repeats per configuration, {where}",
        "- Configurations: " + "; ".join(f"{name}: {CONFIGURATIONS[name].description}" for name in summaries),
        *_sync_line(context),
        "",
        markdown_table(summaries, context.accelerator, context.unit, context.gpu_workload),
        *(
            f"\n**{name} crashed in {len(s.crashes)} run(s) ({'; '.join(s.crashes)}); its figures are from the runs"
            " that finished.**"
            for name, s in ran.items()
            if s.crashes
        ),
        "",
        "Differences (median of the paired speed-ups, their range, and whether they are resolved):",
        "",
        *(f"- {line}" for line in difference_lines(summaries)),
    ]
    targets = target_lines(summaries, context.accelerator, context.budgets)
    if targets:
        parts += ["", "Targets:", "", *(f"- {line}" for line in targets)]
    if breakdowns:
        parts += ["", "Where the time goes (torch.profiler, one extra run each):", ""]
        parts += [f"- {line}" for line in profile_lines(breakdowns)]
    return "\n".join(parts) + "\n"


def _sync_line(context: ReportContext) -> list[str]:
    if not context.sync_steps:
        return []
    how = (
        'torch.cuda.set_sync_debug_mode("warn"), one warning per operation that made the host wait'
        if context.accelerator == "gpu"
        else "lightning_mp.bench.counting (host reads of tensor values)"
    )
    return [f"- Host syncs per step: counted over {context.sync_steps} steps after the timed ones with {how}"]


def difference_lines(summaries: dict[str, Summary]) -> list[str]:
    """One line per comparison the table reports: the paired speed-up, its range and whether it is resolved."""
    lines = []
    for s in summaries.values():
        comparisons = ((FP32, s.paired_vs_fp32), (CONFIGURATIONS[s.name].builtin, s.paired_vs_builtin))
        for reference, paired in comparisons:
            if reference == s.name or not paired:
                continue
            verdict = resolution(paired)
            advice = "; run more --repeats or on an idle machine" if verdict.startswith("NOT") else ""
            lines.append(
                f"{s.name} vs {reference}: {statistics.median(paired):.2f}x, paired range {min(paired):.2f}-"
                f"{max(paired):.2f} over {len(paired)} repeat(s): {verdict}{advice}"
            )
    return lines


def _load_text(load: tuple[float, ...]) -> str:
    return " / ".join(f"{value:.2f}" for value in load)


def profile_lines(breakdowns: dict[str, dict[str, Any]]) -> list[str]:
    """One line per configuration: CPU time per step, the share of matrix products, the casts and the top ops."""
    lines = []
    for name, b in breakdowns.items():
        total = b["total_ms"]
        top = ", ".join(f"`{key}` {ms:.1f}" for key, ms in b["top"])
        lines.append(
            f"{name}: {total:.1f} ms CPU per step; matrix products and attention {b['matmul_ms']:.1f} ms"
            f" ({b['matmul_ms'] / total:.0%}), casts {b['cast_ms']:.1f} ms; top ops (ms): {top}"
        )
    return lines
