"""Regenerate the documentation's figures and the performance page's results: ``python docs/generate.py``.

``python docs/generate.py figures`` (the default) trains the demo (``python -m lightning_mp.demo``: fp16, a planted
loss spike at step 50) into a temporary log directory, reads the event files back with TensorBoard's
``EventAccumulator`` and writes, under ``docs/_static/``:

- ``demo-loss-scale.png``: the loss scale, the skipped steps and the training loss, by step, as the
  ``LossScaleMonitor`` logged them;
- ``demo-sentinel-headroom.png``: the ``PrecisionSentinel``'s per-layer heatmap of fp16 activation headroom, the image
  the run wrote to TensorBoard, saved as it is;
- ``demo-layer-dtypes.png``: the ``LayerDtypeMonitor``'s last table (``precision/layer_dtypes``, a TensorBoard text
  event) drawn as a grid: one row per layer, a column each for its parameters, its output and its gradients, every
  cell coloured and labelled by the dtype the run really used.

Nothing is drawn by hand and nothing is downloaded; on a CPU the run takes about a minute.

``python docs/generate.py performance`` runs the benchmark's measurements (:mod:`lightning_mp.bench`, the code
behind ``python -m lightning_mp.bench --counts`` and ``--memory``) and the parity run of ``tests/test_parity.py``, and
writes their results as JSON under ``docs/performance/``, each file stamped with the command, the date, the CPU and
the torch, Lightning and Python versions. ``docs/performance_tables.py`` renders the page's tables from those files
at build time. Every figure is a count, a byte count or a validation metric of a seeded run: none is a wall time,
which on a shared machine measures its load. ``--only NAME`` reruns one file; the whole run takes several minutes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from tensorboard.backend.event_processing import event_accumulator

ROOT = Path(__file__).resolve().parents[1]
STATIC = Path(__file__).resolve().parent / "_static"
SCALARS = {
    "precision/loss_scale": ("loss scale", True),
    "precision/skipped_steps_total": ("skipped steps", False),
}
HEATMAP = "precision_sentinel/activation_headroom_log2"
LAYER_DTYPES = "precision/layer_dtypes"
DTYPE_COLOURS = {"float32": "#4c72b0", "float16": "#dd8452", "bfloat16": "#55a868"}
"""A colour per dtype; a cell with none (no parameters, not called) is light grey, a mixed one darker grey."""


def read_events(log_dir: Path) -> event_accumulator.EventAccumulator:
    """Every scalar and image event under ``log_dir``, loaded in full."""
    guidance = {event_accumulator.SCALARS: 0, event_accumulator.IMAGES: 0, event_accumulator.TENSORS: 0}
    accumulator = event_accumulator.EventAccumulator(str(log_dir), size_guidance=guidance)
    accumulator.Reload()
    return accumulator


def loss_tag(scalar_tags: list[str]) -> str | None:
    """The training loss's tag, whatever the model named it."""
    return next((tag for tag in sorted(scalar_tags) if "loss" in tag and "train" in tag), None)


def plot_scalars(events: event_accumulator.EventAccumulator, out: Path) -> None:
    """The loss scale, the skipped steps and the training loss, one panel each, sharing the step axis."""
    tags = events.Tags()["scalars"]
    panels = dict(SCALARS)
    loss = loss_tag(tags)
    if loss is not None:
        panels[loss] = ("training loss", False)
    figure, axes = plt.subplots(len(panels), 1, figsize=(7, 1.9 * len(panels)), sharex=True)
    for axis, (tag, (label, log_scale)) in zip(axes, panels.items(), strict=True):
        points = events.Scalars(tag)
        axis.plot([point.step for point in points], [point.value for point in points], drawstyle="steps-post")
        axis.set_ylabel(label)
        if log_scale:
            axis.set_yscale("log", base=2)
        axis.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    axes[0].set_title("python -m lightning_mp.demo: fp16, a loss spike planted at step 50")
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)


def save_heatmap(events: event_accumulator.EventAccumulator, out: Path) -> bool:
    """The last sentinel heatmap the run wrote, as the PNG TensorBoard stores; False where the run wrote none."""
    if HEATMAP not in events.Tags()["images"]:
        return False
    out.write_bytes(events.Images(HEATMAP)[-1].encoded_image_string)
    return True


def layer_dtype_grid(markdown: str) -> tuple[list[str], list[str], list[list[str]]]:
    """The rows (``module (type)``), the columns and the cells of a ``LayerDtypeMonitor`` table in Markdown."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows, cells = [], []
    for line in lines[2:]:
        values = [cell.strip() for cell in line.strip("|").split("|")]
        rows.append(f"{values[0].strip('`')} ({values[1]})")
        cells.append(values[2:])
    return rows, header[2:], cells


def plot_layer_dtypes(events: event_accumulator.EventAccumulator, out: Path) -> bool:
    """The last layer-dtype table the run logged, as a coloured grid; False where the run logged none."""
    tag = next((tag for tag in events.Tags()["tensors"] if tag.startswith(LAYER_DTYPES)), None)
    if tag is None:
        return False
    table = events.Tensors(tag)[-1]
    rows, columns, cells = layer_dtype_grid(table.tensor_proto.string_val[0].decode())
    figure, axis = plt.subplots(figsize=(10, 0.38 * len(rows) + 1.2), layout="constrained")
    for row, values in enumerate(cells):
        for column, value in enumerate(values):
            colour = DTYPE_COLOURS.get(value, "#eeeeee" if value in ("-", "not called") else "#999999")
            axis.add_patch(plt.Rectangle((column, row), 1, 1, facecolor=colour, edgecolor="white", linewidth=2))
            dark = value in DTYPE_COLOURS or colour == "#999999"
            axis.text(column + 0.5, row + 0.5, value, ha="center", va="center", color="white" if dark else "black")
    axis.set_xlim(0, len(columns))
    axis.set_ylim(len(rows), 0)
    axis.set_xticks([column + 0.5 for column in range(len(columns))], columns)
    axis.xaxis.tick_top()
    axis.set_yticks([row + 0.5 for row in range(len(rows))], rows)
    axis.tick_params(length=0)
    for spine in axis.spines.values():
        spine.set_visible(False)
    figure.suptitle(f"LayerDtypeMonitor at step {table.step}: the dtype each layer really used")
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return True


def figures() -> None:
    """Run the demo into a temporary directory and write the figures into ``docs/_static``."""
    from lightning_mp import demo

    STATIC.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as log_dir:
        demo.main(["--accelerator", "cpu", "--log-dir", log_dir])
        events = read_events(next(Path(log_dir).rglob("events.out.tfevents.*")).parent)
        plot_scalars(events, STATIC / "demo-loss-scale.png")
        wrote_heatmap = save_heatmap(events, STATIC / "demo-sentinel-headroom.png")
        wrote_dtypes = plot_layer_dtypes(events, STATIC / "demo-layer-dtypes.png")
    extra = [
        name
        for name, wrote in (("demo-sentinel-headroom.png", wrote_heatmap), ("demo-layer-dtypes.png", wrote_dtypes))
        if wrote
    ]
    print(f"wrote {STATIC / 'demo-loss-scale.png'}" + "".join(f", {name}" for name in extra))


PERFORMANCE = Path(__file__).resolve().parent / "performance"
PARITY_CONFIGURATIONS = (
    ("32-true", "O0"),
    ("bf16-mixed", "O1"),
    ("bf16-mixed", "O2"),
    ("16-mixed", "O1"),
    ("16-mixed", "O2"),
    ("bf16-mixed", "lean"),
    ("bf16-mixed", "lean-kahan"),
    # Lightning's own bf16 weights with round-to-nearest updates: what lean's stochastic rounding is compared with.
    ("bf16-true", "Lightning"),
)
PARITY_STEPS = 600


def machine() -> dict[str, Any]:
    """The CPU, its cores, torch's threads and the versions a result was measured with."""
    import lightning
    import torch

    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.partition(":")[2].strip() for line in cpuinfo.read_text().splitlines() if "model name" in line]
        cpu = names[0] if names else cpu
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "python": platform.python_version(),
    }


def write_result(name: str, about: str, **data: Any) -> None:
    """Write ``docs/performance/NAME.json``: the stamp (command, date, machine), what was measured, and ``data``."""
    PERFORMANCE.mkdir(exist_ok=True)
    result = {
        "command": f"python docs/generate.py performance --only {name}",
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "machine": machine(),
        "about": about,
        **data,
    }
    (PERFORMANCE / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {PERFORMANCE / f'{name}.json'}", file=sys.stderr)


def measure_counts() -> None:
    """Host syncs and ops of one iteration per precision, optimizer and contestant (``bench --counts``' first table)."""
    from lightning_mp.bench.counts import (
        OPTIMIZERS,
        PRECISIONS,
        SHOWN_CONTESTANTS,
        count_iteration,
        tiny_language_model,
    )

    make_model, batch = tiny_language_model()
    rows = []
    for precision in PRECISIONS:
        for optimizer in OPTIMIZERS:
            counts = count_iteration(precision, optimizer, make_model, batch, contestants=SHOWN_CONTESTANTS)
            rows.append(
                {
                    "precision": precision,
                    "optimizer": optimizer,
                    **{name: {"syncs": c.syncs, "compute_ops": c.compute_ops} for name, c in counts.items()},
                }
            )
    write_result(
        "counts",
        "TinyTransformerLM (vocab 16, d_model 16, 2 layers, 2 heads, seq_len 8, batch 2), the third iteration,"
        " counted with lightning_mp.bench.counting.",
        rows=rows,
    )


def measure_opt_levels() -> None:
    """Weight casts, ops, Python calls of one Trainer step per opt level, and DDP's bytes (``bench --counts``)."""
    from lightning_mp.bench.allreduced_bytes import measure_allreduced_bytes
    from lightning_mp.bench.opt_level_counts import LIGHTNING_BF16_TRUE, OPT_LEVELS, count_opt_levels
    from lightning_mp.bench.workloads import SIZES

    counts = count_opt_levels((*OPT_LEVELS, LIGHTNING_BF16_TRUE))
    allreduced = measure_allreduced_bytes(OPT_LEVELS)
    write_result(
        "opt-levels",
        f"A Trainer step of TinyTransformerLM ({SIZES['tiny'].describe()}), AdamW; DDP over gloo, 2 processes.",
        counts=[asdict(row) for row in counts],
        allreduced=[asdict(row) for row in allreduced],
    )


def measure_memory() -> None:
    """Peak tensor bytes of one step by category, and the host work of a steady batch (``bench --memory``)."""
    import warnings

    from lightning_mp.bench.memory import CNN_SHAPE, MEMORY_CONFIGURATIONS, MEMORY_MODELS
    from lightning_mp.bench.memory import measure_memory as measure
    from lightning_mp.bench.workloads import SIZES

    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model in MEMORY_MODELS:
            for name in MEMORY_CONFIGURATIONS:
                rows.append(asdict(measure(name, SIZES["medium"], model=model)))
                print(f"[memory] {model} {name}", file=sys.stderr, flush=True)
    parameters = {row["model"]: row["parameters"] for row in rows}
    write_result(
        "memory",
        f"lm: TinyTransformerLM ({SIZES['medium'].describe()}, {parameters['lm']:,} parameters), AdamW; cnn: a ResNet"
        f" with batch norm ({CNN_SHAPE.describe()}, {parameters['cnn']:,} parameters), AdamW (foreach). One steady"
        " step under torch.profiler's memory timeline.",
        rows=rows,
    )


def measure_parity() -> None:
    """Validation loss and top-1 accuracy after a seeded run per precision and opt level (``tests/test_parity.py``)."""
    import torch

    from tests.test_parity import train_and_validate

    torch.set_num_threads(1)
    rows = []
    for precision, opt_level in PARITY_CONFIGURATIONS:
        metrics = train_and_validate(precision, opt_level, PARITY_STEPS, val_batches=None)
        rows.append(
            {
                "precision": precision,
                "opt_level": opt_level,
                "val_loss": metrics["val_loss"],
                "val_accuracy": metrics["val_accuracy"],
                "skipped_steps": int(metrics["skipped_steps"]),
            }
        )
        print(f"[parity] {precision} {opt_level}: {rows[-1]}", file=sys.stderr, flush=True)
    write_result(
        "parity",
        f"TinyTransformerLM (d_model 32, 1 layer, 2 heads, seq_len 16, vocab 32, batch 8), {PARITY_STEPS} steps from"
        " seed 0, one thread, validated on the whole validation set with torchmetrics.",
        steps=PARITY_STEPS,
        rows=rows,
    )


def measure_support_matrix() -> None:
    """Every opt level under every strategy and front end, trained or refused (``tests/test_support_matrix.py``)."""
    from tests.distributed.support_matrix import ROWS, row_runs_here, run_row, summary

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for label, strategy, front in ROWS:
            if not row_runs_here(strategy):
                print(f"[support-matrix] {label}: DeepSpeed is not installed, row left out", file=sys.stderr)
                continue
            cells = summary(run_row(strategy, front, Path(scratch) / f"{strategy}-{front}"))
            rows.append({"label": label, "strategy": strategy, "front": front, "cells": cells})
            print(f"[support-matrix] {label} ({front})", file=sys.stderr, flush=True)
    write_result(
        "support-matrix",
        "Each cell trains 8 AdamW steps of a 4-layer MLP on 2 CPU processes (gloo; one for a single device), or is"
        " refused by name at setup; tests/distributed/test_support_matrix.py checks every cell.",
        rows=rows,
    )


MEASUREMENTS: dict[str, Callable[[], None]] = {
    "parity": measure_parity,
    "counts": measure_counts,
    "opt-levels": measure_opt_levels,
    "memory": measure_memory,
    "support-matrix": measure_support_matrix,
}


def main(argv: list[str] | None = None) -> int:
    """Regenerate what the command line asks for: the figures (default) or the performance results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", choices=["figures", "performance"], default="figures")
    parser.add_argument("--only", nargs="+", choices=list(MEASUREMENTS), help="performance: these results only")
    arguments = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if arguments.what == "figures":
        figures()
        return 0
    for name in arguments.only or MEASUREMENTS:
        MEASUREMENTS[name]()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
