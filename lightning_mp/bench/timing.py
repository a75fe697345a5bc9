"""One timed run: train one configuration for a fixed number of steps, and measure its steps, memory and host syncs.

How a run measures (:func:`run_configuration`):

1. It fits the workload of :class:`RunSpec` for ``warmup + steps`` optimizer steps under one configuration, in
   this process. Peak memory is the peak resident set size on the CPU, and ``torch.cuda.max_memory_allocated``
   (reset before the fit) on CUDA: a run in a fresh process
   (:func:`~lightning_mp.bench.comparison.run_worker`) measures that configuration alone.
2. A step's time is the time between the ends of two consecutive training batches (data loading, forward,
   backward, optimizer step and every callback included; on CUDA the device is synchronised first), measured by
   :class:`~lightning_mp.bench.step_callbacks.StepTimer`. The first ``--warmup`` steps of each run are dropped; the
   report gives the median of the rest, pooled over the repeats, and the mean, which also counts the occasional
   expensive logging step.
3. On the GPU workloads, :class:`~lightning_mp.bench.step_callbacks.SyncCounter` counts host syncs over
   ``--sync-steps`` more steps after the timed ones (counting slows a step, so it never overlaps the timing).
4. A run that raises returns its error instead (:meth:`RunResult.crashed`): the report's row of that configuration
   says ``crash: <error>``.

With ``--profile`` the timed steps also run under ``torch.profiler``
(:class:`~lightning_mp.bench.step_callbacks.StepProfiler`), which slows them: such a run says where each step's CPU
time goes, not how long a step takes. How the runs are repeated, ordered and compared:
:mod:`~lightning_mp.bench.comparison`.
"""

from __future__ import annotations

import gc
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_mp.bench.configurations import CONFIGURATIONS, MONITOR_EVERY_N_STEPS, float32_matmul
from lightning_mp.bench.machine import current_rss_mib, peak_rss_mib
from lightning_mp.bench.step_callbacks import StepProfiler, StepTimer, SyncCounter
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
            else:
                # Compiles the module's forward in place: the plugins and Lightning still see the same module tree,
                # and training_step (with its logging) runs eagerly around the compiled forward.
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
