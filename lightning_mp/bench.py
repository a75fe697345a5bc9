"""The benchmark: step time, throughput, peak memory and final loss of each precision setup, as a Markdown table.

Run ``python -m lightning_mp.bench`` (``--quick`` for a smoke run, ``--out FILE.md`` to keep the table). Every
configuration trains :class:`~lightning_mp.tasks.TinyTransformerLM` on the same seeded Markov text with the same
Trainer settings; only the precision setup differs:

- ``fp32``: Lightning's ``precision="32-true"``, the reference;
- ``lightning-bf16``: Lightning's built-in ``precision="bf16-mixed"``;
- ``O1-bf16`` and ``O2-bf16``: :class:`~lightning_mp.MixedPrecision` at those opt levels;
- ``O1-bf16+monitors``: ``O1-bf16`` with LossScaleMonitor, GradientHealthMonitor and LayerDtypeMonitor attached;
- on CUDA also ``lightning-fp16``, ``O1-fp16`` and ``O2-fp16`` (most CPUs multiply fp16 far more slowly than fp32,
  so fp16 is benchmarked only where the hardware runs it fast; ``--configs`` can still ask for it).

How it measures:

1. Each run of a configuration is a fresh Python process (``--worker``), so peak memory belongs to that
   configuration alone: the peak resident set size (``resource.getrusage``) on the CPU, and
   ``torch.cuda.max_memory_allocated`` on CUDA. On the CPU the peak includes the interpreter, torch and Lightning,
   so the table also gives the peak *over the RSS just before* ``fit``: the memory that training itself added.
2. The runs alternate: repeat 1 runs the configurations in order, repeat 2 in reverse, and so on, so that a
   machine that slowly speeds up or slows down favours no configuration.
3. A step's time is the time between the ends of two consecutive training batches (data loading, forward,
   backward, optimizer step and every callback included; on CUDA the device is synchronised first). The first
   ``--warmup`` steps of each run are dropped; the table gives the median of the rest, pooled over the repeats,
   and the mean, which also counts the occasional expensive logging step.
4. Ratios are speed-ups (above 1 is faster): the reference's median over the configuration's, against fp32 and
   against Lightning's built-in plugin at the same precision. They are **paired**: each repeat runs every
   configuration back to back, and the ratio of their medians in that repeat is one paired ratio. The table gives
   the median of the paired ratios and their range (min-max); a difference is *resolved* only when every paired
   ratio falls on the same side of 1.00x, and the report says so, or says that more repeats are needed.
5. Load. A benchmark on a shared machine measures the other users too, so the report gives the load average
   before and after, each run's CPU share (the CPU time the process got over ``wall time x threads``) and, on
   Linux, its run-queue wait share: the time its threads were ready to run but waited for a core, over the time
   they were runnable (``/proc/self/task/*/schedstat``). Above :data:`HIGH_WAIT_SHARE` (or, without schedstat, a
   CPU share below :data:`LOW_CPU_SHARE`), or with a load average above half the cores before the start, it warns
   loudly that the timings are distorted, on stderr and in the report.
6. Matrix-product rates are measured with the same number of threads as the training runs (``--threads``, by
   default torch's), each rate the best of several timed rounds of at least :data:`MATMUL_MIN_SECONDS`.

``--quick`` runs in this process (no worker processes, so its memory columns are the whole process's), with the
tiny model and three paired repeats: a smoke test of the whole pipeline that still reports honestly whether its
difference is resolved.

``--memory`` measures tensor memory instead of time, in this process on the CPU (default size ``medium``, the fp16
configurations included, since counting bytes needs no fast fp16): each configuration trains one warm-up step, then
one step under ``torch.profiler`` with ``profile_memory``, ``record_shapes`` and ``with_stack`` (torch's memory
profile requires all three: the Python tracer is what tells parameters and optimizer states apart). The memory
timeline gives the peak of the tensor bytes alive, its split by category at that moment, and the weights, gradients
and optimizer states kept at the end of the step. The last step's gradients are freed before profiling: the
timeline only sees a tensor made before it started once an op touches it, and Lightning frees them untouched. The
byte counts depend on the model and torch's kernels, not on the machine. Private torch names, because torch offers
no public way to read the categorised timeline: ``torch.profiler.profile._memory_profile``,
``torch.profiler._memory_profiler.MemoryProfileTimeline`` and its ``_coalesce_timeline``, ``Category`` and
``_CATEGORY_TO_INDEX`` (the column of each category).

The model's size is chosen for the hardware (``--size auto``): a smaller one on CPUs without AVX512-BF16 or AMX,
where bf16 matrix products are emulated and about a hundred times slower than fp32, so that the full run still
finishes in a few minutes. The output names the machine, the sizes and the load average, because timings from a
shared machine are only as good as its load.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, Category, MemoryProfileTimeline
from typing_extensions import override

from lightning_mp._hardware import cpu_has_native_bf16, device_has_native_bf16
from lightning_mp.callbacks import GradientHealthMonitor, LayerDtypeMonitor, LossScaleMonitor
from lightning_mp.counting import PythonCalls, StepCounts, count_python_calls, count_syncs_and_ops
from lightning_mp.plugin import MixedPrecision, PrecisionName
from lightning_mp.tasks import MarkovTextDataModule, TinyTransformerLM

FP32 = "fp32"
LOW_CPU_SHARE = 0.5
"""Where the scheduler's wait times cannot be read: a run whose process got less than this share of ``wall time x
threads`` in CPU time probably competed for the cores (single-threaded Python overhead alone keeps it below 1)."""
HIGH_WAIT_SHARE = 0.2
"""A run whose threads spent more than this share of their runnable time waiting for a core competed for the cores."""
MATMUL_MIN_SECONDS = 0.05
"""Each timed round of matrix products runs at least this long, so that the timer's resolution does not matter."""


@dataclass(frozen=True)
class Configuration:
    """One precision setup: the Trainer arguments it adds, and the Lightning built-in it is compared with."""

    name: str
    description: str
    trainer_arguments: Callable[[], dict[str, Any]]
    builtin: str
    """The name of Lightning's built-in configuration at the same precision (itself for the built-ins)."""
    cuda_only: bool = False


def _plugin(precision: PrecisionName, opt_level: str) -> Callable[[], dict[str, Any]]:
    return lambda: {"plugins": [MixedPrecision(precision, opt_level=opt_level)]}


def _monitored(precision: PrecisionName, opt_level: str) -> Callable[[], dict[str, Any]]:
    def arguments() -> dict[str, Any]:
        monitors = [LossScaleMonitor(), GradientHealthMonitor(), LayerDtypeMonitor()]
        return {**_plugin(precision, opt_level)(), "callbacks": monitors}

    return arguments


CONFIGURATIONS: dict[str, Configuration] = {
    config.name: config
    for config in (
        Configuration(FP32, 'Lightning precision="32-true"', lambda: {"precision": "32-true"}, FP32),
        Configuration(
            "lightning-bf16", 'Lightning precision="bf16-mixed"', lambda: {"precision": "bf16-mixed"}, "lightning-bf16"
        ),
        Configuration("O1-bf16", "MixedPrecision bf16, O1", _plugin("bf16-mixed", "O1"), "lightning-bf16"),
        Configuration("O2-bf16", "MixedPrecision bf16, O2", _plugin("bf16-mixed", "O2"), "lightning-bf16"),
        Configuration("lean-bf16", "MixedPrecision bf16, lean", _plugin("bf16-mixed", "lean"), "lightning-bf16"),
        Configuration(
            "O1-bf16+monitors",
            "O1-bf16 with the three monitors",
            _monitored("bf16-mixed", "O1"),
            "lightning-bf16",
        ),
        Configuration(
            "lightning-fp16",
            'Lightning precision="16-mixed"',
            lambda: {"precision": "16-mixed"},
            "lightning-fp16",
            cuda_only=True,
        ),
        Configuration("O1-fp16", "MixedPrecision fp16, O1", _plugin("16-mixed", "O1"), "lightning-fp16", True),
        Configuration("O2-fp16", "MixedPrecision fp16, O2", _plugin("16-mixed", "O2"), "lightning-fp16", True),
    )
}
QUICK_CONFIGURATIONS = (FP32, "O1-bf16")


@dataclass(frozen=True)
class ModelSize:
    """The transformer's shape and the batch it trains on."""

    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    batch_size: int
    vocab_size: int = 64

    def describe(self) -> str:
        """The size in words, for the report's header."""
        return (
            f"vocab={self.vocab_size}, d_model={self.d_model}, layers={self.n_layers}, heads={self.n_heads},"
            f" seq_len={self.seq_len}, batch={self.batch_size}"
        )


SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(d_model=32, n_layers=1, n_heads=2, seq_len=16, batch_size=8),
    "small": ModelSize(d_model=64, n_layers=2, n_heads=4, seq_len=32, batch_size=16),
    "demo": ModelSize(d_model=128, n_layers=2, n_heads=4, seq_len=64, batch_size=32),
    "medium": ModelSize(d_model=256, n_layers=2, n_heads=4, seq_len=128, batch_size=8, vocab_size=1024),
    "large": ModelSize(d_model=512, n_layers=4, n_heads=8, seq_len=128, batch_size=16),
}


def auto_size(accelerator: str) -> str:
    """The size for ``--size auto``: large where bf16 is native, small on a CPU that emulates it."""
    if accelerator == "gpu":
        return "large"
    return "large" if cpu_has_native_bf16() else "small"


def default_configurations(accelerator: str) -> list[str]:
    """Every configuration the device runs fast: the fp16 ones only on CUDA."""
    return [name for name, config in CONFIGURATIONS.items() if accelerator == "gpu" or not config.cuda_only]


# ------------------------------------------------------------------------------------------------ one run (worker)


def scheduler_seconds() -> tuple[float, float] | None:
    """``(running, waiting for a core)`` seconds summed over this process's threads; None where unavailable.

    Reads ``/proc/self/task/<tid>/schedstat`` (Linux with scheduler statistics): its first two fields are the
    nanoseconds a thread ran and waited on a run queue. Threads that ended are no longer counted, so use differences
    over a span in which the thread pool stays the same (the timed steps).
    """
    running = waiting = 0
    try:
        for task in Path("/proc/self/task").iterdir():
            fields = (task / "schedstat").read_text().split()
            running += int(fields[0])
            waiting += int(fields[1])
    except (OSError, ValueError, IndexError):
        return None
    return running / 1e9, waiting / 1e9


class StepTimer(L.Callback):
    """Record the wall time between the ends of consecutive training batches, and the last batch's loss.

    Each step's process CPU time and the scheduler's run and wait times (:func:`scheduler_seconds`) are recorded
    beside it, so that a run can say how much of its time it spent waiting for a core.

    The loss stays a tensor until training ends, so that reading it adds no host synchronisation to the steps.
    """

    def __init__(self, synchronize: bool) -> None:
        self.synchronize = synchronize
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


@dataclass
class RunResult:
    """What one worker process measured for one configuration."""

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

    @property
    def cpu_share(self) -> float:
        """CPU time over ``wall time x threads`` in the timed steps: 1.0 when the run had its cores to itself."""
        wall = sum(self.step_seconds) * self.threads
        return sum(self.step_cpu_seconds) / wall if wall > 0 else float("nan")


def _current_rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _peak_rss_mib() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def _task(size: ModelSize, steps: int, seed: int) -> tuple[MarkovTextDataModule, TinyTransformerLM]:
    """The data and the freshly initialised model of ``size``, for ``steps`` training batches."""
    data = MarkovTextDataModule(
        seq_len=size.seq_len,
        batch_size=size.batch_size,
        train_sequences=size.batch_size * steps,
        vocab_size=size.vocab_size,
        seed=seed,
    )
    model = TinyTransformerLM(
        vocab_size=size.vocab_size,
        d_model=size.d_model,
        n_heads=size.n_heads,
        n_layers=size.n_layers,
        seq_len=size.seq_len,
        warmup_steps=2,
    )
    return data, model


def run_configuration(
    name: str,
    size: ModelSize,
    accelerator: str,
    warmup: int,
    steps: int,
    seed: int,
    profile: bool = False,
    threads: int | None = None,
    repeat: int = 0,
) -> RunResult:
    """Train ``warmup + steps`` optimizer steps under configuration ``name`` in this process and measure them.

    With ``profile``, the timed steps also run under ``torch.profiler``, which slows them: use such a run for the
    breakdown, not for the timings. ``threads`` sets torch's intra-op threads for the run (None keeps the current
    number); the previous number is restored afterwards.
    """
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _train_and_measure(name, size, accelerator, warmup, steps, seed, profile, repeat)
    finally:
        torch.set_num_threads(previous_threads)


def _train_and_measure(
    name: str, size: ModelSize, accelerator: str, warmup: int, steps: int, seed: int, profile: bool, repeat: int
) -> RunResult:
    config = CONFIGURATIONS[name]
    on_cuda = accelerator == "gpu"
    L.seed_everything(seed, verbose=False)
    total_steps = warmup + steps
    data, model = _task(size, total_steps, seed)
    timer = StepTimer(synchronize=on_cuda)
    profiler = StepProfiler(first_batch=warmup, last_batch=total_steps - 1)
    arguments = config.trainer_arguments()
    extra_callbacks = [timer, profiler] if profile else [timer]
    with tempfile.TemporaryDirectory() as log_dir:
        trainer = L.Trainer(
            accelerator=accelerator,
            devices=1,
            max_steps=total_steps,
            logger=TensorBoardLogger(log_dir, name="bench"),
            log_every_n_steps=5,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            **{**arguments, "callbacks": [*extra_callbacks, *arguments.get("callbacks", [])]},
        )
        if on_cuda:
            torch.cuda.reset_peak_memory_stats()
            pre_fit = torch.cuda.memory_allocated() / 2**20
        else:
            pre_fit = _current_rss_mib()
        trainer.fit(model, datamodule=data)
        peak = torch.cuda.max_memory_allocated() / 2**20 if on_cuda else _peak_rss_mib()
    return RunResult(
        name,
        timer.step_seconds[warmup:],
        timer.final_loss,
        peak,
        pre_fit,
        profiler.breakdown,
        timer.step_cpu_seconds[warmup:],
        torch.get_num_threads(),
        repeat,
        timer.wait_share(warmup),
    )


# ------------------------------------------------------------------------------------------------ the machine


def machine_description(accelerator: str) -> list[str]:
    """Lines naming the machine: CPU model and its bf16 flags, cores, threads, GPU, versions, load."""
    cpuinfo: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            cpuinfo.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    model_name = cpuinfo.get("model name") or platform.processor() or platform.machine()
    flags = set(cpuinfo.get("flags", "").split())

    def has(flag: str) -> str:
        return "yes" if flag in flags else "no"

    lines = [
        f"CPU: {model_name}, {os.cpu_count()} logical cores, torch threads {torch.get_num_threads()}",
        f"CPU flags: avx2 {has('avx2')}, avx512f {has('avx512f')}, avx512_bf16 {has('avx512_bf16')},"
        f" amx_bf16 {has('amx_bf16')}, avx512_fp16 {has('avx512_fp16')}",
    ]
    if accelerator == "gpu":
        major, minor = torch.cuda.get_device_capability()
        lines.append(f"GPU: {torch.cuda.get_device_name()} (compute capability {major}.{minor})")
    lines.append(f"torch {torch.__version__}, lightning {L.__version__}, Python {platform.python_version()}")
    return lines


def matmul_rates(accelerator: str, n: int = 512, threads: int | None = None, rounds: int = 3) -> dict[str, float]:
    """GFLOP/s of an ``n x n`` matrix product in fp32, bf16 and fp16 on the device: what each dtype can reach.

    Measured with ``threads`` intra-op threads (None: torch's current number), the number the training runs use;
    each rate is the best of ``rounds`` rounds of at least :data:`MATMUL_MIN_SECONDS`, so a busy moment on a shared
    machine lowers one round, not the rate.
    """
    device = "cuda" if accelerator == "gpu" else "cpu"
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    rates = {}
    try:
        for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
            a = torch.randn(n, n, device=device).to(dtype)
            b = torch.randn(n, n, device=device).to(dtype)
            a @ b
            best = 0.0
            for _ in range(rounds):
                if device == "cuda":
                    torch.cuda.synchronize()
                products, start = 0, time.perf_counter()
                while True:
                    a @ b
                    products += 1
                    if device == "cuda":
                        torch.cuda.synchronize()
                    elapsed = time.perf_counter() - start
                    if elapsed >= MATMUL_MIN_SECONDS:
                        break
                best = max(best, 2 * n**3 * products / elapsed / 1e9)
            rates[label] = best
    finally:
        torch.set_num_threads(previous_threads)
    return rates


# ------------------------------------------------------------------------------------------------ the report


@dataclass
class Summary:
    """One configuration's measurements pooled over its repeats."""

    name: str
    median_seconds: float
    mean_seconds: float
    tokens_per_second: float
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


def summarize(results: Sequence[RunResult], size: ModelSize) -> dict[str, Summary]:
    """Pool the runs of each configuration and compute the ratios to fp32 and to Lightning's built-in."""
    summaries: dict[str, Summary] = {}
    for name in dict.fromkeys(result.configuration for result in results):
        runs = [result for result in results if result.configuration == name]
        seconds = [s for run in runs for s in run.step_seconds]
        median = statistics.median(seconds)
        wait_shares = [run.wait_share for run in runs if run.wait_share is not None]
        summaries[name] = Summary(
            name=name,
            median_seconds=median,
            mean_seconds=statistics.fmean(seconds),
            tokens_per_second=size.batch_size * size.seq_len / median,
            peak_memory_mib=statistics.median(run.peak_memory_mib for run in runs),
            training_memory_mib=statistics.median(run.peak_memory_mib - run.pre_fit_memory_mib for run in runs),
            final_loss=statistics.median(run.final_loss for run in runs),
            run_medians_seconds=[statistics.median(run.step_seconds) for run in runs],
            step_count=len(seconds),
            cpu_share=min(run.cpu_share for run in runs),
            wait_share=max(wait_shares) if len(wait_shares) == len(runs) else None,
        )
    for summary in summaries.values():
        if FP32 in summaries:
            summary.paired_vs_fp32 = paired_ratios(results, FP32, summary.name)
            summary.vs_fp32 = statistics.median(summary.paired_vs_fp32)
        builtin = CONFIGURATIONS[summary.name].builtin
        if builtin in summaries:
            summary.paired_vs_builtin = paired_ratios(results, builtin, summary.name)
            summary.vs_builtin = statistics.median(summary.paired_vs_builtin)
    return summaries


def paired_ratios(results: Sequence[RunResult], reference: str, name: str) -> list[float]:
    """Per repeat, the reference's median step time over the configuration's: one speed-up per pair of runs.

    The two runs of a pair ran back to back in the same repeat, so a machine that speeds up or slows down between
    repeats moves both; the spread of the paired ratios is the uncertainty of the speed-up.
    """
    medians: dict[tuple[str, int], float] = {
        (run.configuration, run.repeat): statistics.median(run.step_seconds) for run in results
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


def load_warnings(
    load_start: Sequence[float],
    load_end: Sequence[float],
    cpu_shares: dict[str, float],
    cores: int,
    wait_shares: dict[str, float | None] | None = None,
) -> list[str]:
    """Loud warnings when the machine was busy: a pure function of the loads, the runs' shares and the cores.

    The load average before the start counts other users only (the benchmark had not started). A run-queue wait
    share above :data:`HIGH_WAIT_SHARE` means a run waited for the cores; where it is unknown (None), a CPU share
    below :data:`LOW_CPU_SHARE` is taken as the sign instead.

    Example:
        >>> load_warnings((0.1, 0.1, 0.1), (1.0, 0.5, 0.2), {"fp32": 0.6}, cores=2, wait_shares={"fp32": 0.02})
        []
        >>> len(load_warnings((3.5, 2.0, 1.0), (4.0, 3.0, 1.0), {"fp32": 0.45}, cores=2, wait_shares={"fp32": 0.6}))
        2

    """
    wait_shares = wait_shares or {}
    warnings_found = []
    if load_start[0] > cores / 2:
        warnings_found.append(
            f"WARNING: the machine was busy before the benchmark started (load average {load_start[0]:.2f} on"
            f" {cores} cores, {load_end[0]:.2f} at the end): other processes share the cores, so step times and"
            " ratios are distorted. Rerun on an idle machine."
        )
    waited = {name: share for name, share in wait_shares.items() if share is not None and share > HIGH_WAIT_SHARE}
    if waited:
        shown = ", ".join(f"{name} {share:.0%}" for name, share in waited.items())
        warnings_found.append(
            f"WARNING: runs spent more than {HIGH_WAIT_SHARE:.0%} of their runnable time waiting for a core ({shown}):"
            " their step times measure the load as much as the configuration."
        )
    starved = {
        name: share for name, share in cpu_shares.items() if wait_shares.get(name) is None and share < LOW_CPU_SHARE
    }
    if starved:
        shown = ", ".join(f"{name} {share:.0%}" for name, share in starved.items())
        warnings_found.append(
            f"WARNING: runs got less than {LOW_CPU_SHARE:.0%} of the CPU time their threads asked for ({shown}):"
            " they probably waited for the cores, so their step times measure the load too."
        )
    return warnings_found


def _ratio(value: float | None, paired: Sequence[float] = ()) -> str:
    if value is None:
        return "-"
    if len(paired) < 2:
        return f"{value:.2f}x"
    return f"{value:.2f}x ({min(paired):.2f}-{max(paired):.2f})"


def markdown_table(summaries: dict[str, Summary], accelerator: str) -> str:
    """The results as a Markdown table, one row per configuration."""
    memory = "peak CUDA alloc (MiB)" if accelerator == "gpu" else "peak RSS (MiB)"
    training = "peak over pre-fit (MiB)"
    header = (
        "| configuration | median step (ms) | mean step (ms) | run medians (ms) | tokens/s | vs fp32 (paired range)"
        f" | vs Lightning built-in (paired range) | {memory} | {training} | final loss | CPU share | run-queue wait |"
    )
    lines = [header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summaries.values():
        spread = f"{min(s.run_medians_seconds) * 1e3:.1f}-{max(s.run_medians_seconds) * 1e3:.1f}"
        lines.append(
            f"| {s.name} | {s.median_seconds * 1e3:.1f} | {s.mean_seconds * 1e3:.1f} | {spread}"
            f" | {s.tokens_per_second:,.0f}"
            f" | {_ratio(s.vs_fp32, s.paired_vs_fp32)} | {_ratio(s.vs_builtin, s.paired_vs_builtin)}"
            f" | {s.peak_memory_mib:,.0f} | {s.training_memory_mib:,.1f} | {s.final_loss:.4f} | {s.cpu_share:.0%}"
            f" | {'n/a' if s.wait_share is None else format(s.wait_share, '.0%')} |"
        )
    return "\n".join(lines)


def target_lines(summaries: dict[str, Summary], accelerator: str) -> list[str]:
    """Each of the issue's targets with its measured value, for the configurations that ran."""
    lines = []

    def verdict(met: bool) -> str:
        return "met" if met else "MISSED"

    def both(name: str, reference: str) -> tuple[float, float]:
        a, b = summaries[name], summaries[reference]
        return (a.median_seconds / b.median_seconds - 1) * 100, (a.mean_seconds / b.mean_seconds - 1) * 100

    if {"O1-bf16+monitors", "O1-bf16"} <= summaries.keys():
        median_cost, mean_cost = both("O1-bf16+monitors", "O1-bf16")
        lines.append(
            f"Monitors cost at most 3% of step time: {median_cost:+.1f}% on the median, {mean_cost:+.1f}% on the mean"
            f" -> {verdict(median_cost <= 3 and mean_cost <= 3)}"
        )
    for o1, builtin in (("O1-bf16", "lightning-bf16"), ("O1-fp16", "lightning-fp16")):
        if {o1, builtin} <= summaries.keys():
            median_gap, mean_gap = both(o1, builtin)
            lines.append(
                f"{o1} at most 2% slower than Lightning's built-in: {median_gap:+.1f}% on the median,"
                f" {mean_gap:+.1f}% on the mean (negative is faster) -> {verdict(median_gap <= 2)}"
            )
    if {"O2-bf16", FP32} <= summaries.keys():
        speedup = summaries["O2-bf16"].vs_fp32
        assert speedup is not None
        lines.append(f"O2 bf16 at least 2.0x as fast as fp32: {speedup:.2f}x -> {verdict(speedup >= 2.0)}")
        o2, fp32 = summaries["O2-bf16"], summaries[FP32]
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


def report(
    summaries: dict[str, Summary],
    size_name: str,
    size: ModelSize,
    accelerator: str,
    warmup: int,
    steps: int,
    repeats: int,
    machine: list[str],
    rates: dict[str, float],
    matmul_size: int,
    load: tuple[tuple[float, ...], tuple[float, ...]],
    breakdowns: dict[str, dict[str, Any]],
    threads: int | None = None,
    in_process: bool = False,
) -> str:
    """The whole Markdown report: machine, load and its warnings, sizes, table, resolved differences, targets."""
    rate_text = ", ".join(f"{label} {rate:,.1f}" for label, rate in rates.items())
    threads = threads or torch.get_num_threads()
    cpu_shares = {name: summary.cpu_share for name, summary in summaries.items()}
    wait_shares = {name: summary.wait_share for name, summary in summaries.items()}
    loud = load_warnings(load[0], load[1], cpu_shares, os.cpu_count() or 1, wait_shares)
    where = "all runs in this one process" if in_process else "each run in its own process"
    parts = [
        "### lightning_mp benchmark",
        "",
        *(f"**{line}**" + "\n" for line in loud),
        *(f"- {line}" for line in machine),
        f"- Matrix product {matmul_size}x{matmul_size} with {threads} thread(s), as in training, GFLOP/s: {rate_text}",
        f"- Load average (1, 5, 15 min): {_load_text(load[0])} at the start, {_load_text(load[1])} at the end;"
        " per configuration in the table: CPU share (CPU time over wall time x threads, the lowest run) and run-queue"
        " wait (time ready to run but waiting for a core, over runnable time, the highest run)",
        f"- Model: TinyTransformerLM, size {size_name!r} ({size.describe()}); {warmup} warm-up and {steps} timed"
        f" steps per run, {repeats} alternating repeats per configuration, {where}",
        "- Configurations: " + "; ".join(f"{name}: {CONFIGURATIONS[name].description}" for name in summaries),
        "",
        markdown_table(summaries, accelerator),
        "",
        "Differences (median of the paired speed-ups, their range, and whether they are resolved):",
        "",
        *(f"- {line}" for line in difference_lines(summaries)),
    ]
    targets = target_lines(summaries, accelerator)
    if targets:
        parts += ["", "Targets:", "", *(f"- {line}" for line in targets)]
    if breakdowns:
        parts += ["", "Where the time goes (torch.profiler, one extra run each):", ""]
        parts += [f"- {line}" for line in profile_lines(breakdowns)]
    return "\n".join(parts) + "\n"


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


# ------------------------------------------------------------------------------------------------ the driver


def _worker_command(name: str, args: argparse.Namespace, result_file: Path, profile: bool) -> list[str]:
    command = [sys.executable, "-m", "lightning_mp.bench", "--worker", name, "--result-file", str(result_file)]
    command += ["--accelerator", args.accelerator, "--size", args.size, "--warmup", str(args.warmup)]
    command += ["--steps", str(args.steps), "--seed", str(args.seed), "--threads", str(args.threads)]
    return [*command, "--profile"] if profile else command


def _run_worker(name: str, args: argparse.Namespace, scratch: str, tag: str, profile: bool = False) -> RunResult:
    result_file = Path(scratch) / f"{name}-{tag}.json"
    completed = subprocess.run(
        _worker_command(name, args, result_file, profile), capture_output=True, text=True, check=False
    )
    if completed.returncode != 0:
        raise RuntimeError(
            f"The benchmark run of {name!r} failed (exit code {completed.returncode}):\n" + completed.stderr[-4000:]
        )
    return RunResult(**json.loads(result_file.read_text()))


def unresolved_comparisons(results: Sequence[RunResult], configurations: Sequence[str]) -> list[str]:
    """The comparisons the report will make (against fp32 and the built-in) that the paired ratios do not resolve."""
    unresolved = []
    for name in configurations:
        for reference in (FP32, CONFIGURATIONS[name].builtin):
            if reference == name or reference not in configurations:
                continue
            if resolution(paired_ratios(results, reference, name)).startswith("NOT"):
                unresolved.append(f"{name} vs {reference}")
    return list(dict.fromkeys(unresolved))


def run_all(args: argparse.Namespace, configurations: Sequence[str]) -> list[RunResult]:
    """Run every configuration in paired repeats, alternating the order; in worker processes or in this one.

    After ``args.repeats`` repeats, it adds repeats while a comparison is not resolved, up to ``args.max_repeats``.
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
            order = list(configurations) if repeat % 2 == 0 else list(reversed(configurations))
            for name in order:
                start = time.perf_counter()
                if args.in_process:
                    result = run_configuration(
                        name, SIZES[args.size], args.accelerator, args.warmup, args.steps, args.seed,
                        threads=args.threads, repeat=repeat,
                    )  # fmt: skip
                else:
                    result = _run_worker(name, args, scratch, str(repeat))
                    result.repeat = repeat
                results.append(result)
                print(
                    f"[{len(results)}] {name} (repeat {repeat + 1}):"
                    f" median {statistics.median(result.step_seconds) * 1e3:.1f} ms/step,"
                    f" peak {result.peak_memory_mib:,.0f} MiB, final loss {result.final_loss:.4f}"
                    f" ({time.perf_counter() - start:.1f} s, CPU share {result.cpu_share:.0%}, run-queue wait"
                    f" {'n/a' if result.wait_share is None else format(result.wait_share, '.0%')},"
                    f" load {os.getloadavg()[0]:.2f})",
                    file=sys.stderr,
                    flush=True,
                )
    return results


def profile_all(args: argparse.Namespace, configurations: Sequence[str]) -> dict[str, dict[str, Any]]:
    """One extra run per configuration under ``torch.profiler``: where each step's CPU time goes."""
    breakdowns = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name in configurations:
            result = _run_worker(name, args, scratch, "profile", profile=True)
            assert result.profile is not None
            breakdowns[name] = result.profile
            print(f"[profile] {name}: {result.profile['total_ms']:.1f} ms of CPU per step", file=sys.stderr, flush=True)
    return breakdowns


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


# ------------------------------------------------------------------------------------------------ memory (--memory)

MEMORY_CONFIGURATIONS = (FP32, "lightning-bf16", "O1-bf16", "O2-bf16", "lean-bf16", "O1-fp16", "O2-fp16")
"""What ``--memory`` measures by default: the fp16 ones too, since byte counts need no fast fp16."""


@dataclass(frozen=True)
class MemoryBreakdown:
    """Tensor bytes of one steady-state training step, from the profiler's memory timeline.

    Attributes:
        configuration: the configuration's name.
        parameters: the model's parameter count.
        peak_bytes: the most tensor bytes alive at any moment of the step.
        weights: bytes in parameters at the peak (O2's half copies included: they sit in the modules).
        gradients: bytes in gradients at the peak.
        optimizer_state: bytes in optimizer states at the peak.
        activations: bytes in activations saved or produced by the forward at the peak.
        other: inputs, temporaries, autograd details and unclassified tensors at the peak.
        persistent_bytes: weights, gradients and optimizer states alive at the end of the step: what training keeps
            between steps.
        python_calls: Python function calls of one later training batch, hooks to hooks (0: not counted).
        compute_ops: dispatched compute ops (no views, no host reads) of one later training batch (0: not counted).

    """

    configuration: str
    parameters: int
    peak_bytes: int
    weights: int
    gradients: int
    optimizer_state: int
    activations: int
    other: int
    persistent_bytes: int
    python_calls: int = 0
    compute_ops: int = 0

    @property
    def persistent_bytes_per_parameter(self) -> float:
        """Bytes kept between steps per parameter: 16 with AdamW for fp32, O1 and O2, plus its step counters."""
        return self.persistent_bytes / self.parameters


_CATEGORY_FIELDS: dict[Category | None, str] = {
    Category.PARAMETER: "weights",
    Category.GRADIENT: "gradients",
    Category.OPTIMIZER_STATE: "optimizer_state",
    Category.ACTIVATION: "activations",
}


_KEPT = (Category.PARAMETER, Category.GRADIENT, Category.OPTIMIZER_STATE)
"""What a model keeps between steps: Lightning frees gradients at the next step's ``zero_grad``."""


def breakdown_from_timeline(
    times_and_sizes: tuple[list[int], list[list[int]]], configuration: str, parameters: int
) -> MemoryBreakdown:
    """The peak and its split by category from a coalesced memory timeline (one row of sizes per timestamp)."""
    _, sizes = times_and_sizes
    totals = [sum(row) for row in sizes]
    at_peak = sizes[max(range(len(totals)), key=totals.__getitem__)]
    split = dict.fromkeys(("weights", "gradients", "optimizer_state", "activations", "other"), 0)
    for category, index in _CATEGORY_TO_INDEX.items():
        split[_CATEGORY_FIELDS.get(category, "other")] += at_peak[index + 1]  # column 0 is unused by torch
    split["other"] += at_peak[0]
    at_end = sizes[-1]
    persistent = sum(at_end[_CATEGORY_TO_INDEX[category] + 1] for category in _CATEGORY_FIELDS if category in _KEPT)
    return MemoryBreakdown(configuration, parameters, max(totals), persistent_bytes=persistent, **split)


class MemoryTimelineCallback(L.Callback):
    """Profile the tensor memory of one training batch, forward to optimizer step, and keep the coalesced timeline."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.timeline: tuple[list[int], list[list[int]]] | None = None
        self._profiler: torch.profiler.profile | None = None

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.batch:
            # The timeline sees a tensor made before profiling only once an op touches it; Lightning frees the last
            # step's gradients without touching them. Freeing them here makes every byte of the step visible.
            for optimizer in trainer.optimizers:
                optimizer.zero_grad(set_to_none=True)
            self._profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU],
                profile_memory=True,
                record_shapes=True,
                with_stack=True,
            )
            self._profiler.__enter__()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx != self.batch or self._profiler is None:
            return
        self._profiler.__exit__(None, None, None)
        timeline = MemoryProfileTimeline(self._profiler._memory_profile())
        self.timeline = timeline._coalesce_timeline("cpu")
        self._profiler = None


class HostWorkCallback(L.Callback):
    """Count the compute ops of one training batch and the Python calls of the next, from batch start to batch end.

    Two batches, because the op counter's own Python frames would otherwise be counted as Python calls.
    """

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.compute_ops = 0
        self.python_calls = 0
        self._region: contextlib.ExitStack | None = None
        self._counts: StepCounts | PythonCalls | None = None

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx in (self.batch, self.batch + 1):
            self._region = contextlib.ExitStack()
            if batch_idx == self.batch:
                self._counts = self._region.enter_context(count_syncs_and_ops())
            else:
                self._counts = self._region.enter_context(count_python_calls())

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._region is None:
            return
        self._region.close()
        if isinstance(self._counts, StepCounts):
            self.compute_ops = self._counts.compute_ops
        elif isinstance(self._counts, PythonCalls):
            self.python_calls = self._counts.python_calls
        self._region = self._counts = None


def measure_memory(name: str, size: ModelSize, seed: int = 0, warmup: int = 1) -> MemoryBreakdown:
    """Train ``warmup`` steps under configuration ``name`` on the CPU, then profile the memory of the next one.

    Two more steps count the host work of a steady step: its compute ops, then its Python calls.
    """
    L.seed_everything(seed, verbose=False)
    data, model = _task(size, warmup + 3, seed)
    recorder = MemoryTimelineCallback(batch=warmup)
    host_work = HostWorkCallback(batch=warmup + 1)
    arguments = CONFIGURATIONS[name].trainer_arguments()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=warmup + 3,
        logger=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **{**arguments, "callbacks": [recorder, host_work, *arguments.get("callbacks", [])]},
    )
    with warnings.catch_warnings():
        # The memory profiler reads ``.grad`` of every parameter slot a module call sees; under O2 the slots hold
        # the half copies, which are not leaves, and torch warns about that read.
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
        trainer.fit(model, datamodule=data)
    assert recorder.timeline is not None
    memory = breakdown_from_timeline(recorder.timeline, name, sum(p.numel() for p in model.parameters()))
    return replace(memory, python_calls=host_work.python_calls, compute_ops=host_work.compute_ops)


def _mib(value: int) -> str:
    return f"{value / 2**20:.2f}"


def memory_table(results: Sequence[MemoryBreakdown]) -> str:
    """One row per configuration: the peak, its split by category, its ratio to fp32, and bytes kept per parameter."""
    fp32 = next((result for result in results if result.configuration == FP32), None)
    lines = [
        "| configuration | peak (MiB) | vs fp32 | weights | gradients | optimizer state | activations | other"
        " | persistent (B/param) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        ratio = f"{r.peak_bytes / fp32.peak_bytes:.3f}" if fp32 is not None else "-"
        lines.append(
            f"| {r.configuration} | {_mib(r.peak_bytes)} | {ratio} | {_mib(r.weights)} | {_mib(r.gradients)}"
            f" | {_mib(r.optimizer_state)} | {_mib(r.activations)} | {_mib(r.other)}"
            f" | {r.persistent_bytes_per_parameter:.2f} |"
        )
    return "\n".join(lines)


def memory_target_lines(results: Sequence[MemoryBreakdown]) -> list[str]:
    """The issue's memory targets with their measured values, for the configurations that ran."""
    by_name = {result.configuration: result for result in results}
    lines = []

    def verdict(met: bool) -> str:
        return "met" if met else "MISSED"

    def ratio(name: str, reference: str) -> float:
        return by_name[name].peak_bytes / by_name[reference].peak_bytes

    for o2, o1 in (("O2-bf16", "O1-bf16"), ("O2-fp16", "O1-fp16")):
        if {o2, FP32} <= by_name.keys():
            value = ratio(o2, FP32)
            lines.append(f"{o2} peak <= 0.85x fp32: {value:.3f}x -> {verdict(value <= 0.85)}")
        if {o2, o1} <= by_name.keys():
            value = ratio(o2, o1)
            lines.append(f"{o2} peak <= 0.95x {o1}: {value:.3f}x -> {verdict(value <= 0.95)}")
        if o2 in by_name:
            value = round(by_name[o2].persistent_bytes_per_parameter, 2)  # AdamW's step counters add 4 B per tensor
            lines.append(f"{o2} persistent state <= 16 B/param: {value:.2f} -> {verdict(value <= 16)}")
    if {"O1-bf16", "lightning-bf16"} <= by_name.keys():
        value = ratio("O1-bf16", "lightning-bf16")
        lines.append(f"O1-bf16 peak <= Lightning's bf16-mixed: {value:.3f}x -> {verdict(value <= 1)}")
    if {"O2-bf16", "O1-bf16"} <= by_name.keys() and by_name["O1-bf16"].python_calls:
        value = by_name["O2-bf16"].python_calls / by_name["O1-bf16"].python_calls
        lines.append(f"O2-bf16 Python calls <= 1.10x O1-bf16: {value:.3f}x -> {verdict(value <= 1.10)}")
    if {"O2-bf16", "lightning-bf16"} <= by_name.keys() and by_name["lightning-bf16"].compute_ops:
        value = by_name["O2-bf16"].compute_ops / by_name["lightning-bf16"].compute_ops
        lines.append(f"O2-bf16 compute ops <= 1.05x Lightning's bf16-mixed: {value:.3f}x -> {verdict(value <= 1.05)}")
    return lines


def host_work_table(results: Sequence[MemoryBreakdown]) -> str:
    """One row per configuration: Python calls and compute ops of one steady training batch."""
    lines = ["| configuration | Python calls / step | compute ops / step |", "|---|---:|---:|"]
    lines += [f"| {r.configuration} | {r.python_calls:,} | {r.compute_ops:,} |" for r in results]
    return "\n".join(lines)


def memory_report(results: Sequence[MemoryBreakdown], size_name: str, size: ModelSize) -> str:
    """The ``--memory`` report: the model, the table (MiB of tensor memory) and the targets."""
    parameters = results[0].parameters if results else 0
    parts = [
        "### lightning_mp memory benchmark",
        "",
        f"- Model: TinyTransformerLM, size {size_name!r} ({size.describe()}), {parameters:,} parameters, AdamW",
        "- Peak tensor bytes of one steady-state training step (forward, backward, optimizer step), from"
        " torch.profiler's memory timeline; the split is the one at the peak. Independent of the machine.",
        "",
        memory_table(results),
        "",
        "Host work of one steady training batch (hooks to hooks), counted with lightning_mp.counting:",
        "",
        host_work_table(results),
        "",
        "Targets:",
        "",
        *(f"- {line}" for line in memory_target_lines(results)),
    ]
    return "\n".join(parts) + "\n"


def run_memory(args: argparse.Namespace) -> str:
    """Measure every configuration of ``args.configs`` in this process and return the report."""
    size = SIZES[args.size]
    results = []
    for name in args.configs:
        results.append(measure_memory(name, size, args.seed))
        print(f"[memory] {name}: peak {results[-1].peak_bytes / 2**20:.2f} MiB", file=sys.stderr, flush=True)
    return memory_report(results, args.size, size)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line's flags; a bad flag exits with argparse's usage message, naming it."""
    parser = argparse.ArgumentParser(prog="python -m lightning_mp.bench", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="two configurations, tiny model, in this process, 3 paired repeats"
    )
    parser.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "gpu"], help="default: auto")
    parser.add_argument("--size", default="auto", choices=["auto", *SIZES], help="model size (default: auto)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default 20, quick 8)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per run (default 3, quick 2)")
    parser.add_argument("--repeats", type=int, default=None, help="paired runs per configuration (default 3)")
    parser.add_argument(
        "--max-repeats",
        type=int,
        default=None,
        help="add repeats while a difference is unresolved, up to this many (default: 6 with --quick, else --repeats)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads for training and matrix products (default: torch's)"
    )
    parser.add_argument(
        "--in-process", action="store_true", help="run every configuration in this process (the default with --quick)"
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=list(CONFIGURATIONS),
        help="configurations to run (default: all the device runs fast)",
    )
    parser.add_argument("--out", type=Path, help="also write the Markdown report to this file")
    parser.add_argument(
        "--profile", action="store_true", help="add one torch.profiler run per configuration: where the time goes"
    )
    parser.add_argument(
        "--memory",
        action="store_true",
        help="peak tensor memory of one step per configuration, split by category (CPU; default size medium)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--counts", action="store_true", help="host syncs and compute ops per iteration, per precision and optimizer"
    )
    parser.add_argument("--worker", choices=list(CONFIGURATIONS), help=argparse.SUPPRESS)
    parser.add_argument("--result-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.accelerator == "auto":
        args.accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    if args.accelerator == "gpu" and not torch.cuda.is_available():
        parser.error("--accelerator gpu needs a CUDA GPU, and torch sees none")
    if args.counts and args.memory:
        parser.error("--counts and --memory are two separate reports: ask for one at a time")
    if args.memory and args.accelerator != "cpu":
        parser.error("--memory measures on the CPU: use --accelerator cpu (or auto without a GPU)")
    if args.size == "auto":
        args.size = "tiny" if args.quick else "medium" if args.memory else auto_size(args.accelerator)
    for flag, normal, quick in (("steps", 20, 8), ("warmup", 3, 2), ("repeats", 3, 3)):
        value = getattr(args, flag)
        if value is None:
            setattr(args, flag, quick if args.quick else normal)
        elif value < (0 if flag == "warmup" else 1):
            parser.error(f"--{flag} must be >= {0 if flag == 'warmup' else 1}, got {value}")
    if args.max_repeats is None:
        args.max_repeats = max(args.repeats, 6) if args.quick else args.repeats
    elif args.max_repeats < args.repeats:
        parser.error(f"--max-repeats must be >= --repeats ({args.repeats}), got {args.max_repeats}")
    if args.threads is None:
        args.threads = torch.get_num_threads()
    elif args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    args.in_process = args.in_process or (args.quick and args.worker is None and not args.profile)
    if args.configs is None and args.memory:
        args.configs = list(MEMORY_CONFIGURATIONS)
    if args.configs is None:
        args.configs = list(QUICK_CONFIGURATIONS) if args.quick else default_configurations(args.accelerator)
    return args


def counts_report(quick: bool) -> str:
    """The ``--counts`` table: syncs and compute ops of one iteration for the torch loop, Lightning and lightning_mp.

    Counts do not depend on the machine or its load. ``quick`` counts only fp16 with fused Adam, on a smaller model.
    """
    from lightning_mp._step_counts import OPTIMIZERS, PRECISIONS, counts_table

    if quick:
        table = counts_table(("16-mixed",), ("fused Adam",), vocab_size=8, d_model=8, seq_len=4, batch_size=1)
    else:
        table = counts_table(PRECISIONS, tuple(OPTIMIZERS))
    return (
        "Host syncs / compute ops per training iteration (TinyTransformerLM, 2 layers, steady state, counted on the"
        f" CPU with lightning_mp.counting):\n\n{table}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark that ``argv`` asks for and print its report; returns the exit status."""
    args = parse_args(argv)
    if args.counts:
        counts_text = counts_report(args.quick)
        print(counts_text)
        if args.out is not None:
            args.out.write_text(counts_text + "\n")
        return 0
    size = SIZES[args.size]
    if args.worker is not None:
        # The worker's own warnings (bf16 emulated on this CPU, few dataloader workers) are known and said once below.
        warnings.filterwarnings("ignore")
        result = run_configuration(
            args.worker, size, args.accelerator, args.warmup, args.steps, args.seed, args.profile, args.threads
        )
        args.result_file.write_text(json.dumps(asdict(result)))
        return 0
    if args.memory:
        warnings.filterwarnings("ignore")
        text = run_memory(args)
        print(text)
        if args.out is not None:
            args.out.write_text(text)
        return 0
    if args.accelerator == "cpu" and not device_has_native_bf16("cpu"):
        print(
            "note: this CPU has no AVX512-BF16 or AMX, so bf16 matrix products are emulated and far slower than fp32;"
            f" using the {args.size!r} model size.",
            file=sys.stderr,
        )
    load_start = os.getloadavg()
    if load_start[0] > (os.cpu_count() or 1) / 2:
        print(
            f"WARNING: load average {load_start[0]:.2f} on {os.cpu_count()} cores before the benchmark starts: other"
            " processes compete for the CPU and the timings will be distorted.",
            file=sys.stderr,
        )
    machine = machine_description(args.accelerator)
    matmul_size = 256 if args.quick else 512
    rates = matmul_rates(args.accelerator, matmul_size, threads=args.threads)
    results = run_all(args, args.configs)
    breakdowns = profile_all(args, args.configs) if args.profile else {}
    summaries = summarize(results, size)
    text = report(
        summaries,
        args.size,
        size,
        args.accelerator,
        args.warmup,
        args.steps,
        len({result.repeat for result in results}),
        machine,
        rates,
        matmul_size,
        (load_start, os.getloadavg()),
        breakdowns,
        threads=args.threads,
        in_process=args.in_process,
    )
    for line in text.splitlines():
        if line.startswith("**WARNING"):
            print(line.strip("*"), file=sys.stderr)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
