"""Bytes all-reduced per training step under DDP, per opt level: what crosses the wire between GPUs.

DDP averages gradients in buckets: flat buffers of gradients of one dtype, each all-reduced once per backward.
A DDP communication hook (``DistributedDataParallel.register_comm_hook``, torch's public API for compressing or
logging that traffic) sees every bucket. :func:`counting_allreduce_hook` adds ``bucket.buffer().numel() *
element_size()`` to a :class:`BucketLedger`, by dtype, then runs torch's default all-reduce
(``default_hooks.allreduce_hook``: divide by the world size, all-reduce), so training is unchanged.

The measurement runs a real two-process DDP training (Lightning's ``DDPStrategy`` on the CPU with gloo) in a
subprocess, ``python -m lightning_mp.bench.allreduced_bytes --result-file FILE O1:16-mixed O2:16-mixed ...``, which
Lightning re-launches once for the second rank. Each opt level trains the tiny Markov-text model for
``WARMUP_STEPS`` batches and counts the next; every level runs in the same two processes one after the other, so
that the processes start once (about 10 of the 20 seconds the whole table takes on two cores). Rank zero writes the
results as JSON; :func:`measure_allreduced_bytes` starts the subprocess, waits with a timeout, and reads them.

Why it carries over: the bytes are the gradients' bytes, set by how many there are and their dtype. NCCL on GPUs
all-reduces the same buckets as gloo does here (Lightning registers communication hooks itself only on CUDA, so
the hook is registered here from ``on_fit_start``, on the wrapped model ``trainer.strategy.model``).
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations against the real types, not strings.

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

import lightning_mp
from lightning_mp.bench.workloads import QUIET_TRAINER, SIZES, markov_task
from lightning_mp.plugin import MixedPrecision

WARMUP_STEPS = 2
_MODULE = "lightning_mp.bench.allreduced_bytes"
_DISTRIBUTED_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class AllReducedBytes:
    """Bytes DDP all-reduced in one steady training step, on one rank.

    Attributes:
        opt_level: the opt level.
        precision: the plugin's precision.
        bytes_by_dtype: bytes of the buckets all-reduced, by the buckets' dtype (``"torch.float32"``).
        trainable_elements: the model's trainable parameter elements (4 bytes each when gradients are fp32).

    """

    opt_level: str
    precision: str
    bytes_by_dtype: dict[str, int]
    trainable_elements: int

    @property
    def total(self) -> int:
        """Bytes all-reduced in the step, all dtypes together."""
        return sum(self.bytes_by_dtype.values())


class BucketLedger(L.Callback):
    """Registers :func:`counting_allreduce_hook` on the DDP model and keeps the bytes of batch ``batch``'s buckets."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.counting = False
        self.bytes_by_dtype: Counter[str] = Counter()

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        model = trainer.strategy.model
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(
                f"BucketLedger counts the buckets of DistributedDataParallel; {type(trainer.strategy).__name__}"
                f" wrapped the model in {type(model).__name__}. Use strategy='ddp'."
            )
        model.register_comm_hook(self, counting_allreduce_hook)

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.counting = batch_idx == self.batch

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: STEP_OUTPUT, batch: Any, batch_idx: int
    ) -> None:
        self.counting = False


def counting_allreduce_hook(ledger: BucketLedger, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Add the bucket's bytes to ``ledger`` (while it counts), then all-reduce the bucket as DDP does by default."""
    if ledger.counting:
        buffer = bucket.buffer()
        ledger.bytes_by_dtype[str(buffer.dtype)] += buffer.numel() * buffer.element_size()
    world = dist.group.WORLD
    assert world is not None, "DDP runs in the default process group"
    return default_hooks.allreduce_hook(world, bucket)


def train_and_count(opt_level: str, precision: str) -> AllReducedBytes:
    """Train the tiny Markov-text model under DDP (this process is one rank) and count one steady step's buckets."""
    steps = WARMUP_STEPS + 1
    torch.manual_seed(0)
    data, model = markov_task(SIZES["tiny"], 2 * (steps + 1), seed=0)  # each rank sees half the sequences
    ledger = BucketLedger(batch=WARMUP_STEPS)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(process_group_backend="gloo"),
        plugins=[MixedPrecision(precision, opt_level=opt_level)],
        max_steps=steps,
        callbacks=[ledger],
        **QUIET_TRAINER,
    )
    trainer.fit(model, data)
    trainable = sum(parameter.numel() for parameter in model.parameters() if parameter.requires_grad)
    return AllReducedBytes(opt_level, precision, dict(ledger.bytes_by_dtype), trainable)


def _worker(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {_MODULE}", description=__doc__.splitlines()[0])
    parser.add_argument("--result-file", type=Path, required=True, help="where rank zero writes the JSON results")
    parser.add_argument("levels", nargs="+", help="OPT_LEVEL:PRECISION, e.g. O2:bf16-mixed")
    args = parser.parse_args(argv)
    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # emulated bf16 and few dataloader workers on this CPU: known, not counted
        for level in args.levels:
            opt_level, _, precision = level.partition(":")
            results.append(train_and_count(opt_level, precision))
    dist.barrier()
    if dist.get_rank() == 0:
        args.result_file.write_text(json.dumps([asdict(result) for result in results]))
    dist.destroy_process_group()
    return 0


def _environment() -> dict[str, str]:
    """This process's environment without distributed variables, importing this copy of the package, one thread."""
    env = {key: value for key, value in os.environ.items() if key not in _DISTRIBUTED_VARIABLES}
    package_root = str(Path(lightning_mp.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"  # two ranks share the cores; more threads only contend
    return env


def measure_allreduced_bytes(opt_levels: Sequence[tuple[str, str]], timeout: float = 120) -> list[AllReducedBytes]:
    """Bytes all-reduced per steady step for each ``(opt_level, precision)``, from two DDP processes (gloo, CPU).

    Args:
        opt_levels: the ``(opt_level, precision)`` pairs, measured in order in the same two processes.
        timeout: seconds the processes may take; then they are stopped.

    Raises:
        RuntimeError: the processes failed or ran past ``timeout``; the message ends with their output.

    """
    with tempfile.TemporaryDirectory() as scratch:
        result_file = Path(scratch) / "allreduced_bytes.json"
        levels = [f"{opt_level}:{precision}" for opt_level, precision in opt_levels]
        process = subprocess.Popen(
            [sys.executable, "-m", _MODULE, "--result-file", str(result_file), *levels],
            cwd=scratch,
            env=_environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # one process group holds both ranks, so that both can be stopped together
        )
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(process)
            output, _ = process.communicate()
            raise RuntimeError(f"DDP byte counting ran past {timeout} s:\n{output[-4000:]}") from None
        finally:
            _stop(process)
        if process.returncode != 0:
            raise RuntimeError(f"DDP byte counting exited with {process.returncode}:\n{output[-4000:]}")
        return [AllReducedBytes(**record) for record in json.loads(result_file.read_text())]


def _stop(process: subprocess.Popen) -> None:
    """Kill what is left of the process group started for the measurement (the second rank, after a failure)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


__all__ = ["AllReducedBytes", "BucketLedger", "counting_allreduce_hook", "measure_allreduced_bytes", "train_and_count"]

if __name__ == "__main__":
    sys.exit(_worker())
