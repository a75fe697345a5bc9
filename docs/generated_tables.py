"""The documentation's generated tables: the performance results, and the private names from their registry.

A page holds a marker, ``<!-- generated: NAME -->``, where a table goes; the Sphinx build (``docs/conf.py``) replaces
each marker with :func:`render` ``(NAME)``, and ``tests/test_docs.py`` checks that the pages hold markers, not typed
tables, so that no figure and no registry row is typed by hand.

``python docs/generate.py performance`` runs the benchmark's measurements (:mod:`lightning_mp.bench`) and writes one
JSON file per measurement under ``docs/performance/``, each stamped with the command, the date, the machine and the
torch, Lightning and Python versions; this module turns those files into Markdown. The opt-level and memory tables
are drawn by the benchmark's own table functions, so the page and ``python -m lightning_mp.bench --counts`` /
``--memory`` print the same rows.

The private-names table is :data:`lightning_mp._private_names.PRIVATE_NAMES`, one row per record, under a sentence
that counts the records and the names they cover.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_mp._private_names import CHECKED_ON, PRIVATE_NAMES
from lightning_mp.bench.allreduced_bytes import AllReducedBytes
from lightning_mp.bench.memory import MemoryBreakdown, host_work_table, memory_table
from lightning_mp.bench.opt_level_counts import OptLevelCounts, opt_level_table

RESULTS = Path(__file__).resolve().parent / "performance"
MARKER = re.compile(r"^<!-- generated: ([\w-]+) -->$", re.MULTILINE)
"""A marker: alone on its line, so that prose can name the syntax."""
CONTESTANTS = ("torch loop", "Lightning", "lightning_mp")


def load(name: str) -> dict[str, Any]:
    """The result file ``docs/performance/NAME.json``."""
    return json.loads((RESULTS / f"{name}.json").read_text())


def stamp(result: dict[str, Any]) -> str:
    """Where and when a result file was measured, in one sentence."""
    machine = result["machine"]
    return (
        f"*Measured by `{result['command']}` on {result['date']}: {machine['cpu']} ({machine['cores']} logical cores,"
        f" torch threads {machine['threads']}), torch {machine['torch']}, Lightning {machine['lightning']},"
        f" Python {machine['python']}. {result['about']}*"
    )


def counts_markdown() -> str:
    """Host syncs and compute ops of one iteration, per precision, optimizer and contestant."""
    result = load("counts")
    lines = [
        "| precision | optimizer | " + " | ".join(f"{name}: syncs / ops" for name in CONTESTANTS) + " |",
        "|---|---|" + "---|" * len(CONTESTANTS),
    ]
    for row in result["rows"]:
        cells = " | ".join(f"{row[name]['syncs']} / {row[name]['compute_ops']}" for name in CONTESTANTS)
        lines.append(f"| {row['precision']} | {row['optimizer']} | {cells} |")
    return stamp(result) + "\n\n" + "\n".join(lines)


def opt_level_rows() -> tuple[list[OptLevelCounts], list[AllReducedBytes]]:
    """The committed counts per opt level and DDP's bytes, as the benchmark's own records."""
    result = load("opt-levels")
    counts = [OptLevelCounts(**row) for row in result["counts"]]
    return counts, [AllReducedBytes(**row) for row in result["allreduced"]]


def opt_levels_markdown() -> str:
    """Weight casts by phase, ops, Python calls and DDP bytes of one step per opt level."""
    counts, allreduced = opt_level_rows()
    return stamp(load("opt-levels")) + "\n\n" + opt_level_table(counts, allreduced)


def memory_rows() -> list[MemoryBreakdown]:
    """The committed memory breakdowns, as the benchmark's own records."""
    return [MemoryBreakdown(**row) for row in load("memory")["rows"]]


def memory_markdown() -> str:
    """Peak tensor bytes of one step, split by category, per configuration."""
    return stamp(load("memory")) + "\n\n" + memory_table(memory_rows())


def host_work_markdown() -> str:
    """Python calls and compute ops of one steady batch, per configuration (the memory run's second table)."""
    return host_work_table(memory_rows())


def _by_name(rows: list[MemoryBreakdown], model: str = "lm") -> dict[str, MemoryBreakdown]:
    return {row.configuration: row for row in rows if row.model == model}


def memory_facts_markdown() -> str:
    """The comparisons a reader of the memory table looks for, computed from the same file."""
    every_row = memory_rows()
    rows = _by_name(every_row)
    lines = []
    for half in ("bf16", "fp16"):
        o2, o1, fp32 = rows.get(f"O2-{half}"), rows.get(f"O1-{half}"), rows.get("fp32")
        if o2 and o1 and fp32:
            lines.append(
                f"- O2 in {half} peaks at {o2.peak_bytes / fp32.peak_bytes:.3f}x fp32 and"
                f" {o2.peak_bytes / o1.peak_bytes:.3f}x O1, and keeps {o2.persistent_bytes_per_parameter:.2f} bytes"
                f" per parameter between steps (O1: {o1.persistent_bytes_per_parameter:.2f})."
            )
    for model, described in (("lm", "the LM"), ("cnn", "the CNN")):
        by_model = _by_name(every_row, model)
        exact, o2 = by_model.get("lean-exact-bf16"), by_model.get("O2-bf16")
        if exact and o2:
            budget = o2.peak_bytes - 2 * o2.parameters
            lines.append(
                f"- On {described}, lean-exact keeps {exact.weight_and_master_bytes_per_parameter:.2f} bytes of"
                f" weight and master per parameter (O2 in bf16: {o2.weight_and_master_bytes_per_parameter:.2f}) and"
                f" peaks at {exact.peak_bytes / budget:.3f}x O2's peak less 2 bytes per parameter on the profiler's"
                " timeline (which still counts the remainders a step frees), with O2's numbers bit for bit."
            )
    o1, builtin = rows.get("O1-bf16"), rows.get("lightning-bf16")
    if o1 and builtin:
        lines.append(
            f"- O1 in bf16 peaks at {o1.peak_bytes:,} bytes, Lightning's bf16-mixed at {builtin.peak_bytes:,}"
            f" ({o1.peak_bytes - builtin.peak_bytes:+,})."
        )
    lean, fp32 = rows.get("lean-bf16"), rows.get("fp32")
    if lean and fp32:
        lines.append(
            f"- lean peaks at {lean.peak_bytes / fp32.peak_bytes:.3f}x fp32 and keeps"
            f" {lean.persistent_bytes_per_parameter:.2f} bytes per parameter."
        )
    return "\n".join(lines)


def opt_level_facts_markdown() -> str:
    """The comparisons between O1, O2 and lean that the opt-level table supports, computed from the same file."""
    counts, allreduced = opt_level_rows()
    rows = {(row.opt_level, row.precision): row for row in counts}
    wire = {(row.opt_level, row.precision): row for row in allreduced}
    lines = []
    for precision in ("bf16-mixed", "16-mixed"):
        o1, o2 = rows.get(("O1", precision)), rows.get(("O2", precision))
        if o1 and o2:
            ratio = ""
            if ("O1", precision) in wire and ("O2", precision) in wire:
                o1_bytes, o2_bytes = wire["O1", precision].total, wire["O2", precision].total
                ratio = f", and sends {o2_bytes / o1_bytes:.2f}x O1's bytes over DDP's wire"
            lines.append(
                f"- {precision}: of {o2.weights} weights O2 casts {o2.casts_forward} in forward, {o2.casts_backward}"
                f" in backward and {o2.casts_step} in the step (O1: {o1.casts_forward} / {o1.casts_backward} /"
                f" {o1.casts_step}); it dispatches {o2.compute_ops:,} ops against O1's {o1.compute_ops:,}, makes"
                f" {o2.python_calls:,} Python calls against O1's {o1.python_calls:,}{ratio}."
            )
    lean, o1 = rows.get(("lean", "bf16-mixed")), rows.get(("O1", "bf16-mixed"))
    if lean and o1:
        lines.append(
            f"- lean (bf16): {lean.syncs} host syncs, {lean.compute_ops:,} ops against O1's {o1.compute_ops:,},"
            f" {lean.python_calls:,} Python calls against O1's {o1.python_calls:,}."
        )
    return "\n".join(lines)


def parity_markdown() -> str:
    """Validation loss, its change from O0, top-1 accuracy and skipped steps per precision and opt level."""
    result = load("parity")
    baseline = next(row for row in result["rows"] if row["opt_level"] == "O0")["val_loss"]
    lines = [
        "| precision | opt level | val loss | vs O0 | top-1 accuracy | skipped steps |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        change = (row["val_loss"] - baseline) / baseline
        lines.append(
            f"| {row['precision']} | {row['opt_level']} | {row['val_loss']:.4f} | {change:+.2%}"
            f" | {row['val_accuracy']:.2%} | {row['skipped_steps']} |"
        )
    return stamp(result) + "\n\n" + "\n".join(lines)


def private_names_markdown() -> str:
    """The registry of private torch and Lightning names: a sentence that counts it, then one row per record."""
    owners = [record.owner for record in PRIVATE_NAMES]
    covered = sum(len(record.members) or 1 for record in PRIVATE_NAMES)
    lines = [
        f"The registry holds {len(PRIVATE_NAMES)} records ({owners.count('torch')} torch,"
        f" {owners.count('lightning')} Lightning), checked on {CHECKED_ON}; with their members they cover {covered}"
        " names.",
        "",
        "| private name | owner | used in | why |",
        "|---|---|---|---|",
    ]
    for record in PRIVATE_NAMES:
        modules = ", ".join(f"`{module}`" for module in record.used_in)
        reason = record.reason.replace("|", "\\|")
        lines.append(f"| `{record.name}` | {record.owner} | {modules} | {reason} |")
    return "\n".join(lines)


COLUMN_NAMES = {
    "32-true:O0": "O0",
    "16-mixed:O1": "fp16 O1",
    "16-mixed:O2": "fp16 O2",
    "16-mixed:O3": "fp16 O3",
    "bf16-mixed:O1": "bf16 O1",
    "bf16-mixed:O2": "bf16 O2",
    "bf16-mixed:O3": "bf16 O3",
    "bf16-mixed:lean": "lean",
    "bf16-mixed:lean-kahan": "lean-kahan",
    "bf16-mixed:lean-exact": "lean-exact",
    "bf16-mixed:O1:tensorwise": "FP8",
}
"""The table's column heading of each cell of ``tests/ddp_scripts/matrix_train.py``."""


def support_matrix_markdown() -> str:
    """Every opt level under every strategy and front end: "trains", or the refusal, numbered under the table."""
    result = load("support-matrix")
    cells = list(result["rows"][0]["cells"])
    lines = [
        "| strategy | front end | " + " | ".join(COLUMN_NAMES.get(cell, cell) for cell in cells) + " |",
        "|---|---|" + "---|" * len(cells),
    ]
    refusals: dict[str, int] = {}
    for row in result["rows"]:
        marks = []
        for cell in cells:
            text = row["cells"][cell]
            if text == "trains":
                marks.append("trains")
                continue
            reason = text.split(": ", 2)[-1]
            number = refusals.setdefault(reason, len(refusals) + 1)
            marks.append(f"refused ({number})")
        lines.append(f"| {row['label']} | {row['front'].capitalize()} | " + " | ".join(marks) + " |")
    notes = [f"{number}. {reason}" for reason, number in refusals.items()]
    return "\n".join([*lines, "", *notes, "", stamp(result)])


RENDERERS: dict[str, Callable[[], str]] = {
    "private-names": private_names_markdown,
    "parity": parity_markdown,
    "counts": counts_markdown,
    "opt-levels": opt_levels_markdown,
    "opt-level-facts": opt_level_facts_markdown,
    "memory": memory_markdown,
    "memory-facts": memory_facts_markdown,
    "host-work": host_work_markdown,
    "support-matrix": support_matrix_markdown,
}
"""Each marker's name and what it renders."""


def render(name: str) -> str:
    """The Markdown of marker ``name``.

    Raises:
        KeyError: for a marker no renderer knows, naming the known ones.

    """
    if name not in RENDERERS:
        raise KeyError(f"<!-- generated: {name} --> is no generated table; known: {sorted(RENDERERS)}")
    return RENDERERS[name]()


def fill(text: str) -> str:
    """``text`` with each marker replaced by its rendered Markdown."""
    return MARKER.sub(lambda match: render(match.group(1)), text)
