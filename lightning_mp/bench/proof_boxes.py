"""The GPU proof's time boxes: each part runs in a child process, stopped when its share of the budget ends.

**Sharing the budget.** The budget counts from the start of the parent process (:func:`process_start_time`, so its
imports count too); a few seconds are kept for the report (:data:`RESERVE_SECONDS`), and the rest is shared out as
the parts run (:func:`part_box`): each box is a fixed allowance for the child's start (:data:`STARTUP_SECONDS`)
plus the part's share (:attr:`Part.share`) of the time left after the remaining parts' starts, over the shares of
the parts still to run. Time a part leaves unused, or a skipped part's, passes on to the parts after it, and the
whole ends within the budget.

**Stopping a child.** A child is told its deadline and stops starting work that would not finish before it (a
smoke case, a figure's run), which it reports as cut; a child still running when its box ends is killed with its
process group (:func:`run_boxed`: ``start_new_session``, so pytest's own subprocesses go too) and reported as cut.
Either way the next part runs, and every record a part wrote before the cut is kept: children write one JSON line
per result as they go (:func:`read_records`). :func:`run_parts` runs the parts in order and gives each a status
(passed, failed, cut, crashed or skipped, with why) from how its child ended and what it wrote.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning_mp

RESERVE_SECONDS = 5.0
"""Kept from the budget for writing the report and exiting (never more than 10% of the budget)."""
STARTUP_SECONDS = 8.0
"""Every box's fixed allowance for its child's start: importing torch and Lightning takes 5 to 8 s on a slow CPU."""
MIN_BOX_SECONDS = 1.0
"""A part whose box would be shorter is skipped: no child process starts and exits in less."""
LOG_TAIL_LINES = 30


@dataclass(frozen=True)
class Part:
    """One part of the proof: its name (``--parts`` takes it), what it shows, and its share of the budget."""

    name: str
    title: str
    share: float


@dataclass(frozen=True)
class BoxedRun:
    """How a child process ended: ``"finished"`` (with its exit code) or ``"cut"`` at its box."""

    ending: str
    exit_code: int | None
    seconds: float
    log_tail: list[str]


def run_boxed(command: Sequence[str], box_seconds: float, log_path: Path, cwd: Path | None = None) -> BoxedRun:
    """Run ``command`` for at most ``box_seconds``; past that, kill it and every process it started.

    Its output goes to ``log_path``; the result keeps the last :data:`LOG_TAIL_LINES` lines. The child leads a
    new process group, which is killed as a whole (POSIX), so that subprocesses of the child stop too.
    """
    start = time.monotonic()
    environment = dict(os.environ)
    # The children import this very copy of the package, wherever the interpreter would look first otherwise.
    package_root = str(Path(lightning_mp.__file__).resolve().parents[1])
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, environment.get("PYTHONPATH")]))
    with log_path.open("w") as log:
        process = subprocess.Popen(
            list(command), stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=environment, start_new_session=True
        )
        try:
            exit_code: int | None = process.wait(timeout=max(box_seconds, 0.0))
            ending = "finished"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            exit_code, ending = None, "cut"
    tail = log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
    return BoxedRun(ending, exit_code, time.monotonic() - start, tail)


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON lines a child wrote; a last line cut off by a kill is dropped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _part_status(boxed: BoxedRun, records: list[dict[str, Any]], pytest_part: bool) -> tuple[str, str]:
    """The part's status (passed, failed, cut or crashed) and why, from how its child ended and what it wrote."""
    failed = [r for r in records if r.get("outcome") in ("failed", "error")]
    ends = [r for r in records if r["kind"] == "part-end"]
    # A child that wrote its last record did all its work, even if the box ended while the interpreter exited.
    if boxed.ending == "cut" and not ends:
        return "cut", f"killed at the end of its time box, after {len(records)} record(s)"
    if any(end["cut"] for end in ends):
        return "cut", "stopped before its time box ended, with work left that would not have fitted"
    # pytest exits 1 when tests failed and 5 when none was selected: the run itself worked.
    worked = boxed.exit_code == 0 or bool(ends) or (pytest_part and boxed.exit_code in (1, 5))
    if not worked:
        return "crashed", f"exit code {boxed.exit_code}"
    if failed:
        return "failed", f"{len(failed)} failed"
    if pytest_part and boxed.exit_code == 5:
        return "passed", "no test selected"
    # A skipped figure (no torchao, no FP8 device) has no targets.
    targets = [t for r in records if r["kind"] == "figure" for t in r.get("targets", [])]
    missed = sum(target["verdict"] == "MISSED" for target in targets)
    return "passed", f"{missed} of {len(targets)} targets missed" if missed else ""


def part_box(seconds_left: float, part: Part, remaining: Sequence[Part]) -> float:
    """``part``'s box: :data:`STARTUP_SECONDS`, plus its share of what is left after every remaining part's start.

    ``remaining`` lists the parts still to run, ``part`` first. With less left than the starts need, the time left
    is shared out by share alone.

    Example:
        >>> parts = [Part("a", "", 0.25), Part("b", "", 0.75)]
        >>> part_box(100.0, parts[0], parts), part_box(10.0, parts[0], parts)
        (29.0, 2.5)

    """
    share = part.share / sum(later.share for later in remaining)
    spare = seconds_left - STARTUP_SECONDS * len(remaining)
    return STARTUP_SECONDS + spare * share if spare > 0 else max(seconds_left, 0.0) * share


def process_start_time() -> float:
    """When this process started, as a ``time.time()``: the budget counts the interpreter's imports too (Linux).

    Elsewhere, or where ``/proc`` cannot be read, it is now.
    """
    try:
        # Field 22 of /proc/self/stat is the start in clock ticks after boot; the name in field 2 may hold spaces.
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


CommandBuilder = Callable[[Path, float, list[dict[str, Any]]], "list[str] | str"]
"""Given the part's records file, its deadline (``time.time()``) and the parts done so far: the child's command,
or the reason to skip the part."""


def run_parts(
    parts: Sequence[tuple[Part, CommandBuilder]],
    budget_seconds: float,
    scratch: Path,
    cwd: Path | None = None,
    pytest_parts: frozenset[str] = frozenset(),
    started: float | None = None,
) -> list[dict[str, Any]]:
    """Run each part's child in its time box, in order, and return one record per part (see the module docstring).

    The parts share ``budget_seconds`` less the reserve, counted from ``started`` (a ``time.time()``; None: now);
    ``scratch`` holds the children's records and logs. ``pytest_parts`` names the parts whose child is pytest (its
    exit code 1 means failed tests, not a crash).
    """
    deadline = (started or time.time()) + budget_seconds - min(RESERVE_SECONDS, 0.1 * budget_seconds)
    done: list[dict[str, Any]] = []
    for index, (part, build_command) in enumerate(parts):
        box = part_box(deadline - time.time(), part, [later for later, _ in parts[index:]])
        record: dict[str, Any] = {
            "name": part.name,
            "title": part.title,
            "box_seconds": max(box, 0.0),
            "wall_seconds": 0.0,
            "exit_code": None,
            "log_tail": [],
            "records": [],
        }
        records_path = scratch / f"{part.name}.jsonl"
        # The child stops starting work a little before its box ends, so that it can report the cut itself.
        command = build_command(records_path, time.time() + box - min(5.0, 0.1 * box), done)
        if isinstance(command, str) or box < MIN_BOX_SECONDS:
            # A part with no time left is cut before it starts; one with nothing to run here is skipped.
            status, reason = ("skipped", command) if isinstance(command, str) else ("cut", "no time left in the budget")
            done.append({**record, "status": status, "reason": reason})
            print(f"[gpu-proof] {part.name}: {status} ({reason})", file=sys.stderr, flush=True)
            continue
        print(f"[gpu-proof] {part.name}: running, box {box:.0f} s", file=sys.stderr, flush=True)
        boxed = run_boxed(command, box, scratch / f"{part.name}.log", cwd)
        records = read_records(records_path)
        status, reason = _part_status(boxed, records, part.name in pytest_parts)
        done.append(
            {
                **record,
                "status": status,
                "reason": reason,
                "wall_seconds": boxed.seconds,
                "exit_code": boxed.exit_code,
                "log_tail": boxed.log_tail,
                "records": [r for r in records if r["kind"] != "part-end"],
            }
        )
        print(f"[gpu-proof] {part.name}: {status} in {boxed.seconds:.0f} s {reason}", file=sys.stderr, flush=True)
    return done
