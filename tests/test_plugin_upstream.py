"""Lightning's own AMP plugin scenarios (plugins/precision/test_amp*.py, manual optimization with 16-mixed), rewritten
for lightning_mp's MixedPrecision and run on the CPU with real fp16.

Where the expected behaviour differs on purpose (Lightning refuses to clip with a fused optimizer; this plugin
unscales first and clips), the test says so.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn

from lightning_mp import LossScaler, MixedPrecision
from tests.helpers import make_trainer


def _scaled_gradients(plugin: MixedPrecision, optimizer_class: type = torch.optim.SGD, **options: Any):
    """A layer whose gradients come from a loss scaled by the plugin's scaler, and its optimizer."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    optimizer = optimizer_class(layer.parameters(), lr=1.0, **options)
    loss = layer(torch.randn(8, 4)).pow(2).sum() * 100
    plugin.scaler.scale(loss).backward()
    return layer, optimizer


def _fp16_plugin() -> MixedPrecision:
    plugin = MixedPrecision("16-mixed", "cpu", init_scale=2.0**10)
    plugin.setup_for_device("cpu")
    return plugin


def test_clip_gradients_is_a_no_op_when_clipping_is_off():
    """clip_val=0 leaves the gradients exactly as they are (still scaled: nothing asked for true gradients)."""
    plugin = _fp16_plugin()
    layer, optimizer = _scaled_gradients(plugin)
    before = [p.grad.clone() for p in layer.parameters()]
    plugin.clip_gradients(optimizer)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, layer.parameters(), strict=True))


@pytest.mark.parametrize("algorithm", [GradClipAlgorithmType.VALUE, GradClipAlgorithmType.NORM])
def test_clip_gradients_by_value_and_by_norm_clip_the_true_gradients(algorithm):
    """Clipping by value bounds every true gradient entry; by norm bounds the true gradients' total norm."""
    plugin = _fp16_plugin()
    layer, optimizer = _scaled_gradients(plugin)
    true_grads = [p.grad / 2.0**10 for p in layer.parameters()]
    plugin.clip_gradients(optimizer, clip_val=1.0, gradient_clip_algorithm=algorithm)
    grads = [p.grad for p in layer.parameters()]
    if algorithm is GradClipAlgorithmType.VALUE:
        for grad, true in zip(grads, true_grads, strict=True):
            torch.testing.assert_close(grad, true.clamp(-1.0, 1.0))
    else:
        assert float(torch.cat([g.flatten() for g in true_grads]).norm()) > 1.0
        assert float(torch.cat([g.flatten() for g in grads]).norm()) == pytest.approx(1.0, rel=1e-4)


def test_a_fused_optimizer_clips_then_steps_without_unscaling_again():
    """Lightning refuses to clip a fused optimizer; this plugin unscales, clips, and the fused step uses those grads."""
    plugin = _fp16_plugin()
    layer, optimizer = _scaled_gradients(plugin, torch.optim.SGD, fused=True)
    before = [p.detach().clone() for p in layer.parameters()]
    plugin.clip_gradients(optimizer, clip_val=0.5, gradient_clip_algorithm=GradClipAlgorithmType.NORM)
    plugin.scaler.step(optimizer)
    plugin.scaler.update()
    update = torch.cat([(b - p.detach()).flatten() for b, p in zip(before, layer.parameters(), strict=True)])
    assert float(update.norm()) == pytest.approx(0.5, rel=1e-4)


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
def test_a_no_grad_forward_inside_the_forward_context_keeps_later_gradients(grad_mode):
    """A no_grad or inference_mode forward inside forward_context does not stop the next forward's gradients."""
    layer, x = nn.Linear(2, 1), torch.randn(1, 2)
    plugin = MixedPrecision("bf16-mixed", "cpu")
    plugin.setup_for_device("cpu")
    with plugin.forward_context():
        with grad_mode():
            layer(x)
        loss = layer(x).mean()
        loss.backward()
    assert loss.grad_fn is not None
    assert layer.weight.grad is not None


def test_autocast_context_manager_disables_the_cache():
    """Like Lightning's, the plugin's autocast runs without the weight-cast cache."""
    plugin = MixedPrecision("bf16-mixed", "cpu")
    with plugin.autocast_context_manager():
        assert not torch.is_autocast_cache_enabled()
    plugin.setup_for_device("cpu")
    with plugin.forward_context():
        assert torch.is_autocast_enabled("cpu") and not torch.is_autocast_cache_enabled()


class AdamBoringModel(BoringModel):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.fused = fused

    def configure_optimizers(self) -> Any:
        assert isinstance(self.trainer.precision_plugin.scaler, torch.amp.GradScaler)
        return torch.optim.Adam(self.parameters(), lr=1.0, fused=self.fused)


def test_fused_and_plain_adam_give_the_same_weights_in_fp16():
    """fp16 training with fused Adam and with plain Adam ends with the same weights."""

    def run(fused: bool) -> list[torch.Tensor]:
        L.seed_everything(1234)
        model = AdamBoringModel(fused)
        make_trainer(MixedPrecision("16-mixed", init_scale=2.0**8), max_steps=5).fit(model)
        return [p.detach() for p in model.parameters()]

    for plain, fused in zip(run(False), run(True), strict=True):
        torch.testing.assert_close(plain, fused)


class CountingLossScaler(LossScaler):
    """A real LossScaler that counts the calls the plugin makes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = {"unscale_": 0, "step": 0, "update": 0}

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.calls["unscale_"] += 1
        super().unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        self.calls["step"] += 1
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        self.calls["update"] += 1
        super().update(new_scale)


def test_a_skipped_training_step_skips_the_scaler_too():
    """A training_step returning None on odd batches: 5 batches, 3 unscale_/step/update, with clipping on."""

    class EvenBatchesOnly(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return None if batch_idx % 2 else super().training_step(batch, batch_idx)

    scaler = CountingLossScaler("cpu", init_scale=2.0**8)
    trainer = make_trainer(MixedPrecision("16-mixed", "cpu", scaler=scaler), max_steps=5, gradient_clip_val=0.5)
    trainer.fit(EvenBatchesOnly())
    assert scaler.calls == {"unscale_": 3, "step": 3, "update": 3}


class ManualOptModel(BoringModel):
    """Manual optimization, two SGD optimizers over the same layer, as in Lightning's manual-optimization tests."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.layer.parameters(), lr=0.1), torch.optim.SGD(self.layer.parameters(), lr=0.1)


def test_manual_optimization_steps_several_optimizers_over_shared_parameters():
    """opt_a.step(), then two retained backwards and opt_b.step(): runs in fp16, all weights stay finite."""

    class TwoSteps(ManualOptModel):
        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt_a, opt_b = self.optimizers()
            assert self.layer.weight.grad is None or torch.all(self.layer.weight.grad == 0)
            out = self(batch)
            self.manual_backward(self.loss(out))
            opt_a.step()
            out = self(batch)
            loss = self.loss(out)
            self.manual_backward(loss, retain_graph=True)
            self.manual_backward(loss, retain_graph=True)
            assert self.layer.weight.grad is not None
            opt_b.step()
            opt_b.zero_grad()

    model = TwoSteps()
    plugin = MixedPrecision("16-mixed", init_scale=2.0**8)
    make_trainer(plugin, max_steps=6, limit_train_batches=3).fit(model)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert plugin.stats.skipped_steps == 0


def test_manual_optimization_with_accumulated_gradients_steps_every_fourth_batch():
    """Stepping every 4th batch in fp16: weights change only on those batches, gradients are zeroed after them."""

    class Accumulating(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.weight_changed: list[bool] = []

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()
            before = self.layer.weight.detach().clone()
            self.manual_backward(self.loss(self(batch)) / 4)
            if (batch_idx + 1) % 4 == 0:
                opt.step()
                opt.zero_grad()
                assert self.layer.weight.grad is None or torch.all(self.layer.weight.grad == 0)
            self.weight_changed.append(not torch.equal(before, self.layer.weight))

    model = Accumulating()
    plugin = MixedPrecision("16-mixed", init_scale=2.0**8, growth_interval=1)
    make_trainer(plugin, max_epochs=1, max_steps=-1, limit_train_batches=8).fit(model)
    assert model.weight_changed == [False, False, False, True] * 2
    assert plugin.stats.loss_scale == 2.0**10  # two optimizer steps, two iterations that grew the scale


@pytest.mark.parametrize("manual", [False, True])
def test_gradient_accumulation_unscales_once_per_optimizer_step(manual):
    """accumulate_grad_batches=4 (or stepping every 4th batch by hand): one unscale_, step and update per 4 batches."""

    class Accumulating(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = not manual

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if not manual:
                return super().training_step(batch, batch_idx)
            opt = self.optimizers()
            self.manual_backward(self.loss(self(batch)) / 4)
            if (batch_idx + 1) % 4 == 0:
                self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
                opt.step()
                opt.zero_grad()
            return None

    scaler = CountingLossScaler("cpu", init_scale=2.0**8)
    options = {} if manual else {"accumulate_grad_batches": 4, "gradient_clip_val": 1.0}
    trainer = make_trainer(MixedPrecision("16-mixed", scaler=scaler), max_epochs=1, max_steps=-1, **options)
    trainer.fit(Accumulating(), train_dataloaders=BoringModel().train_dataloader())
    batches = len(BoringModel().train_dataloader())
    assert scaler.calls == {"unscale_": batches // 4, "step": batches // 4, "update": batches // 4}
