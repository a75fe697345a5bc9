"""O2's master parameters: the model's half parameters and their fp32 masters stay in step (edits of the half weights by
callbacks, ``load_state_dict`` and weight averaging reach the masters), a checkpoint holds the fp32 masters unrounded,
and weights no optimizer steps keep their fp32 values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import StochasticWeightAveraging
from torch import Tensor, nn

from tests.helpers import fit
from tests.policies.o2.helpers import HALF, PRECISIONS, STEPS, Net, StartWeights, converted, o2, snapshot


def test_o2_model_holds_half_weights_the_optimizer_the_same_objects_and_fp32_masters_wait_beside_them() -> None:
    """The model's chosen weights become half in place; the optimizer holds those very objects; each has an fp32
    master of equal value beside it, which teardown writes back into the same object in fp32."""
    model, plugin, optimizer = converted()
    params = optimizer.param_groups[0]["params"]
    assert params == list(model.parameters())
    assert model.net[0].weight.dtype == torch.bfloat16 and model.net[1].weight.dtype == torch.float32
    masters = plugin.policy.masters  # type: ignore[union-attr]
    assert {m.dtype for m in masters.master_params} == {torch.float32}
    assert torch.equal(masters.master_params[0].bfloat16(), model.net[0].weight)
    exact = masters.master_params[0].detach().clone()
    plugin.teardown()
    assert optimizer.param_groups[0]["params"] == list(model.parameters()) == params
    assert model.net[0].weight.dtype == torch.float32 and torch.equal(model.net[0].weight, exact)


def test_o2_state_dict_gives_fp32_masters_and_load_state_dict_restores_them_exactly() -> None:
    """While the model holds half weights, state_dict() is fp32 and load_state_dict sets the fp32 masters exactly."""
    model, plugin, _ = converted()
    fp32 = {name: torch.randn_like(value, dtype=torch.float32) for name, value in model.state_dict().items()}
    model.load_state_dict(fp32)
    assert all(value.dtype == torch.float32 for value in model.state_dict().values())
    assert all(torch.equal(model.state_dict()[name], value) for name, value in fp32.items())
    assert torch.equal(model.net[0].weight, fp32["net.0.weight"].bfloat16())
    plugin.teardown()
    assert all(torch.equal(model.state_dict()[name], value) for name, value in fp32.items())


def test_o2_an_edit_of_a_half_weight_reaches_its_master_and_a_swap_back_loses_no_bits() -> None:
    """An in-place edit of a half weight reaches its master; writing the same half values back keeps the fp32 bits."""
    model, plugin, _optimizer = converted()
    master = plugin.policy.masters.master_params[0]  # type: ignore[union-attr]
    before = master.detach().clone()
    with torch.no_grad():
        kept = model.net[0].weight.clone()
        model.net[0].weight.zero_()  # an EMA swap: other weights in, then the originals back
        model.net[0].weight.copy_(kept)
    assert torch.equal(model.state_dict()["net.0.weight"], before)
    with torch.no_grad():
        model.net[0].weight[0].fill_(0.5)
    edited = model.state_dict()["net.0.weight"]
    assert torch.equal(edited[0], torch.full((8,), 0.5)) and torch.equal(edited[1:], before[1:])
    plugin.teardown()


def test_o2_an_edit_of_a_half_weight_after_a_training_forward_survives_an_evaluation() -> None:
    """A weight written after a forward with gradients keeps its new value through a following evaluation forward,
    and the state dict gives it in fp32."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    plugin = o2()
    model = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin]).setup(net)
    model(torch.randn(2, 8)).sum()  # a forward with gradients whose loss is dropped: no backward, no step
    with torch.no_grad():
        net[0].weight.fill_(0.5)
        model(torch.randn(2, 8))
    assert net[0].weight.dtype == torch.bfloat16
    assert torch.equal(net.state_dict()["0.weight"], torch.full((16, 8), 0.5))
    plugin.teardown()
    assert net[0].weight.dtype == torch.float32 and torch.equal(net[0].weight, torch.full((16, 8), 0.5))


class ZeroHead(L.Callback):
    """Zeroes the head after the first batch, as a user's weight-editing callback would."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            with torch.no_grad():
                pl_module.net[3].weight.zero_()
                pl_module.net[3].bias.zero_()
            self.zeroed = snapshot(pl_module)["net.3.weight"]


def test_o2_keeps_weights_a_callback_edits_during_training() -> None:
    """A callback that zeroes the head mid-training: the next step starts from the zeroed fp32 weights."""
    model, callback = Net(optimizer="sgd"), ZeroHead()
    fit(model, o2(), max_steps=2, callbacks=[callback])
    # One SGD step from a zero head moves it by at most lr * |grad|: nowhere near the initial weights.
    assert model.net[3].weight.abs().max() < 0.1
    assert torch.equal(callback.zeroed, torch.zeros(4, 16))


class LoadsOnFitStart(Net):
    def __init__(self, weights: dict[str, Tensor]) -> None:
        super().__init__(optimizer="sgd")
        self.weights = weights
        self.seen_in_first_step: Tensor | None = None

    def on_fit_start(self) -> None:
        self.load_state_dict(self.weights)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        if batch_idx == 0:
            self.seen_in_first_step = self.net[0].weight.detach().float().clone()
        return super().training_step(batch, batch_idx)


def test_o2_trains_from_weights_loaded_in_on_fit_start() -> None:
    """load_state_dict in on_fit_start (after setup) decides the weights the first step computes with."""
    weights = {name: torch.full_like(value, 0.5) for name, value in Net().state_dict().items()}
    model = LoadsOnFitStart(weights)
    fit(model, o2(), max_steps=1)
    assert torch.equal(model.seen_in_first_step, torch.full((16, 8), 0.5))


class EditsWeightsInStep(Net):
    """Writes fp32 values into the model with load_state_dict inside training_step, before the forward."""

    def __init__(self, weights: dict[str, Tensor]) -> None:
        super().__init__(optimizer="sgd")
        self.weights = weights

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        if batch_idx == 1:
            self.load_state_dict(self.weights)
            self.in_step = {name: p.detach().clone() for name, p in self.named_parameters()}
        return super().training_step(batch, batch_idx)


def test_o2_load_state_dict_inside_training_step_decides_the_step_and_keeps_fp32_precision() -> None:
    """fp32 weights loaded inside training_step are what the forward computes with and what the step starts from."""
    weights = {name: torch.randn_like(value) for name, value in Net().state_dict().items()}
    model = EditsWeightsInStep(weights)
    stepped: dict[str, Tensor] = {}

    class Record(L.Callback):
        def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
            if trainer.global_step == 1:  # the state dict gives the fp32 masters
                stepped.update({name: p.detach().clone() for name, p in pl_module.state_dict().items()})

    fit(model, o2(), max_steps=2, callbacks=[Record()])
    assert model.in_step["net.0.weight"].dtype == torch.bfloat16
    assert torch.equal(model.in_step["net.0.weight"], weights["net.0.weight"].bfloat16())
    for name, value in weights.items():  # the masters the optimizer steps hold the loaded fp32 values, unrounded
        assert torch.equal(stepped[name], value), name


def test_o2_keeps_stochastic_weight_averaging_weights() -> None:
    """StochasticWeightAveraging's averaged weights are what the model holds after fit, in fp32: the average written
    into the half weights, within half a bf16 rounding of it."""
    model = Net(optimizer="sgd")
    averaged: dict[str, Tensor] = {}

    class Record(L.Callback):
        def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
            swa = next(c for c in trainer.callbacks if isinstance(c, StochasticWeightAveraging))
            averaged.update({n: p.detach().clone() for n, p in swa._average_model.named_parameters()})

    swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)
    fit(model, o2(), max_steps=3 * STEPS, max_epochs=3, callbacks=[swa, Record()])
    for name, parameter in model.named_parameters():
        assert parameter.dtype == torch.float32
        torch.testing.assert_close(parameter, averaged[name], rtol=2**-8, atol=0)


class Ema(L.Callback):
    """An exponential moving average of the weights, updated after every step."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        current = {name: p.detach() for name, p in pl_module.named_parameters()}
        if not hasattr(self, "average"):
            self.average = {name: p.clone() for name, p in current.items()}
        for name, p in current.items():
            self.average[name].lerp_(p, 0.5)


def test_o2_ema_callback_averages_the_weights_the_model_computes_with() -> None:
    """An EMA-style callback reads the model's weights after every step: the half weights, the stepped fp32 masters
    rounded, changing every step."""
    model, ema = Net(), Ema()
    fit(model, o2(), max_steps=3, callbacks=[ema])
    assert ema.average["net.0.weight"].dtype == torch.bfloat16  # the LayerNorm stays fp32
    assert not torch.equal(ema.average["net.0.weight"].float(), model.net[0].weight)
    assert (ema.average["net.0.weight"].float() - model.net[0].weight).abs().max() < 0.1


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_checkpoint_holds_the_model_fp32_weights_and_resume_is_exact(precision: str, tmp_path: Path) -> None:
    """A checkpoint holds the model's fp32 weights, unrounded; resuming continues from exactly them."""
    model = Net()
    trainer = fit(model, o2(precision), max_steps=STEPS)
    path = tmp_path / "o2.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["state_dict"]
    assert all(value.dtype == torch.float32 for value in saved.values())
    assert all(torch.equal(saved[name], value) for name, value in model.state_dict().items())
    assert not torch.equal(saved["net.0.weight"], saved["net.0.weight"].to(HALF[precision]).float())

    start = StartWeights()
    fit(Net(), o2(precision), max_steps=STEPS + 1, ckpt_path=path, callbacks=[start])
    assert all(torch.equal(start.weights[name], value) for name, value in saved.items())


class PartlyTrained(Net):
    """net.0 frozen, net.3 in no optimizer: only the LayerNorm trains."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        for parameter in self.net[0].parameters():
            parameter.requires_grad_(False)
        return torch.optim.SGD(self.net[1].parameters(), lr=0.1)


def test_o2_frozen_parameters_and_parameters_in_no_optimizer_keep_their_fp32_values() -> None:
    """A frozen layer and a layer no optimizer steps end fit with exactly their fp32 values; the rest trains."""
    model = PartlyTrained()
    before = snapshot(model)
    fit(model, o2(), max_steps=2)
    after = snapshot(model)
    for name in ("net.0.weight", "net.0.bias", "net.3.weight", "net.3.bias"):
        assert after[name].dtype == torch.float32 and torch.equal(after[name], before[name]), name
    assert not torch.equal(after["net.1.weight"], before["net.1.weight"])
    assert not model.net[0].weight.requires_grad and model.net[3].weight.requires_grad
