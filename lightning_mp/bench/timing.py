"""Step time of each configuration: paired, alternating, repeated runs, each in a fresh process by default.

How it measures:

1. Each run of a configuration is a fresh Python process (``--worker``), so peak memory belongs to that
   configuration alone: the peak resident set size on the CPU, and ``torch.cuda.max_memory_allocated`` (reset
   before each run) on CUDA. ``--quick`` and ``--in-process`` run everything in this process instead.
2. The runs alternate: repeat 1 runs the configurations in order, repeat 2 in reverse, and so on, so that a
   machine that slowly speeds up or slows down favours no configuration.
3. A step's time is the time between the ends of two consecutive training batches (data loading, forward,
   backward, optimizer step and every callback included; on CUDA the device is synchronised first), measured by
   :class:`StepTimer`. The first ``--warmup`` steps of each run are dropped; the report gives the median of the
   rest, pooled over the repeats, and the mean, which also counts the occasional expensive logging step.
4. Ratios are speed-ups (above 1 is faster) and **paired** (:func:`paired_ratios`): each repeat runs every
   configuration back to back, and the ratio of their medians in that repeat is one paired ratio. A difference is
   *resolved* only when every paired ratio falls on the same side of 1.00x (:func:`resolution`); while one is not,
   :func:`run_all` adds repeats, up to ``--max-repeats``.
5. On the GPU workloads, :class:`SyncCounter` counts host syncs over ``--sync-steps`` more steps after the timed
   ones (counting slows a step, so it never overlaps the timing): on CUDA with
   ``torch.cuda.set_sync_debug_mode("warn")``, which warns at every operation that makes the host wait for the
   device, and on the CPU with :func:`lightning_mp.bench.counting.count_syncs_and_ops`, which counts host reads of
   tensor values (there the foreach optimizers' reads of their CPU step counters count too; on CUDA they are no sync).
6. A configuration that raises is not retried: its row in the report says ``crash: <error>``, and the others run on.

With ``--profile`` one more run per configuration goes under ``torch.profiler`` (:class:`StepProfiler`), which
slows it: its breakdown says where each step's CPU time goes, not how long a step takes.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from typing_extensions import override

from lightning_mp.bench.configurations import CONFIGURATIONS, FP32, MONITOR_EVERY_N_STEPS, float32_matmul
from lightning_mp.bench.counting import StepCounts, count_syncs_and_ops
from lightning_mp.bench.machine import current_rss_mib, peak_rss_mib, scheduler_seconds
from lightning_mp.bench.workloads import (
    MARKOV,
    QUIET_TRAINER,
    SIZES,
    WORKLOADS,
    OptimizerKind,
    RepeatedBatch,
    Shape,
    WorkloadModule,
    markov_task,
    workload_shape,
)

CRASH = "crash: "
"""How the report starts the row of a configuration whose run raised."""
_SYNC_WARNING = "called a synchronizing CUDA operation"
"""What ``torch.cuda.set_sync_debug_mode("warn")`` says at each operation that makes the host wait."""


@dataclass(frozen=True)
class RunSpec:
    """What every run of a benchmark trains, apart from the configuration: the workload, its size and the steps.

    Attributes:
        workload: ``"markov"`` or a GPU workload's name (:data:`~lightning_mp.bench.workloads.WORKLOADS`).
        size: a Markov size (:data:`~lightning_mp.bench.workloads.SIZES`), or ``"full"``/``"tiny"`` for a GPU
            workload.
        accelerator: ``"cpu"`` or ``"gpu"``.
        warmup: untimed steps per run.
        steps: timed steps per run.
        seed: seeds the model and the data.
        sync_steps: steps after the timed ones in which host syncs are counted (0: not counted).
        batch_size: replaces the GPU workload's batch size (None: its own).
        optimizer: replaces the GPU workload's AdamW implementation (None: its own).
        compile: compiles the model's forward with ``torch.compile`` (``nn.Module.compile``).
        compile_blocks: compiles each of a GPU language model's transformer blocks instead of the whole forward, as
            large-model trainers do: the blocks are alike, so they share one compiled graph and the compile time does
            not grow with the depth.

    """

    workload: str = MARKOV
    size: str = "tiny"
    accelerator: str = "cpu"
    warmup: int = 3
    steps: int = 20
    seed: int = 0
    sync_steps: int = 0
    batch_size: int | None = None
    optimizer: OptimizerKind | None = None
    compile: bool = False
    compile_blocks: bool = False

    def shape(self) -> Shape:
        """The GPU workload's shape at this size and batch size."""
        return workload_shape(self.workload, "full" if self.size == "full" else "tiny", self.batch_size)


class StepTimer(L.Callback):
    """Record the wall time between the ends of consecutive training batches, and the last timed batch's loss.

    Only the first ``batches`` batches are timed (None: all), so that later steps (the sync counting) are not.
    Each step's process CPU time and the scheduler's run and wait times (:func:`scheduler_seconds`) are recorded
    beside it, so that a run can say how much of its time it spent waiting for a core.

    The loss stays a tensor until training ends, so that reading it adds no host synchronisation to the steps.
    """

    def __init__(self, synchronize: bool, batches: int | None = None) -> None:
        self.synchronize = synchronize
        self.batches = batches
        self.step_seconds: list[float] = []
        self.step_cpu_seconds: list[float] = []
        self.last_loss: torch.Tensor | None = None
        self._last_end: float | None = None
        self._last_cpu: float | None = None
        self.scheduler_by_step: list[tuple[float, float] | None] = []

    def _now(self) -> float:
        if self.synchronize:
            torch.cuda.synchronize()
        return time.perf_counter()

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._last_end is None:
            self._last_end = self._now()
            self._last_cpu = time.process_time()
            self.scheduler_by_step.append(scheduler_seconds())

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.batches is not None and batch_idx >= self.batches:
            return
        now, cpu = self._now(), time.process_time()
        assert self._last_end is not None and self._last_cpu is not None
        self.step_seconds.append(now - self._last_end)
        self.step_cpu_seconds.append(cpu - self._last_cpu)
        self._last_end, self._last_cpu = now, cpu
        self.scheduler_by_step.append(scheduler_seconds())
        self.last_loss = outputs["loss"].detach()

    def wait_share(self, first_step: int) -> float | None:
        """Share of runnable time spent waiting for a core, from the start of step ``first_step`` to the last end."""
        start, end = self.scheduler_by_step[first_step], self.scheduler_by_step[-1]
        if start is None or end is None:
            return None
        running, waiting = end[0] - start[0], end[1] - start[1]
        return waiting / (running + waiting) if running + waiting > 0 else None

    @property
    def final_loss(self) -> float:
        """The loss of the last training batch; NaN before the first."""
        return float("nan") if self.last_loss is None else float(self.last_loss)


_MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul")
_CAST_OPS = ("aten::copy_", "aten::_to_copy")


class StepProfiler(L.Callback):
    """Run ``torch.profiler`` over the timed steps and split each step's CPU time into where it went.

    Matrix products include attention (``scaled_dot_product`` kernels); casts are ``copy_`` and ``_to_copy``
    (autocast's casts, O2's half copies of the weights). Times are self times, so nothing is counted twice.
    """

    def __init__(self, first_batch: int, last_batch: int) -> None:
        self.first_batch = first_batch
        self.last_batch = last_batch
        self.breakdown: dict[str, Any] | None = None
        self._profiler: torch.profiler.profile | None = None

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.first_batch:
            self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self._profiler.__enter__()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx != self.last_batch or self._profiler is None:
            return
        self._profiler.__exit__(None, None, None)
        steps = self.last_batch - self.first_batch + 1
        events = self._profiler.key_averages()

        def milliseconds(keep: Callable[[str], bool]) -> float:
            return sum(event.self_cpu_time_total for event in events if keep(event.key)) / steps / 1e3

        top = sorted(events, key=lambda event: -event.self_cpu_time_total)[:3]
        self.breakdown = {
            "total_ms": milliseconds(lambda key: True),
            "matmul_ms": milliseconds(lambda key: key in _MATMUL_OPS or "scaled_dot_product" in key),
            "cast_ms": milliseconds(lambda key: key in _CAST_OPS),
            "top": [(event.key, event.self_cpu_time_total / steps / 1e3) for event in top],
        }


class SyncCounter(L.Callback):
    """Count the host syncs of ``batches`` training batches from ``first_batch`` on, hooks to hooks.

    On CUDA it turns on ``torch.cuda.set_sync_debug_mode("warn")`` and counts the warnings it raises, one per
    operation that made the host wait for the device; on the CPU it counts host reads of tensor values with
    :func:`lightning_mp.bench.counting.count_syncs_and_ops`. Either way the counting slows the steps, so the timed steps
    come before it.
    """

    def __init__(self, first_batch: int, batches: int, on_cuda: bool) -> None:
        self.first_batch = first_batch
        self.batches = batches
        self.on_cuda = on_cuda
        self.syncs_per_step: float | None = None
        self._region: contextlib.ExitStack | None = None
        self._caught: list[warnings.WarningMessage] = []
        self._counts: StepCounts | None = None

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx != self.first_batch:
            return
        self._region = contextlib.ExitStack()
        if self.on_cuda:
            self._caught = self._region.enter_context(warnings.catch_warnings(record=True))
            warnings.simplefilter("always")
            self._region.callback(torch.cuda.set_sync_debug_mode, torch.cuda.get_sync_debug_mode())
            torch.cuda.set_sync_debug_mode("warn")
        else:
            self._counts = self._region.enter_context(count_syncs_and_ops())

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx != self.first_batch + self.batches - 1 or self._region is None:
            return
        self._close()
        if self.on_cuda:
            syncs = sum(_SYNC_WARNING in str(caught.message) for caught in self._caught)
        else:
            assert self._counts is not None
            syncs = self._counts.syncs
        self.syncs_per_step = syncs / self.batches

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self._region is not None:
            self._region.close()
            self._region = None


@dataclass
class RunResult:
    """What one run measured for one configuration (the JSON a worker process writes).

    ``error`` is set, and the measurements are empty, where the run raised.
    """

    configuration: str
    step_seconds: list[float]
    final_loss: float
    peak_memory_mib: float
    pre_fit_memory_mib: float
    profile: dict[str, Any] | None = None
    step_cpu_seconds: list[float] = field(default_factory=list)
    threads: int = 1
    repeat: int = 0
    wait_share: float | None = None
    """Share of the threads' runnable time spent waiting for a core (None where it cannot be read)."""
    syncs_per_step: float | None = None
    """Host syncs per training step, counted after the timed steps (None: not counted)."""
    error: str | None = None
    """The exception the run raised, as ``"Type: message"`` (None: it ran)."""

    @property
    def cpu_share(self) -> float:
        """CPU time over ``wall time x threads`` in the timed steps: 1.0 when the run had its cores to itself."""
        wall = sum(self.step_seconds) * self.threads
        return sum(self.step_cpu_seconds) / wall if wall > 0 else float("nan")

    @classmethod
    def crashed(cls, configuration: str, error: str, repeat: int = 0) -> RunResult:
        """The result of a run that raised ``error``: no measurements."""
        nan = float("nan")
        return cls(configuration, [], nan, nan, nan, repeat=repeat, error=error)


def describe_error(error: BaseException) -> str:
    """``"Type: first line of the message"``, the form the report's crash rows take."""
    message = str(error).strip().splitlines()
    return f"{type(error).__name__}: {message[0]}" if message else type(error).__name__


def step_units(spec: RunSpec) -> tuple[int, str]:
    """How much work one training step of ``spec`` is: ``(count, "tokens" or "images")``."""
    if spec.workload == MARKOV:
        size = SIZES[spec.size]
        return size.batch_size * size.seq_len, "tokens"
    shape = spec.shape()
    return shape.units_per_step(), shape.unit


def run_configuration(
    name: str, spec: RunSpec, profile: bool = False, threads: int | None = None, repeat: int = 0
) -> RunResult:
    """Train ``spec.warmup + spec.steps`` optimizer steps under configuration ``name`` in this process and time them.

    With ``spec.sync_steps``, that many more steps follow in which host syncs are counted. With ``profile``, the
    timed steps also run under ``torch.profiler``, which slows them: use such a run for the breakdown, not for the
    timings. ``threads`` sets torch's intra-op threads for the run (None keeps the current number); the previous
    number is restored afterwards, as is the TF32 setting of the configuration. A run that raises returns
    :meth:`RunResult.crashed` with the error instead of raising.
    """
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with float32_matmul(CONFIGURATIONS[name].float32_matmul):
            return _train_and_measure(name, spec, profile, repeat)
    except Exception as error:
        return RunResult.crashed(name, describe_error(error), repeat)
    finally:
        torch.set_num_threads(previous_threads)
        if spec.accelerator == "gpu":
            gc.collect()
            torch.cuda.empty_cache()


def _task(spec: RunSpec, total_steps: int) -> tuple[L.LightningModule, Callable[[L.Trainer, Any], None]]:
    """The model of ``spec``, and how to fit it on its data: the Markov text, or a batch repeated on the device."""
    if spec.workload == MARKOV:
        data, model = markov_task(SIZES[spec.size], total_steps, spec.seed)
        return model, lambda trainer, module: trainer.fit(module, datamodule=data)
    shape = spec.shape()
    module = WorkloadModule(shape.build(), spec.optimizer or WORKLOADS[spec.workload].optimizer)
    device = torch.device("cuda" if spec.accelerator == "gpu" else "cpu")
    batches = RepeatedBatch(shape, total_steps, device, spec.seed)
    return module, lambda trainer, module: trainer.fit(module, train_dataloaders=batches)


def _train_and_measure(name: str, spec: RunSpec, profile: bool, repeat: int) -> RunResult:
    config = CONFIGURATIONS[name]
    on_cuda = spec.accelerator == "gpu"
    L.seed_everything(spec.seed, verbose=False)
    timed_steps = spec.warmup + spec.steps
    total_steps = timed_steps + spec.sync_steps
    model, fit = _task(spec, total_steps)
    timer = StepTimer(synchronize=on_cuda, batches=timed_steps)
    extra_callbacks: list[L.Callback] = [timer]
    if profile:
        profiler = StepProfiler(first_batch=spec.warmup, last_batch=timed_steps - 1)
        extra_callbacks.append(profiler)
    sync_counter = SyncCounter(first_batch=timed_steps, batches=spec.sync_steps, on_cuda=on_cuda)
    if spec.sync_steps:
        extra_callbacks.append(sync_counter)
    arguments = config.trainer_arguments()
    with tempfile.TemporaryDirectory() as log_dir:
        trainer = L.Trainer(
            accelerator=spec.accelerator,
            devices=1,
            max_steps=total_steps,
            log_every_n_steps=5 if spec.workload == MARKOV else MONITOR_EVERY_N_STEPS,
            **{**QUIET_TRAINER, "logger": TensorBoardLogger(log_dir, name="bench")},
            **{**arguments, "callbacks": [*extra_callbacks, *arguments.get("callbacks", [])]},
        )
        if on_cuda:
            torch.cuda.reset_peak_memory_stats()
            pre_fit = torch.cuda.memory_allocated() / 2**20
        else:
            pre_fit = current_rss_mib()
        if config.prepare_network is not None:
            config.prepare_network(model.network if isinstance(model, WorkloadModule) else model)
        if spec.compile or spec.compile_blocks:
            # Each run compiles afresh: in one process, earlier runs' graphs would otherwise count towards dynamo's
            # recompile limit, past which it silently runs eagerly.
            torch.compiler.reset()
        if spec.compile_blocks and isinstance(model, WorkloadModule) and hasattr(model.network, "blocks"):
            for block in model.network.get_submodule("blocks").children():
                block.compile()
        elif spec.compile or spec.compile_blocks:
            # Compiles the module's forward in place: the plugins and Lightning still see the same module tree, and
            # training_step (with its logging) runs eagerly around the compiled forward.
            model.compile()
        fit(trainer, model)
        peak = torch.cuda.max_memory_allocated() / 2**20 if on_cuda else peak_rss_mib()
    return RunResult(
        name,
        timer.step_seconds[spec.warmup :],
        timer.final_loss,
        peak,
        pre_fit,
        profiler.breakdown if profile else None,
        timer.step_cpu_seconds[spec.warmup :],
        torch.get_num_threads(),
        repeat,
        timer.wait_share(spec.warmup),
        sync_counter.syncs_per_step,
    )


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
