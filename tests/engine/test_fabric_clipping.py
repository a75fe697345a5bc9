"""Clipping under Fabric: ``fabric.clip_gradients`` and a user's own unscale and clip see true gradients, and an
overflowing, NaN or infinite threshold never reaches the weights.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_mp import MixedPrecision
from tests.engine.fabric_helpers import batch, make_model, setup, train_step

pytestmark = pytest.mark.filterwarnings("ignore:.*opt_level='O3'")


def test_clip_gradients_sees_true_gradients() -> None:
    """fabric.clip_gradients returns the norm of the unscaled gradients and clips those, not the scaled ones."""
    plugin = MixedPrecision("16-mixed", init_scale=2.0**12)
    reference = make_model()
    fabric, model, optimizer = setup(plugin, copy.deepcopy(reference))
    x, y = batch(0)
    fabric.backward(nn.functional.mse_loss(model(x), y))
    with torch.autocast("cpu", dtype=torch.float16):
        nn.functional.mse_loss(reference(x).float(), y).backward()
    true_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()]))
    max_norm = float(true_norm) / 2
    total_norm = fabric.clip_gradients(model, optimizer, max_norm=max_norm)
    torch.testing.assert_close(total_norm, true_norm)
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    torch.testing.assert_close(clipped, torch.tensor(max_norm), rtol=1e-3, atol=0)
    optimizer.step()  # already unscaled: step must not unscale a second time
    assert plugin.stats.skipped_steps == 0


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("given", ["fabric_optimizer", "torch_optimizer"])
def test_a_users_unscale_then_torch_clipping_then_step_equals_fabric_clip_gradients(opt_level: str, given: str) -> None:
    """plugin.scaler.unscale_(optimizer), torch's clip_grad_norm_ of the model's parameters, then optimizer.step():
    the gradients are unscaled once, clipped true, and the weights end as with fabric.clip_gradients."""

    def run(users_unscale: bool) -> list[torch.Tensor]:
        plugin = MixedPrecision("16-mixed", init_scale=2.0**8, opt_level=opt_level)  # type: ignore[arg-type]
        fabric, model, optimizer = setup(plugin)
        for seed in range(3):
            x, y = batch(seed)
            fabric.backward(nn.functional.mse_loss(model(x), y))
            if users_unscale:
                plugin.scaler.unscale_(optimizer if given == "fabric_optimizer" else optimizer.optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.1)
            else:
                fabric.clip_gradients(model, optimizer, max_norm=0.1)
            optimizer.step()
            optimizer.zero_grad()
        assert plugin.stats.skipped_steps == 0
        return [value.clone() for value in model.state_dict().values()]  # O2's fp32 masters

    for actual, expected in zip(run(users_unscale=True), run(users_unscale=False), strict=True):
        assert actual.dtype == torch.float32 and torch.isfinite(actual).all()
        torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("given", ["fabric_optimizer", "torch_optimizer"])
def test_an_inf_found_by_a_users_unscale_skips_the_step(opt_level: str, given: str) -> None:
    """An inf gradient, then plugin.scaler.unscale_(optimizer) and optimizer.step(): skipped and counted, the weights
    and Adam's moments as they were."""
    plugin = MixedPrecision("16-mixed", init_scale=2.0**10, opt_level=opt_level)  # type: ignore[arg-type]
    fabric, model, optimizer = setup(plugin, optimizer="adam")
    train_step(fabric, model, optimizer, seed=0)
    weights = [value.clone() for value in model.state_dict().values()]
    moments = copy.deepcopy(optimizer.state_dict()["state"])
    x, y = batch(1)
    fabric.backward(nn.functional.mse_loss(model(x), y))
    next(model.parameters()).grad.view(-1)[0] = float("inf")
    plugin.scaler.unscale_(optimizer if given == "fabric_optimizer" else optimizer.optimizer)
    optimizer.step()
    for before, after in zip(weights, model.state_dict().values(), strict=True):
        assert torch.equal(before, after)
    for index, state in optimizer.state_dict()["state"].items():
        assert torch.equal(state["exp_avg"], moments[index]["exp_avg"])
    assert (plugin.stats.skipped_steps, plugin.stats.optimizer_steps) == (1, 2)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "32-true"])
@pytest.mark.parametrize("clip", [{"max_norm": 0.1}, {"clip_val": 0.01}])
def test_clipping_a_fused_optimizer_matches_the_foreach_one(precision: str, clip: dict[str, float]) -> None:
    """fabric.clip_gradients works with fused SGD: unscaled once, clipped, then stepped like foreach SGD."""
    runs = {}
    for kind in ("fused", "foreach"):
        plugin = MixedPrecision(precision, init_scale=2.0**12) if precision == "16-mixed" else MixedPrecision(precision)
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        module = make_model()
        sgd = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9, **{kind: True})
        model, optimizer = fabric.setup(module, sgd)
        norms = []
        for seed in range(3):
            x, y = batch(seed)
            fabric.backward(nn.functional.mse_loss(model(x), y))
            norms.append(fabric.clip_gradients(model, optimizer, **clip))
            optimizer.step()
            optimizer.zero_grad()
        assert plugin.stats.skipped_steps == 0
        runs[kind] = ([p.detach().clone() for p in model.parameters()], norms)
    for fused, foreach in zip(runs["fused"][0], runs["foreach"][0], strict=True):
        torch.testing.assert_close(fused, foreach)
    for fused_norm, foreach_norm in zip(runs["fused"][1], runs["foreach"][1], strict=True):
        torch.testing.assert_close(fused_norm, foreach_norm)
    untouched = make_model()
    assert not torch.equal(runs["fused"][0][0], next(untouched.parameters()))


def test_clipping_a_fused_optimizer_on_an_overflow_skips_the_step() -> None:
    """With fused Adam an inf gradient found at clipping time clips nothing, and the step leaves the weights."""
    plugin = MixedPrecision("16-mixed", init_scale=2.0**10)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    module = make_model()
    model, optimizer = fabric.setup(module, torch.optim.Adam(module.parameters(), lr=1e-2, fused=True))
    train_step(fabric, model, optimizer, seed=0)
    weights = [p.detach().clone() for p in model.parameters()]
    x, y = batch(1)
    fabric.backward(nn.functional.mse_loss(model(x), y))
    next(model.parameters()).grad.view(-1)[0] = float("inf")
    norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)
    optimizer.step()
    optimizer.zero_grad()
    assert float(norm) == 0.0
    assert all(torch.equal(before, after) for before, after in zip(weights, model.parameters(), strict=True))
    assert (plugin.stats.skipped_steps, plugin.stats.loss_scale) == (1, 2.0**9)


def test_clipping_an_overflowing_step_clips_nothing_and_the_step_is_skipped() -> None:
    """With Fabric's default error_if_nonfinite=True, clipping an inf step does not raise: it is skipped anyway."""
    plugin = MixedPrecision("16-mixed", init_scale=2.0**8)
    fabric, model, optimizer = setup(plugin)
    weights = [p.detach().clone() for p in model.parameters()]
    x, y = batch(0)
    fabric.backward(nn.functional.mse_loss(model(x), y))
    next(model.parameters()).grad.view(-1)[0] = float("inf")
    total_norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)
    optimizer.step()
    assert float(total_norm) == 0.0
    assert all(torch.equal(b, a) for b, a in zip(weights, model.parameters(), strict=True))
    assert plugin.stats.skipped_steps == 1


@pytest.mark.parametrize(
    ("precision", "opt_level"), [("16-mixed", "O1"), ("16-mixed", "O2"), ("bf16-mixed", "O1"), ("bf16-mixed", "lean")]
)
@pytest.mark.parametrize("fused", [False, True])
def test_clipping_by_value_on_an_overflowing_step_skips_it(precision: str, opt_level: str, fused: bool) -> None:
    """fabric.clip_gradients(clip_val=...) on a step with an inf gradient does not raise, and the step is skipped."""
    plugin = MixedPrecision(precision, opt_level=opt_level)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    module = make_model()
    model, optimizer = fabric.setup(module, torch.optim.Adam(module.parameters(), lr=1e-2, fused=fused))
    # state_dict(): the weights the optimizer steps (O2's fp32 masters, while the model holds their half copies).
    weights = [value.clone() for value in model.state_dict().values()]
    x, y = batch(0)
    fabric.backward(nn.functional.mse_loss(model(x).float(), y))
    next(model.parameters()).grad.view(-1)[0] = float("inf")
    fabric.clip_gradients(model, optimizer, clip_val=0.01)
    optimizer.step()
    optimizer.zero_grad()
    assert all(torch.equal(b, a) for b, a in zip(weights, model.state_dict().values(), strict=True))
    assert plugin.stats.skipped_steps == 1
    train_step(fabric, model, optimizer, seed=1)
    assert not torch.equal(weights[0], next(model.parameters()))


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "32-true"])
@pytest.mark.parametrize("kind", ["foreach", "fused"])
@pytest.mark.parametrize("clip", [{"max_norm": float("nan")}, {"clip_val": float("nan")}])
def test_a_nan_clipping_threshold_never_reaches_the_weights(precision: str, kind: str, clip: dict[str, float]) -> None:
    """fabric.clip_gradients with a NaN threshold makes the gradients NaN: that step is skipped, the weights stay."""
    plugin = MixedPrecision(precision)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    module = make_model()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1, **{kind: True}))
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batch(0)
    fabric.backward(nn.functional.mse_loss(model(x), y))
    fabric.clip_gradients(model, optimizer, **clip)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
    optimizer.zero_grad()
    for parameter, weight in zip(model.parameters(), before, strict=True):
        assert torch.equal(parameter, weight)
    assert plugin.stats.skipped_steps == 1
    # The host learns of a skip decided on the device only at the scale update; one decided on the host at once, and
    # says why. In bf16 and fp32 a foreach SGD is handed to the fused kernel: only fp16's foreach step is on the host.
    decided_on_host = kind != "fused" and precision == "16-mixed"
    assert any("clip_gradients made finite gradients inf or NaN" in str(w.message) for w in caught) == decided_on_host
    train_step(fabric, model, optimizer, seed=1)
    assert plugin.stats.skipped_steps == 1 and plugin.stats.consecutive_skips == 0


@pytest.mark.parametrize("clip", [{"max_norm": float("inf")}, {"clip_val": float("inf")}])
def test_an_infinite_clipping_threshold_clips_nothing_and_steps(clip: dict[str, float]) -> None:
    """fabric.clip_gradients with an infinite threshold (torch's idiom for 'norm only') steps as without clipping."""
    runs = []
    for clipped in (True, False):
        plugin = MixedPrecision("16-mixed", init_scale=2.0**8)
        fabric, model, optimizer = setup(plugin)
        x, y = batch(0)
        fabric.backward(nn.functional.mse_loss(model(x), y))
        if clipped:
            fabric.clip_gradients(model, optimizer, **clip)
        optimizer.step()
        assert plugin.stats.skipped_steps == 0
        runs.append([p.detach().clone() for p in model.parameters()])
    for clipped_weight, plain_weight in zip(*runs, strict=True):
        assert torch.equal(clipped_weight, plain_weight)
