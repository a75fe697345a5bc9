"""Pytest's fixtures for the whole suite; the shared helpers themselves live in :mod:`tests.helpers`."""

from __future__ import annotations

import pytest
import torch

# Re-exported only for the test files that still say `from conftest import ...`; new code imports tests.helpers.
from tests.helpers import TinyRegressor, loader, make_trainer, regression_data

__all__ = ["TinyRegressor", "loader", "make_trainer", "regression_data"]

# The test models are tiny: one thread runs them faster than two, and leaves the second core to the DDP workers and
# subprocesses that some tests start.
torch.set_num_threads(1)

collect_ignore = ["ddp_scripts"]
"""Scripts that tests start in subprocesses: nothing to collect, and ``--doctest-modules`` should not import them."""

SLOW_MODULES = frozenset({"test_ddp.py"})
"""Test files whose every test starts subprocesses (real DDP)."""
SLOW_TESTS = frozenset(
    {
        "test_fabric_ddp_ranks_agree_on_skips",
        "test_ddp_logging_step_reduces_every_counter_in_one_collective_and_one_sync",
    }
)
"""Single tests in other files that start DDP subprocesses."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the DDP subprocess tests slow, so that ``pytest -m "not slow"`` leaves them out.

    They are listed here until their files, edited on other branches, carry ``pytest.mark.slow`` themselves.
    """
    for item in items:
        if item.path.name in SLOW_MODULES or getattr(item, "originalname", None) in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
