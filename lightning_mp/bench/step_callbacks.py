"""The Trainer callbacks that measure a run's steps from inside the fit.

:func:`~lightning_mp.bench.timing.run_configuration` adds them to its Trainer:

- :class:`StepTimer`: the wall time between the ends of consecutive training batches (on CUDA the device is
  synchronised first), with each step's process CPU time and the time its threads waited for a core;
- :class:`SyncCounter`: host syncs per step over steps after the timed ones: on CUDA with
  ``torch.cuda.set_sync_debug_mode("warn")``, which warns at every operation that makes the host wait for the
  device, and on the CPU with :func:`lightning_mp.bench.counting.count_syncs_and_ops`, which counts host reads of
  tensor values (there the foreach optimizers' reads of their CPU step counters count too; on CUDA they are no sync);
- :class:`StepProfiler`: ``torch.profiler`` over the timed steps, and where each step's CPU time went (matrix
  products, casts, the three most expensive operations).

Counting and profiling slow a step, so syncs are counted after the timed steps, never during them, and a profiled
run is read for its breakdown, not for its timings.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from lightning_mp.bench.counting import StepCounts, count_syncs_and_ops
from lightning_mp.bench.machine import scheduler_seconds

_SYNC_WARNING = "called a synchronizing CUDA operation"
"""What ``torch.cuda.set_sync_debug_mode("warn")`` says at each operation that makes the host wait."""


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
