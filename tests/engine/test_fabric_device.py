"""Under Fabric the plugin autocasts where Fabric put the model: ``device=None`` follows it, a contradiction raises.

Fabric converts the model before moving it and tells a plugin nothing of its accelerator, so the plugin confirms its
device at every forward from the model's parameters. The CPU has one real device type, so these tests move the model
to ``meta`` to stand for another; ``tests/cuda/test_fabric_device.py`` runs the same on a GPU.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_mp import MixedPrecision


def _setup_on_cpu(plugin: MixedPrecision) -> nn.Module:
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    return fabric.setup(nn.Sequential(nn.Linear(8, 4), nn.LayerNorm(4)))


@pytest.mark.parametrize("opt_level", ["O1", "O2", "lean"])
def test_device_none_follows_the_model_to_where_fabric_moved_it(opt_level: str) -> None:
    """With device=None, a model moved after fabric.setup is autocast on its new device type, not the setup's."""
    plugin = MixedPrecision("bf16-mixed", opt_level=opt_level)  # type: ignore[arg-type]
    model = _setup_on_cpu(plugin)
    assert model(torch.randn(2, 8)).isfinite().all()
    model.to("meta")
    with contextlib.suppress(RuntimeError):  # torch has no autocast for meta: O1 and O2 stop there, lean runs
        model(torch.empty(2, 8, device="meta"))
    assert plugin.device == "meta"


@pytest.mark.parametrize("opt_level", ["O1", "O2", "lean"])
def test_an_explicit_device_that_fabric_contradicts_is_refused(opt_level: str) -> None:
    """MixedPrecision(device='cpu') on a model Fabric runs elsewhere raises, naming both devices and the fix."""
    plugin = MixedPrecision("bf16-mixed", opt_level=opt_level, device="cpu")  # type: ignore[arg-type]
    model = _setup_on_cpu(plugin)
    model.to("meta")
    with pytest.raises(ValueError, match=r"device='cpu'\) does not match Fabric's device.*'meta'.*device=None"):
        model(torch.empty(2, 8, device="meta"))
