"""``python -m lightning_mp.bench gpu-proof``: everything the GPU must show, in one time-boxed command, as a report.

GPU time comes in short slots, so the proof is one command that spends a slot in order of what matters most and
always leaves a report. It runs four parts (:data:`PARTS`), each in a child process with its own time box
(:mod:`~lightning_mp.bench.proof_boxes`):

1. ``versions-smoke``: the versions (GPU, driver, torch, CUDA, Lightning), then the smoke matrix
   (:mod:`~lightning_mp.bench.smoke_matrix`): every precision x opt level x optimizer family x front end trains
   20 steps and skips a planted inf;
2. ``cuda-tests``: the CUDA test suite, ``pytest -m cuda tests/cuda`` without ``-x``, each outcome recorded as it
   is known (:mod:`~lightning_mp.bench.outcome_log`);
3. ``fsdp``: FSDP1 and FSDP2 on one GPU, the FSDP cases of ``tests/cuda``, where part 2 did not reach them (when
   part 2 ran to its end, they ran there and this part is skipped);
4. ``figures``: the paired figures and their targets (:mod:`~lightning_mp.bench.proof_figures`), FP8's last;
   ``--figures NAME ...`` measures only those (``--parts figures --figures fp8-lm-1b`` spends a slot on FP8).

**Time boxes.** The budget (``--budget``) counts from the start of this process, its imports included, and each
part's box is its share of what is left (:attr:`~lightning_mp.bench.proof_boxes.Part.share`: 15%, 30%, 8% and
47%); time a part leaves unused passes on to the parts after it. The shares follow what each part costs on an H100
with the 540 s budget: the 60 smoke runs about a minute, the CUDA suite (its compiled cases dominate) two to three,
the figures (the 219M LM and ResNet-50 at batch 256, each configuration twice) three to four. A part cut at the end
of its box keeps every record it wrote, and the next part runs.

**Report.** One JSON file and one Markdown file per run, written to ``--out`` as ``<date>-<gpu>.json`` and
``.md``: the versions, each part's status (passed, failed, cut, crashed or skipped, with why) and box, every smoke
case, every test outcome, and every figure stamped with the versions it was measured with and each target met or
missed. The Markdown is rendered from the JSON alone (:mod:`~lightning_mp.bench.proof_report`), and ``--render
FILE.json`` renders it again.

**On the CPU** (``--device cpu --smoke``, under a minute) the same parts run: the smoke matrix (6 steps a case in
smoke runs), the suite's CPU cases (``-m "not slow"``; its CUDA cases skip; FSDP on one GPU is skipped) and a few
figures on tiny shapes with two timed steps per run. CI runs it on
every commit, so the command, its boxes and its report keep working between GPU slots; its figures are stamped as
not GPU figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch

import lightning_mp
from lightning_mp.bench.machine import machine_description
from lightning_mp.bench.proof_boxes import CommandBuilder, Part, process_start_time, run_parts
from lightning_mp.bench.proof_figures import FIGURES, fp8_skip_reason, run_figure, skipped_figure
from lightning_mp.bench.proof_report import render_markdown
from lightning_mp.bench.smoke_matrix import QUICK_SMOKE_STEPS, SMOKE_STEPS, run_matrix, smoke_cases

COMMAND = "gpu-proof"
"""The first argument of ``python -m lightning_mp.bench`` that selects the proof."""
DEFAULT_BUDGET_SECONDS = 540.0
FSDP_TEST_FILES = ("tests/cuda/test_fsdp.py", "tests/cuda/test_fsdp2.py")


PARTS: tuple[Part, ...] = (
    Part("versions-smoke", "versions and the smoke matrix", 0.15),
    Part("cuda-tests", "the CUDA test suite (tests/cuda)", 0.30),
    Part("fsdp", "FSDP1 and FSDP2 on one GPU", 0.08),
    Part("figures", "the paired figures and their targets", 0.47),
)
"""The parts in the order they run."""


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by None, so that the JSON is strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite(item) for item in value]
    return value


def _nvidia_smi() -> tuple[str, str] | None:
    """The first GPU's name and driver version from ``nvidia-smi``; None where it is missing or fails."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        completed = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    name, _, driver = completed.stdout.splitlines()[0].rpartition(", ") if completed.stdout.strip() else ("", "", "")
    return (name.strip(), driver.strip()) if name else None


def versions(device: str, query_device: bool = True) -> dict[str, str]:
    """The versions every figure is stamped with; with ``query_device`` the GPU is asked through torch (CUDA init)."""
    stamp = {
        "device": device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "lightning": L.__version__,
        "lightning_mp": lightning_mp.__version__,
        "python": platform.python_version(),
    }
    if device != "cuda":
        return {**stamp, "gpu": f"no GPU; {machine_description('cpu')[0]}", "driver": "none"}
    smi = _nvidia_smi()
    if query_device:
        major, minor = torch.cuda.get_device_capability()
        memory = torch.cuda.get_device_properties(0).total_memory / 2**30
        gpu = f"{torch.cuda.get_device_name()} (compute capability {major}.{minor}, {memory:.0f} GiB)"
    else:
        gpu = smi[0] if smi else "unknown GPU"
    return {**stamp, "gpu": gpu, "driver": smi[1] if smi else "unknown (no nvidia-smi)"}


def _quiet() -> None:
    """Silence the Trainer's and Fabric's setup banners and the known warnings of short runs."""
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).setLevel(logging.WARNING)


def run_part(
    name: str,
    device: str,
    smoke: bool,
    records_path: Path,
    deadline: float,
    figure_names: Sequence[str] | None = None,
) -> int:
    """A child's work: run part ``name`` (``versions-smoke`` or ``figures``), one JSON line per result.

    ``figure_names`` limits the figures part to those figures (None: all of them).
    """
    _quiet()
    cut = False
    with records_path.open("a") as records:

        def emit(record: dict[str, Any]) -> None:
            records.write(json.dumps(finite(record)) + "\n")
            records.flush()

        stamp = versions(device)
        if name == "versions-smoke":
            emit({"kind": "versions", "stamp": stamp})
            steps = QUICK_SMOKE_STEPS if smoke else SMOKE_STEPS
            for case in run_matrix(smoke_cases(), device, steps, deadline):
                emit(case)
                cut = cut or case["outcome"] == "cut"
        else:
            figures = [
                figure
                for figure in FIGURES
                if (figure.smoke_configurations or not smoke) and (figure_names is None or figure.name in figure_names)
            ]
            for index, figure in enumerate(figures):
                skip = fp8_skip_reason(device) if figure.needs_fp8 else None
                if skip is not None:
                    emit({**skipped_figure(figure, skip), "stamp": stamp})
                    continue
                left = deadline - time.time()
                share = figure.share / sum(later.share for later in figures[index:])
                result = run_figure(figure, device, smoke, time.time() + left * share)
                emit({**result, "stamp": stamp})
                cut = cut or result["cut"]
        emit({"kind": "part-end", "cut": cut})
    return 0


def _repository_root() -> Path:
    return Path(lightning_mp.__file__).resolve().parents[1]


def _builders(device: str, smoke: bool, figure_names: Sequence[str] | None = None) -> dict[str, CommandBuilder]:
    root = _repository_root()
    pytest = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "lightning_mp.bench.outcome_log", "-q"]
    # On the CPU the CUDA cases skip and the CPU halves of the suite's fast loop run: the path, not the GPU.
    marker = "cuda" if device == "cuda" else "not slow"

    def child(name: str) -> CommandBuilder:
        def build(records: Path, deadline: float, done: list[dict[str, Any]]) -> list[str] | str:
            command = [sys.executable, "-m", "lightning_mp.bench", COMMAND, "--part", name, "--device", device]
            command += ["--records", str(records), "--deadline", repr(deadline)]
            if name == "figures" and figure_names is not None:
                command += ["--figures", *figure_names]
            return [*command, "--smoke"] if smoke else command

        return build

    def cuda_tests(records: Path, deadline: float, done: list[dict[str, Any]]) -> list[str] | str:
        if not (root / "tests" / "cuda").is_dir():
            return f"no tests/cuda beside the package ({root}): run the proof from a checkout of the repository"
        return [*pytest, "-m", marker, "--outcome-log", str(records), "tests/cuda"]

    def fsdp(records: Path, deadline: float, done: list[dict[str, Any]]) -> list[str] | str:
        if device != "cuda":
            return "FSDP on one GPU needs CUDA: on the CPU its cases skip in part 2"
        if not all((root / path).is_file() for path in FSDP_TEST_FILES):
            return f"no {' or '.join(FSDP_TEST_FILES)} beside the package ({root})"
        suite = next((part for part in done if part["name"] == "cuda-tests"), None)
        if suite is not None and suite["status"] in ("passed", "failed"):
            ran = [r for r in suite["records"] if r["nodeid"].startswith(FSDP_TEST_FILES)]
            return f"covered by part 2, which ran to its end: {len(ran)} FSDP outcomes are listed there"
        outcomes = [] if suite is None else suite["records"]
        reached = [r["nodeid"] for r in outcomes if r["nodeid"].startswith(FSDP_TEST_FILES)]
        deselect = [argument for nodeid in reached for argument in ("--deselect", nodeid)]
        return [*pytest, "-m", marker, "--outcome-log", str(records), *deselect, *FSDP_TEST_FILES]

    return {
        "versions-smoke": child("versions-smoke"),
        "cuda-tests": cuda_tests,
        "fsdp": fsdp,
        "figures": child("figures"),
    }


def report_stem(date: str, stamp: dict[str, str], smoke: bool) -> str:
    """``<date>-<gpu>``: the GPU's name in lower case with dashes (``cpu`` without one), ``-smoke`` for smoke runs.

    Example:
        >>> stamp = {"device": "cuda", "gpu": "NVIDIA H100 80GB HBM3 (compute capability 9.0, 79 GiB)"}
        >>> report_stem("2026-01-31", stamp, smoke=False)
        '2026-01-31-nvidia-h100-80gb-hbm3'

    """
    name = stamp["gpu"].split(" (")[0] if stamp["device"] == "cuda" else "cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return f"{date}-{slug}{'-smoke' if smoke else ''}"


def write_report(report: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """Write ``report`` as ``<stem>.json`` and its Markdown as ``<stem>.md`` in ``out``; a second run gets ``-2``."""
    out.mkdir(parents=True, exist_ok=True)
    stem = report_stem(report["date"], report["stamp"], report["smoke"])
    candidate, number = stem, 1
    while (out / f"{candidate}.json").exists() or (out / f"{candidate}.md").exists():
        number += 1
        candidate = f"{stem}-{number}"
    json_path, markdown_path = out / f"{candidate}.json", out / f"{candidate}.md"
    json_path.write_text(json.dumps(finite(report), indent=1) + "\n")
    markdown_path.write_text(render_markdown(json.loads(json_path.read_text())))
    return json_path, markdown_path


def render_file(json_path: Path) -> Path:
    """Render the Markdown of a JSON report again, beside it (``FILE.json`` -> ``FILE.md``); its path."""
    markdown_path = json_path.with_suffix(".md")
    markdown_path.write_text(render_markdown(json.loads(json_path.read_text())))
    return markdown_path


def parse_proof_args(argv: Sequence[str]) -> argparse.Namespace:
    """The flags of ``gpu-proof``; a bad one exits with argparse's message naming it."""
    parser = argparse.ArgumentParser(
        prog=f"python -m lightning_mp.bench {COMMAND}", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--budget", type=float, default=DEFAULT_BUDGET_SECONDS, help="seconds the whole proof may take (default 540)"
    )
    parser.add_argument("--out", type=Path, help="folder for the report: <date>-<gpu>.json and .md")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="default: cuda if present")
    parser.add_argument("--smoke", action="store_true", help="short runs and tiny shapes: proves the command works")
    parser.add_argument(
        "--parts", nargs="+", choices=[part.name for part in PARTS], help="run only these parts (default: all four)"
    )
    parser.add_argument(
        "--figures",
        nargs="+",
        choices=[figure.name for figure in FIGURES],
        help="the figures part measures only these figures (default: all, in order; fp8-lm-1b last)",
    )
    parser.add_argument("--render", type=Path, help="render the Markdown of this JSON report again, and exit")
    parser.add_argument("--part", choices=["versions-smoke", "figures"], help=argparse.SUPPRESS)
    parser.add_argument("--records", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.render is not None:
        if not args.render.is_file():
            parser.error(f"--render {args.render}: no such file; give a JSON report that gpu-proof wrote")
        return args
    if not args.budget > 0:
        parser.error(f"--budget must be a number of seconds above 0, got {args.budget}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU, and torch sees none (torch.cuda.is_available() is False)")
    if args.part is not None and (args.records is None or args.deadline is None):
        parser.error("--part needs --records and --deadline")
    if args.part is None and args.out is None:
        parser.error("--out is required: the folder the report is written to")
    return args


def main(argv: Sequence[str]) -> int:
    """Run the proof (or one part of it, in a child) and write its report; 1 when a part failed or crashed."""
    args = parse_proof_args(argv)
    if args.render is not None:
        print(render_file(args.render))
        return 0
    if args.part is not None:
        return run_part(args.part, args.device, args.smoke, args.records, args.deadline, args.figures)
    start = process_start_time()
    started = datetime.datetime.fromtimestamp(start, datetime.timezone.utc)
    builders = _builders(args.device, args.smoke, args.figures)
    selected = [part for part in PARTS if args.parts is None or part.name in args.parts]
    with tempfile.TemporaryDirectory(prefix="gpu-proof-") as scratch:
        parts = run_parts(
            [(part, builders[part.name]) for part in selected],
            args.budget,
            Path(scratch),
            cwd=_repository_root(),
            pytest_parts=frozenset({"cuda-tests", "fsdp"}),
            started=start,
        )
    measured = [r["stamp"] for part in parts for r in part["records"] if r["kind"] == "versions"]
    report = {
        "schema": "lightning_mp gpu-proof 1",
        "command": shlex.join(["python", "-m", "lightning_mp.bench", COMMAND, *argv]),
        "date": started.date().isoformat(),
        "started": started.isoformat(timespec="seconds"),
        "device": args.device,
        "smoke": args.smoke,
        "gpu_figures": args.device == "cuda" and not args.smoke,
        "budget_seconds": args.budget,
        "wall_seconds": time.time() - start,
        "stamp": measured[0] if measured else versions(args.device, query_device=False),
        "parts": parts,
    }
    json_path, markdown_path = write_report(report, args.out)
    print(f"[gpu-proof] report: {markdown_path} and {json_path}", file=sys.stderr)
    return 1 if any(part["status"] in ("failed", "crashed") for part in parts) else 0
