"""Lightning Fabric's own tests of its AMP plugin, rewritten for lightning_mp's MixedPrecision under a real Fabric.

The sources are ``tests_fabric/plugins/precision/test_amp.py`` and ``test_amp_integration.py``. Lightning's unit tests
put mocks in place of the scaler, the tensor and the optimizer. Here a CPU Fabric runs real fp16 with a real
LossScaler, so every test checks what reaches the gradients and the weights. Every test names the upstream test it
adapts. ``tests/upstream_inventory/`` lists each upstream test as adapted, skipped or deliberately different, with
the reason for each. Two examples: Fabric turns ``"16-mixed"`` on the CPU into bf16, while this plugin runs real fp16
there; and Fabric casts the inputs to the half dtype, while this plugin leaves them to autocast.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_mp import LossScaler, MixedPrecision

HALF = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


def _fabric_run(
    plugin: MixedPrecision, model: nn.Module, optimizer_ctor: Any = torch.optim.SGD, **options: Any
) -> tuple[Fabric, Any, Any]:
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    module, optimizer = fabric.setup(model, optimizer_ctor(model.parameters(), **{"lr": 0.1, **options}))
    return fabric, module, optimizer


def _linear(seed: int = 0, features: int = 4) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(features, features)


def test_a_16_mixed_plugin_gets_its_loss_scaler_when_fabric_sets_it_up():
    """fp16's scaler is a LossScaler, hence a torch GradScaler; it exists from fabric.setup, not from the constructor.

    Lightning builds a ``GradScaler`` in the constructor; this plugin builds its scaler at setup, once it knows the
    device and the opt level (an fp16 O3 run, for one, lets it unscale fp16 gradients).

    Upstream: tests_fabric/plugins/precision/test_amp.py test_amp_precision_default_scaler (differs).
    """
    plugin = MixedPrecision("16-mixed")
    assert plugin.scaler is None
    _fabric_run(plugin, _linear())
    assert isinstance(plugin.scaler, LossScaler) and isinstance(plugin.scaler, torch.amp.GradScaler)


def test_bf16_refuses_a_scaler_and_has_none():
    """A scaler given with bf16 is refused with Lightning's reason; bf16 has no scaler before or after setup.

    Upstream: tests_fabric/plugins/precision/test_amp.py test_amp_precision_scaler_with_bf16.
    """
    with pytest.raises(ValueError, match="`precision='bf16-mixed'` does not use a scaler"):
        MixedPrecision("bf16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    plugin = MixedPrecision("bf16-mixed", "cpu")
    assert plugin.scaler is None
    _fabric_run(plugin, _linear())
    assert plugin.scaler is None


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_the_forward_context_autocasts_on_the_cpu_in_the_half_dtype(precision):
    """Inside the forward context, CPU autocast is on in the plugin's half dtype; the default dtype stays fp32.

    Lightning's ``forward_context()`` returns the ``torch.autocast`` object itself; this plugin's wraps it (the opt
    level's context around it), so only what it does is checked.

    Upstream: tests_fabric/plugins/precision/test_amp.py test_amp_precision_forward_context (its CPU part).
    """
    plugin = MixedPrecision(precision, "cpu")
    plugin.setup_for_device("cpu")
    with plugin.forward_context():
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") is HALF[precision]
        assert torch.get_default_dtype() is torch.float32
    assert not torch.is_autocast_enabled("cpu")


def test_fabric_backward_scales_the_loss_and_passes_its_arguments_on():
    """fabric.backward leaves scale-times-true gradients; retain_graph reaches torch, so a second backward works.

    Upstream: tests_fabric/plugins/precision/test_amp.py test_amp_precision_backward.
    """
    scale = 2.0**10
    reference = _linear()
    plugin = MixedPrecision("16-mixed", init_scale=scale)
    fabric, module, _ = _fabric_run(plugin, copy.deepcopy(reference))
    x = torch.randn(2, 4)
    fabric.backward(module(x).float().pow(2).sum(), retain_graph=True)
    with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
        out = reference(x)
    out.float().pow(2).sum().backward()
    for ours, theirs in zip(module.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad * scale)
    fabric.backward(module(x).float().pow(2).sum())  # the first graph was retained: no error


def test_a_step_of_the_fabric_optimizer_goes_through_the_scaler():
    """optimizer.step() unscales and steps (the weights move by the true gradient) and counts in the scale update.

    Upstream: tests_fabric/plugins/precision/test_amp.py test_amp_precision_optimizer_step_with_scaler.
    """
    reference = _linear()
    plugin = MixedPrecision("16-mixed", init_scale=2.0**10, growth_interval=1)
    fabric, module, optimizer = _fabric_run(plugin, copy.deepcopy(reference))
    x = torch.randn(2, 4)
    fabric.backward(module(x).float().pow(2).sum())
    optimizer.step()
    with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
        out = reference(x)
    out.float().pow(2).sum().backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    for ours, theirs in zip(module.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-4)
    assert (plugin.stats.optimizer_steps, plugin.stats.skipped_steps, plugin.stats.loss_scale) == (1, 0, 2.0**11)


def test_a_bf16_step_steps_the_optimizer_without_a_scaler():
    """In bf16 there is nothing to unscale: optimizer.step() steps the weights, and the scale stays 1.

    Upstream: tests_fabric/plugins/precision/test_amp.py test_amp_precision_optimizer_step_without_scaler.
    """
    plugin = MixedPrecision("bf16-mixed", "cpu")
    fabric, module, optimizer = _fabric_run(plugin, _linear())
    before = [p.detach().clone() for p in module.parameters()]
    fabric.backward(module(torch.randn(2, 4)).float().pow(2).sum())
    optimizer.step()
    assert plugin.scaler is None
    assert all(not torch.equal(b, p) for b, p in zip(before, module.parameters(), strict=True))
    assert (plugin.stats.optimizer_steps, plugin.stats.loss_scale) == (1, 1.0)


class DtypeCheckingModule(nn.Module):
    """One linear layer that records the input's dtype, whether autocast is on, and the output's dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(32, 2)
        self.seen: dict[str, Any] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = self.layer(x)
        self.seen = {"input": x.dtype, "autocast": torch.is_autocast_enabled("cpu"), "output": output.dtype}
        return output


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_fabric_computes_in_the_half_dtype_with_fp32_weights_gradients_and_outputs(precision):
    """The layer computes in the half dtype (real fp16 for '16-mixed'); weights, gradients and outputs stay fp32.

    Fabric's own plugin casts the inputs to the half dtype and runs '16-mixed' on the CPU as bf16. This plugin leaves
    the inputs as they are (autocast casts each op's inputs, and an integer or fp32-only input is not touched) and
    runs real fp16 there.

    Upstream: tests_fabric/plugins/precision/test_amp_integration.py test_amp (on one CPU process, not two).
    """
    plugin = MixedPrecision(precision, "cpu")
    model = DtypeCheckingModule()
    fabric, module, optimizer = _fabric_run(plugin, model, torch.optim.Adam)
    batch = torch.rand(2, 32)
    assert module.layer.weight.dtype is torch.float32
    output = module(batch)
    assert model.seen == {"input": torch.float32, "autocast": True, "output": HALF[precision]}
    assert output.dtype is torch.float32
    fabric.backward(nn.functional.mse_loss(output, torch.ones_like(output)))
    assert module.layer.weight.grad.dtype is torch.float32
    optimizer.step()
    optimizer.zero_grad()


def test_fused_and_plain_adam_give_the_same_losses_and_weights_in_fp16():
    """Five fp16 Fabric steps with fused Adam and with plain Adam give the same losses and the same weights.

    Upstream: tests_fabric/plugins/precision/test_amp_integration.py test_amp_fused_optimizer_parity (on the CPU).
    """

    def run(fused: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        plugin = MixedPrecision("16-mixed")
        fabric, module, optimizer = _fabric_run(plugin, _linear(1234, 10), torch.optim.Adam, lr=1.0, fused=fused)
        generator = torch.Generator().manual_seed(0)
        data, target = torch.randn(10, 10, generator=generator), torch.randn(10, 10, generator=generator)
        losses = []
        for _ in range(5):
            optimizer.zero_grad()
            loss = (module(data) - target).abs().sum()
            fabric.backward(loss)
            optimizer.step()
            losses.append(loss.detach())
        plugin.teardown()
        return torch.stack(losses), [p.detach() for p in module.parameters()]

    plain_losses, plain = run(fused=False)
    fused_losses, fused = run(fused=True)
    torch.testing.assert_close(fused_losses, plain_losses)
    for a, b in zip(plain, fused, strict=True):
        torch.testing.assert_close(b, a)
