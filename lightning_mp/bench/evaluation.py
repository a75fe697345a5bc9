"""Evaluation in each ``eval_precision`` (``--eval``): time per validation batch and the tensor memory it adds.

For each trained form (O1 and O2 in ``--eval-training`` precision) and each evaluation precision, one
``trainer.validate`` of the Markov-text model runs under ``torch.profiler`` with ``profile_memory``: its ``[memory]``
events, summed in time order from the start of validation, give the most tensor bytes evaluation added above what the
model already held (the evaluation weights, made once per run, plus the activations of a batch). Those bytes depend
on the model and torch's kernels, not on the machine. The bytes of the evaluation weights alone are read from the
run (:attr:`~lightning_mp.policies.evaluation.EvalWeights.copied_bytes`): 0 where training's own tensors serve.

Time is a wall time, so it is measured without the profiler and repeated: the evaluation precisions of one trained
form run in turn, ``--repeats`` rounds, and each round gives the median time per validation batch of each; the
report gives each precision's median over the rounds and its ratio to evaluating as training does, as the median and
the range of the per-round ratios. On a CPU that emulates bf16 or fp16 the half precisions are slower, not faster:
the ratios say what this machine does, the bytes what any machine would hold.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from lightning_mp.bench.workloads import QUIET_TRAINER, SIZES, ModelSize, markov_task
from lightning_mp.plugin.mixed_precision import MixedPrecision

EVAL_PRECISIONS: tuple[str | None, ...] = (None, "32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")
"""The evaluation precisions measured; None is evaluation as training does, the reference of each ratio."""
TRAINED_LEVELS = ("O1", "O2")
VALIDATION_BATCHES = 8


@dataclass(frozen=True)
class EvalMeasurement:
    """One evaluation precision of one trained form: its time per batch in each round and its memory."""

    training: str
    """The trained form, as ``"O2 bf16-mixed"``."""
    eval_precision: str
    """The evaluation precision, ``"as training"`` for None."""
    ms_per_batch: tuple[float, ...]
    """The median milliseconds per validation batch of each round."""
    added_bytes: int
    """The most tensor bytes the validation run held above what the model held when it started."""
    weight_bytes: int
    """The bytes of the evaluation weights made for the run (0 where training's tensors serve)."""


VALIDATION_REGION = "lightning_mp.bench.validation"


class _ValidationRegion(L.Callback):
    """Mark the validation run in the profiler's trace, and read the bytes of its evaluation weights."""

    def __init__(self) -> None:
        self.weight_bytes = 0
        self._region: torch.profiler.record_function | None = None

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._region = torch.profiler.record_function(VALIDATION_REGION)
        self._region.__enter__()

    @override
    def on_validation_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        plugin = trainer.precision_plugin
        weights = plugin.evaluation_weights if isinstance(plugin, MixedPrecision) else None
        self.weight_bytes = max(self.weight_bytes, 0 if weights is None else weights.copied_bytes)

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        assert self._region is not None
        self._region.__exit__(None, None, None)


class _BatchTimer(L.Callback):
    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0

    @override
    def on_validation_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._start = time.perf_counter()

    @override
    def on_validation_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.seconds.append(time.perf_counter() - self._start)


def _validate(
    level: str, precision: str, eval_precision: str | None, size: ModelSize, seed: int, callbacks: list[L.Callback]
) -> None:
    L.seed_everything(seed, verbose=False)
    data, model = markov_task(size, VALIDATION_BATCHES, seed)
    data.setup("validate")
    plugin = MixedPrecision(precision, opt_level=level, eval_precision=eval_precision)
    options = {**QUIET_TRAINER, "limit_val_batches": VALIDATION_BATCHES}
    trainer = L.Trainer(accelerator="cpu", devices=1, plugins=[plugin], callbacks=callbacks, **options)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(does not have many workers|bf16|fp16).*")
        trainer.validate(model, data.val_dataloader(), verbose=False)


def added_bytes(events: Sequence[Any]) -> int:
    """The most tensor bytes alive inside the validation region above the level where it starts.

    ``events`` are the profiler's raw events: each ``[memory]`` event is one allocation (positive ``nbytes``) or
    free (negative), so their running sum in time order is the bytes alive of everything made since the profiler
    started (the model included, built inside it).
    """
    start, end = next((e.start_ns(), e.end_ns()) for e in events if e.name() == VALIDATION_REGION)
    changes = sorted(
        (event.start_ns(), event.nbytes())
        for event in events
        if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU
    )
    alive, level, most = 0, 0, 0
    for moment, change in changes:
        if moment > end:
            break
        if moment < start:
            level = alive = alive + change
            continue
        alive += change
        most = max(most, alive - level)
    return most


def measure_evaluation(precision: str, size: ModelSize, seed: int = 0, repeats: int = 3) -> list[EvalMeasurement]:
    """Every trained form and evaluation precision: its memory once, its time over ``repeats`` rounds."""
    results = []
    for level in TRAINED_LEVELS:
        memory: dict[str | None, tuple[int, int]] = {}
        for eval_precision in EVAL_PRECISIONS:
            region = _ValidationRegion()
            with torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True, record_shapes=False
            ) as profiler:
                _validate(level, precision, eval_precision, size, seed, [region])
            memory[eval_precision] = (added_bytes(profiler.profiler.kineto_results.events()), region.weight_bytes)
        rounds: dict[str | None, list[float]] = {name: [] for name in EVAL_PRECISIONS}
        for round_index in range(repeats):
            for eval_precision in EVAL_PRECISIONS:
                timer = _BatchTimer()
                _validate(level, precision, eval_precision, size, seed, [timer])
                rounds[eval_precision].append(1000 * statistics.median(timer.seconds[1:] or timer.seconds))
            print(f"[eval] {level} {precision}: round {round_index + 1}/{repeats}", file=sys.stderr, flush=True)
        for eval_precision in EVAL_PRECISIONS:
            added, weight_bytes = memory[eval_precision]
            results.append(
                EvalMeasurement(
                    f"{level} {precision}",
                    eval_precision or "as training",
                    tuple(rounds[eval_precision]),
                    added,
                    weight_bytes,
                )
            )
    return results


def eval_table(results: Sequence[EvalMeasurement]) -> str:
    """One row per trained form and evaluation precision: time per batch, its ratio to evaluating as training, bytes."""
    lines = [
        "| trained | eval_precision | ms / batch (median) | vs as training (median, range) | added MiB (peak)"
        " | evaluation weights MiB |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for result in results:
        reference = next(r for r in results if r.training == result.training and r.eval_precision == "as training")
        ratios = [ms / ref for ms, ref in zip(result.ms_per_batch, reference.ms_per_batch, strict=True)]
        lines.append(
            f"| {result.training} | {result.eval_precision} | {statistics.median(result.ms_per_batch):.2f}"
            f" | {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
            f" | {result.added_bytes / 2**20:.2f} | {result.weight_bytes / 2**20:.2f} |"
        )
    return "\n".join(lines)


def run_evaluation(args: argparse.Namespace) -> str:
    """The ``--eval`` report for ``args.size`` and ``args.eval_training``."""
    size = SIZES[args.size]
    results = measure_evaluation(args.eval_training, size, args.seed, args.repeats)
    return (
        "\n".join(
            [
                "### lightning_mp evaluation benchmark",
                "",
                f"- Model: TinyTransformerLM, size {args.size!r} ({size.describe()}), {VALIDATION_BATCHES} validation"
                f" batches per run, trained precision {args.eval_training!r}, {args.repeats} rounds",
                "- Time: the median per batch of each round (the first batch left out), then the median over rounds;"
                " ratios are per round, against evaluating as training does.",
                "- Memory: the most tensor bytes a validation run added above what the model held (torch.profiler's"
                " memory events), and the bytes of the evaluation weights made for it.",
                "",
                eval_table(results),
            ]
        )
        + "\n"
    )
