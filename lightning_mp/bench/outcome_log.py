"""A pytest plugin that writes each test's outcome as one JSON line the moment it is known.

The GPU proof runs ``pytest -p lightning_mp.bench.outcome_log --outcome-log FILE`` in a child process that it kills
when its time box runs out. A report written at the end of the session (``--junitxml``) would then be lost; this
log keeps every outcome up to the kill, one line per test, flushed as it is written:

``{"kind": "test", "nodeid": ..., "outcome": "passed" | "failed" | "error" | "skipped" | "xfailed" | "xpassed",
"duration": seconds, "message": the first line of the failure or the skip reason}``.

A failure in setup or teardown is an ``"error"``; a skip in setup (a ``skipif`` marker) is a ``"skipped"``.
pytest is a development dependency, not the package's: the hooks take pytest's objects without importing it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any

_log: IO[str] | None = None


def pytest_addoption(parser: Any) -> None:
    """``--outcome-log FILE``: where the JSON lines go."""
    parser.addoption("--outcome-log", type=Path, help="append one JSON line per test outcome to this file")


def pytest_configure(config: Any) -> None:
    """Open the log, when one was asked for."""
    global _log
    path = config.getoption("--outcome-log")
    if path is not None:
        _log = path.open("a")


def pytest_unconfigure(config: Any) -> None:
    """Close the log."""
    global _log
    if _log is not None:
        _log.close()
        _log = None


def _message(report: Any) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        text = str(report.longrepr[2])
    else:
        text = getattr(report, "longreprtext", "") or ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    # A traceback's last line is the exception; a skip's only line is its reason.
    errors = [line for line in lines if line.startswith("E ")]
    return (errors[0][2:].strip() if errors else lines[-1] if lines else "")[:300]


def _outcome(report: Any) -> str | None:
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "xpassed"
    if report.when == "call":
        return report.outcome
    if report.failed:
        return "error"
    if report.skipped:
        return "skipped"
    return None


def pytest_runtest_logreport(report: Any) -> None:
    """Write the outcome of a test's call, or of a setup or teardown that did not pass."""
    outcome = _outcome(report)
    if _log is None or outcome is None:
        return
    record: dict[str, Any] = {
        "kind": "test",
        "nodeid": report.nodeid,
        "outcome": outcome,
        "duration": round(report.duration, 3),
        "message": "" if outcome == "passed" else _message(report),
    }
    _log.write(json.dumps(record) + "\n")
    _log.flush()
