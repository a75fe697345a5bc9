"""The machine a benchmark ran on, and how busy it was: what makes its timings worth trusting or not.

A benchmark on a shared machine measures the other users too, so the report gives:

- the machine: CPU model and its bf16 flags, cores, torch threads, the GPU, and the torch, Lightning and Python
  versions (:func:`machine_description`);
- what each dtype's matrix products can reach on it (:func:`matmul_rates`), measured with the training's threads,
  each rate the best of several rounds of at least :data:`MATMUL_MIN_SECONDS`, so that a busy moment lowers one
  round, not the rate;
- the load: the load average before and after, each run's CPU share (CPU time over ``wall time x threads``) and,
  on Linux, its run-queue wait share (:func:`scheduler_seconds`): the time its threads were ready to run but waited
  for a core, over the time they were runnable. Above :data:`HIGH_WAIT_SHARE` (or, without schedstat, a CPU share
  below :data:`LOW_CPU_SHARE`), or with a load average above half the cores before the start,
  :func:`load_warnings` says loudly that the timings are distorted;
- peak memory: the peak resident set size on the CPU (:func:`peak_rss_mib`), which includes the interpreter, torch
  and Lightning, so the report also gives the peak over the RSS just before ``fit`` (:func:`current_rss_mib`).
"""

from __future__ import annotations

import os
import platform
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import lightning as L
import torch

LOW_CPU_SHARE = 0.5
"""Where the scheduler's wait times cannot be read: a run whose process got less than this share of ``wall time x
threads`` in CPU time probably competed for the cores (single-threaded Python overhead alone keeps it below 1)."""
HIGH_WAIT_SHARE = 0.2
"""A run whose threads spent more than this share of their runnable time waiting for a core competed for the cores."""
MATMUL_MIN_SECONDS = 0.05
"""Each timed round of matrix products runs at least this long, so that the timer's resolution does not matter."""


def scheduler_seconds() -> tuple[float, float] | None:
    """``(running, waiting for a core)`` seconds summed over this process's threads; None where unavailable.

    Reads ``/proc/self/task/<tid>/schedstat`` (Linux with scheduler statistics): its first two fields are the
    nanoseconds a thread ran and waited on a run queue. Threads that ended are no longer counted, so use differences
    over a span in which the thread pool stays the same (the timed steps).
    """
    running = waiting = 0
    try:
        for task in Path("/proc/self/task").iterdir():
            fields = (task / "schedstat").read_text().split()
            running += int(fields[0])
            waiting += int(fields[1])
    except (OSError, ValueError, IndexError):
        return None
    return running / 1e9, waiting / 1e9


def current_rss_mib() -> float:
    """This process's resident set size now, in MiB (NaN where ``/proc/self/status`` does not say)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mib() -> float:
    """This process's peak resident set size so far, in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def machine_description(accelerator: str) -> list[str]:
    """Lines naming the machine: CPU model and its bf16 flags, cores, threads, GPU, versions, load."""
    cpuinfo: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            cpuinfo.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    model_name = cpuinfo.get("model name") or platform.processor() or platform.machine()
    flags = set(cpuinfo.get("flags", "").split())

    def has(flag: str) -> str:
        return "yes" if flag in flags else "no"

    lines = [
        f"CPU: {model_name}, {os.cpu_count()} logical cores, torch threads {torch.get_num_threads()}",
        f"CPU flags: avx2 {has('avx2')}, avx512f {has('avx512f')}, avx512_bf16 {has('avx512_bf16')},"
        f" amx_bf16 {has('amx_bf16')}, avx512_fp16 {has('avx512_fp16')}",
    ]
    if accelerator == "gpu":
        major, minor = torch.cuda.get_device_capability()
        lines.append(
            f"GPU: {torch.cuda.get_device_name()} (compute capability {major}.{minor}), CUDA {torch.version.cuda}"
        )
    lines.append(f"torch {torch.__version__}, lightning {L.__version__}, Python {platform.python_version()}")
    return lines


def matmul_rates(accelerator: str, n: int = 512, threads: int | None = None, rounds: int = 3) -> dict[str, float]:
    """GFLOP/s of an ``n x n`` matrix product in fp32, bf16 and fp16 on the device: what each dtype can reach.

    Measured with ``threads`` intra-op threads (None: torch's current number), the number the training runs use;
    each rate is the best of ``rounds`` rounds of at least :data:`MATMUL_MIN_SECONDS`, so a busy moment on a shared
    machine lowers one round, not the rate.
    """
    device = "cuda" if accelerator == "gpu" else "cpu"
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    rates = {}
    try:
        for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
            a = torch.randn(n, n, device=device).to(dtype)
            b = torch.randn(n, n, device=device).to(dtype)
            a @ b
            best = 0.0
            for _ in range(rounds):
                if device == "cuda":
                    torch.cuda.synchronize()
                products, start = 0, time.perf_counter()
                while True:
                    a @ b
                    products += 1
                    if device == "cuda":
                        torch.cuda.synchronize()
                    elapsed = time.perf_counter() - start
                    if elapsed >= MATMUL_MIN_SECONDS:
                        break
                best = max(best, 2 * n**3 * products / elapsed / 1e9)
            rates[label] = best
    finally:
        torch.set_num_threads(previous_threads)
    return rates


def load_warnings(
    load_start: Sequence[float],
    load_end: Sequence[float],
    cpu_shares: dict[str, float],
    cores: int,
    wait_shares: dict[str, float | None] | None = None,
) -> list[str]:
    """Loud warnings when the machine was busy: a pure function of the loads, the runs' shares and the cores.

    The load average before the start counts other users only (the benchmark had not started). A run-queue wait
    share above :data:`HIGH_WAIT_SHARE` means a run waited for the cores; where it is unknown (None), a CPU share
    below :data:`LOW_CPU_SHARE` is taken as the sign instead.

    Example:
        >>> load_warnings((0.1, 0.1, 0.1), (1.0, 0.5, 0.2), {"fp32": 0.6}, cores=2, wait_shares={"fp32": 0.02})
        []
        >>> len(load_warnings((3.5, 2.0, 1.0), (4.0, 3.0, 1.0), {"fp32": 0.45}, cores=2, wait_shares={"fp32": 0.6}))
        2

    """
    wait_shares = wait_shares or {}
    warnings_found = []
    if load_start[0] > cores / 2:
        warnings_found.append(
            f"WARNING: the machine was busy before the benchmark started (load average {load_start[0]:.2f} on"
            f" {cores} cores, {load_end[0]:.2f} at the end): other processes share the cores, so step times and"
            " ratios are distorted. Rerun on an idle machine."
        )
    waited = {name: share for name, share in wait_shares.items() if share is not None and share > HIGH_WAIT_SHARE}
    if waited:
        shown = ", ".join(f"{name} {share:.0%}" for name, share in waited.items())
        warnings_found.append(
            f"WARNING: runs spent more than {HIGH_WAIT_SHARE:.0%} of their runnable time waiting for a core ({shown}):"
            " their step times measure the load as much as the configuration."
        )
    starved = {
        name: share for name, share in cpu_shares.items() if wait_shares.get(name) is None and share < LOW_CPU_SHARE
    }
    if starved:
        shown = ", ".join(f"{name} {share:.0%}" for name, share in starved.items())
        warnings_found.append(
            f"WARNING: runs got less than {LOW_CPU_SHARE:.0%} of the CPU time their threads asked for ({shown}):"
            " they probably waited for the cores, so their step times measure the load too."
        )
    return warnings_found
