"""What one steady training step costs at each opt level, in counts that carry over to a GPU (``--counts``).

Each opt level (O0 in fp32; O1, O2 and O3 in fp16 and bf16; lean in bf16) trains the tiny Markov-text model
(:mod:`~lightning_mp.bench.workloads`) with a real Trainer and :class:`~lightning_mp.MixedPrecision` on the CPU:
the plugin runs every hook it runs on a GPU, in the same order; Lightning's own ``bf16-true`` runs beside them as a
baseline row (lean's step-time reference). After ``2`` warm-up batches (the optimizer's state, the scaler's tensors
and autocast's first calls exist by then) :class:`SteadyStepCounter` counts, from the start of one batch to its
end:

* **Weight casts**, with :class:`~lightning_mp.bench.counting.WeightCastCounter`: every dispatched copy that changes the
  dtype of a weight or writes another dtype into one (``aten._to_copy``, ``copy_``, ``_foreach_copy_``). A tensor
  is a weight when its storage (``untyped_storage().data_ptr()``) is the storage of one of the model's parameters
  or of a tensor in an optimizer's ``param_groups``, so fp32 masters kept by the optimizer count as weights, and
  so do views of a weight (a transposed weight saved for backward). Autocast's cached casts are ``_to_copy`` of a
  parameter, so they count. The batch is split into three phases at Lightning's hooks: *forward* up to
  ``on_before_backward`` (the training step, its forward context and the loss scaling), *backward* up to
  ``on_after_backward``, *step* up to the batch's end (unscaling, clipping, the optimizer step, whatever the level
  does after it). Which storages are weights is asked again at each phase, for levels that swap tensors in and out
  of the modules.
* **Compute ops and host syncs**, with :func:`~lightning_mp.bench.counting.count_syncs_and_ops` in the same batch: every
  dispatched ATen op that is neither a view nor a host read (on a GPU at least one kernel launch each).
* **Python calls**, with :func:`~lightning_mp.bench.counting.count_python_calls` in the next batch, so that the dispatch
  modes' own Python frames are not counted. The counting callback's own hooks are left out; what Lightning does to
  call them is the same at every level. The garbage collector is off during that batch: a collection could run
  finalizers or weakref callbacks (Python calls) at a moment that depends on the process's history.

Bytes all-reduced per step under DDP come from :mod:`~lightning_mp.bench.allreduced_bytes` (two gloo processes).

Why these carry over. The CPU runs the same Python code, the same dispatcher and the same autograd graph as a GPU;
only the kernels differ. A cast of a weight is one kernel that reads the whole weight and writes a copy, on any
device. Ops are launches, and Python calls are the host's work per step, which bounds the step of a launch-bound
model. Bytes all-reduced are the gradients' bytes, set by their dtype, which NCCL moves as gloo does. Counts are
deterministic: they depend on the model, the data's shapes and the library versions, not on the machine or its
load (the tests check that two runs agree). Two things differ on a GPU: CUDA autocast casts a few more ops than the
CPU's (normalisation layers to fp32), and a foreach or fused optimizer may group tensors differently; both are the
same for every level, so the comparisons between levels hold.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.utilities.types import STEP_OUTPUT
from typing_extensions import override

from lightning_mp.bench.allreduced_bytes import AllReducedBytes, measure_allreduced_bytes
from lightning_mp.bench.counting import StepCounts, WeightCastCounter, count_python_calls, count_syncs_and_ops
from lightning_mp.bench.workloads import QUIET_TRAINER, SIZES, markov_task
from lightning_mp.plugin import MixedPrecision

Phase = Literal["forward", "backward", "step"]
Task = Callable[[int], tuple[L.LightningModule, Any]]
"""Builds a fresh model and its training data (a DataLoader or a LightningDataModule) for at least ``steps`` batches."""

OPT_LEVELS: tuple[tuple[str, str], ...] = (
    ("O0", "32-true"),
    ("O1", "16-mixed"),
    ("O1", "bf16-mixed"),
    ("O2", "16-mixed"),
    ("O2", "bf16-mixed"),
    ("O3", "16-mixed"),
    ("O3", "bf16-mixed"),
    ("lean", "bf16-mixed"),
)
"""Every opt level in each precision it supports, as ``(opt_level, precision)``: the rows of the table."""
QUICK_OPT_LEVELS = (("O0", "32-true"), ("O1", "16-mixed"), ("O2", "16-mixed"))
LIGHTNING_BF16_TRUE = ("Lightning", "bf16-true")
"""Lightning's own ``precision="bf16-true"`` (bf16 weights, no masters, no plugin): lean's step-time reference. The
full report counts it as a baseline row; pass it to :func:`count_opt_level` as ``(opt_level, precision)``."""
WARMUP_STEPS = 2


@dataclass(frozen=True)
class OptLevelCounts:
    """What one steady training step of one opt level dispatched and called.

    Attributes:
        opt_level: the opt level.
        precision: the plugin's precision.
        weights: the model's trainable parameter tensors: what "per weight" divides by.
        casts_forward: casts of weights from the batch's start to ``on_before_backward``.
        casts_backward: casts of weights from ``on_before_backward`` to ``on_after_backward``.
        casts_step: casts of weights from ``on_after_backward`` to the batch's end (the optimizer step).
        compute_ops: dispatched ATen ops of the step that are neither views nor host reads.
        syncs: host reads of tensor values in the step.
        python_calls: Python function calls of the next (equally steady) step.

    """

    opt_level: str
    precision: str
    weights: int
    casts_forward: int
    casts_backward: int
    casts_step: int
    compute_ops: int
    syncs: int
    python_calls: int

    @property
    def casts(self) -> int:
        """Casts of weights in the whole step."""
        return self.casts_forward + self.casts_backward + self.casts_step

    def casts_per_weight(self, phase: Phase | None = None) -> float:
        """Casts of weights per trainable parameter tensor, in ``phase`` or (None) in the whole step."""
        casts = self.casts if phase is None else getattr(self, f"casts_{phase}")
        return casts / self.weights


class SteadyStepCounter(L.Callback):
    """Count the weight casts (by phase), ops and syncs of training batch ``batch``, and the Python calls of the next.

    Args:
        batch: the index of the first counted batch in the epoch; the epoch must hold ``batch + 2`` batches.

    Raises:
        RuntimeError: after fit, from :meth:`counts`, when a counted step was skipped (an fp16 overflow): its counts
            are not those of a steady step.

    """

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.weights = 0
        self.casts: WeightCastCounter | None = None
        self.ops: StepCounts | None = None
        self.python_calls = 0
        self.skipped = False
        self._ops_region: AbstractContextManager[StepCounts] | None = None
        self._calls: count_python_calls | None = None
        self._collecting_garbage = True
        self._skipped_before = 0

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx not in (self.batch, self.batch + 1):
            return
        self._skipped_before = _skipped_steps(trainer)
        if batch_idx == self.batch:
            self.weights = sum(1 for parameter in pl_module.parameters() if parameter.requires_grad)
            self._ops_region = count_syncs_and_ops()
            self.ops = self._ops_region.__enter__()
            self.casts = WeightCastCounter(lambda: _weights(trainer)).__enter__()
            return
        gc.collect()
        self._collecting_garbage = gc.isenabled()
        gc.disable()
        self._calls = count_python_calls(excluding=_HOOK_CODES)
        self._calls.__enter__()

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self._ops_region is not None and self.casts is not None:
            self.casts.start_phase("backward")

    @override
    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._ops_region is not None and self.casts is not None:
            self.casts.start_phase("step")

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: STEP_OUTPUT, batch: Any, batch_idx: int
    ) -> None:
        if self._calls is None and self._ops_region is None:
            return
        self._stop()
        self.skipped |= _skipped_steps(trainer) != self._skipped_before

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._calls is not None:
            self._calls.__exit__(None, None, None)
            self.python_calls = self._calls.calls.python_calls
            self._calls = None
            if self._collecting_garbage:
                gc.enable()
        if self._ops_region is not None:
            assert self.casts is not None
            self.casts.__exit__(None, None, None)
            self._ops_region.__exit__(None, None, None)
            self._ops_region = None

    def counts(self, opt_level: str, precision: str) -> OptLevelCounts:
        """The counts of the two batches, once fit has run past them."""
        if self.skipped:
            raise RuntimeError(
                f"{opt_level} {precision}: a counted step was skipped (non-finite gradients), so its counts are not"
                " those of a steady step; count later batches or lower the initial loss scale."
            )
        if self.casts is None or self.ops is None or not self.python_calls:
            raise RuntimeError(f"{opt_level} {precision}: training ended before batch {self.batch + 1} was counted.")
        return OptLevelCounts(
            opt_level=opt_level,
            precision=precision,
            weights=self.weights,
            casts_forward=self.casts.by_phase["forward"],
            casts_backward=self.casts.by_phase["backward"],
            casts_step=self.casts.by_phase["step"],
            compute_ops=self.ops.compute_ops,
            syncs=self.ops.syncs,
            python_calls=self.python_calls,
        )


_HOOK_CODES = tuple(
    hook.__code__
    for hook in (
        SteadyStepCounter.on_before_backward,
        SteadyStepCounter.on_after_backward,
        SteadyStepCounter.on_train_batch_end,
        SteadyStepCounter._stop,
    )
)
"""The counting callback's own hooks, which the Python call count leaves out."""


def _weights(trainer: L.Trainer) -> list[torch.Tensor]:
    """The model's parameters and every tensor the optimizers step (fp32 masters, where a level keeps them there)."""
    tensors: list[torch.Tensor] = list(trainer.lightning_module.parameters())
    tensors += [p for optimizer in trainer.optimizers for group in optimizer.param_groups for p in group["params"]]
    return tensors


def _skipped_steps(trainer: L.Trainer) -> int:
    plugin = trainer.precision_plugin
    return plugin.stats.skipped_steps if isinstance(plugin, MixedPrecision) else 0


def markov_counting_task(steps: int) -> tuple[L.LightningModule, Any]:
    """The tiny Markov-text model (one layer, ``d_model`` 32) and data for ``steps`` batches."""
    data, model = markov_task(SIZES["tiny"], steps, seed=0)
    return model, data


def trainer_for_counting(opt_level: str, precision: str, max_steps: int, **options: Any) -> L.Trainer:
    """A CPU Trainer with ``MixedPrecision(precision, opt_level=opt_level)`` that logs, checks and saves nothing.

    ``opt_level="Lightning"`` trains with Lightning's own plugin of ``precision`` (:data:`LIGHTNING_BF16_TRUE`).
    """
    if opt_level == LIGHTNING_BF16_TRUE[0]:
        precision_arguments: dict[str, Any] = {"precision": precision}
    else:
        precision_arguments = {"plugins": [MixedPrecision(precision, opt_level=opt_level)]}
    arguments: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": max_steps,
        **QUIET_TRAINER,
        **precision_arguments,
    }
    return L.Trainer(**{**arguments, **options})


def count_opt_level(opt_level: str, precision: str, task: Task = markov_counting_task) -> OptLevelCounts:
    """Train ``task``'s model under ``opt_level`` in ``precision`` and count one steady step.

    Args:
        opt_level: an opt level of :class:`~lightning_mp.MixedPrecision`, or ``"Lightning"`` for Lightning's own
            plugin of ``precision``.
        precision: ``"16-mixed"``, ``"bf16-mixed"`` or ``"32-true"``; with ``"Lightning"``, any precision of
            Lightning's Trainer (``"bf16-true"``).
        task: builds the model and its data.

    Returns:
        The counts of batch ``WARMUP_STEPS`` (Python calls: of the batch after it).

    Example:
        >>> counts = count_opt_level("O1", "bf16-mixed")
        >>> counts.casts_forward, counts.casts_backward, counts.casts_step, counts.weights
        (10, 0, 0, 18)

    """
    steps = WARMUP_STEPS + 2
    torch.manual_seed(0)
    model, data = task(steps + 1)  # the counted batches are not the epoch's last, which Lightning handles apart
    counter = SteadyStepCounter(batch=WARMUP_STEPS)
    trainer = trainer_for_counting(opt_level, precision, steps, callbacks=[counter])
    # Counted with torch's autocast weight cache on, as in a fresh process: a process whose earlier work left it off
    # would count each weight's cast again in backward.
    cache_was_enabled = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # emulated bf16 and few dataloader workers on this CPU: known, not counted
            trainer.fit(model, data)
    finally:
        torch.set_autocast_cache_enabled(cache_was_enabled)
    return counter.counts(opt_level, precision)


def count_opt_levels(
    opt_levels: Sequence[tuple[str, str]] = OPT_LEVELS, task: Task = markov_counting_task
) -> list[OptLevelCounts]:
    """:func:`count_opt_level` for each ``(opt_level, precision)``, in order."""
    return [count_opt_level(opt_level, precision, task) for opt_level, precision in opt_levels]


def _o1_reference(row: OptLevelCounts | AllReducedBytes, rows: Sequence[Any]) -> Any:
    """O1's row in ``row``'s precision; for fp32, O1's first row (O1 all-reduces fp32 gradients in either)."""
    o1_rows = [other for other in rows if other.opt_level == "O1"]
    same_precision = [other for other in o1_rows if other.precision == row.precision]
    return (same_precision or o1_rows or [None])[0]


def opt_level_table(counts: Sequence[OptLevelCounts], allreduced: Sequence[AllReducedBytes] = ()) -> str:
    """One row per opt level and precision: weight casts per weight by phase, ops, Python calls, DDP bytes."""
    by_level = {(r.opt_level, r.precision): r for r in allreduced}
    lines = [
        "| opt level | precision | weight casts fwd / bwd / step (per weight) | ops / step | Python calls / step"
        " | DDP bytes all-reduced / step (dtype) | vs O1 |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for row in counts:
        casts = " / ".join(f"{row.casts_per_weight(phase):.2f}" for phase in ("forward", "backward", "step"))
        reduced = by_level.get((row.opt_level, row.precision))
        reference = _o1_reference(reduced, allreduced) if reduced is not None else None
        wire = "-" if reduced is None else f"{reduced.total:,} ({', '.join(sorted(reduced.bytes_by_dtype))})"
        ratio = "-" if reduced is None or reference is None else f"{reduced.total / reference.total:.2f}x"
        lines.append(
            f"| {row.opt_level} | {row.precision} | {casts} | {row.compute_ops:,} | {row.python_calls:,}"
            f" | {wire} | {ratio} |"
        )
    return "\n".join(lines)


O2_HOOK_PYTHON_CALLS = 16
"""The Python calls a steady O2 step may make beyond O1's: its optimizer hooks and the master bookkeeping around the
step, a fixed number whatever the number of parameters (:mod:`lightning_mp.policies.o2`)."""


def opt_level_target_lines(counts: Sequence[OptLevelCounts], allreduced: Sequence[AllReducedBytes] = ()) -> list[str]:
    """Issue 22's CPU-checkable targets for O2 and lean, with the measured values, for the precisions that ran."""
    lines = []

    def verdict(met: bool) -> str:
        return "met" if met else "MISSED"

    for o2 in (row for row in counts if row.opt_level == "O2"):
        name = f"O2 {o2.precision}"
        steady = o2.casts_forward == 0 and o2.casts_backward == 0 and o2.casts_step <= o2.weights
        lines.append(
            f"{name} weight casts: none in forward or backward, <= 1 per weight in the step: {o2.casts_forward} /"
            f" {o2.casts_backward} / {o2.casts_step} for {o2.weights} weights -> {verdict(steady)}"
        )
        o1 = _o1_reference(o2, counts)
        if o1 is not None and o1.precision == o2.precision:
            lines.append(
                f"{name} ops <= O1's: {o2.compute_ops:,} vs {o1.compute_ops:,}"
                f" -> {verdict(o2.compute_ops <= o1.compute_ops)}"
            )
            allowed = o1.python_calls + O2_HOOK_PYTHON_CALLS
            lines.append(
                f"{name} Python calls <= O1's + {O2_HOOK_PYTHON_CALLS} (its optimizer hooks, none per parameter):"
                f" {o2.python_calls:,} vs {o1.python_calls:,} -> {verdict(o2.python_calls <= allowed)}"
            )
    for lean in (row for row in counts if row.opt_level == "lean"):
        o1 = _o1_reference(lean, counts)
        lines.append(f"lean {lean.precision} host syncs per step, none: {lean.syncs} -> {verdict(lean.syncs == 0)}")
        if o1 is not None and o1.precision == lean.precision:
            lines.append(
                f"lean {lean.precision} ops and Python calls <= O1's: {lean.compute_ops:,} vs {o1.compute_ops:,},"
                f" {lean.python_calls:,} vs {o1.python_calls:,}"
                f" -> {verdict(lean.compute_ops <= o1.compute_ops and lean.python_calls <= o1.python_calls)}"
            )
    for o2_bytes in (row for row in allreduced if row.opt_level == "O2"):
        o1_bytes = _o1_reference(o2_bytes, allreduced)
        if o1_bytes is not None and o1_bytes.precision == o2_bytes.precision:
            value = o2_bytes.total / o1_bytes.total
            lines.append(
                f"O2 {o2_bytes.precision} bytes all-reduced <= 0.55x O1's: {value:.2f}x -> {verdict(value <= 0.55)}"
            )
    return lines


def opt_level_report(quick: bool) -> str:
    """The opt levels' part of the ``--counts`` report: the table and the budgets it checks.

    ``quick`` counts O0, O1 and O2 in fp16 only, and leaves out DDP (two processes, about 20 seconds) and the
    baseline row of Lightning's ``bf16-true``.
    """
    opt_levels = QUICK_OPT_LEVELS if quick else OPT_LEVELS
    counts = count_opt_levels(opt_levels if quick else (*opt_levels, LIGHTNING_BF16_TRUE))
    allreduced = () if quick else measure_allreduced_bytes(opt_levels)
    size = SIZES["tiny"]
    parts = [
        f"Per opt level, one steady training step (Trainer, TinyTransformerLM {size.describe()}, AdamW; counted on the"
        " CPU with lightning_mp.bench.counting; DDP: gloo, 2 processes). Weight casts per trainable parameter tensor,"
        " split at on_before_backward and on_after_backward:",
        "",
        opt_level_table(counts, allreduced),
        "",
        *(f"- {line}" for line in opt_level_target_lines(counts, allreduced)),
    ]
    return "\n".join(parts)


__all__ = [
    "LIGHTNING_BF16_TRUE",
    "OPT_LEVELS",
    "OptLevelCounts",
    "SteadyStepCounter",
    "count_opt_level",
    "count_opt_levels",
    "markov_counting_task",
    "opt_level_report",
    "opt_level_table",
    "opt_level_target_lines",
    "trainer_for_counting",
]
