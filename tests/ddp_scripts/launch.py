"""Start ``train.py`` in subprocesses with a timeout, and always clean up: the helpers the DDP tests share."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

TRAIN_SCRIPT = Path(__file__).with_name("train.py")
REPOSITORY_ROOT = Path(__file__).resolve().parents[2]
"""Put first on the scripts' ``PYTHONPATH``, so that they import ``tests.helpers`` and this checkout's package."""
_DISTRIBUTED_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def clean_environment(**extra: str) -> dict[str, str]:
    """This process's environment: no distributed variables, the repository root first on ``PYTHONPATH``, ``extra``."""
    env = {key: value for key, value in os.environ.items() if key not in _DISTRIBUTED_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPOSITORY_ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


@functools.cache
def fsdp2_sums_over_gloo() -> bool:
    """Whether this torch's FSDP2 sums gradients over gloo instead of averaging them (``fsdp2_gloo_probe.py``)."""
    probe = Path(__file__).with_name("fsdp2_gloo_probe.py")
    completed = subprocess.run(
        [sys.executable, str(probe), str(free_port())], capture_output=True, text=True, timeout=120, check=True
    )
    return completed.stdout.strip().splitlines()[-1] == "sums"


FSDP2_SUMS_OVER_GLOO_REASON = (
    "this torch's FSDP2 sums gradients over gloo instead of averaging them (pytorch/pytorch#162338), so FSDP2 on CPU"
    " processes cannot match DDP; the comparison runs on torch releases whose FSDP2 averages"
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(arguments: Sequence[str], env: dict[str, str] | None = None, script: Path = TRAIN_SCRIPT) -> subprocess.Popen:
    """Start ``script`` (``train.py``) in its own session, so that it and every process it launches can be stopped
    together."""
    return subprocess.Popen(
        [sys.executable, str(script), *arguments],
        env=env if env is not None else clean_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def stop(process: subprocess.Popen) -> None:
    """Kill the process group of a process started by :func:`start`, if anything of it is still running."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def finish(process: subprocess.Popen, timeout: float) -> str:
    """Wait for a process started by :func:`start`; fail with its output when it fails or runs too long."""
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(process)
        output, _ = process.communicate()
        raise AssertionError(f"train.py ran past {timeout} s:\n{output[-4000:]}") from None
    finally:
        stop(process)
    if process.returncode != 0:
        raise AssertionError(f"train.py exited with {process.returncode}:\n{output[-4000:]}")
    return output


def run(
    arguments: Sequence[str], timeout: float = 60, env: dict[str, str] | None = None, script: Path = TRAIN_SCRIPT
) -> str:
    """Run ``script`` (``train.py``) to the end and return its output."""
    return finish(start(arguments, env, script), timeout)


def reports(out: Path, world_size: int = 2, tag: str = "") -> list[dict[str, Any]]:
    """The JSON report of every rank, by global rank."""
    return [json.loads((out / f"{tag}rank{rank}.json").read_text()) for rank in range(world_size)]


def leave_process_group() -> NoReturn:
    """End a rank that wrote its report: wait for every rank, then exit without tearing the gloo group down.

    gloo's teardown, in ``destroy_process_group`` or at interpreter exit, now and then aborts a finished run ("terminate
    called without an active exception", SIGABRT) when one rank's threads stop while the other still talks to the
    store. Past this barrier every rank has written its report and made its last collective: nothing is left to clean
    up, so the process ends at once with status 0.
    """
    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
