"""Bad numbers during real training: random inf/NaN losses and gradients are skipped, and a collapse stops the run."""

from __future__ import annotations

import math
import random
import warnings
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lightning_mp import LossScaleCollapseError, MixedPrecision
from tests.helpers import TinyRegressor, loader, make_trainer

STEPS = 300


class FaultyRegressor(TinyRegressor):
    """Makes the loss inf or NaN, or plants an inf or NaN gradient, at chosen steps; records every loss."""

    def __init__(self, faults: dict[int, str]) -> None:
        super().__init__(lr=0.02)
        self.faults = faults
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        fault = self.faults.get(self.global_step)
        if fault == "inf loss":
            loss = loss * math.inf
        elif fault == "nan loss":
            # Multiplied, not added: an added constant has no gradient, so backward would stay finite.
            loss = loss * math.nan
        return loss

    def on_after_backward(self) -> None:
        fault = self.faults.get(self.global_step)
        if fault == "inf grad":
            self.second.weight.grad[0, 3] = math.inf
        elif fault == "nan grad":
            self.first.bias.grad[5] = math.nan


class ParameterWatch(L.Callback):
    """After every step: every parameter is finite; records which steps were skipped."""

    def __init__(self) -> None:
        self.skipped_steps: list[int] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        for name, parameter in pl_module.named_parameters():
            assert torch.isfinite(parameter).all(), f"{name} is not finite after step {trainer.global_step - 1}"
        if trainer.precision_plugin.stats.last_step_skipped:
            self.skipped_steps.append(trainer.global_step - 1)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_random_faults_are_skipped_and_training_still_converges(precision):
    """8% of 300 steps get an inf/NaN loss or gradient: each is skipped, weights stay finite, the loss goes down."""
    rng = random.Random(precision)
    injected = sorted(rng.sample(range(STEPS), k=24))
    faults = {step: rng.choice(["inf loss", "nan loss", "inf grad", "nan grad"]) for step in injected}
    assert len(faults) / STEPS >= 0.05
    torch.manual_seed(0)
    model = FaultyRegressor(faults)
    watch = ParameterWatch()
    # max_scale keeps the scaled gradients of this model far from fp16's limit, so only the injected steps overflow.
    plugin = MixedPrecision(precision, init_scale=2.0**8, max_scale=2.0**8, growth_interval=5)
    make_trainer(plugin, max_steps=STEPS, callbacks=[watch]).fit(model, loader())

    assert watch.skipped_steps == injected
    assert plugin.stats.skipped_steps == len(injected)
    assert plugin.stats.optimizer_steps == STEPS
    clean = [loss for step, loss in enumerate(model.losses) if step not in faults]
    assert all(math.isfinite(loss) for loss in clean)
    first, last = sum(clean[:16]) / 16, sum(clean[-16:]) / 16
    assert last < 0.25 * first, f"the loss did not go down: {first:.3f} -> {last:.3f}"


class AlwaysInfinite(TinyRegressor):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * math.inf


@pytest.mark.parametrize(
    ("settings", "last_step"),
    [
        # 2**16 halves 40 times down to the collapse floor 2**-24; the 41st overflow would go below it.
        ({}, 41),
        # Hysteresis 3 absorbs two overflows; it refills only on growth, so each later overflow backs off:
        # 2**10 reaches min_scale=1 after 10 backoffs, and the next overflow raises.
        ({"init_scale": 2.0**10, "min_scale": 1.0, "hysteresis": 3}, 13),
    ],
)
def test_scale_collapse_raises_within_a_bounded_number_of_steps(settings, last_step):
    """Gradients that are always infinite end the run with LossScaleCollapseError, never skip forever."""
    plugin = MixedPrecision("16-mixed", **settings)
    with pytest.raises(LossScaleCollapseError, match="Loss scale collapse") as caught:
        make_trainer(plugin, max_steps=1000).fit(AlwaysInfinite(), loader())
    init_scale, floor = settings.get("init_scale", 2.0**16), settings.get("min_scale", 2.0**-24)
    bound = settings.get("hysteresis", 1) * (round(math.log2(init_scale / floor)) + 1)
    assert caught.value.step == last_step <= bound
    assert caught.value.scale == floor
    assert plugin.stats.skipped_steps == last_step
    assert ("first.weight", (16, 8)) in caught.value.nonfinite_parameters


def test_scale_collapse_in_warn_mode_warns_on_every_step_at_the_floor():
    """on_min_scale='warn' keeps training at the floor and warns on every further overflow, never silently."""
    plugin = MixedPrecision("16-mixed", init_scale=4.0, min_scale=1.0, on_min_scale="warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(plugin, max_steps=10).fit(AlwaysInfinite(), loader())
    floor_warnings = [w for w in caught if "at its floor" in str(w.message)]
    # 4 -> 2 -> 1 takes two overflows; the eight after them each warn.
    assert len(floor_warnings) == 8
    assert plugin.stats.loss_scale == 1.0
    assert plugin.stats.skipped_steps == 10


def test_nonfinite_input_in_one_layer_never_reaches_the_weights():
    """A NaN that enters through the data is skipped like any overflow; every weight stays finite."""

    class NaNInput(TinyRegressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            if self.global_step == 2:
                x = x.clone()
                x[0, 0] = math.nan
            return nn.functional.mse_loss(self(x).float(), y)

    model, watch = NaNInput(), ParameterWatch()
    plugin = MixedPrecision("16-mixed", init_scale=2.0**8)
    make_trainer(plugin, max_steps=5, callbacks=[watch]).fit(model, loader())
    assert watch.skipped_steps == [2]


# ------------------------------------------------------------------------ the defects of issue 9, plugin side
