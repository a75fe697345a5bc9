"""The GPU proof's Markdown report, rendered from its JSON report alone.

:func:`render_markdown` is a pure function of the JSON document that :mod:`~lightning_mp.bench.proof` writes, so
the Markdown can always be regenerated from the JSON (``python -m lightning_mp.bench gpu-proof --render
FILE.json``), and a committed pair cannot disagree. The report opens with the versions every figure was measured
with, lists each part with its status and time box (and the cut ones by name), then gives per part: the smoke
matrix's failures, each test that did not pass, and per figure its table and its targets, each met or missed and
stamped with the GPU, driver, torch, CUDA and Lightning versions it was measured with. Figures measured on the CPU
say, in each figure's stamp, that they are not GPU figures.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

NOT_GPU = "NOT GPU FIGURES"
"""What the stamp of every figure measured without a GPU starts with."""


def stamp_line(stamp: dict[str, Any]) -> str:
    """The versions a figure was measured with, in one line; a CPU stamp says they are not GPU figures."""
    versions = f"torch {stamp['torch']}, CUDA {stamp['cuda']}, Lightning {stamp['lightning']}"
    versions += f", lightning_mp {stamp['lightning_mp']}"
    if stamp["device"] != "cuda":
        return f"{NOT_GPU}: measured on the CPU ({stamp['gpu']}); {versions}"
    return f"GPU {stamp['gpu']} (driver {stamp['driver']}), {versions}"


def _number(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def _smoke_section(part: dict[str, Any]) -> list[str]:
    versions = [r for r in part["records"] if r["kind"] == "versions"]
    cases = [r for r in part["records"] if r["kind"] == "smoke"]
    lines = []
    if versions:
        lines += [f"- Versions: {stamp_line(versions[0]['stamp'])}", ""]
    if not cases:
        return [*lines, "Smoke matrix: no case ran."]
    counts = Counter(case["outcome"] for case in cases)
    lines.append(
        f"Smoke matrix, {cases[0]['steps']} steps a case with an inf planted at step {cases[0]['inf_step']} that"
        " must be skipped (cut: not started, out of time): "
        + ", ".join(f"{count} {outcome}" for outcome, count in sorted(counts.items()))
    )
    bad = [case for case in cases if case["outcome"] == "failed"]
    if bad:
        lines += ["", "| precision | opt level | optimizer | front end | outcome | reason |", "|---" * 6 + "|"]
        lines += [
            f"| {c['precision']} | {c['opt_level']} | {c['optimizer']} | {c['front_end']} | {c['outcome']}"
            f" | {c.get('reason', '')} |"
            for c in bad
        ]
    return lines


def _tests_section(part: dict[str, Any]) -> list[str]:
    tests = [r for r in part["records"] if r["kind"] == "test"]
    counts = Counter(test["outcome"] for test in tests)
    lines = ["Tests: " + (", ".join(f"{count} {outcome}" for outcome, count in sorted(counts.items())) or "none ran")]
    bad = [test for test in tests if test["outcome"] in ("failed", "error", "xpassed")]
    if bad:
        lines += ["", "| test | outcome | message |", "|---|---|---|"]
        lines += [f"| `{t['nodeid']}` | {t['outcome']} | {t['message'].replace('|', '/')} |" for t in bad]
    return lines


def _figure_section(figure: dict[str, Any]) -> list[str]:
    if "skipped" in figure:
        return [f"#### {figure['name']}: {figure['title']}", "", f"Skipped: {figure['skipped']}", ""]
    unit = figure["unit"]
    lines = [
        f"#### {figure['name']}: {figure['title']}",
        "",
        f"- Measured with: {stamp_line(figure['stamp'])}",
        f"- Shape: {figure['shape']}; {figure['optimizer']} AdamW; {figure['warmup']} warm-up and {figure['steps']}"
        f" timed steps per run; {figure['repeats_done']} of {figure['repeats_planned']} alternating repeats done"
        + ("; **cut**: out of time before every run finished" if figure["cut"] else ""),
        "",
        f"| configuration | median step (ms) | mean step (ms) | {unit}/s | peak (MiB) | host syncs/step | runs |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in figure["rows"]:
        if "error" in row:
            lines.append(f"| {row['configuration']} | crash: {row['error'].replace('|', '/')} | | | | | |")
            continue
        lines.append(
            f"| {row['configuration']} | {_number(row['median_ms'])} | {_number(row['mean_ms'])}"
            f" | {_number(row['units_per_second'], 0)} | {_number(row['peak_mib'], 0)}"
            f" | {_number(row['syncs_per_step'], 2)} | {row['runs']} |"
        )
    if figure["targets"]:
        lines += ["", *(f"- {_target_text(target)}" for target in figure["targets"])]
    return [*lines, ""]


def _target_text(target: dict[str, Any]) -> str:
    measured = "-" if target["measured"] is None else f"{target['measured']:.3f}"
    detail = f" ({target['detail']})" if target["detail"] else ""
    return f"{target['target']}: measured {measured}{detail} -> **{target['verdict']}**"


def _figures_section(part: dict[str, Any]) -> list[str]:
    figures = [r for r in part["records"] if r["kind"] == "figure"]
    if not figures:
        return ["No figure finished."]
    lines: list[str] = []
    for figure in figures:
        lines += _figure_section(figure)
    return lines


_SECTIONS = {
    "versions-smoke": _smoke_section,
    "cuda-tests": _tests_section,
    "fsdp": _tests_section,
    "figures": _figures_section,
}


def all_targets(report: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every target of every figure in the report, with its figure's name."""
    return [
        (record["name"], target)
        for part in report["parts"]
        for record in part["records"]
        if record["kind"] == "figure"
        for target in record.get("targets", [])
    ]


def render_markdown(report: dict[str, Any]) -> str:
    """The Markdown report of a GPU proof's JSON report."""
    stamp = report["stamp"]
    cut = [part["name"] for part in report["parts"] if part["status"] == "cut"]
    lines = [
        f"# lightning_mp GPU proof, {report['date']}, {stamp['gpu']}",
        "",
        f"- Command: `{report['command']}`",
        f"- Versions: {stamp_line(stamp)}, Python {stamp['python']}",
        f"- Budget {report['budget_seconds']:g} s, took {report['wall_seconds']:.0f} s;"
        f" {'smoke mode (short runs, tiny shapes on the CPU)' if report['smoke'] else 'full mode'}",
        f"- Cut parts: {', '.join(cut) if cut else 'none'}",
    ]
    if report["device"] != "cuda":
        lines.append(f"- **{NOT_GPU}**: no GPU took part; the figures below only prove that the command works.")
    elif report["smoke"]:
        lines.append("- **Smoke run**: two timed steps per run; the figures prove the command works, not the speed.")
    lines += ["", "## Parts", "", "| part | status | box (s) | took (s) | note |", "|---|---|---:|---:|---|"]
    for part in report["parts"]:
        lines.append(
            f"| {part['name']}: {part['title']} | {part['status']} | {part['box_seconds']:.0f}"
            f" | {part['wall_seconds']:.0f} | {part['reason'].replace('|', '/')} |"
        )
    targets = all_targets(report)
    if targets:
        lines += ["", "## Targets", "", "| figure | target | measured | verdict |", "|---|---|---:|---|"]
        for figure, target in targets:
            measured = "-" if target["measured"] is None else f"{target['measured']:.3f}"
            lines.append(f"| {figure} | {target['target']} | {measured} | {target['verdict']} |")
    for number, part in enumerate(report["parts"], start=1):
        lines += ["", f"## {number}. {part['title']} ({part['status']})", ""]
        if part["reason"]:
            lines += [part["reason"], ""]
        lines += _SECTIONS[part["name"]](part)
        if part["status"] in ("crashed", "cut") and part["log_tail"]:
            lines += ["", "Last lines of its output:", "", "```", *part["log_tail"], "```"]
    return "\n".join(lines).rstrip("\n") + "\n"
