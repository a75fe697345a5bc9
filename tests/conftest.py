"""Pytest's fixtures for the whole suite; the shared helpers themselves live in :mod:`tests.helpers`."""

from __future__ import annotations

from collections.abc import Generator

import pytest
import torch
import torch.distributed as dist

# The test models are tiny: one thread runs them faster than two, and leaves the second core to the DDP workers and
# subprocesses that some tests start.
torch.set_num_threads(1)

collect_ignore = ["ddp_scripts"]
"""Scripts that tests start in subprocesses: nothing to collect, and ``--doctest-modules`` should not import them."""


@pytest.fixture
def single_process_group() -> Generator[None, None, None]:
    """For a test that runs a strategy on one process (DDP, FSDP, ModelParallelStrategy; gloo or NCCL): destroys the
    one-process group that the strategy starts, so that the next test starts without one."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
