"""What users register on parameters acts under O2 as under O1: gradient hooks and post-accumulate hooks registered
in ``__init__`` or ``on_fit_start`` fire at every backward (a hook that plants an inf skips that step), and
``requires_grad`` set before fit holds, under the Trainer and Fabric."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor
from torch.nn import functional as F

from lightning_mp import MixedPrecision
from tests.helpers import fit
from tests.policies.o2.helpers import PRECISIONS, STEPS, Net, net_loader


class Hooked(Net):
    """Registers a clamping gradient hook and a post-accumulate hook in ``__init__``, and another gradient hook in
    ``on_fit_start``; the ``__init__`` hook plants an inf at backward ``plant_at``."""

    def __init__(self, plant_at: int | None = None) -> None:
        super().__init__()
        self.plant_at = plant_at
        self.calls = {"init": 0, "post_accumulate": 0, "on_fit_start": 0}
        self.net[0].weight.register_hook(self.clamp)
        self.net[3].bias.register_post_accumulate_grad_hook(self.count_post_accumulate)

    def clamp(self, grad: Tensor) -> Tensor:
        backward = self.calls["init"]
        self.calls["init"] += 1
        if backward == self.plant_at:
            return torch.full_like(grad, math.inf)
        return grad.clamp(-1.0, 1.0)

    def count_post_accumulate(self, parameter: Tensor) -> None:
        assert parameter.grad is not None and not parameter.grad.is_sparse
        self.calls["post_accumulate"] += 1

    def on_fit_start(self) -> None:
        self.net[3].weight.register_hook(self.count_on_fit_start)

    def count_on_fit_start(self, grad: Tensor) -> None:
        self.calls["on_fit_start"] += 1


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_hooks_registered_before_fit_fire_at_every_backward(opt_level: str, precision: str) -> None:
    """Gradient hooks from ``__init__`` and ``on_fit_start`` and a post-accumulate hook fire once per backward, at O2
    as at O1."""
    model = Hooked()
    fit(model, MixedPrecision(precision, opt_level=opt_level), max_steps=STEPS)  # type: ignore[arg-type]
    assert model.calls == {"init": STEPS, "post_accumulate": STEPS, "on_fit_start": STEPS}


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_an_inf_planted_by_a_hook_registered_in_init_skips_that_step(opt_level: str) -> None:
    """A gradient hook registered in ``__init__`` that returns an inf makes its step skipped, at O2 as at O1."""
    model = Hooked(plant_at=2)
    trainer = fit(model, MixedPrecision("bf16-mixed", opt_level=opt_level), max_steps=STEPS)  # type: ignore[arg-type]
    stats = trainer.precision_plugin.stats
    assert (stats.optimizer_steps, stats.skipped_steps) == (STEPS, 1)
    assert all(torch.isfinite(p).all() for p in model.parameters())


class FrozenFirstLayer(Net):
    def __init__(self) -> None:
        super().__init__()
        self.net[0].requires_grad_(False)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


def test_requires_grad_set_before_fit_holds_at_o2() -> None:
    """A layer frozen in ``__init__`` gets no gradient and keeps its weights at O2, as at O1."""
    model = FrozenFirstLayer()
    frozen = model.net[0].weight.detach().clone()
    seen: list[Any] = []

    class Grads(L.Callback):
        def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
            seen.append(pl_module.net[0].weight.grad)

    fit(model, MixedPrecision("bf16-mixed", opt_level="O2"), max_steps=2, callbacks=[Grads()])
    assert seen == [None, None]
    assert torch.equal(model.net[0].weight, frozen) and not model.net[0].weight.requires_grad


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_fabric_hooks_registered_before_setup_fire_at_every_backward(opt_level: str) -> None:
    """Under Fabric, a gradient hook registered on a parameter before ``fabric.setup`` fires at every backward."""
    torch.manual_seed(0)
    model = Net()
    calls = []
    model.net[0].weight.register_hook(lambda grad: calls.append(grad.dtype))
    plugin = MixedPrecision("16-mixed", opt_level=opt_level, init_scale=2.0**10)  # type: ignore[arg-type]
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    wrapped, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    for features, target in net_loader(STEPS):
        fabric.backward(F.cross_entropy(wrapped(features), target))
        optimizer.step()
        optimizer.zero_grad()
    half = torch.float16 if opt_level == "O2" else torch.float32
    assert calls == [half] * STEPS
    assert plugin.stats.skipped_steps == 0
