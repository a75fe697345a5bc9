"""Pytest's fixtures for the whole suite; the shared helpers themselves live in :mod:`tests.helpers`."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

# Re-exported only for the test files that still say `from conftest import ...`; new code imports tests.helpers.
from tests.helpers import TinyRegressor, loader, make_trainer, regression_data

__all__ = ["TinyRegressor", "loader", "make_trainer", "regression_data"]

# The test models are tiny: one thread runs them faster than two, and leaves the second core to the DDP workers and
# subprocesses that some tests start.
torch.set_num_threads(1)

SLOW_MODULES = frozenset({"test_ddp.py"})
"""Test files whose every test starts subprocesses; marked here until the files carry ``pytest.mark.slow``."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tests of :data:`SLOW_MODULES` slow, so that ``pytest -m "not slow"`` leaves them out."""
    for item in items:
        if item.path.name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def tiny_loader() -> DataLoader:
    """The deterministic regression loader of :func:`tests.helpers.loader`."""
    return loader()
