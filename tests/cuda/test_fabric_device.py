"""Fabric on a GPU: without ``device=`` the plugin autocasts where Fabric's accelerator put the model.

``tests/engine/test_fabric_device.py`` proves the same logic on the CPU, with ``meta`` standing for the other device.
"""

from __future__ import annotations

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_mp import MixedPrecision
from tests.cuda.matrix import make_network, on_device

pytestmark = [pytest.mark.filterwarnings("ignore:lightning_mp:UserWarning")]
CUDA_ONLY = [on_device("cuda")]


@pytest.mark.parametrize("device", CUDA_ONLY)
@pytest.mark.parametrize(("precision", "opt_level"), [("16-mixed", "O1"), ("16-mixed", "O2"), ("bf16-mixed", "lean")])
def test_fabric_on_cuda_autocasts_on_cuda_without_a_device(device: str, precision: str, opt_level: str) -> None:
    """Fabric(accelerator='cuda') with MixedPrecision(precision) and no device: the first forward runs in half."""
    plugin = MixedPrecision(precision, opt_level=opt_level)  # type: ignore[arg-type]
    fabric = Fabric(accelerator=device, devices=1, plugins=[plugin])
    model = fabric.setup(make_network())
    hidden: list[torch.dtype] = []
    model.module[0].register_forward_hook(lambda module, args, output: hidden.append(output.dtype))
    output = model(torch.randn(8, 8, device=device))
    assert plugin.device == "cuda"
    assert output.device.type == "cuda" and output.isfinite().all()
    assert hidden == [torch.float16 if precision == "16-mixed" else torch.bfloat16]


@pytest.mark.parametrize("device", CUDA_ONLY)
def test_a_model_created_on_cuda_under_init_module_sets_the_plugin_up_for_cuda(device: str) -> None:
    """A model built inside fabric.init_module() on CUDA gives the plugin its device at setup already."""
    plugin = MixedPrecision("bf16-mixed")
    fabric = Fabric(accelerator=device, devices=1, plugins=[plugin])
    with fabric.init_module():
        network = make_network()
    model = fabric.setup(network)
    assert plugin.device == "cuda"
    assert model(torch.randn(8, 8, device=device)).isfinite().all()


@pytest.mark.parametrize("device", CUDA_ONLY)
def test_an_explicit_cpu_device_under_a_cuda_fabric_is_refused(device: str) -> None:
    """MixedPrecision(device='cpu') under Fabric(accelerator='cuda') raises at the first forward, naming the fix."""
    fabric = Fabric(accelerator=device, devices=1, plugins=[MixedPrecision("16-mixed", device="cpu")])
    model = fabric.setup(make_network())
    with pytest.raises(ValueError, match=r"device='cpu'\) does not match Fabric's device.*'cuda'"):
        model(torch.randn(8, 8, device=device))


@pytest.mark.parametrize("device", CUDA_ONLY)
def test_a_cpu_fabric_on_a_gpu_machine_autocasts_on_the_cpu(device: str) -> None:
    """Fabric(accelerator='cpu') on a GPU machine: the plugin, set up assuming CUDA, follows the model to the CPU."""
    plugin = MixedPrecision("bf16-mixed")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = fabric.setup(nn.Sequential(nn.Linear(8, 4)))
    assert model(torch.randn(2, 8)).isfinite().all()
    assert plugin.device == "cpu"


@pytest.mark.parametrize("device", CUDA_ONLY)
def test_o2_masters_follow_the_model_to_cuda(device: str) -> None:
    """Fabric moves the model to CUDA after O2 converted it: the fp32 masters the optimizer steps move with it."""
    plugin = MixedPrecision("16-mixed", opt_level="O2")
    fabric = Fabric(accelerator=device, devices=1, plugins=[plugin])
    network = make_network()
    model, optimizer = fabric.setup(network, torch.optim.AdamW(network.parameters(), lr=1e-3))
    for _ in range(2):
        fabric.backward(model(torch.randn(8, 8, device=device)).float().square().mean())
        optimizer.step()
        optimizer.zero_grad()
    masters = [p for group in optimizer.param_groups for p in group["params"]]
    assert {p.device.type for p in masters} == {"cuda"} and {p.dtype for p in masters} == {torch.float32}
    assert plugin.stats.optimizer_steps == 2 and all(p.isfinite().all() for p in masters)
    plugin.teardown()
    assert {p.device.type for p in network.parameters()} == {"cuda"}
