"""torch's own GradScaler scenarios (``test_grad_scaling_*``), run on LossScaler and torch's GradScaler side by side.

Each scenario is written once, as a function of the scaler, and run twice: with ``torch.amp.GradScaler("cpu")`` and
with ``LossScaler("cpu")`` at torch's settings. LossScaler must move its scale exactly as torch's does and leave the
parameters as torch's leave them, including in the iterations where a gradient overflows.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

from lightning_mp import LossScaler

SETTINGS = {"init_scale": 128.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2}
ITERATIONS = 6
OVERFLOW_AT = (2,)


def _models(count: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)) for _ in range(count)]


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(3, 4, generator=generator), torch.randn(3, 1, generator=generator)


def _loss(model: nn.Module) -> torch.Tensor:
    x, y = _data()
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    return nn.functional.mse_loss(out.float(), y)


def _plant_inf(model: nn.Module) -> None:
    next(model.parameters()).grad[0, 0] = math.inf


def _run_both(scenario: Callable[[torch.amp.GradScaler], tuple[list[float], list[nn.Module]]]) -> None:
    torch_scales, torch_models = scenario(torch.amp.GradScaler("cpu", **SETTINGS))
    ours_scales, our_models = scenario(LossScaler("cpu", **SETTINGS))
    assert ours_scales == torch_scales
    for theirs, ours in zip(torch_models, our_models, strict=True):
        for a, b in zip(theirs.parameters(), ours.parameters(), strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
            assert torch.isfinite(b).all()


@pytest.mark.parametrize("fused", [(False, False), (True, False), (True, True)], ids=["plain", "mixed", "fused"])
def test_multiple_models_losses_and_optimizers(fused):
    """Two models, two losses, two optimizers (fused or not) and one update per iteration move like torch's."""

    def scenario(scaler: torch.amp.GradScaler) -> tuple[list[float], list[nn.Module]]:
        models = _models(2)
        optimizers = [
            torch.optim.Adam(m.parameters(), lr=0.01, fused=is_fused) for m, is_fused in zip(models, fused, strict=True)
        ]
        scales = []
        for iteration in range(ITERATIONS):
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            loss0, loss1 = _loss(models[0]), _loss(models[1])
            scaler.scale(loss0 + 0.5 * loss1).backward(retain_graph=True)
            scaler.scale(loss1).backward()
            if iteration in OVERFLOW_AT:
                _plant_inf(models[0])
            for optimizer in optimizers:
                scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales, models

    _run_both(scenario)


def test_an_optimizer_unscaled_found_to_overflow_and_not_stepped_still_backs_off():
    """An optimizer unscaled, found inf and never stepped makes the scale back off at update, as in torch."""

    def scenario(scaler: torch.amp.GradScaler) -> tuple[list[float], list[nn.Module]]:
        models = _models(2)
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
        scales = []
        for iteration in range(ITERATIONS):
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            scaler.scale(_loss(models[0]) + _loss(models[1])).backward()
            if iteration in OVERFLOW_AT:
                _plant_inf(models[1])
            scaler.unscale_(optimizers[1])
            scaler.step(optimizers[0])
            scaler.update()
            scales.append(scaler.get_scale())
        return scales, models

    _run_both(scenario)


def test_gradient_penalty_through_autograd_grad():
    """A penalty on scaled gradients from autograd.grad, unscaled by hand, trains like torch's recipe."""

    def scenario(scaler: torch.amp.GradScaler) -> tuple[list[float], list[nn.Module]]:
        (model,) = _models(1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        scales = []
        for iteration in range(ITERATIONS):
            optimizer.zero_grad(set_to_none=True)
            loss = _loss(model)
            scaled_grads = torch.autograd.grad(scaler.scale(loss), model.parameters(), create_graph=True)
            inv_scale = 1.0 / scaler.get_scale()
            penalty = sum((g * inv_scale).pow(2).sum() for g in scaled_grads).sqrt()
            scaler.scale(loss + penalty).backward()
            if iteration in OVERFLOW_AT:
                _plant_inf(model)
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales, [model]

    _run_both(scenario)


def test_gradient_accumulation_over_several_backwards():
    """Several scaled backwards accumulate into one step and one update, as in torch."""

    def scenario(scaler: torch.amp.GradScaler) -> tuple[list[float], list[nn.Module]]:
        (model,) = _models(1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        scales = []
        for iteration in range(ITERATIONS):
            optimizer.zero_grad(set_to_none=True)
            for _ in range(3):
                scaler.scale(_loss(model) / 3).backward()
            if iteration in OVERFLOW_AT:
                _plant_inf(model)
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales, [model]

    _run_both(scenario)


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_clipping_unscaled_gradients(fused):
    """unscale_, clip_grad_norm_ on true gradients, then step: the same as torch, fused optimizers included."""

    def scenario(scaler: torch.amp.GradScaler) -> tuple[list[float], list[nn.Module]]:
        (model,) = _models(1)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.05, fused=fused)
        scales = []
        for iteration in range(ITERATIONS):
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(_loss(model)).backward()
            if iteration in OVERFLOW_AT:
                _plant_inf(model)
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales, [model]

    _run_both(scenario)


def test_state_dict_round_trips_with_torch_in_both_directions():
    """torch's GradScaler loads LossScaler's state and LossScaler loads torch's, scale and tracker included."""
    ours = LossScaler("cpu", **SETTINGS)
    ours.load_state_dict({**torch.amp.GradScaler("cpu", **SETTINGS).state_dict(), "scale": 512.0, "_growth_tracker": 1})
    assert (ours.get_scale(), ours._get_growth_tracker()) == (512.0, 1)
    theirs = torch.amp.GradScaler("cpu", **SETTINGS)
    theirs.load_state_dict(ours.state_dict())
    assert (theirs.get_scale(), theirs._get_growth_tracker()) == (512.0, 1)
    back = LossScaler("cpu", **SETTINGS)
    back.load_state_dict(theirs.state_dict())
    assert back.state_dict()["scale"] == 512.0 and back.state_dict()["_growth_tracker"] == 1
