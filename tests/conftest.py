"""Pytest's fixtures for the whole suite; the shared helpers themselves live in :mod:`tests.helpers`."""

from __future__ import annotations

import torch

# The test models are tiny: one thread runs them faster than two, and leaves the second core to the DDP workers and
# subprocesses that some tests start.
torch.set_num_threads(1)

collect_ignore = ["ddp_scripts"]
"""Scripts that tests start in subprocesses: nothing to collect, and ``--doctest-modules`` should not import them."""
