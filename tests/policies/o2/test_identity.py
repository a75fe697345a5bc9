"""One identity per parameter under O2: the model's parameters are the user's own, made half in place, and the very
objects the optimizer holds, from setup to teardown, at every hook; forwards without gradients, gradient accumulation,
manual optimization and LBFGS compute with the current weights."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging
from lightning.pytorch.utilities import grad_norm
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_mp import MixedPrecision
from tests.helpers import fit, hook_count
from tests.policies.o2.helpers import HALF, PRECISIONS, STEPS, Net, net_loader, o2, snapshot


class WeightsAtHooks(L.Callback):
    """Records, per hook of each training batch, the dtype of ``net.0.weight`` and whether the model's parameters
    are the very objects the optimizer holds."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, torch.dtype, bool]] = []

    def record(self, hook: str, trainer: L.Trainer, pl_module: Any) -> None:
        held = [id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]]
        self.seen.append((hook, pl_module.net[0].weight.dtype, [id(p) for p in pl_module.parameters()] == held))

    def on_before_backward(self, trainer: L.Trainer, pl_module: Any, loss: Tensor) -> None:
        self.record("before_backward", trainer, pl_module)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.record("before_optimizer_step", trainer, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.record("batch_end", trainer, pl_module)


class SkipsBatchOne(Net):
    """Its training_step returns None (no loss, no backward) for the second batch."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor | None:
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx == 1 else loss


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_parameters_are_the_optimizers_own_half_objects_at_every_hook_and_fp32_after_fit(precision: str) -> None:
    """At every hook of every batch the model's parameters are half and are the very objects the optimizer holds;
    after fit they are the same objects again, in fp32."""
    model = Net()
    before = list(model.parameters())
    recorder = WeightsAtHooks()
    fit(model, o2(precision), max_steps=2, callbacks=[recorder])
    half = HALF[precision]
    assert (
        recorder.seen
        == [("before_backward", half, True), ("before_optimizer_step", half, True), ("batch_end", half, True)] * 2
    )
    assert list(model.parameters()) == before and model.net[0].weight.dtype == torch.float32


def test_o2_a_training_step_that_returns_none_changes_no_parameter_object() -> None:
    """After a batch whose training_step returned None, the model's parameters are still the optimizer's."""
    recorder = WeightsAtHooks()
    fit(SkipsBatchOne(), o2(), max_steps=3, callbacks=[recorder])
    assert [entry for entry in recorder.seen if entry[0] == "batch_end"] == [("batch_end", torch.bfloat16, True)] * 3


class Accumulating(Net):
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.half_micro_batches = getattr(self, "half_micro_batches", 0) + (self.net[0].weight.dtype == torch.bfloat16)
        return super().training_step(batch, batch_idx)


def test_o2_gradient_accumulation_equals_one_big_batch_of_fp32_gradients() -> None:
    """With accumulate_grad_batches=2 each micro-batch computes in half and the fp32 gradients add up; 2 steps run."""
    model = Accumulating()
    trainer = fit(model, o2(), max_steps=2, accumulate_grad_batches=2)
    assert model.half_micro_batches == 4 and trainer.global_step == 2
    assert {p.dtype for p in model.parameters()} == {torch.float32}


class TwoForwards(Net):
    """Manual optimization: step, then a second forward that must see the stepped weights."""

    def __init__(self) -> None:
        super().__init__(optimizer="sgd")
        self.automatic_optimization = False
        self.second_forward_weight: Tensor | None = None
        self.stepped_weight: Tensor | None = None

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        optimizer = self.optimizers()
        features, target = batch
        optimizer.zero_grad()
        self.manual_backward(F.cross_entropy(self(features), target))
        before = self.net[0].weight.detach().clone()
        optimizer.step()
        masters = self.trainer.precision_plugin.policy.masters
        self.stepped_weight = masters.master_params[0].detach().clone()
        self.second_forward_weight = self.net[0].weight.detach().clone()
        assert not torch.equal(before, self.second_forward_weight)


def test_o2_manual_optimization_recasts_after_a_step_inside_training_step() -> None:
    """In manual optimization a forward after optimizer.step() inside training_step sees the new weights, in half:
    the stepped fp32 master rounded."""
    model = TwoForwards()
    trainer = fit(model, o2(), max_steps=2)
    assert model.second_forward_weight.dtype == torch.bfloat16 and model.stepped_weight.dtype == torch.float32
    torch.testing.assert_close(model.second_forward_weight, model.stepped_weight.bfloat16(), rtol=0, atol=0)
    assert trainer.precision_plugin.stats.optimizer_steps == 2


class StepsInTrainingStep(TwoForwards):
    """Manual optimization: the training step takes the optimizer step, except for the second batch."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        if batch_idx != 1:
            super().training_step(batch, batch_idx)
            return
        self(batch[0])


def test_o2_manual_optimization_keeps_the_optimizers_objects_in_the_model_after_a_step() -> None:
    """In manual optimization, callbacks after a batch whose training step stepped read the optimizer's parameters."""
    recorder = WeightsAtHooks()
    fit(StepsInTrainingStep(), o2(), max_steps=2, limit_train_batches=3, callbacks=[recorder])
    batch_ends = [(dtype, same) for hook, dtype, same in recorder.seen if hook == "batch_end"]
    assert batch_ends == [(torch.bfloat16, True)] * 3


class ReadsGradientsInTrainingStep(Net):
    """Manual optimization that reads and clips ``.grad`` itself, in on_after_backward and in training_step."""

    def __init__(self) -> None:
        super().__init__(optimizer="sgd")
        self.automatic_optimization = False
        self.norms_after_backward: list[float] = []
        self.norms_before_clipping: list[float] = []
        self.norms_after_clipping: list[float] = []

    def on_after_backward(self) -> None:
        self.norms_after_backward.append(float(grad_norm(self, norm_type=2)["grad_2.0_norm_total"]))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        optimizer = self.optimizers()
        features, target = batch
        optimizer.zero_grad()
        self.manual_backward(F.cross_entropy(self(features), target))
        self.norms_before_clipping.append(float(nn.utils.clip_grad_norm_(self.parameters(), 1e-3)))
        self.norms_after_clipping.append(float(nn.utils.get_total_norm([p.grad for p in self.parameters()])))
        optimizer.step()


def test_o2_manual_optimization_reads_and_clips_the_gradients_in_training_step() -> None:
    """After manual_backward, self.parameters() hold their (half) gradients; clipping them decides the step."""
    model = ReadsGradientsInTrainingStep()
    initial = model.net[0].weight.detach().clone()
    fit(model, o2(), max_steps=2)
    assert len(model.norms_after_backward) == 2 and all(norm > 0 for norm in model.norms_after_backward)
    assert model.norms_before_clipping == pytest.approx(model.norms_after_backward, rel=1e-4)
    assert model.norms_after_clipping == pytest.approx([1e-3] * 2, rel=1e-2)
    # Two SGD steps of lr 0.1 on gradients clipped to a norm of 1e-3 move no weight by more than 2e-4.
    assert 0 < (model.net[0].weight - initial).abs().max() <= 2e-4 * 1.01


class LBFGSNet(Net):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)


def test_o2_lbfgs_evaluates_its_closure_with_the_weights_it_moved_to() -> None:
    """LBFGS steps the fp32 masters several times per step; each closure computes with their current half values."""
    seen: list[tuple[Tensor, Tensor]] = []

    class Records(LBFGSNet):
        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            master = self.trainer.optimizers[0].param_groups[0]["params"][0]
            seen.append((master.detach().clone(), self.net[0].weight.detach().clone()))
            return super().training_step(batch, batch_idx)

    model = Records()
    initial = model.net[0].weight.detach().clone()
    trainer = fit(model, o2(), max_steps=2)
    assert trainer.precision_plugin.stats.skipped_steps == 0 and len(seen) > 2
    assert all(torch.equal(master.bfloat16(), model_param) for master, model_param in seen)
    assert not torch.equal(model.net[0].weight, initial)


def test_o2_an_lbfgs_closure_that_raises_mid_step_leaves_the_users_parameters_with_the_step_written() -> None:
    """LBFGS under Fabric moves the masters, then its third closure evaluation raises: the optimizer's groups hold
    the model's own half parameters again, and those hold the masters the failed step left, so the next forward
    computes with what the optimizer holds."""
    plugin = o2()
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    module, optimizer = fabric.setup(net, torch.optim.LBFGS(net.parameters(), lr=0.5, max_iter=4))
    features, target = torch.randn(16, 8), torch.randn(16, 4)
    initial = net[0].weight.detach().clone()
    evaluations = []

    def closure() -> Tensor:
        evaluations.append(net[0].weight.detach().clone())
        if len(evaluations) == 3:
            raise RuntimeError("the closure failed")
        optimizer.zero_grad()
        loss = (module(features).float() - target).square().mean()
        fabric.backward(loss)
        return loss

    with pytest.raises(RuntimeError, match="the closure failed"):
        optimizer.step(closure)
    held = [p for group in optimizer.optimizer.param_groups for p in group["params"]]
    assert all(a is b for a, b in zip(held, net.parameters(), strict=True))
    assert net[0].weight.dtype == HALF["bf16-mixed"]
    assert torch.equal(net[0].weight, evaluations[-1]) and not torch.equal(net[0].weight, initial)


def test_o2_validation_uses_half_copies_and_leaves_fp32_parameters() -> None:
    """Validation and trainer.validate compute with half copies and leave the fp32 parameters untouched."""
    model = Net()
    trainer = fit(model, o2(), max_steps=2, limit_val_batches=1, num_sanity_val_steps=0)
    before = snapshot(model)
    trainer.validate(model, verbose=False)
    assert all(torch.equal(before[name], value) for name, value in snapshot(model).items())
    assert hook_count(model) == 0


def test_o2_validation_computes_with_the_average_lightnings_weight_averaging_swaps_in() -> None:
    """EMAWeightAveraging swaps the average in through .data for validation: validation computes with it, in half."""
    seen: list[tuple[Tensor, Tensor]] = []

    class Records(Net):
        def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
            master = self.trainer.optimizers[0].param_groups[0]["params"][0]
            seen.append((master.detach().clone(), self.net[0].weight.detach().clone()))
            super().validation_step(batch, batch_idx)

    model = Records()
    fit(model, o2(), max_steps=2 * STEPS, max_epochs=2, callbacks=[EMAWeightAveraging(decay=0.5)])
    assert len(seen) >= 2  # the sanity check, then one validation per epoch
    for master, weight in seen:
        assert weight.dtype == torch.bfloat16 and torch.equal(master.bfloat16(), weight)


PROBES = ["no_grad", "eval_no_grad", "inference_mode"]


@contextlib.contextmanager
def without_gradients(model: nn.Module, how: str) -> Iterator[None]:
    """Gradients off for a metric or pseudo-label pass: ``torch.no_grad()``, also in eval mode, or inference mode."""
    if how == "inference_mode":
        with torch.inference_mode():
            yield
        return
    training = model.training
    model.train(how != "eval_no_grad")
    with torch.no_grad():
        yield
    model.train(training)


class ProbesBeforeBackward(L.Callback):
    """Runs the model without gradients in ``on_before_backward``, in the plugin's forward context (autocast)."""

    def __init__(self, how: str) -> None:
        self.how = how

    def on_before_backward(self, trainer: L.Trainer, pl_module: Any, loss: Tensor) -> None:
        with without_gradients(pl_module, self.how), trainer.precision_plugin.forward_context():
            pl_module(torch.randn(8, 8))


class ProbesInTrainingStep(Net):
    """Computes the loss, then runs the model without gradients before returning it."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        with without_gradients(self, self.how):
            self(batch[0])
        return loss


@pytest.mark.parametrize("where", ["on_before_backward", "training_step"])
@pytest.mark.parametrize("how", PROBES)
def test_o2_a_forward_without_gradients_before_backward_trains_as_without_it(where: str, how: str) -> None:
    """A forward without gradients between the training forward and its backward (in training_step, or in a hook
    under the plugin's forward context) leaves the backward working and the weights as a run without it gives."""
    reference = Net()
    fit(reference, o2("16-mixed"), max_steps=STEPS)
    if where == "training_step":
        model = ProbesInTrainingStep(how)
        fit(model, o2("16-mixed"), max_steps=STEPS)
    else:
        model = Net()
        fit(model, o2("16-mixed"), max_steps=STEPS, callbacks=[ProbesBeforeBackward(how)])
    for name, value in snapshot(reference).items():
        assert torch.equal(model.state_dict()[name], value), name


def fabric_o2_run(step: Any, steps: int = STEPS, opt_level: str = "O2") -> tuple[nn.Module, list[Tensor], list[Tensor]]:
    """A Fabric run of ``steps`` Adam steps of ``step(model, features, target) -> loss`` (called before backward);
    returns the model, its outputs with gradients and ``step``'s outputs."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))
    plugin = MixedPrecision("16-mixed", opt_level=opt_level, init_scale=2.0**10)  # type: ignore[arg-type]
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model, optimizer = fabric.setup(net, torch.optim.Adam(net.parameters(), lr=1e-2))
    outputs, probes = [], []
    for features, target in net_loader(steps):
        logits = model(features)
        outputs.append(logits.detach())
        probes.append(step(model, features))
        fabric.backward(F.cross_entropy(logits, target))
        optimizer.step()
        optimizer.zero_grad()
    assert plugin.stats.skipped_steps == 0
    plugin.teardown()
    return net, outputs, probes


@pytest.mark.parametrize("how", PROBES)
def test_o2_fabric_forward_without_gradients_before_backward_trains_as_without_it(how: str) -> None:
    """Under Fabric, model(x) without gradients between the training forward and fabric.backward computes what the
    training forward did, and the run ends with the weights of a run without it."""
    reference, reference_outputs, _ = fabric_o2_run(lambda model, features: None)

    def probe(model: nn.Module, features: Tensor) -> Tensor:
        with without_gradients(model, how):
            return model(features)

    net, outputs, probes = fabric_o2_run(probe)
    assert all(torch.equal(probe, output) for probe, output in zip(probes, outputs, strict=True))
    assert all(torch.equal(output, expected) for output, expected in zip(outputs, reference_outputs, strict=True))
    for name, value in snapshot(reference).items():
        assert torch.equal(net.state_dict()[name], value), name


def test_o2_fabric_edits_on_both_sides_of_a_forward_without_gradients_reach_the_step() -> None:
    """A weight set after the training forward, then changed after a forward without gradients in the same step,
    ends the run as in O1: neither edit is lost, whichever weights the model shows at the time."""

    def edit_probe_edit(model: nn.Module, features: Tensor) -> None:
        head = model.module[3]
        with torch.no_grad():
            head.bias.fill_(0.5)
            model(features)
            head.bias.add_(0.25)

    heads = [fabric_o2_run(edit_probe_edit, opt_level=level)[0][3].bias.detach() for level in ("O1", "O2")]
    assert heads[1].dtype == torch.float32
    torch.testing.assert_close(heads[1], heads[0], rtol=0, atol=1e-3)
    # Both edits, then one Adam step of about lr = 1e-2: losing either edit would be 0.25 or more away.
    torch.testing.assert_close(heads[1], torch.full_like(heads[1], 0.75), rtol=0, atol=0.03)


class PostHookRegisteredFirst(Net):
    """Registers a step post-hook in configure_optimizers, before the plugin connects the optimizer; the hook records
    whether the optimizer's groups hold the model's parameters and a copy of the first weight."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bool, Tensor]] = []

    def configure_optimizers(self) -> torch.optim.Optimizer:
        optimizer = super().configure_optimizers()
        optimizer.register_step_post_hook(lambda opt, args, kwargs: self.seen.append(post_hook_view(opt, self.net)))
        return optimizer

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.after_step = self.net[0].weight.detach().clone()


def post_hook_view(optimizer: torch.optim.Optimizer, net: nn.Module) -> tuple[bool, Tensor]:
    held = [p for group in optimizer.param_groups for p in group["params"]]
    return all(a is b for a, b in zip(held, net.parameters(), strict=True)), net[0].weight.detach().clone()


@pytest.mark.parametrize("front", ["trainer", "fabric"])
def test_o2_a_step_post_hook_registered_before_the_plugin_connects_sees_the_stepped_weights(front: str) -> None:
    """An EMA-style step post-hook the user registers first (in configure_optimizers, or after fabric.setup: the
    plugin connects at the first step there) runs after O2 finished the step: the groups hold the model's parameters
    and the weights it reads are the ones the step wrote, as at O1."""
    if front == "trainer":
        model = PostHookRegisteredFirst()
        fit(model, o2(), net_loader(), max_steps=2)
        (held, weight), final = model.seen[-1], model.after_step  # fit's end puts fp32 weights back
    else:
        plugin = o2()
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))
        module, optimizer = fabric.setup(net, torch.optim.Adam(net.parameters(), lr=1e-2))
        seen: list[tuple[bool, Tensor]] = []
        optimizer.optimizer.register_step_post_hook(lambda opt, args, kwargs: seen.append(post_hook_view(opt, net)))
        for _ in range(2):
            fabric.backward(F.cross_entropy(module(torch.randn(4, 8)).float(), torch.randint(0, 4, (4,))))
            optimizer.step()
            optimizer.zero_grad()
        (held, weight), final = seen[-1], net[0].weight.detach()
    assert held
    assert weight.dtype == HALF["bf16-mixed"] and torch.equal(weight, final)
