"""The command line, ``python -m lightning_mp.bench``: which benchmark to run, on what, and where the report goes.

Three benchmarks share it, and ``gpu-proof`` as the first argument runs the GPU proof instead
(:mod:`~lightning_mp.bench.proof`, its own flags):

- the default, step time (runs timed by :mod:`~lightning_mp.bench.timing`, compared by
  :mod:`~lightning_mp.bench.comparison`, reported by :mod:`~lightning_mp.bench.report`): on the CPU the
  Markov-text model, on CUDA the three GPU-sized workloads (:mod:`~lightning_mp.bench.workloads`);
  ``--workload`` picks others, ``--quick`` runs a smoke test in this process;
- ``--memory``: tensor memory of one step per configuration (:mod:`~lightning_mp.bench.memory`);
- ``--counts``: host syncs and ops per iteration (:mod:`~lightning_mp.bench.counts`), then weight casts, ops,
  Python calls and DDP bytes all-reduced of one step per opt level (:mod:`~lightning_mp.bench.opt_level_counts`);
- ``--eval``: time per validation batch and tensor memory added, per ``eval_precision``
  (:mod:`~lightning_mp.bench.evaluation`).

Every report is Markdown on stdout (``--out FILE.md`` keeps a copy); progress and warnings go to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
import warnings
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from lightning_mp.bench.comparison import profile_all, run_all
from lightning_mp.bench.configurations import (
    CONFIGURATIONS,
    GPU_WORKLOAD_CONFIGURATIONS,
    QUICK_CONFIGURATIONS,
    default_configurations,
)
from lightning_mp.bench.counts import counts_report
from lightning_mp.bench.evaluation import run_evaluation
from lightning_mp.bench.machine import machine_description, matmul_rates
from lightning_mp.bench.memory import MEMORY_CONFIGURATIONS, MEMORY_MODELS, run_memory
from lightning_mp.bench.opt_level_counts import opt_level_report
from lightning_mp.bench.proof import COMMAND as PROOF_COMMAND
from lightning_mp.bench.proof import main as proof_main
from lightning_mp.bench.report import ReportContext, report, summarize
from lightning_mp.bench.timing import RunSpec, run_configuration, step_units
from lightning_mp.bench.workloads import (
    GPU_WORKLOADS,
    MARKOV,
    OPTIMIZER_KINDS,
    SIZES,
    WORKLOADS,
    TimeBudgets,
    auto_size,
)
from lightning_mp.plugin.hardware import device_has_native_bf16

GPU_WORKLOAD_SIZES = ("tiny", "full")
"""The sizes of a GPU workload: ``full`` is what the GPU runs, ``tiny`` the same code small enough for the CPU."""
DEFAULT_SYNC_STEPS = 10
"""Steps in which a GPU workload's runs count host syncs: a multiple of the monitors' and the logger's interval."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line's flags; a bad flag exits with argparse's usage message, naming it."""
    parser = argparse.ArgumentParser(prog="python -m lightning_mp.bench", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="two configurations, tiny model, in this process, 3 paired repeats"
    )
    parser.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "gpu"], help="default: auto")
    parser.add_argument(
        "--workload",
        nargs="+",
        choices=[MARKOV, *WORKLOADS],
        help=f"what to train (default: {MARKOV} on the CPU, {', '.join(GPU_WORKLOADS)} on CUDA)",
    )
    parser.add_argument(
        "--size",
        default="auto",
        choices=["auto", *SIZES, "full"],
        help=f"model size: {', '.join(SIZES)} for {MARKOV}; tiny or full for the GPU workloads (default: auto, which"
        " is full on CUDA and tiny on the CPU for them)",
    )
    parser.add_argument("--batch-size", type=int, help="batch size of the GPU workloads (default: their own)")
    parser.add_argument(
        "--optimizer", choices=OPTIMIZER_KINDS, help="AdamW implementation of the GPU workloads (default: their own)"
    )
    parser.add_argument("--compile", action="store_true", help="compile the model's forward with torch.compile")
    parser.add_argument(
        "--compile-blocks",
        action="store_true",
        help="compile each transformer block of the GPU language models instead (alike blocks share one graph)",
    )
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default 20, quick 8)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per run (default 3, quick 2)")
    parser.add_argument(
        "--sync-steps",
        type=int,
        default=None,
        help=f"steps after the timed ones that count host syncs (default {DEFAULT_SYNC_STEPS} on the GPU workloads,"
        f" 0 on {MARKOV})",
    )
    parser.add_argument("--repeats", type=int, default=None, help="paired runs per configuration (default 3)")
    parser.add_argument(
        "--max-repeats",
        type=int,
        default=None,
        help="add repeats while a difference is unresolved, up to this many (default: 6 with --quick, else --repeats)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads for training and matrix products (default: torch's)"
    )
    parser.add_argument(
        "--in-process", action="store_true", help="run every configuration in this process (the default with --quick)"
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=list(CONFIGURATIONS),
        help="configurations to run (default: all the device runs fast)",
    )
    parser.add_argument("--out", type=Path, help="also write the Markdown report to this file")
    parser.add_argument(
        "--profile", action="store_true", help="add one torch.profiler run per configuration: where the time goes"
    )
    parser.add_argument(
        "--memory",
        action="store_true",
        help="peak tensor memory of one step per configuration, split by category (CPU; default size medium)",
    )
    parser.add_argument(
        "--memory-model",
        choices=MEMORY_MODELS,
        default="lm",
        help="the model --memory measures: the Markov-text transformer LM, or a ResNet with batch norm (cnn)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--counts",
        action="store_true",
        help="host syncs and compute ops per iteration, per precision and optimizer; weight casts, ops, Python calls"
        " and DDP bytes all-reduced per step, per opt level",
    )
    parser.add_argument(
        "--eval",
        action="store_true",
        help="time per validation batch and tensor memory added, per eval_precision, at O1 and O2 (CPU; default size"
        " small)",
    )
    parser.add_argument(
        "--eval-training",
        default="bf16-mixed",
        choices=["16-mixed", "bf16-mixed"],
        help="with --eval: the precision the evaluated model trains in (default: bf16-mixed)",
    )
    parser.add_argument("--worker", choices=list(CONFIGURATIONS), help=argparse.SUPPRESS)
    parser.add_argument("--result-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.accelerator == "auto":
        args.accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    if args.accelerator == "gpu" and not torch.cuda.is_available():
        parser.error("--accelerator gpu needs a CUDA GPU, and torch sees none")
    reports = [flag for flag in ("counts", "memory", "eval") if getattr(args, flag)]
    if len(reports) > 1:
        parser.error(f"{' and '.join('--' + flag for flag in reports)} are separate reports: ask for one at a time")
    for flag in ("memory", "eval"):
        if getattr(args, flag) and args.accelerator != "cpu":
            parser.error(f"--{flag} measures on the CPU: use --accelerator cpu (or auto without a GPU)")
    _resolve_workloads(parser, args)
    for flag, normal, quick in (("steps", 20, 8), ("warmup", 3, 2), ("repeats", 3, 3)):
        value = getattr(args, flag)
        if value is None:
            setattr(args, flag, quick if args.quick else normal)
        elif value < (0 if flag == "warmup" else 1):
            parser.error(f"--{flag} must be >= {0 if flag == 'warmup' else 1}, got {value}")
    if args.sync_steps is not None and args.sync_steps < 0:
        parser.error(f"--sync-steps must be >= 0, got {args.sync_steps}")
    if args.max_repeats is None:
        args.max_repeats = max(args.repeats, 6) if args.quick else args.repeats
    elif args.max_repeats < args.repeats:
        parser.error(f"--max-repeats must be >= --repeats ({args.repeats}), got {args.max_repeats}")
    if args.threads is None:
        args.threads = torch.get_num_threads()
    elif args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    args.in_process = args.in_process or (args.quick and args.worker is None and not args.profile)
    if args.configs is None and args.memory:
        args.configs = list(MEMORY_CONFIGURATIONS)
    if args.configs is None and args.quick:
        args.configs = list(QUICK_CONFIGURATIONS)
    return args


def _resolve_workloads(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill in ``args.workload`` and the sizes; refuse flags that do not fit the workloads.

    ``args.size`` becomes the Markov model's size; ``args.gpu_workload_size`` keeps what the GPU workloads were asked
    for (``auto``, ``tiny`` or ``full``).
    """
    if args.workload is None:
        on_gpu_by_default = args.accelerator == "gpu" and not (args.quick or args.memory or args.counts or args.eval)
        args.workload = list(GPU_WORKLOADS) if on_gpu_by_default else [MARKOV]
    gpu_workloads = [name for name in args.workload if name != MARKOV]
    if gpu_workloads and (args.memory or args.counts or args.eval):
        flag = "--memory" if args.memory else "--counts" if args.counts else "--eval"
        parser.error(f"{flag} measures the {MARKOV} model: --workload {' '.join(gpu_workloads)} is not allowed with it")
    if args.worker is not None and len(args.workload) != 1:
        parser.error(f"--worker runs one workload, got --workload {' '.join(args.workload)}")
    if gpu_workloads and args.size not in ("auto", *GPU_WORKLOAD_SIZES):
        parser.error(
            f"--size {args.size} is a size of the {MARKOV} model; --workload {' '.join(gpu_workloads)} takes auto,"
            f" {' or '.join(GPU_WORKLOAD_SIZES)}"
        )
    args.gpu_workload_size = args.size
    if MARKOV in args.workload:
        if args.size == "full":
            parser.error(f"--size full is a size of the GPU workloads; the {MARKOV} model takes {', '.join(SIZES)}")
        for flag, value in (("--batch-size", args.batch_size), ("--optimizer", args.optimizer)):
            if value is not None and not gpu_workloads:
                parser.error(f"{flag} {value} applies to the GPU workloads; the {MARKOV} model takes --size")
        if args.size == "auto":
            args.size = (
                "tiny"
                if args.quick
                else "medium"
                if args.memory
                else "small"
                if args.eval
                else auto_size(args.accelerator)
            )
    if args.batch_size is not None and args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")


def run_spec(args: argparse.Namespace, workload: str) -> RunSpec:
    """What every run of ``workload`` trains, from the command line's flags."""
    size = args.size if workload == MARKOV else args.gpu_workload_size
    if size == "auto":
        size = "full" if args.accelerator == "gpu" else "tiny"
    default_sync_steps = 0 if workload == MARKOV else DEFAULT_SYNC_STEPS
    return RunSpec(
        workload=workload,
        size=size,
        accelerator=args.accelerator,
        warmup=args.warmup,
        steps=args.steps,
        seed=args.seed,
        sync_steps=default_sync_steps if args.sync_steps is None else args.sync_steps,
        batch_size=args.batch_size,
        optimizer=args.optimizer,
        compile=args.compile,
        compile_blocks=args.compile_blocks,
    )


def model_description(spec: RunSpec) -> str:
    """The model of ``spec`` in words, for the report's header."""
    compiled = ", under torch.compile" if spec.compile else ""
    compiled = ", each block under torch.compile" if spec.compile_blocks else compiled
    if spec.workload == MARKOV:
        return f"TinyTransformerLM, size {spec.size!r} ({SIZES[spec.size].describe()}){compiled}"
    workload = WORKLOADS[spec.workload]
    optimizer = spec.optimizer or workload.optimizer
    return (
        f"{workload.description} ({spec.workload}), size {spec.size!r} ({spec.shape().describe()}),"
        f" {optimizer} AdamW{compiled}"
    )


def _timing_report(
    args: argparse.Namespace, spec: RunSpec, machine: list[str], rates: dict[str, float], matmul_size: int
) -> str:
    if args.configs is not None:
        configurations = list(args.configs)
    elif spec.workload == MARKOV:
        configurations = default_configurations(args.accelerator)
    else:
        configurations = default_configurations(args.accelerator, GPU_WORKLOAD_CONFIGURATIONS)
    load_start = os.getloadavg()
    results = run_all(args, spec, configurations)
    breakdowns = profile_all(args, spec, configurations) if args.profile else {}
    units, unit = step_units(spec)
    context = ReportContext(
        model=model_description(spec),
        unit=unit,
        accelerator=args.accelerator,
        warmup=spec.warmup,
        steps=spec.steps,
        repeats=len({result.repeat for result in results}),
        machine=machine,
        rates=rates,
        matmul_size=matmul_size,
        load=(load_start, os.getloadavg()),
        threads=args.threads,
        in_process=args.in_process,
        gpu_workload=spec.workload != MARKOV,
        budgets=TimeBudgets() if spec.workload == MARKOV else WORKLOADS[spec.workload].budgets,
        sync_steps=spec.sync_steps,
    )
    return report(summarize(results, units), context, breakdowns)


def _emit(text: str, out: Path | None) -> None:
    print(text)
    if out is not None:
        out.write_text(text if text.endswith("\n") else text + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark that ``argv`` asks for and print its report; returns the exit status.

    ``gpu-proof`` as the first argument runs the GPU proof instead (:mod:`~lightning_mp.bench.proof`).
    """
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == [PROOF_COMMAND]:
        return proof_main(arguments[1:])
    args = parse_args(arguments)
    # Every configuration builds a Trainer, whose setup banners ("GPU available: ...") would bury the report; the
    # caller's logging is put back afterwards (main runs inside tests and notebooks too).
    banners = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    level = banners.level
    banners.setLevel(logging.WARNING)
    try:
        return _run(args)
    finally:
        banners.setLevel(level)


def _run(args: argparse.Namespace) -> int:
    if args.counts:
        _emit(f"{counts_report(args.quick)}\n\n{opt_level_report(args.quick)}", args.out)
        return 0
    if args.worker is not None:
        # The worker's own warnings (bf16 emulated on this CPU, few dataloader workers) are known and said once below.
        warnings.filterwarnings("ignore")
        try:
            result = run_configuration(args.worker, run_spec(args, args.workload[0]), args.profile, args.threads)
            args.result_file.write_text(json.dumps(asdict(result)))
        except Exception as error:
            # The parent reads the last line of stderr as the error; tracebacks are formatted differently by some
            # installed packages, so the error itself is the last line, whatever came before it.
            traceback.print_exc()
            print(f"{type(error).__name__}: {error}", file=sys.stderr, flush=True)
            return 1
        return 0
    if args.memory:
        warnings.filterwarnings("ignore")
        _emit(run_memory(args), args.out)
        return 0
    if args.eval:
        warnings.filterwarnings("ignore")
        _emit(run_evaluation(args), args.out)
        return 0
    if MARKOV in args.workload and args.accelerator == "cpu" and not device_has_native_bf16("cpu"):
        print(
            "note: this CPU has no AVX512-BF16 or AMX, so bf16 matrix products are emulated and far slower than fp32;"
            f" using the {args.size!r} model size.",
            file=sys.stderr,
        )
    load_start = os.getloadavg()
    if load_start[0] > (os.cpu_count() or 1) / 2:
        print(
            f"WARNING: load average {load_start[0]:.2f} on {os.cpu_count()} cores before the benchmark starts: other"
            " processes compete for the CPU and the timings will be distorted.",
            file=sys.stderr,
        )
    machine = machine_description(args.accelerator)
    matmul_size = 256 if args.quick else 512
    rates = matmul_rates(args.accelerator, matmul_size, threads=args.threads)
    text = "\n".join(
        _timing_report(args, run_spec(args, workload), machine, rates, matmul_size) for workload in args.workload
    )
    for line in text.splitlines():
        if line.startswith("**WARNING"):
            print(line.strip("*"), file=sys.stderr)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0
