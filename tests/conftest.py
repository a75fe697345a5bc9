"""Pytest's fixtures for the whole suite; the shared helpers themselves live in :mod:`tests.helpers`."""

from __future__ import annotations

import functools
from collections.abc import Generator

import lightning.fabric.utilities.registry
import pytest
import torch
import torch.distributed as dist

# The test models are tiny: one thread runs them faster than two, and leaves the second core to the DDP workers and
# subprocesses that some tests start.
torch.set_num_threads(1)

# Every Trainer and every Fabric looks for callback factories among the entry points of every installed package
# (about 9 ms here, more than a small test's whole fit); the installed packages do not change during a session, so
# the suite looks them up once. Each test still builds its real Trainer or Fabric, with Lightning's own callbacks.
_registry = lightning.fabric.utilities.registry
if callable(getattr(_registry, "entry_points", None)):
    _registry.entry_points = functools.cache(_registry.entry_points)

collect_ignore = ["ddp_scripts"]
"""Scripts that tests start in subprocesses: nothing to collect, and ``--doctest-modules`` should not import them."""


@pytest.fixture
def single_process_group() -> Generator[None, None, None]:
    """For a test that runs a strategy on one process (DDP, FSDP, ModelParallelStrategy; gloo or NCCL): destroys the
    one-process group that the strategy starts, so that the next test starts without one."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
