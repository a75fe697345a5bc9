"""Every upstream test of torch's GradScaler and of Lightning's precision plugins, and what this package does with it.

torch's grad-scaling tests and Lightning's precision-plugin tests describe how a loss scaler and an AMP plugin
behave. Users rely on that behaviour. The package runs them, rewritten against :class:`~lightning_mp.LossScaler` and
:class:`~lightning_mp.MixedPrecision`, in five modules under ``tests/``: ``scaling/test_scaler_upstream.py`` and
``scaling/test_scaler_upstream_side_by_side.py``, ``plugin/test_plugin_upstream.py``,
``engine/test_fabric_upstream.py`` and ``distributed/test_fsdp_upstream.py``. This module is the one list of what was
done with each upstream test, and why:

* ``adapted``: the upstream assertions hold here. Mocks are replaced by real runs, CUDA by the CPU, private torch
  calls by the public API.
* ``differs``: this package deliberately behaves otherwise. The local tests assert the package's behaviour, and the
  reason says what differs.
* ``skipped``: nothing here to test. The test needs CUDA, or tests a private helper, another plugin or a newer
  Lightning API.

A ``name`` of ``"*"`` stands for every test of a file that concerns another plugin. ``local`` names the tests that
adapt an entry, as ``"<module>::<test function>"``. ``tests/test_upstream_inventory.py`` checks that each one exists
and names its upstream test in its docstring, and that every test of the four modules is listed here.
"""

from __future__ import annotations

from tests.upstream_inventory.entries import UpstreamTest
from tests.upstream_inventory.lightning_tests import LIGHTNING_INVENTORY
from tests.upstream_inventory.torch_tests import TORCH_INVENTORY

__all__ = ["INVENTORY", "UpstreamTest"]

INVENTORY: tuple[UpstreamTest, ...] = TORCH_INVENTORY + LIGHTNING_INVENTORY
"""What this package does with every upstream test; ``tests/test_upstream_inventory.py`` keeps it true."""
