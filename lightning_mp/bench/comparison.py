"""Step time of each configuration compared: paired, alternating, repeated runs, each in a fresh process by default.

How it compares:

1. Each run of a configuration (:func:`~lightning_mp.bench.timing.run_configuration`) is a fresh Python process
   (``--worker``, :func:`run_worker`), so peak memory belongs to that configuration alone. ``--quick`` and
   ``--in-process`` run everything in this process instead.
2. The runs alternate: repeat 1 runs the configurations in order, repeat 2 in reverse, and so on, so that a
   machine that slowly speeds up or slows down favours no configuration.
3. Ratios are speed-ups (above 1 is faster) and **paired** (:func:`paired_ratios`): each repeat runs every
   configuration back to back, and the ratio of their medians in that repeat is one paired ratio. A difference is
   *resolved* only when every paired ratio falls on the same side of 1.00x (:func:`resolution`); while one is not,
   :func:`run_all` adds repeats, up to ``--max-repeats``.
4. A configuration that raises is not retried: its row in the report says ``crash: <error>``, and the others run on.

With ``--profile`` one more run per configuration goes under ``torch.profiler`` (:func:`profile_all`), which
slows it: its breakdown says where each step's CPU time goes, not how long a step takes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_mp.bench.configurations import CONFIGURATIONS, FP32
from lightning_mp.bench.timing import CRASH, RunResult, RunSpec, run_configuration


def paired_ratios(results: Sequence[RunResult], reference: str, name: str) -> list[float]:
    """Per repeat, the reference's median step time over the configuration's: one speed-up per pair of runs.

    The two runs of a pair ran back to back in the same repeat, so a machine that speeds up or slows down between
    repeats moves both; the spread of the paired ratios is the uncertainty of the speed-up. Crashed runs pair with
    nothing.
    """
    medians: dict[tuple[str, int], float] = {
        (run.configuration, run.repeat): statistics.median(run.step_seconds) for run in results if run.step_seconds
    }
    repeats = sorted({run.repeat for run in results})
    return [
        medians[reference, repeat] / medians[name, repeat]
        for repeat in repeats
        if (reference, repeat) in medians and (name, repeat) in medians
    ]


def resolution(ratios: Sequence[float]) -> str:
    """Whether paired speed-ups resolve a difference: all on one side of 1.00x, over at least two pairs.

    Example:
        >>> resolution([0.05, 0.06, 0.04]), resolution([0.9, 1.1, 1.0]), resolution([1.9])
        ('resolved: slower', 'NOT resolved: the paired ratios straddle 1.00x', 'NOT resolved: one pair has no spread')

    """
    if len(ratios) < 2:
        return "NOT resolved: one pair has no spread" if ratios else "NOT resolved: no pairs"
    if min(ratios) > 1:
        return "resolved: faster"
    if max(ratios) < 1:
        return "resolved: slower"
    return "NOT resolved: the paired ratios straddle 1.00x"


def worker_command(name: str, spec: RunSpec, threads: int, result_file: Path, profile: bool = False) -> list[str]:
    """The command line of a worker process that runs configuration ``name`` of ``spec`` once."""
    command = [sys.executable, "-m", "lightning_mp.bench", "--worker", name, "--result-file", str(result_file)]
    command += ["--workload", spec.workload, "--accelerator", spec.accelerator, "--size", spec.size]
    command += ["--warmup", str(spec.warmup), "--steps", str(spec.steps), "--sync-steps", str(spec.sync_steps)]
    command += ["--seed", str(spec.seed), "--threads", str(threads)]
    if spec.batch_size is not None:
        command += ["--batch-size", str(spec.batch_size)]
    if spec.optimizer is not None:
        command += ["--optimizer", spec.optimizer]
    if spec.compile:
        command.append("--compile")
    if spec.compile_blocks:
        command.append("--compile-blocks")
    return [*command, "--profile"] if profile else command


def run_worker(name: str, spec: RunSpec, threads: int, result_file: Path, profile: bool = False) -> RunResult:
    """Run configuration ``name`` of ``spec`` once in a fresh process; a process that fails gives a crashed result."""
    completed = subprocess.run(
        worker_command(name, spec, threads, result_file, profile), capture_output=True, text=True, check=False
    )
    if completed.returncode != 0:
        # A worker that dies outside Python's reach (a CUDA fault, the OOM killer) leaves its last words on stderr.
        last_line = next((line for line in reversed(completed.stderr.splitlines()) if line.strip()), "")
        return RunResult.crashed(name, f"exit code {completed.returncode}: {last_line.strip()}")
    return RunResult(**json.loads(result_file.read_text()))


def unresolved_comparisons(results: Sequence[RunResult], configurations: Sequence[str]) -> list[str]:
    """The comparisons the report will make (against fp32 and the built-in) that the paired ratios do not resolve.

    A comparison with a configuration that crashed is left out: more repeats cannot resolve it.
    """
    crashed = {result.configuration for result in results if result.error is not None}
    unresolved = []
    for name in configurations:
        for reference in (FP32, CONFIGURATIONS[name].builtin):
            if reference == name or reference not in configurations or {name, reference} & crashed:
                continue
            if resolution(paired_ratios(results, reference, name)).startswith("NOT"):
                unresolved.append(f"{name} vs {reference}")
    return list(dict.fromkeys(unresolved))


def _progress_line(result: RunResult, count: int, seconds: float) -> str:
    where = f"[{count}] {result.configuration} (repeat {result.repeat + 1}):"
    if result.error is not None:
        return f"{where} {CRASH}{result.error} ({seconds:.1f} s)"
    wait = "n/a" if result.wait_share is None else format(result.wait_share, ".0%")
    return (
        f"{where} median {statistics.median(result.step_seconds) * 1e3:.1f} ms/step,"
        f" peak {result.peak_memory_mib:,.0f} MiB, final loss {result.final_loss:.4f}"
        f" ({seconds:.1f} s, CPU share {result.cpu_share:.0%}, run-queue wait {wait},"
        f" load {os.getloadavg()[0]:.2f})"
    )


def run_all(args: argparse.Namespace, spec: RunSpec, configurations: Sequence[str]) -> list[RunResult]:
    """Run every configuration in paired repeats, alternating the order; in worker processes or in this one.

    After ``args.repeats`` repeats, it adds repeats while a comparison is not resolved, up to ``args.max_repeats``.
    A configuration that crashed is not run again.
    """
    results: list[RunResult] = []
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.max_repeats):
            if repeat >= args.repeats:
                unresolved = unresolved_comparisons(results, configurations)
                if not unresolved:
                    break
                print(
                    f"not resolved after {repeat} repeats: {', '.join(unresolved)}; adding repeat {repeat + 1}"
                    f" (at most {args.max_repeats})",
                    file=sys.stderr,
                    flush=True,
                )
            crashed = {result.configuration for result in results if result.error is not None}
            order = list(configurations) if repeat % 2 == 0 else list(reversed(configurations))
            for name in (name for name in order if name not in crashed):
                start = time.perf_counter()
                if args.in_process:
                    result = run_configuration(name, spec, threads=args.threads, repeat=repeat)
                else:
                    result = run_worker(name, spec, args.threads, Path(scratch) / f"{name}-{repeat}.json")
                    result.repeat = repeat
                results.append(result)
                print(_progress_line(result, len(results), time.perf_counter() - start), file=sys.stderr, flush=True)
    return results


def profile_all(args: argparse.Namespace, spec: RunSpec, configurations: Sequence[str]) -> dict[str, dict[str, Any]]:
    """One extra run per configuration under ``torch.profiler``: where each step's CPU time goes (crashes left out)."""
    breakdowns = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name in configurations:
            result = run_worker(name, spec, args.threads, Path(scratch) / f"{name}-profile.json", profile=True)
            if result.profile is None:
                continue
            breakdowns[name] = result.profile
            print(f"[profile] {name}: {result.profile['total_ms']:.1f} ms of CPU per step", file=sys.stderr, flush=True)
    return breakdowns
