"""Tensor memory of one training step per configuration (``--memory``): the peak, split by category.

Each configuration trains one warm-up step on the CPU, then one step under ``torch.profiler`` with
``profile_memory``, ``record_shapes`` and ``with_stack`` (torch's memory profile requires all three: the Python
tracer is what tells parameters and optimizer states apart). The memory timeline gives the peak of the tensor
bytes alive, its split by category at that moment, and the weights, gradients and optimizer states kept at the end
of the step. The last step's gradients are freed before profiling: the timeline only sees a tensor made before it
started once an op touches it, and Lightning frees them untouched. The byte counts depend on the model and torch's
kernels, not on the machine, and since counting bytes needs no fast fp16, the fp16 configurations are measured too.

The timeline is read through torch's public ``profile.export_memory_timeline(path, device)``, whose JSON file holds
``[times, sizes]``: one row of byte counts per timestamp, column 0 unused and then one column per category in torch's
order (:data:`TIMELINE_COLUMNS`, the same from torch 2.8 to 2.15). torch deprecates that export in favour of CUDA's
memory snapshots, which know no categories and no CPU; the deprecation warning is silenced where it is called.

Two more steps count the host work of a steady step with :mod:`lightning_mp.bench.counting`: its compute ops in one
batch, its Python calls in the next (so that the op counter's own frames are not counted as Python calls).

Weight and master bytes per parameter are read from the tensors themselves at the end of the profiled step: the
storage of every parameter and, where the opt level keeps masters (O2, ``lean-exact``), of every master and packed
remainder, each storage once. Two models (``--memory-model``): the Markov-text transformer LM, and a small ResNet
with batch norm (:data:`CNN_SHAPE`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import tempfile
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from lightning_mp.bench.configurations import CONFIGURATIONS, FP32
from lightning_mp.bench.counting import PythonCalls, StepCounts, count_python_calls, count_syncs_and_ops
from lightning_mp.bench.workloads import (
    QUIET_TRAINER,
    SIZES,
    ImageModelShape,
    ModelSize,
    RepeatedBatch,
    WorkloadModule,
    markov_task,
)

MEMORY_CONFIGURATIONS = (
    FP32,
    "lightning-bf16",
    "O1-bf16",
    "O2-bf16",
    "lean-bf16",
    "lean-kahan-bf16",
    "lean-exact-bf16",
    "O1-fp16",
    "O2-fp16",
)
"""What ``--memory`` measures by default: the fp16 ones too, since byte counts need no fast fp16."""
CNN_SHAPE = ImageModelShape(image_size=32, batch_size=16, num_classes=10, blocks=(1, 1), base_width=32)
"""``--memory-model cnn``: a two-stage ResNet with batch norm on 32x32 images, AdamW (foreach)."""
MEMORY_MODELS = ("lm", "cnn")


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
        weight_and_master_bytes: bytes of the parameters' storages and of the masters kept beside them (O2's fp32
            masters, lean-exact's int16 remainders) at the end of the step (0: not measured).
        model: ``"lm"`` or ``"cnn"`` (:data:`MEMORY_MODELS`).
        unseen_frees: bytes made before the profiled step and freed in it, which the timeline still counts at its
            peak (:func:`live_storages`): lean-exact's remainders, freed when its masters are rebuilt.

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
    weight_and_master_bytes: int = 0
    model: str = "lm"
    unseen_frees: int = 0

    @property
    def weight_and_master_bytes_per_parameter(self) -> float:
        """Bytes of weights and of the masters beside them (O2's fp32, lean-exact's remainders) per parameter."""
        return self.weight_and_master_bytes / self.parameters

    @property
    def persistent_bytes_per_parameter(self) -> float:
        """Bytes kept between steps per parameter: 16 with AdamW for fp32, O1 and O2, plus its step counters."""
        return self.persistent_bytes / self.parameters


TIMELINE_COLUMNS = (
    "unused",
    "parameter",
    "optimizer_state",
    "input",
    "temporary",
    "activation",
    "gradient",
    "autograd_detail",
    "unknown",
)
"""The columns of a row of ``export_memory_timeline``'s sizes: torch's categories in the order it writes them."""

_FIELD_OF_COLUMN = {
    "parameter": "weights",
    "gradient": "gradients",
    "optimizer_state": "optimizer_state",
    "activation": "activations",
}
"""The breakdown's field for each category it names; the other columns go to ``other``."""

_KEPT = ("parameter", "gradient", "optimizer_state")
"""What a model keeps between steps: Lightning frees gradients at the next step's ``zero_grad``."""


def breakdown_from_timeline(
    times_and_sizes: tuple[list[int], list[list[int]]], configuration: str, parameters: int
) -> MemoryBreakdown:
    """The peak and its split by category from a memory timeline (one row of sizes per timestamp).

    Raises:
        ValueError: if a row does not have one size per column of :data:`TIMELINE_COLUMNS`.

    """
    _, sizes = times_and_sizes
    if any(len(row) != len(TIMELINE_COLUMNS) for row in sizes):
        raise ValueError(
            f"A memory timeline row must have {len(TIMELINE_COLUMNS)} sizes ({', '.join(TIMELINE_COLUMNS)}), got"
            f" {sorted({len(row) for row in sizes})}: this torch writes another format."
        )
    totals = [sum(row) for row in sizes]
    at_peak = dict(zip(TIMELINE_COLUMNS, sizes[max(range(len(totals)), key=totals.__getitem__)], strict=True))
    split = dict.fromkeys(("weights", "gradients", "optimizer_state", "activations", "other"), 0)
    for column, size in at_peak.items():
        split[_FIELD_OF_COLUMN.get(column, "other")] += size
    at_end = dict(zip(TIMELINE_COLUMNS, sizes[-1], strict=True))
    persistent = sum(at_end[column] for column in _KEPT)
    return MemoryBreakdown(
        configuration,
        parameters,
        max(totals),
        weights=split["weights"],
        gradients=split["gradients"],
        optimizer_state=split["optimizer_state"],
        activations=split["activations"],
        other=split["other"],
        persistent_bytes=persistent,
    )


def export_timeline(profiler: torch.profiler.profile, device: str) -> tuple[list[int], list[list[int]]]:
    """``profiler``'s memory timeline on ``device``: the timestamps, and one row of sizes per timestamp."""
    with tempfile.TemporaryDirectory() as directory:
        path = f"{directory}/timeline.json"
        with warnings.catch_warnings():
            # Deprecated for CUDA's memory snapshots, which have no categories and no CPU (module docstring).
            warnings.filterwarnings("ignore", message=".*export_memory_timeline", category=FutureWarning)
            profiler.export_memory_timeline(path, device)
        with open(path) as file:
            times, sizes = json.load(file)
    return times, sizes


class MemoryTimelineCallback(L.Callback):
    """Profile the tensor memory of one training batch, forward to optimizer step, and keep its memory timeline."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.timeline: tuple[list[int], list[list[int]]] | None = None
        self.unseen_frees = 0
        """Bytes of tensors made before the profiled batch and freed in it, which the timeline keeps to its end."""
        self._profiler: torch.profiler.profile | None = None
        self._live_before: dict[int, int] = {}

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.batch:
            # The timeline sees a tensor made before profiling only once an op touches it; Lightning frees the last
            # step's gradients without touching them. Freeing them here makes every byte of the step visible.
            for optimizer in trainer.optimizers:
                optimizer.zero_grad(set_to_none=True)
            self._live_before = live_storages()
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
        self.timeline = export_timeline(self._profiler, "cpu")
        self._profiler = None
        live_after = live_storages()
        self.unseen_frees = sum(size for pointer, size in self._live_before.items() if pointer not in live_after)


def live_storages() -> dict[int, int]:
    """``data_ptr -> bytes`` of the storage of every tensor Python holds now.

    torch's memory profiler records no free of a block allocated before it started ("Memory block of unknown size
    was allocated before the profiling started"), so such a tensor, once an op touched it, stays in the timeline to
    its end. Comparing the storages alive before and after the profiled batch finds the bytes freed unseen (an
    address reused in between is missed, which only undercounts).
    """
    gc.collect()
    storages = (obj.untyped_storage() for obj in gc.get_objects() if isinstance(obj, torch.Tensor))
    return {storage.data_ptr(): storage.nbytes() for storage in storages if storage.data_ptr()}


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


def weight_and_master_bytes(trainer: L.Trainer, module: torch.nn.Module) -> int:
    """Bytes of ``module``'s parameters and of the masters and remainders its opt level keeps, each storage once."""
    tensors = list(module.parameters())
    masters = getattr(getattr(trainer.precision_plugin, "policy", None), "masters", None)
    if masters is not None:
        tensors += list(masters.master_params)
        tensors += [remainder for remainder in getattr(masters, "remainders", []) if remainder is not None]
    storages = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes() for tensor in tensors}
    return sum(storages.values())


class WeightBytesCallback(L.Callback):
    """Read :func:`weight_and_master_bytes` at the end of batch ``batch``."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.bytes = 0

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.batch:
            self.bytes = weight_and_master_bytes(trainer, pl_module)


def memory_task(model: str, size: ModelSize, steps: int, seed: int) -> tuple[L.LightningModule, dict[str, Any]]:
    """The model of ``--memory-model`` and the ``fit`` arguments that feed it ``steps`` batches."""
    if model == "cnn":
        network = WorkloadModule(CNN_SHAPE.build(), "foreach")
        return network, {"train_dataloaders": RepeatedBatch(CNN_SHAPE, steps, torch.device("cpu"), seed)}
    data, lm = markov_task(size, steps, seed)
    return lm, {"datamodule": data}


def measure_memory(name: str, size: ModelSize, seed: int = 0, warmup: int = 1, model: str = "lm") -> MemoryBreakdown:
    """Train ``warmup`` steps under configuration ``name`` on the CPU, then profile the memory of the next one.

    Two more steps count the host work of a steady step: its compute ops, then its Python calls. ``model`` is
    ``"lm"`` (the Markov-text transformer of ``size``) or ``"cnn"`` (:data:`CNN_SHAPE`).
    """
    L.seed_everything(seed, verbose=False)
    module, data = memory_task(model, size, warmup + 3, seed)
    recorder = MemoryTimelineCallback(batch=warmup)
    host_work = HostWorkCallback(batch=warmup + 1)
    weights = WeightBytesCallback(batch=warmup)
    arguments = CONFIGURATIONS[name].trainer_arguments()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=warmup + 3,
        **QUIET_TRAINER,
        **{**arguments, "callbacks": [recorder, host_work, weights, *arguments.get("callbacks", [])]},
    )
    with warnings.catch_warnings():
        # The memory profiler reads ``.grad`` of every parameter slot a module call sees; under O2 the slots hold
        # the half copies, which are not leaves, and torch warns about that read.
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
        trainer.fit(module, **data)
    assert recorder.timeline is not None
    memory = breakdown_from_timeline(recorder.timeline, name, sum(p.numel() for p in module.parameters()))
    return replace(
        memory,
        python_calls=host_work.python_calls,
        compute_ops=host_work.compute_ops,
        weight_and_master_bytes=weights.bytes,
        model=model,
        unseen_frees=recorder.unseen_frees,
    )


def _mib(value: int) -> str:
    return f"{value / 2**20:.2f}"


def _table(results: Sequence[MemoryBreakdown], header: str, rule: str, cells: Callable[[MemoryBreakdown], str]) -> str:
    """A Markdown table of one row per result, with a model column first where the results are of several models."""
    several = len({result.model for result in results}) > 1
    lines = [("| model " if several else "") + header, ("|---" if several else "") + rule]
    lines += [(f"| {r.model} " if several else "") + cells(r) for r in results]
    return "\n".join(lines)


def memory_table(results: Sequence[MemoryBreakdown]) -> str:
    """One row per configuration: the peak, its split by category, its ratio to fp32, and bytes kept per parameter.

    Results of more than one model (:data:`MEMORY_MODELS`) get a model column, each compared with its own fp32 row.
    """
    fp32 = {result.model: result for result in results if result.configuration == FP32}

    def cells(r: MemoryBreakdown) -> str:
        reference = fp32.get(r.model)
        ratio = f"{r.peak_bytes / reference.peak_bytes:.3f}" if reference is not None else "-"
        return (
            f"| {r.configuration} | {_mib(r.peak_bytes)} | {ratio} | {_mib(r.weights)} | {_mib(r.gradients)}"
            f" | {_mib(r.optimizer_state)} | {_mib(r.activations)} | {_mib(r.other)}"
            f" | {r.persistent_bytes_per_parameter:.2f} | {r.weight_and_master_bytes_per_parameter:.2f} |"
        )

    header = (
        "| configuration | peak (MiB) | vs fp32 | weights | gradients | optimizer state | activations | other"
        " | persistent (B/param) | weights + masters (B/param) |"
    )
    return _table(results, header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|", cells)


def memory_target_lines(results: Sequence[MemoryBreakdown]) -> list[str]:
    """The memory budgets with their measured values, for the configurations that ran."""
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
    if {"lean-exact-bf16", "O2-bf16"} <= by_name.keys():
        exact, o2_row = by_name["lean-exact-bf16"], by_name["O2-bf16"]
        value, o2_value = exact.weight_and_master_bytes_per_parameter, o2_row.weight_and_master_bytes_per_parameter
        lines.append(
            f"lean-exact-bf16 weight + master bytes per parameter <= 4 (O2-bf16: {o2_value:.2f}): {value:.2f}"
            f" -> {verdict(value <= 4.05)}"
        )
        budget = o2_row.peak_bytes - 2 * o2_row.parameters
        peak = exact.peak_bytes - exact.unseen_frees
        lines.append(
            f"lean-exact-bf16 peak <= O2-bf16's - 2 B x parameters ({_mib(budget)} MiB), within 5%:"
            f" {_mib(peak)} MiB ({_mib(exact.peak_bytes)} on the timeline, less {_mib(exact.unseen_frees)} of"
            f" remainders freed unseen by the profiler) -> {verdict(peak <= 1.05 * budget)}"
        )
        if o2_row.compute_ops and o2_row.python_calls:
            ops, calls = exact.compute_ops / o2_row.compute_ops, exact.python_calls / o2_row.python_calls
            lines.append(
                f"lean-exact-bf16 compute ops and Python calls <= 1.10x O2-bf16's: {ops:.3f}x, {calls:.3f}x"
                f" -> {verdict(ops <= 1.10 and calls <= 1.10)}"
            )
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
    """One row per configuration: Python calls and compute ops of one steady training batch.

    Results of more than one model get a model column.
    """
    header = "| configuration | Python calls / step | compute ops / step |"
    return _table(
        results, header, "|---|---:|---:|", lambda r: f"| {r.configuration} | {r.python_calls:,} | {r.compute_ops:,} |"
    )


def memory_report(results: Sequence[MemoryBreakdown], size_name: str, size: ModelSize) -> str:
    """The ``--memory`` report: the model, the table (MiB of tensor memory) and the targets."""
    parameters = results[0].parameters if results else 0
    model = results[0].model if results else "lm"
    described = (
        f"a ResNet with batch norm ({CNN_SHAPE.describe()}), {parameters:,} parameters, AdamW (foreach)"
        if model == "cnn"
        else f"TinyTransformerLM, size {size_name!r} ({size.describe()}), {parameters:,} parameters, AdamW"
    )
    parts = [
        "### lightning_mp memory benchmark",
        "",
        f"- Model: {described}",
        "- Peak tensor bytes of one steady-state training step (forward, backward, optimizer step), from"
        " torch.profiler's memory timeline; the split is the one at the peak. Independent of the machine.",
        "",
        memory_table(results),
        "",
        "Host work of one steady training batch (hooks to hooks), counted with lightning_mp.bench.counting:",
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
        results.append(measure_memory(name, size, args.seed, model=args.memory_model))
        print(f"[memory] {name}: peak {results[-1].peak_bytes / 2**20:.2f} MiB", file=sys.stderr, flush=True)
    return memory_report(results, args.size, size)
