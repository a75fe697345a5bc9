"""torch's own GradScaler tests (``test/test_torch.py``, ``test/test_cuda.py``: ``test_grad_scaling_*``), side by side.

The same scenario runs once with ``torch.amp.GradScaler("cpu")`` and once with ``LossScaler("cpu")`` at torch's
settings; both must give the same scales and the same weights. The adaptations against an unscaled control are in
``test_scaler_upstream.py``; ``tests/upstream_inventory/`` lists each upstream test as adapted, skipped, or
deliberately different, with the reason for each.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from lightning_mp import LossScaler
from lightning_mp._compat import FUSED_ADAGRAD_TAKES_FOUND_INF
from tests.scaling.test_scaler_upstream import ITERATIONS, OVERFLOW_AT, SETTINGS

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")


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
    """Two models, two losses, two optimizers (fused or not) and one update per iteration move like torch's.

    Upstream: test/test_torch.py test_grad_scaling_multiple (side by side with torch's scaler, fused Adam too).
    """

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
    """An optimizer unscaled, found inf and never stepped makes the scale back off at update, as in torch.

    Upstream: test/test_torch.py test_grad_scaling_multiple (its separately unscaled optimizer, here never stepped).
    """

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
    """A penalty on scaled gradients from autograd.grad, unscaled by hand, trains like torch's recipe.

    Upstream: test/test_torch.py test_grad_scaling_penalty (side by side with torch's scaler).
    """

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
    """Several scaled backwards accumulate into one step and one update, as in torch.

    Upstream: test/test_torch.py test_grad_scaling_accumulation (side by side with torch's scaler, with momentum).
    """

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
    """unscale_, clip_grad_norm_ on true gradients, then step: the same as torch, fused optimizers included.

    Upstream: test/test_torch.py test_grad_scaling_clipping_separate_unscale (side by side, fused Adam too).
    """

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
    """torch's GradScaler loads LossScaler's state and LossScaler loads torch's, scale and tracker included.

    Upstream: test/test_torch.py test_grad_scaling_state_dict (across the two classes).
    """
    ours = LossScaler("cpu", **SETTINGS)
    ours.load_state_dict({**torch.amp.GradScaler("cpu", **SETTINGS).state_dict(), "scale": 512.0, "_growth_tracker": 1})
    assert (ours.get_scale(), ours.state_dict()["_growth_tracker"]) == (512.0, 1)
    theirs = torch.amp.GradScaler("cpu", **SETTINGS)
    theirs.load_state_dict(ours.state_dict())
    assert (theirs.get_scale(), theirs.state_dict()["_growth_tracker"]) == (512.0, 1)
    back = LossScaler("cpu", **SETTINGS)
    back.load_state_dict(theirs.state_dict())
    assert back.state_dict()["scale"] == 512.0 and back.state_dict()["_growth_tracker"] == 1


FUSED_OPTIMIZERS = {
    "Adam": torch.optim.Adam,
    "AdamW": torch.optim.AdamW,
    "SGD": torch.optim.SGD,
    "Adagrad": torch.optim.Adagrad,
}


@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale-then-step"])
@pytest.mark.parametrize("name", list(FUSED_OPTIMIZERS))
@pytest.mark.parametrize("make_scaler", [torch.amp.GradScaler, LossScaler], ids=["torch", "ours"])
def test_a_grad_scale_set_on_a_fused_optimizer_divides_the_gradients_too(make_scaler, name, unscale_first):
    """A user's ``optimizer.grad_scale`` of 3 with a scale of 5 turns a gradient of 15 into 1, as in torch.

    Upstream: test/test_torch.py test_grad_scaler_pass_itself (the ``grad_scale``/``found_inf`` fused step it checks).
    """
    if name == "Adagrad" and not FUSED_ADAGRAD_TAKES_FOUND_INF:
        pytest.skip("torch<2.12's fused Adagrad is outside the fused-step protocol; torch's GradScaler fails it too")
    weight = torch.ones(5, 5, requires_grad=True)
    weight.grad = torch.full_like(weight, 15.0)
    optimizer = FUSED_OPTIMIZERS[name]([weight], lr=0.1, fused=True)
    scaler = make_scaler("cpu", init_scale=5.0)
    scaler.scale(torch.ones(5))  # the scale of the loss behind these gradients
    optimizer.grad_scale = torch.ones(1) * 3
    if unscale_first:
        scaler.unscale_(optimizer)
    scaler.step(optimizer)
    assert torch.equal(weight.grad, torch.ones_like(weight))
    assert not hasattr(optimizer, "grad_scale") and not hasattr(optimizer, "found_inf")  # torch removes both


class _DeclaresAmpScaling(torch.optim.Optimizer):
    """A custom optimizer that handles scaling itself (``_step_supports_amp_scaling``); it records what it was given."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {})
        self._step_supports_amp_scaling = True
        self.received: dict[str, Any] = {}


class _TakesTheScaler(_DeclaresAmpScaling):
    def step(self, closure: Any = None, *, grad_scaler: Any = None) -> None:
        self.received = {"grad_scaler": grad_scaler, "attributes": hasattr(self, "grad_scale")}
        grad_scaler.unscale_(self)  # the contract: the optimizer queries and unscales through the scaler itself


class _ReadsItsAttributes(_DeclaresAmpScaling):
    def step(self, closure: Any = None) -> None:
        (parameter,) = self.param_groups[0]["params"]
        self.received = {
            "grad_scale": self.grad_scale.clone(),
            "found_inf": self.found_inf.clone(),
            "grad": parameter.grad.clone(),
        }


@pytest.mark.parametrize("make_scaler", [torch.amp.GradScaler, LossScaler], ids=["torch", "ours"])
def test_a_custom_optimizer_declaring_amp_scaling_gets_torchs_fused_step(make_scaler):
    """step(grad_scaler=) receives the scaler (with torch's FutureWarning); one reading self.grad_scale gets the scale
    and found_inf tensors and still-scaled gradients; update then moves the scale.

    Upstream: test/test_torch.py test_grad_scaler_pass_itself.
    """
    weights = [torch.ones(2, requires_grad=True) for _ in range(2)]
    first, second = _TakesTheScaler([weights[0]]), _ReadsItsAttributes([weights[1]])
    scaler = make_scaler("cpu", init_scale=2.0, growth_interval=1)
    scaler.scale(sum(w.sum() * 3 for w in weights)).backward()
    with pytest.warns(FutureWarning, match="GradScaler is going to stop passing itself"):
        scaler.step(first)
    scaler.step(second)
    scaler.update()
    assert first.received == {"grad_scaler": scaler, "attributes": False}
    assert torch.equal(weights[0].grad, torch.full((2,), 3.0))  # unscaled by the optimizer's own call
    assert second.received["grad_scale"].item() == 2.0 and second.received["found_inf"].item() == 0.0
    assert torch.equal(second.received["grad"], torch.full((2,), 6.0))  # scaled: the optimizer unscales them
    assert not hasattr(second, "grad_scale") and not hasattr(second, "found_inf")
    assert scaler.get_scale() == 4.0


def test_unscale_finds_inf_and_nan_and_leaves_finite_gradients_unscaled():
    """unscale_ divides every gradient by the scale and reports a flag per optimizer when one holds inf or NaN.

    Upstream: test/test_torch.py test_grad_scaling_unscale (side by side with torch's scaler, three optimizers).
    """

    def scenario(scaler: torch.amp.GradScaler) -> tuple[list[float], list[nn.Module]]:
        models = _models(3)
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
        scaler.scale(sum(_loss(m) for m in models)).backward()
        next(models[1].parameters()).grad[0, 0] = math.inf
        next(models[2].parameters()).grad[0, 1] = math.nan
        expected = [[p.grad / 128.0 for p in m.parameters()] for m in models]
        for optimizer in optimizers:
            scaler.unscale_(optimizer)
        # torch's protocol getter, which fused optimizers read: the same on both classes.
        found = [sum(flag.item() for flag in scaler._found_inf_per_device(o).values()) for o in optimizers]
        for model, grads in zip(models, expected, strict=True):
            for parameter, grad in zip(model.parameters(), grads, strict=True):
                torch.testing.assert_close(parameter.grad, grad, equal_nan=True)
        for optimizer in optimizers:
            scaler.step(optimizer)
        scaler.update()
        assert found == [0.0, 1.0, 1.0]
        return [scaler.get_scale()], models[:1]

    _run_both(scenario)


@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale-then-step"])
@pytest.mark.parametrize("name", list(FUSED_OPTIMIZERS))
def test_fused_optimizers_under_autocast_train_as_with_torchs_scaler(name, unscale_first):
    """Fused Adam, AdamW, SGD and Adagrad under fp16 autocast move weights and scale as with torch's GradScaler.

    Upstream: test/test_torch.py test_grad_scaling_autocast (its fused forms, side by side with torch's scaler).
    """

    def scenario(scaler: torch.amp.GradScaler) -> tuple[list[float], list[nn.Module]]:
        (model,) = _models(1)
        optimizer = FUSED_OPTIMIZERS[name](model.parameters(), lr=0.05, fused=True)
        scales = []
        for iteration in range(ITERATIONS):
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(_loss(model)).backward()
            if iteration in OVERFLOW_AT:
                _plant_inf(model)
            if unscale_first:
                scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales, [model]

    _run_both(scenario)


@pytest.mark.parametrize("form", [{}, {"foreach": True}], ids=["default", "foreach"])
@pytest.mark.parametrize("optimizer_ctor", [torch.optim.Adam, torch.optim.AdamW], ids=["Adam", "AdamW"])
def test_adam_under_autocast_trains_as_with_torchs_scaler(optimizer_ctor, form):
    """Adam and AdamW (default and foreach) under fp16 autocast move weights and scale as with torch's GradScaler.

    Upstream: test/test_torch.py test_grad_scaling_autocast (Adam and AdamW, default and foreach). torch expects these
    to miss the fp32 control at 1e-3, so both scalers are compared with each other instead.
    """

    def scenario(scaler: torch.amp.GradScaler) -> tuple[list[float], list[nn.Module]]:
        (model,) = _models(1)
        optimizer = optimizer_ctor(model.parameters(), lr=0.05, **form)
        scales = []
        for iteration in range(ITERATIONS):
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(_loss(model)).backward()
            if iteration in OVERFLOW_AT:
                _plant_inf(model)
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales, [model]

    _run_both(scenario)
