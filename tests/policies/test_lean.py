"""Lean: bf16 weights, gradients and optimizer states with stochastic rounding, in real Trainer runs."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import Callback, Trainer
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_mp import MixedPrecision
from lightning_mp.stochastic_rounding import STATE_KEY
from tests.helpers import make_trainer
from tests.policies.lean_helpers import (
    ELEMENTWISE_STATES,
    LeanNet,
    RecordStep,
    classification_loader,
)
from tests.test_parity import train_and_validate


@pytest.mark.parametrize("optimizer", ["adamw", "adamw-fused", "adam", "sgd"])
def test_lean_trains_in_bf16_with_fp32_norms_and_keep_fp32(optimizer: str) -> None:
    """Weights, gradients and optimizer states are bf16; the LayerNorm and a keep_fp32 head stay fp32; loss falls."""
    model = LeanNet(optimizer)
    plugin = MixedPrecision("bf16-mixed", opt_level="lean", keep_fp32=["head"])
    trainer = make_trainer(plugin, max_epochs=3, max_steps=-1)
    trainer.fit(model, classification_loader())
    optimizer_state = trainer.optimizers[0].state
    linear, norm, head = model.body[0].weight, model.body[1].weight, model.head.weight
    assert linear.dtype is torch.bfloat16 and linear.grad is not None and linear.grad.dtype is torch.bfloat16
    assert {value.dtype for key, value in optimizer_state[linear].items() if key in ELEMENTWISE_STATES} == {
        torch.bfloat16
    }
    for kept in (norm, head):
        assert kept.dtype is torch.float32 and kept.grad.dtype is torch.float32
        assert {value.dtype for key, value in optimizer_state[kept].items() if key in ELEMENTWISE_STATES} == {
            torch.float32
        }
    # The scheduler drives the same optimizer object: 12 steps of decay.
    base_lr = 3e-2 if "adam" in optimizer else 0.1
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(base_lr * 0.97**12)
    assert sum(model.losses[-4:]) < 0.8 * sum(model.losses[:4])


def test_a_skipped_step_changes_no_weight_and_no_state() -> None:
    """An inf gradient skips the step: bf16 weights, moments and step counts stay exactly as they were."""
    model = LeanNet(inject_at=(2,))
    plugin = MixedPrecision("bf16-mixed", opt_level="lean")
    recorder = RecordStep(batch=2)
    trainer = make_trainer(plugin, max_steps=4, callbacks=[recorder])
    trainer.fit(model, classification_loader())
    assert plugin.stats.skipped_steps == 1
    assert recorder.before.keys() == recorder.after.keys()
    for key, value in recorder.before.items():
        assert torch.equal(value, recorder.after[key]), key
    assert all(torch.isfinite(parameter).all() for parameter in model.parameters())


@pytest.mark.parametrize("algorithm", ["value", "norm"])
def test_an_inf_gradient_clipped_for_a_fused_optimizer_still_skips_the_step(algorithm: str) -> None:
    """Lean with fused AdamW and gradient clipping: an injected inf is caught before clipping, and the step skipped."""
    plugin = MixedPrecision("bf16-mixed", opt_level="lean")
    model = LeanNet("adamw-fused", inject_at=(2,))
    weights: dict[int, Tensor] = {}

    class RecordWeights(Callback):
        def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
            weights[trainer.global_step] = model.body[0].weight.detach().clone()

    trainer = make_trainer(
        plugin, max_steps=4, gradient_clip_val=0.01, gradient_clip_algorithm=algorithm, callbacks=[RecordWeights()]
    )
    trainer.fit(model, classification_loader())
    assert plugin.stats.skipped_steps == 1
    assert torch.equal(weights[2], weights[3])  # global_step counts the skipped step too
    assert torch.isfinite(model.body[0].weight).all() and not torch.equal(weights[1], weights[2])


@pytest.mark.parametrize("optimizer", ["adamw-fused", "sgd-fused", "adam"])
def test_a_skipped_fabric_step_changes_no_weight_or_state(optimizer: str) -> None:
    """Lean under Fabric, clipped: an inf gradient skips the step; weights, states and Kahan buffers stay put."""
    from lightning.fabric import Fabric

    plugin = MixedPrecision("bf16-mixed", opt_level="lean-kahan")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    module = LeanNet()
    make = {
        "adamw-fused": lambda: torch.optim.AdamW(module.parameters(), lr=3e-2, fused=True),
        "sgd-fused": lambda: torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9, fused=True),
        "adam": lambda: torch.optim.Adam(module.parameters(), lr=3e-2),
    }
    model, fabric_optimizer = fabric.setup(module, make[optimizer]())
    batches = list(classification_loader())

    def step(index: int, inject: bool = False) -> None:
        features, target = batches[index]
        fabric.backward(F.cross_entropy(model(features).float(), target))
        if inject:
            module.body[0].weight.grad[0, 0] = float("inf")
        fabric.clip_gradients(model, fabric_optimizer, max_norm=1.0)
        fabric_optimizer.step()
        fabric_optimizer.zero_grad()

    step(0)
    before = copy.deepcopy(fabric_optimizer.state_dict())
    weights = [parameter.detach().clone() for parameter in module.parameters()]
    step(1, inject=True)
    after = fabric_optimizer.state_dict()
    assert plugin.stats.skipped_steps == 1
    assert all(torch.equal(w, p) for w, p in zip(weights, module.parameters(), strict=True))
    for index, state in before["state"].items():
        for key, value in state.items():
            assert torch.equal(value, after["state"][index][key]), key
    step(2)
    assert not torch.equal(weights[0], module.body[0].weight)
    drawn = fabric_optimizer.state_dict()[STATE_KEY]["generators"]["cpu"]
    assert not torch.equal(after[STATE_KEY]["generators"]["cpu"], drawn)  # a clean step draws random numbers


def test_persistent_bytes_per_parameter_are_8_and_10_with_kahan() -> None:
    """Weight, gradient and AdamW moments take 8 bytes per parameter; Kahan compensation adds 2."""
    for opt_level, expected in (("lean", 8), ("lean-kahan", 10)):
        model = LeanNet(norm=False)
        trainer = make_trainer(MixedPrecision("bf16-mixed", opt_level=opt_level), max_steps=2)
        trainer.fit(model, classification_loader())
        state = trainer.optimizers[0].state
        total = 0
        for parameter in model.parameters():
            total += parameter.nbytes + (parameter.grad.nbytes if parameter.grad is not None else 0)
            total += sum(value.nbytes for key, value in state[parameter].items() if key in ELEMENTWISE_STATES)
        assert total == expected * sum(parameter.numel() for parameter in model.parameters())


def test_unsupported_settings_are_refused_with_clear_errors() -> None:
    """fp16, fp32 and optimizers other than Adam, AdamW and SGD are refused, naming what is allowed."""
    for precision in ("16-mixed", "32-true"):  # refused at construction, not first at fit
        with pytest.raises(ValueError, match=f"precision='{precision}'.*Use precision='bf16-mixed'"):
            MixedPrecision(precision, opt_level="lean-kahan")
    trainer = make_trainer(MixedPrecision("bf16-mixed", opt_level="lean"), max_steps=1)
    with pytest.raises(TypeError, match="RMSprop"):
        trainer.fit(LeanNet("rmsprop"), classification_loader())


@pytest.mark.parametrize("opt_level", ["lean", "lean-kahan"])
def test_lean_with_fp16_is_refused_when_the_plugin_is_built(opt_level: str) -> None:
    """MixedPrecision("16-mixed", opt_level="lean") fails in the constructor, naming both arguments and the fix."""
    with pytest.raises(ValueError, match=rf"precision='16-mixed', opt_level='{opt_level}'.*'bf16-mixed'"):
        MixedPrecision("16-mixed", opt_level=opt_level)


def test_the_policy_hooks_drive_lean_without_a_trainer() -> None:
    """Driven only through the policy hooks, as Fabric does, the user's optimizer steps bf16 weights unbiasedly."""
    plugin = MixedPrecision("bf16-mixed", opt_level="lean")
    plugin.setup_for_device("cpu")
    assert plugin.policy is not None
    torch.manual_seed(0)
    model = plugin.policy.convert_module(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    (connected,) = plugin.policy.connect(model, [optimizer])
    assert connected is optimizer
    before = model[0].weight.detach().clone()
    model(torch.randn(2, 4)).float().square().sum().backward()
    optimizer.step()
    assert model[0].weight.dtype is torch.bfloat16 and not torch.equal(before, model[0].weight)
    assert STATE_KEY in optimizer.state_dict()


def test_optimizers_connected_one_at_a_time_all_keep_stochastic_rounding() -> None:
    """Two optimizers connected separately, as Fabric connects a GAN's, both round stochastically."""
    plugin = MixedPrecision("bf16-mixed", opt_level="lean")
    plugin.setup_for_device("cpu")
    assert plugin.policy is not None
    weights = [nn.Parameter(torch.ones(1000, dtype=torch.bfloat16)) for _ in range(2)]
    optimizers = [torch.optim.SGD([weight], lr=1e-4) for weight in weights]
    for optimizer in optimizers:
        plugin.policy.connect(nn.Module(), [optimizer])
    plugin.policy.connect(nn.Module(), optimizers)  # again: no second set of hooks
    for weight, optimizer in zip(weights, optimizers, strict=True):
        weight.grad = -torch.ones_like(weight)
        optimizer.step()
        # 1e-4 is 1.3% of the bf16 gap above 1.0: round-to-nearest would move nothing, a double step twice as much.
        assert weight.double().mean().item() - 1.0 == pytest.approx(1e-4, rel=0.5)


@pytest.fixture(scope="module")
def reference_losses() -> dict[str, float]:
    return {
        level: train_and_validate(precision, level, steps=60)["val_loss"]
        for precision, level in (("32-true", "O0"), ("bf16-mixed", "O1"))
    }


@pytest.mark.slow
@pytest.mark.parametrize("opt_level", ["lean", "lean-kahan"])
def test_lean_reaches_the_validation_loss_of_o0_and_o1(reference_losses: dict[str, float], opt_level: str) -> None:
    """On the reference task (60 steps), lean ends within 2% of O0's and 1% of O1's validation loss, never skipping."""
    lean = train_and_validate("bf16-mixed", opt_level, steps=60)
    assert abs(lean["val_loss"] - reference_losses["O0"]) <= 0.02 * reference_losses["O0"]
    assert abs(lean["val_loss"] - reference_losses["O1"]) <= 0.01 * reference_losses["O1"]
    assert lean["skipped_steps"] == 0


def test_lean_under_fabric_trains_bf16_weights_skips_and_resumes_exactly(tmp_path: Path) -> None:
    """Fabric's own loop with lean: bf16 weights, an inf step skipped, and fabric.save/load continues bit for bit."""

    def run(steps: range, checkpoint: Path | None = None, resume: Path | None = None) -> tuple[MixedPrecision, Any]:
        plugin = MixedPrecision("bf16-mixed", opt_level="lean")
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2))
        state = {"model": model, "optimizer": optimizer, "precision": plugin}
        if resume is not None:
            fabric.load(resume, state)
        for step in steps:
            generator = torch.Generator().manual_seed(step)
            features, target = torch.randn(8, 8, generator=generator), torch.randn(8, 1, generator=generator)
            fabric.backward(F.mse_loss(model(features).float(), target))
            if step == 2:
                model.module[0].weight.grad[0, 0] = float("inf")
            optimizer.step()
            optimizer.zero_grad()
        if checkpoint is not None:
            fabric.save(checkpoint, state)
        return plugin, model

    path = tmp_path / "lean.ckpt"
    straight, straight_model = run(range(8))
    run(range(5), checkpoint=path)
    resumed, resumed_model = run(range(5, 8), resume=path)
    assert all(parameter.dtype is torch.bfloat16 for parameter in straight_model.parameters())
    assert straight.stats.skipped_steps == 1 and resumed.stats == straight.stats
    for expected, actual in zip(straight_model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(expected, actual)
