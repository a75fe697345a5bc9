"""O2: the model computes with persistent half weights, the optimizer steps the original fp32 parameters (the masters),
one cast per weight per step links them, and every Lightning recipe that touches the weights (callbacks, param groups,
checkpoints, a second stage) sees the fp32 masters."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, EMAWeightAveraging, StochasticWeightAveraging
from lightning.pytorch.utilities import grad_norm
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecision
from lightning_mp.counting import count_python_calls, count_syncs_and_ops
from lightning_mp.inference import compare, to_inference
from lightning_mp.policies.o2 import HalfOverflowError, O2Policy, computes_weights_in_fp32
from tests.ddp_scripts.launch import reports, run
from tests.helpers import make_trainer
from tests.test_parity import train_and_validate

HALF = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
PRECISIONS = ["bf16-mixed", "16-mixed"]
STEPS = 4


def loader(steps: int = STEPS) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(steps * 8, 8, generator=generator)
    target = torch.randint(0, 4, (steps * 8,), generator=generator)
    return DataLoader(TensorDataset(features, target), batch_size=8)


class Net(L.LightningModule):
    """Linear, LayerNorm, ReLU, Linear with Adam; records the dtypes the weights had inside training_step."""

    def __init__(self, optimizer: str = "adam", inf_at: tuple[int, ...] = ()) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))
        self.optimizer = optimizer
        self.inf_at = inf_at
        self.dtypes_in_step: dict[str, torch.dtype] = {}
        self.output_dtype: torch.dtype | None = None

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.dtypes_in_step = {name: p.dtype for name, p in self.named_parameters()}
        features, target = batch
        logits = self(features)
        self.output_dtype = logits.dtype
        loss = F.cross_entropy(logits, target)
        return loss * float("inf") if batch_idx in self.inf_at else loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        features, target = batch
        self.log("val_loss", F.cross_entropy(self(features), target))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        factories = {
            "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
            "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
            "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
            "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        }
        return factories[self.optimizer](self.parameters())

    def train_dataloader(self) -> DataLoader:
        return loader()

    def val_dataloader(self) -> DataLoader:
        return loader(1)


def o2(precision: str = "bf16-mixed", **kwargs: Any) -> MixedPrecision:
    if precision == "16-mixed":
        kwargs.setdefault("init_scale", 2.0**10)
    return MixedPrecision(precision, opt_level="O2", **kwargs)  # type: ignore[arg-type]


def fit(
    model: L.LightningModule, plugin: Any = None, max_steps: int = STEPS, ckpt_path: Path | None = None, **kwargs: Any
) -> L.Trainer:
    trainer = make_trainer(plugin, max_steps=max_steps, **kwargs)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


def hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def snapshot(model: nn.Module) -> dict[str, Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


class StartWeights(L.Callback):
    """Records the model's state_dict when training starts (after setup and checkpoint restore)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.weights = snapshot(pl_module)


# ------------------------------------------------------------------------------------------------ the algorithm


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_computes_with_half_copies_and_keeps_fp32_parameters_grads_and_states(precision: str) -> None:
    """Inside the step the weights are half (norms fp32); the parameters, gradients and Adam states stay fp32."""
    model = Net()
    grads: list[torch.dtype] = []

    class GradDtypes(L.Callback):
        def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
            grads.extend(p.grad.dtype for p in pl_module.parameters())

    trainer = fit(model, o2(precision), max_steps=2, callbacks=[GradDtypes()])
    half = HALF[precision]
    assert model.dtypes_in_step["net.0.weight"] == model.dtypes_in_step["net.3.bias"] == half
    assert model.dtypes_in_step["net.1.weight"] == torch.float32
    assert model.output_dtype == half
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert set(grads) == {torch.float32} and len(grads) == 2 * 6
    optimizer = trainer.optimizers[0]
    assert optimizer.param_groups[0]["params"] == list(model.parameters())  # no master copies
    assert {v.dtype for p in model.parameters() for k, v in optimizer.state[p].items() if k != "step"} == {
        torch.float32
    }
    assert trainer.precision_plugin.stats.skipped_steps == 0


def hand_written_o2(dtype: torch.dtype, loss_scale: float) -> list[Tensor]:
    """The O2 algorithm by hand with public torch APIs: fp32 parameters, half copies for the forward under autocast."""
    model = Net()
    half_names = {"net.0.weight", "net.0.bias", "net.3.weight", "net.3.bias"}
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for features, target in loader():
        weights = {name: p.to(dtype) if name in half_names else p for name, p in model.named_parameters()}
        with torch.autocast("cpu", dtype=dtype):
            loss = F.cross_entropy(functional_call(model, weights, (features,)), target)
        (loss * loss_scale).backward()
        for parameter in model.parameters():
            parameter.grad.mul_(1.0 / loss_scale)
        optimizer.step()
        optimizer.zero_grad()
    return list(model.parameters())


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_matches_a_hand_written_o2_loop(precision: str) -> None:
    """After N steps the plugin's fp32 parameters equal those of O2 written out by hand with functional_call."""
    loss_scale = 2.0**10 if precision == "16-mixed" else 1.0
    model = Net()
    trainer = fit(model, o2(precision))
    assert trainer.precision_plugin.stats.skipped_steps == 0
    for got, want in zip(model.parameters(), hand_written_o2(HALF[precision], loss_scale), strict=True):
        torch.testing.assert_close(got, want)


def test_o2_keeps_batchnorm_fp32_and_its_running_statistics_learn() -> None:
    """BatchNorm keeps fp32 weights and running statistics and computes from half inputs; the model trains."""
    model = Net()
    model.net[1] = nn.BatchNorm1d(16)
    fit(model, o2(), max_steps=2)
    norm = model.net[1]
    assert model.dtypes_in_step["net.1.weight"] == torch.float32
    assert norm.weight.dtype == norm.running_mean.dtype == norm.running_var.dtype == torch.float32
    assert not torch.equal(norm.running_mean, torch.zeros(16))


def test_o2_keep_fp32_module_computes_in_fp32_and_leaves_no_hook() -> None:
    """A keep_fp32 layer keeps fp32 weights in the step and returns fp32; after fit no hook is left on the model."""
    model = Net()
    fit(model, o2(keep_fp32=["net.3"]), max_steps=2)
    assert model.dtypes_in_step["net.3.weight"] == torch.float32
    assert model.dtypes_in_step["net.0.weight"] == torch.bfloat16
    assert model.output_dtype == torch.float32
    assert hook_count(model) == 0


def test_o2_keep_fp32_regions_stay_attached_across_forwards_until_teardown() -> None:
    """Under Fabric the keep_fp32 region's hooks are attached once at setup, not per forward; teardown removes them."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    plugin = o2(keep_fp32=["2"])
    model = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin]).setup(net)
    hooks_after_setup = dict(net[2]._forward_pre_hooks)
    assert len(hooks_after_setup) == 1 and hook_count(net) == 2
    for _ in range(2):
        assert model(torch.randn(3, 4)).dtype == torch.float32
        assert dict(net[2]._forward_pre_hooks) == hooks_after_setup
    plugin.teardown()
    assert hook_count(net) == 0
    assert all(isinstance(p, nn.Parameter) and p.dtype == torch.float32 for p in net.parameters())


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
        optimizer.step()
        self.stepped_weight = optimizer.optimizer.param_groups[0]["params"][0].detach().clone()
        self.second_forward_weight = self.net[0].weight.detach().clone()


def test_o2_manual_optimization_recasts_after_a_step_inside_training_step() -> None:
    """In manual optimization a forward after optimizer.step() inside training_step sees the new weights, in half."""
    model = TwoForwards()
    fit(model, o2(), max_steps=2)
    # Inside training_step the model holds the half weights; the step wrote the stepped fp32 master into them.
    assert model.second_forward_weight.dtype == torch.bfloat16 and model.stepped_weight.dtype == torch.float32
    torch.testing.assert_close(model.second_forward_weight, model.stepped_weight.bfloat16(), rtol=0, atol=0)


class WeightsAtHooks(L.Callback):
    """Records, per hook of each training batch, the dtype of ``net.0.weight`` and whether the model's parameters
    are the ones the optimizer steps."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, torch.dtype, bool]] = []

    def record(self, hook: str, trainer: L.Trainer, pl_module: Any) -> None:
        stepped = [id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]]
        self.seen.append((hook, pl_module.net[0].weight.dtype, [id(p) for p in pl_module.parameters()] == stepped))

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
def test_o2_shows_half_weights_from_the_training_forward_to_the_step_and_fp32_masters_after_it(precision: str) -> None:
    """Between the training forward and the step the model holds its half weights; from the step on (hooks before
    it, gradient clipping, callbacks after the batch) the fp32 masters the optimizer steps."""
    recorder = WeightsAtHooks()
    fit(Net(), o2(precision), max_steps=2, callbacks=[recorder])
    half = HALF[precision]
    assert (
        recorder.seen
        == [
            ("before_backward", half, False),
            ("before_optimizer_step", torch.float32, True),
            ("batch_end", torch.float32, True),
        ]
        * 2
    )


def test_o2_a_training_step_that_returns_none_leaves_the_fp32_masters_in_the_model() -> None:
    """After a batch whose training_step returned None, callbacks (EMA, weight averaging) read the fp32 masters."""
    recorder = WeightsAtHooks()
    fit(SkipsBatchOne(), o2(), max_steps=3, callbacks=[recorder])
    assert [entry for entry in recorder.seen if entry[0] == "batch_end"] == [("batch_end", torch.float32, True)] * 3


class StepsInTrainingStep(TwoForwards):
    """Manual optimization: the training step takes the optimizer step, except for the second batch."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        if batch_idx != 1:
            super().training_step(batch, batch_idx)
            return
        self(batch[0])


def test_o2_manual_optimization_leaves_the_fp32_masters_in_the_model_after_a_step() -> None:
    """In manual optimization, callbacks after a batch whose training step stepped read the fp32 masters."""
    recorder = WeightsAtHooks()
    fit(StepsInTrainingStep(), o2(), max_steps=2, limit_train_batches=3, callbacks=[recorder])
    batch_ends = [(dtype, masters) for hook, dtype, masters in recorder.seen if hook == "batch_end"]
    assert batch_ends[0] == batch_ends[2] == (torch.float32, True)


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


# ------------------------------------------------------------------------------------------------ loss scaling


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_skips_an_injected_overflow_leaving_weights_and_optimizer_states_unchanged(precision: str) -> None:
    """An inf loss is skipped: fp32 weights and Adam states are as before; the other steps train."""
    model = Net(inf_at=(1,))
    states: dict[int, tuple[dict[str, Tensor], list[Tensor]]] = {}

    class Snapshots(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
            optimizer = trainer.optimizers[0]
            moments = [v.clone() for p in pl_module.parameters() for v in optimizer.state[p].values()]
            states[batch_idx] = (snapshot(pl_module), moments)

    trainer = fit(model, o2(precision), max_steps=3, callbacks=[Snapshots()])
    assert trainer.precision_plugin.stats.skipped_steps == 1
    (before, moments_before), (after, moments_after) = states[1], states[2]
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert all(torch.equal(a, b) for a, b in zip(moments_before, moments_after, strict=True))
    assert not torch.equal(after["net.0.weight"], snapshot(model)["net.0.weight"])


@pytest.mark.parametrize("optimizer", ["adam_fused", "adamw_foreach", "sgd"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_trains_with_fused_and_foreach_optimizers(optimizer: str, precision: str) -> None:
    """Fused and foreach optimizers step the fp32 parameters with fp32 gradients under O2, in fp16 and in bf16."""
    model = Net(optimizer=optimizer)
    initial = snapshot(model)
    clip = None if optimizer == "adam_fused" else 0.5
    trainer = fit(model, o2(precision), max_steps=2, gradient_clip_val=clip)
    assert trainer.precision_plugin.stats.skipped_steps == 0
    assert not torch.equal(model.net[0].weight, initial["net.0.weight"])
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ------------------------------------------------------------------------------------------------ what users rely on


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


def test_o2_keeps_stochastic_weight_averaging_weights() -> None:
    """StochasticWeightAveraging's averaged weights are what the model holds after fit, in fp32."""
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
        torch.testing.assert_close(parameter, averaged[name], rtol=0, atol=0)


class Backbone(Net):
    def __init__(self) -> None:
        super().__init__(optimizer="sgd")
        self.backbone = self.net[0]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_backbone_finetuning_unfreezes_and_trains_the_backbone(precision: str) -> None:
    """Lightning's BackboneFinetuning adds the backbone's group after setup; it trains in fp32 with no KeyError."""
    model = Backbone()
    initial = model.backbone.weight.detach().clone()
    finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=1.0)
    trainer = fit(model, o2(precision), max_steps=2 * STEPS, max_epochs=2, callbacks=[finetuning])
    groups = trainer.optimizers[0].param_groups
    assert len(groups) == 2 and model.backbone.weight in groups[1]["params"]
    assert model.backbone.weight.dtype == torch.float32
    assert not torch.equal(model.backbone.weight, initial)
    assert trainer.precision_plugin.stats.skipped_steps == 0


class AddsGroup(Net):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.net[0].parameters(), lr=0.1)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.trainer.optimizers[0]
        if batch_idx == 1:
            optimizer.add_param_group({"params": [*self.net[1].parameters(), *self.net[3].parameters()]})


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_add_param_group_after_setup_trains_the_new_fp32_parameters(precision: str) -> None:
    """optimizer.add_param_group after setup: the new parameters get fp32 gradients, are unscaled and step."""
    model = AddsGroup()
    head = model.net[3].weight.detach().clone()
    trainer = fit(model, o2(precision), max_steps=3)
    assert trainer.precision_plugin.stats.skipped_steps == 0
    assert model.net[3].weight.dtype == torch.float32
    assert not torch.equal(model.net[3].weight, head)
    assert torch.isfinite(model.net[3].weight).all()


class Ema(L.Callback):
    """An exponential moving average of the weights, updated after every step."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        current = {name: p.detach() for name, p in pl_module.named_parameters()}
        if not hasattr(self, "average"):
            self.average = {name: p.clone() for name, p in current.items()}
        for name, p in current.items():
            self.average[name].lerp_(p, 0.5)


def test_o2_ema_callback_averages_the_fp32_weights() -> None:
    """An EMA-style callback reads fp32 weights that change every step, not frozen or half copies."""
    model, ema = Net(), Ema()
    fit(model, o2(), max_steps=3, callbacks=[ema])
    assert {p.dtype for p in ema.average.values()} == {torch.float32}
    assert not torch.equal(ema.average["net.0.weight"], model.net[0].weight)
    assert (ema.average["net.0.weight"] - model.net[0].weight).abs().max() < 0.1


def test_o2_grad_norm_sees_every_gradient() -> None:
    """Lightning's grad_norm in on_before_optimizer_step sees all parameters' fp32 gradients."""
    norms: dict[str, Tensor] = {}

    class Norms(L.Callback):
        def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
            norms.update(grad_norm(pl_module, norm_type=2))

    model = Net()
    fit(model, o2("16-mixed"), max_steps=1, callbacks=[Norms()])
    assert len([key for key in norms if key != "grad_2.0_norm_total"]) == 6


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


class Explodes(Net):
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        if batch_idx == 1:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_after_fit_and_after_a_crash_the_model_is_fp32_without_hooks(precision: str) -> None:
    """After fit, or after an exception in fit, the model has fp32 parameters, fp32 state_dict and no hooks."""
    finished = Net()
    fit(finished, o2(precision, keep_fp32=["net.3"]), max_steps=2)
    crashed = Explodes()
    with pytest.raises(RuntimeError, match="boom"):
        fit(crashed, o2(precision, keep_fp32=["net.3"]), max_steps=3)
    for model in (finished, crashed):
        assert all(isinstance(p, nn.Parameter) and p.dtype == torch.float32 for p in model.parameters())
        assert {value.dtype for value in model.state_dict().values()} == {torch.float32}
        assert hook_count(model) == 0


@pytest.mark.parametrize("second", ["O2", "O1", "none"])
def test_o2_second_training_stage_starts_from_the_fp32_weights(second: str) -> None:
    """A second stage (a new O2 plugin, O1, or no plugin) starts from the exact fp32 weights and trains cleanly."""
    model = Net()
    fit(model, o2("16-mixed"), max_steps=2)
    after_first = snapshot(model)
    plugin = {"O2": o2("16-mixed"), "O1": MixedPrecision("16-mixed", init_scale=2.0**10), "none": None}[second]
    start = StartWeights()
    trainer = fit(model, plugin, max_steps=2, callbacks=[start])
    assert all(torch.equal(start.weights[name], after_first[name]) for name in after_first)
    if plugin is not None:
        assert trainer.precision_plugin.stats.skipped_steps == 0
    assert model.dtypes_in_step["net.0.weight"] == (torch.float16 if second == "O2" else torch.float32)
    assert not torch.equal(model.net[0].weight, after_first["net.0.weight"])


def test_o2_compare_after_fit_measures_against_fp32() -> None:
    """compare(model, to_inference(model), batch) after an O2 fit compares fp32 with fp16: the error is not 0."""
    model = Net()
    fit(model, o2("16-mixed"), max_steps=2)
    features = next(iter(loader()))[0]
    report = compare(model, to_inference(model, dtype=torch.float16), features, verbose=False)
    assert 0 < report.max_rel_error < 0.05


def test_o2_validation_uses_half_copies_and_leaves_fp32_parameters() -> None:
    """Validation and trainer.validate compute with half copies and leave the fp32 parameters untouched."""
    model = Net()
    trainer = fit(model, o2(), max_steps=2, limit_val_batches=1, num_sanity_val_steps=0)
    before = snapshot(model)
    trainer.validate(model, verbose=False)
    assert all(torch.equal(before[name], value) for name, value in snapshot(model).items())
    assert hook_count(model) == 0


class Recurrent(L.LightningModule):
    """Embedding, LSTM, Linear: the LSTM reads its weights from a cached list, not from its parameter slots."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(10, 8)
        self.rnn = nn.LSTM(8, 8, batch_first=True)
        self.head = nn.Linear(8, 10)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        tokens = batch[1].reshape(4, 2) % 10
        hidden, _ = self.rnn(self.embedding(tokens))
        self.hidden_dtype = hidden.dtype
        return F.cross_entropy(self.head(hidden).reshape(-1, 10), tokens.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return loader()


def test_o2_trains_a_recurrent_layer_in_half_with_fp32_weights() -> None:
    """An LSTM computes in half under O2 (autocast casts its weights per call) and its fp32 weights train."""
    model = Recurrent()
    initial = model.rnn.weight_ih_l0.detach().clone()
    trainer = fit(model, o2(), max_steps=2)
    assert model.hidden_dtype == torch.bfloat16 and model.rnn.weight_ih_l0.dtype == torch.float32
    assert not torch.equal(model.rnn.weight_ih_l0, initial)
    assert trainer.precision_plugin.stats.skipped_steps == 0


class Tied(Recurrent):
    """Embedding and head share one weight, as language models often do."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embedding.weight

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        tokens = batch[1].reshape(4, 2) % 10
        self.shared_copy_is_one_tensor = self.head.weight is self.embedding.weight
        return F.cross_entropy(self.head(self.embedding(tokens)).reshape(-1, 10), tokens.reshape(-1))


def test_o2_tied_weights_share_one_half_copy_and_stay_tied() -> None:
    """A weight shared by two modules is cast once per step, and after fit the two modules still share it."""
    model = Tied()
    initial = model.embedding.weight.detach().clone()
    fit(model, o2(), max_steps=2)
    assert model.shared_copy_is_one_tensor
    assert model.head.weight is model.embedding.weight and isinstance(model.head.weight, nn.Parameter)
    assert not torch.equal(model.embedding.weight, initial)


class WithFp64(Net):
    def __init__(self) -> None:
        super().__init__(optimizer="sgd")
        self.temperature = nn.Parameter(torch.ones((), dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x) / self.temperature.float()


def test_o2_fp64_parameter_stays_fp64() -> None:
    """An fp64 parameter is never cast to half: it stays fp64 inside the step and after, and it trains."""
    model = WithFp64()
    fit(model, o2("16-mixed"), max_steps=2)
    assert model.dtypes_in_step["temperature"] == torch.float64
    assert model.temperature.dtype == torch.float64
    assert model.temperature.item() != 1.0


def test_o2_fp16_refuses_a_weight_beyond_fp16_range_at_setup() -> None:
    """A finite fp32 weight beyond 65504 is reported by name before training, instead of becoming an inf fp16 copy."""
    model = Net()
    with torch.no_grad():
        model.net[3].weight[0, 0] = 1e5
    with pytest.raises(HalfOverflowError, match=r"net\.3\.weight \(max \|w\| = 1e\+05\).*bf16"):
        fit(model, o2("16-mixed"), max_steps=1)
    assert model.net[3].weight.dtype == torch.float32 and hook_count(model) == 0


class GrowsHead(L.Callback):
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            with torch.no_grad():
                pl_module.net[0].weight[0, 0] = 7e4


def test_o2_fp16_names_a_weight_that_grows_beyond_fp16_range_during_training() -> None:
    """A weight pushed beyond 65504 mid-training: the skipped step's report names it instead of blaming gradients."""
    with pytest.raises(HalfOverflowError, match=r"net\.0\.weight") as error:
        fit(Net(), o2("16-mixed"), max_steps=3, callbacks=[GrowsHead()])
    assert error.value.names == ["net.0.weight"]


def test_o2_bf16_accepts_large_weights() -> None:
    """bf16 has fp32's range: a weight of 1e5 is no overflow and trains."""
    model = Net()
    with torch.no_grad():
        model.net[3].weight[0, 0] = 1e5
    assert fit(model, o2("bf16-mixed"), max_steps=1).precision_plugin.stats.skipped_steps == 0


def test_o2_reused_plugin_holds_no_reference_to_the_previous_model() -> None:
    """A plugin reused for a second model lets the first one be garbage-collected."""
    plugin = o2()
    first = Net()
    trainer = fit(first, plugin, max_steps=1)
    references = [weakref.ref(first), weakref.ref(first.net[0]), weakref.ref(first.net[0].weight)]
    del first, trainer  # the Trainer refers to the model; the plugin must not
    gc.collect()
    assert [reference() for reference in references] == [None, None, None]
    second = Net()
    assert fit(second, plugin, max_steps=1).precision_plugin is plugin
    assert second.dtypes_in_step["net.0.weight"] == torch.bfloat16


def test_o2_policy_rejects_a_non_half_dtype() -> None:
    """O2 needs a half type; fp32 is refused with a message naming the value and what is allowed."""
    with pytest.raises(ValueError, match=r"half_dtype=torch.float32\) is not allowed: .*float16 or torch.bfloat16"):
        O2Policy(torch.float32)


@pytest.mark.slow
def test_o2_under_real_ddp_skips_an_overflow_on_one_rank_and_keeps_the_ranks_identical(tmp_path: Path) -> None:
    """Under strategy='ddp' an O2 fp16 overflow on rank 1 is skipped by both ranks, whose parameters stay equal."""
    run(["--strategy", "ddp", "--out", str(tmp_path), "--opt-level", "O2", "--inject-rank", "1", "--inject-at", "2"])
    ranks = reports(tmp_path)
    assert [step - 1 for step, _, skipped in ranks[0]["steps"] if skipped] == [2]
    assert ranks[0]["steps"] == ranks[1]["steps"]
    assert ranks[0]["stats"]["skipped_steps"] == 1 and ranks[0]["stats"]["optimizer_steps"] == 8
    assert len({checksum for rank in ranks for checksum in rank["checksums"]}) == 1


@pytest.mark.slow
def test_o2_under_real_ddp_all_reduces_half_gradients(tmp_path: Path) -> None:
    """Under strategy='ddp' (gloo, 2 ranks) O2's gradient buckets are half: at most 0.55x the bytes O1 all-reduces."""
    precision, reduced = "16-mixed", {}
    for opt_level in ("O1", "O2"):
        out = tmp_path / opt_level
        common = ["--strategy", "ddp", "--max-steps", "4", "--count-reduced-bytes"]
        run([*common, "--out", str(out), "--opt-level", opt_level, "--precision", precision])
        reduced[opt_level] = ranks = reports(out)
        assert ranks[0]["checksums"][0] == ranks[0]["checksums"][1]
        assert ranks[0]["reduced_bytes"] == ranks[1]["reduced_bytes"] > 0
    assert reduced["O1"][0]["reduced_dtypes"] == ["torch.float32"]
    assert reduced["O2"][0]["reduced_dtypes"] == [str(HALF[precision])]
    assert reduced["O2"][0]["reduced_bytes"] <= 0.55 * reduced["O1"][0]["reduced_bytes"]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_validation_loss_is_within_2_percent_of_o0_on_the_reference_task(precision: str) -> None:
    """On the reference task O2 ends within 2% of the fp32 baseline's validation loss, without a skipped step."""
    baseline = train_and_validate("32-true", "O0", steps=60)
    mixed = train_and_validate(precision, "O2", steps=60)
    assert abs(mixed["val_loss"] - baseline["val_loss"]) <= 0.02 * baseline["val_loss"]
    assert mixed["skipped_steps"] == 0


class ToggledGAN(L.LightningModule):
    """Lightning's GAN recipe (toggle, backward, step, zero_grad, untoggle per optimizer), optionally by closure."""

    def __init__(self, use_closure: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.generator = nn.Linear(8, 8)
        self.discriminator = nn.Linear(8, 1)
        self.use_closure = use_closure

    def _phase(self, optimizer: Any, loss_of: Any) -> None:
        self.toggle_optimizer(optimizer)

        def closure() -> Tensor:
            loss = loss_of()
            optimizer.zero_grad()
            self.manual_backward(loss)
            return loss

        if self.use_closure:
            optimizer.step(closure=closure)
        else:
            closure()
            optimizer.step()
        self.untoggle_optimizer(optimizer)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        x, _ = batch
        self._phase(opt_g, lambda: -self.discriminator(self.generator(x)).float().mean())
        fake = self.generator(x).detach()
        self._phase(
            opt_d,
            lambda: (self.discriminator(fake).float().square() + (self.discriminator(x).float() - 1).square()).mean(),
        )

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.generator.parameters(), lr=1e-2), torch.optim.SGD(
            self.discriminator.parameters(), lr=1e-2
        )


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
@pytest.mark.parametrize("use_closure", [False, True])
def test_o2_trains_a_toggled_gan_like_o1(precision, use_closure):
    """Under O2 the GAN recipe with toggle_optimizer trains both networks, as under O1 (within half precision)."""
    models = {}
    for opt_level in ("O1", "O2"):
        models[opt_level] = model = ToggledGAN(use_closure)
        plugin = MixedPrecision(precision, opt_level=opt_level, init_scale=2.0**8 if precision == "16-mixed" else None)
        make_trainer(plugin, max_steps=8).fit(model, loader())
    untrained = ToggledGAN()
    for name, parameter in models["O2"].named_parameters():
        assert not torch.equal(parameter, untrained.get_parameter(name)), f"{name} never trained"
        torch.testing.assert_close(parameter, models["O1"].get_parameter(name), rtol=2e-2, atol=2e-3)


class PerSampleGradNorms(Net):
    """Logs per-sample gradient norms of the head with torch.func inside training_step."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        features, target = batch
        head = self.net[3]
        params = {k: v.detach() for k, v in head.named_parameters()}
        hidden = self.net[:3](features).detach()

        def sample_loss(p: dict[str, Tensor], h: Tensor, t: Tensor) -> Tensor:
            return F.cross_entropy(functional_call(head, p, (h[None],)), t[None])

        grads = torch.func.vmap(torch.func.grad(sample_loss), in_dims=(None, 0, 0))(params, hidden, target)
        self.per_sample_norm = grads["weight"].flatten(1).norm(dim=1)
        return super().training_step(batch, batch_idx)


def test_o2_torch_func_in_the_step_trains() -> None:
    """torch.func (vmap of grad) inside training_step works under O2 as it is: no saved-tensor hook refuses it."""
    model = PerSampleGradNorms()
    fit(model, o2(), max_steps=2)
    assert model.per_sample_norm.shape == (8,) and torch.isfinite(model.per_sample_norm).all()


class Checkpointed(L.LightningModule):
    """A block under torch.utils.checkpoint (non-reentrant), or the same block run plainly."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
        self.head = nn.Linear(8, 4)
        self.checkpointed = checkpointed

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        features, target = batch
        hidden = checkpoint(self.block, features, use_reentrant=False) if self.checkpointed else self.block(features)
        return F.cross_entropy(self.head(hidden), target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_o2_activation_checkpointing_trains_exactly_as_without_it() -> None:
    """Non-reentrant activation checkpointing under O2 recomputes the block in backward and gives the same weights."""
    weights = []
    for checkpointed in (True, False):
        model = Checkpointed(checkpointed)
        make_trainer(o2(), max_steps=STEPS).fit(model, loader())
        assert all(p.dtype == torch.float32 for p in model.parameters())
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(weights[0], weights[1])
    assert not torch.equal(weights[0], torch.cat([p.detach().flatten() for p in Checkpointed(False).parameters()]))


# ------------------------------------------------------------------------------------------------ layers users have


class WithLayer(L.LightningModule):
    """A layer under test, then a plain linear head; records the head's and the layer's weight dtypes per step."""

    def __init__(self, layer: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer_name = layer
        self.layer = _LAYERS[layer]()
        self.head = nn.Linear(8, 4)
        self.weight_dtypes: list[tuple[torch.dtype, torch.dtype]] = []

    def forward(self, features: Tensor) -> Tensor:
        if isinstance(self.layer, nn.EmbeddingBag):
            hidden = self.layer((features.abs() * 3).long().clamp(max=9))
        elif isinstance(self.layer, nn.Embedding):
            hidden = self.layer((features.abs() * 3).long().clamp(max=9)).mean(1)
        else:
            hidden = self.layer(features)
        self.weight_dtypes.append((self.layer.weight.dtype, self.head.weight.dtype))
        return self.head(hidden)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        features, target = batch
        return F.cross_entropy(self(features).float(), target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


_LAYERS: dict[str, Any] = {
    "spectral_norm": lambda: nn.utils.spectral_norm(nn.Linear(8, 8)),
    "weight_norm": lambda: nn.utils.weight_norm(nn.Linear(8, 8)),
    "parametrizations.spectral_norm": lambda: nn.utils.parametrizations.spectral_norm(nn.Linear(8, 8)),
    "parametrizations.weight_norm": lambda: nn.utils.parametrizations.weight_norm(nn.Linear(8, 8)),
    "sparse_embedding": lambda: nn.Embedding(10, 8, sparse=True),
    "sparse_embedding_bag": lambda: nn.EmbeddingBag(10, 8, sparse=True),
    "lazy_linear": lambda: nn.LazyLinear(8),
}


def fit_layer(layer: str, precision: str, opt_level: str) -> WithLayer:
    model = WithLayer(layer)
    init_scale = 2.0**10 if precision == "16-mixed" else None
    plugin = MixedPrecision(precision, opt_level=opt_level, init_scale=init_scale)  # type: ignore[arg-type]
    make_trainer(plugin, max_steps=4).fit(model, loader())
    return model


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize(
    "layer", ["spectral_norm", "weight_norm", "parametrizations.spectral_norm", "parametrizations.weight_norm"]
)
def test_o2_trains_reparametrized_weights_in_fp32_like_o1(layer: str, precision: str) -> None:
    """A spectral- or weight-normalised layer (GAN discriminators) trains under O2 as under O1; the rest is half."""
    o1, o2_model = fit_layer(layer, precision, "O1"), fit_layer(layer, precision, "O2")
    assert o2_model.weight_dtypes[-1] == (torch.float32, HALF[precision])
    for name, tensor in o2_model.state_dict().items():
        assert tensor.dtype == torch.float32, name
        torch.testing.assert_close(tensor, o1.state_dict()[name], rtol=2e-2, atol=2e-3)
    assert not torch.equal(o2_model.head.weight, WithLayer(layer).head.weight)


class Scaled(nn.Linear):
    """A linear layer with a plain constant tensor attribute and parameters whose names end like weight norm's."""

    def __init__(self) -> None:
        super().__init__(8, 8)
        self.scale = torch.full((8,), 0.5)
        self.weight_v = nn.Parameter(torch.ones(8))
        self.bias_g = nn.Parameter(torch.ones(8))


def test_o2_tells_the_older_norm_hooks_from_plain_tensor_attributes() -> None:
    """The older weight and spectral norm hooks keep their layer's weights fp32 under O2; once removed, the layer
    gets half twins again; a layer with a constant tensor attribute of its own is not taken for one."""
    weight_norm = nn.utils.weight_norm(nn.Linear(8, 8))
    spectral_norm = nn.utils.spectral_norm(nn.Linear(8, 8))
    removed = nn.utils.remove_spectral_norm(nn.utils.spectral_norm(nn.Linear(8, 8)))
    model = nn.Sequential(weight_norm, spectral_norm, removed, Scaled())
    assert computes_weights_in_fp32(model) == {weight_norm, spectral_norm}


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("layer", ["sparse_embedding", "sparse_embedding_bag"])
def test_o2_trains_sparse_embeddings_with_sgd_like_o1(layer: str, precision: str) -> None:
    """Sparse embeddings train with SGD under O2, as under O1: their fp32 rows get sparse fp32 gradients."""
    o1, o2_model = fit_layer(layer, precision, "O1"), fit_layer(layer, precision, "O2")
    assert o2_model.weight_dtypes[-1] == (torch.float32, HALF[precision])
    assert not torch.equal(o2_model.layer.weight, WithLayer(layer).layer.weight)
    for name, parameter in o2_model.named_parameters():
        torch.testing.assert_close(parameter, o1.get_parameter(name), rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_trains_a_lazy_linear_with_half_copies_after_its_first_forward(precision: str) -> None:
    """A LazyLinear materialises in fp32 at its first forward and then computes with half copies, like O1 trains."""
    o1, o2_model = fit_layer("lazy_linear", precision, "O1"), fit_layer("lazy_linear", precision, "O2")
    assert o2_model.weight_dtypes[0] == (torch.float32, HALF[precision])
    assert o2_model.weight_dtypes[-1] == (HALF[precision], HALF[precision])
    assert o2_model.layer.weight.dtype == torch.float32 and o2_model.layer.weight.shape == (8, 8)
    for name, parameter in o2_model.named_parameters():
        torch.testing.assert_close(parameter, o1.get_parameter(name), rtol=2e-2, atol=2e-3)


# ------------------------------------------------------------------------------------------------ what a step costs


class WeightCasts(TorchDispatchMode):
    """Counts the reads of the given fp32 weights by ops that write half tensors (casts), and all ops."""

    def __init__(self, weights: list[Tensor]) -> None:
        super().__init__()
        self.pointers = {weight.untyped_storage().data_ptr() for weight in weights}
        self.casts = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        tensors = [t for t in tree_leaves((args, kwargs, output)) if isinstance(t, Tensor)]
        if any(t.dtype in HALF.values() for t in tensors):
            self.casts += sum(
                t.dtype == torch.float32 and t.untyped_storage().data_ptr() in self.pointers
                for t in tree_leaves((args, kwargs))
                if isinstance(t, Tensor)
            )
        return output


def fabric_step_counts(opt_level: str, precision: str) -> tuple[int, int, int, int]:
    """(weight casts in forward and backward, in the optimizer step, ops per step, Python calls per step)."""
    plugin = MixedPrecision(precision, opt_level=opt_level)  # type: ignore[arg-type]
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))
    weights = [model[0].weight, model[0].bias, model[3].weight, model[3].bias]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    model, optimizer = fabric.setup(model, optimizer)
    features, target = torch.randn(8, 8), torch.randint(0, 4, (8,))

    def forward_backward() -> None:
        fabric.backward(F.cross_entropy(model(features), target))

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(2):  # steady state
        forward_backward()
        step()
    with WeightCasts(weights) as in_forward_and_backward:
        forward_backward()
    with WeightCasts(weights) as in_step:
        step()
    with count_syncs_and_ops() as counts:
        forward_backward()
        step()
    with count_python_calls() as calls:
        forward_backward()
        step()
    plugin.teardown()
    return in_forward_and_backward.casts, in_step.casts, counts.ops, calls.python_calls


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_casts_each_weight_once_per_optimizer_step_and_never_in_forward_or_backward(precision: str) -> None:
    """Steady O2 steps cast no weight in forward or backward and each converted weight once at the step."""
    in_forward_and_backward, in_step, _, _ = fabric_step_counts("O2", precision)
    assert in_forward_and_backward == 0
    assert in_step == 4  # the two linears' weights and biases; the LayerNorm stays fp32


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_dispatches_no_more_ops_and_python_calls_per_step_than_o1(precision: str) -> None:
    """A steady O2 step dispatches no more ATen ops and makes no more Python calls than O1, whatever the model."""
    _, _, o1_ops, o1_calls = fabric_step_counts("O1", precision)
    _, _, o2_ops, o2_calls = fabric_step_counts("O2", precision)
    assert o2_ops <= o1_ops
    assert o2_calls <= o1_calls


# ------------------------------------------------------------------------------------------------ edits and checkpoints


def converted(precision: str = "bf16-mixed") -> tuple[Net, MixedPrecision, torch.optim.Optimizer]:
    """A Net converted by an O2 plugin outside any loop, with its optimizer connected (the Trainer's order), and its
    half weights in place, as a training forward leaves them for the backward."""
    model = Net()
    plugin = o2(precision)
    plugin.setup_for_device("cpu")
    plugin.convert_module(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plugin.connect(model, [optimizer], [])
    assert list(model.parameters()) == optimizer.param_groups[0]["params"]  # setup ends showing the masters
    with plugin.forward_context():
        pass
    return model, plugin, optimizer


def test_o2_model_holds_half_weights_and_the_optimizer_their_fp32_masters() -> None:
    """In a training forward the model's chosen weights are half twins; the optimizer steps fp32 masters of equal
    value, which the model shows again from setup to the first forward."""
    model, plugin, optimizer = converted()
    masters = optimizer.param_groups[0]["params"]
    assert model.net[0].weight.dtype == torch.bfloat16 and model.net[1].weight.dtype == torch.float32
    assert {p.dtype for p in masters} == {torch.float32}
    assert all(p is not q for p, q in zip(masters, model.parameters(), strict=True) if q.dtype == torch.bfloat16)
    assert torch.equal(masters[0].bfloat16(), model.net[0].weight)
    plugin.teardown()
    assert list(model.parameters()) == masters  # the original fp32 parameter objects are back


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
    model, plugin, optimizer = converted()
    master = optimizer.param_groups[0]["params"][0]
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
    """A weight written after a forward with gradients (the half weights stay until the step) keeps its new value
    through a following evaluation forward, and the model then shows it in fp32."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    plugin = o2()
    model = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin]).setup(net)
    model(torch.randn(2, 8)).sum()  # a forward with gradients whose loss is dropped: no backward, no step
    with torch.no_grad():
        net[0].weight.fill_(0.5)
        model(torch.randn(2, 8))
    assert net[0].weight.dtype == torch.float32
    assert torch.equal(net[0].weight, torch.full((16, 8), 0.5))
    plugin.teardown()


def test_o2_add_param_group_with_model_parameters_steps_their_masters() -> None:
    """A group added with the model's (half) parameters is pointed at their fp32 masters at the next step."""
    model, plugin, optimizer = converted()
    optimizer.param_groups[0]["params"] = optimizer.param_groups[0]["params"][:2]
    optimizer.add_param_group({"params": list(model.net[3].parameters())})
    policy = plugin.policy
    assert isinstance(policy, O2Policy)
    policy.prepare_step(optimizer)
    assert {p.dtype for p in optimizer.param_groups[1]["params"]} == {torch.float32}
    plugin.teardown()
    assert optimizer.param_groups[1]["params"] == list(model.net[3].parameters())


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
            if trainer.global_step == 1:
                stepped.update({name: p.detach().clone() for name, p in pl_module.named_parameters()})

    fit(model, o2(), max_steps=2, callbacks=[Record()])
    assert model.in_step["net.0.weight"].dtype == torch.bfloat16
    assert torch.equal(model.in_step["net.0.weight"], weights["net.0.weight"].bfloat16())
    for name, value in weights.items():  # the masters the optimizer steps hold the loaded fp32 values, unrounded
        assert torch.equal(stepped[name], value), name


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_a_skipped_step_leaves_masters_and_half_weights_unchanged(precision: str) -> None:
    """An inf step changes neither the fp32 masters nor the half weights the next forward computes with."""
    seen: dict[int, tuple[Tensor, Tensor]] = {}

    class Records(Net):
        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            master = self.trainer.optimizers[0].param_groups[0]["params"][0]
            seen[batch_idx] = (master.detach().clone(), self.net[0].weight.detach().clone())
            return super().training_step(batch, batch_idx)

    trainer = fit(Records(inf_at=(1,)), o2(precision), max_steps=3)
    assert trainer.precision_plugin.stats.skipped_steps == 1
    assert torch.equal(seen[1][0], seen[2][0]) and torch.equal(seen[1][1], seen[2][1])
    assert seen[2][1].dtype == HALF[precision] and torch.equal(seen[2][0].to(HALF[precision]), seen[2][1])
    assert not torch.equal(seen[0][0], seen[1][0])


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
    assert all(torch.equal(master.bfloat16(), twin) for master, twin in seen)
    assert not torch.equal(model.net[0].weight, initial)


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


def test_o2_fabric_optimizer_loaded_while_it_held_half_weights_continues_in_fp32_and_says_so(tmp_path: Path) -> None:
    """An optimizer built after fabric.setup_module and loaded before its first step warns and steps fp32 states."""
    features, target = torch.randn(8, 8), torch.randint(0, 4, (8,))
    states = []
    for run_index in range(2):
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[o2()])
        torch.manual_seed(0)
        model = fabric.setup_module(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
        optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
        if run_index == 1:
            fabric.load(tmp_path / "state.ckpt", {"optimizer": optimizer})
        fabric.backward(F.cross_entropy(model(features), target))
        if run_index == 1:
            with pytest.warns(UserWarning, match="rounded it to half; it continues in fp32"):
                optimizer.step()
        else:
            optimizer.step()
        states.append(optimizer.state_dict()["state"])
        fabric.save(tmp_path / "state.ckpt", {"optimizer": optimizer})
    assert {value.dtype for state in states[1].values() for key, value in state.items() if key != "step"} == {
        torch.float32
    }


def test_o2_fabric_trains_two_models_set_up_one_after_the_other() -> None:
    """Two models set up by one Fabric (a GAN's): both compute with half weights that follow their stepped masters."""
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[o2()])
    torch.manual_seed(0)
    models, optimizers = [], []
    for _ in range(2):
        network = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        model, optimizer = fabric.setup(network, torch.optim.SGD(network.parameters(), lr=0.1))
        models.append(model)
        optimizers.append(optimizer)
    features = torch.randn(8, 8)
    seen: list[list[Tensor]] = [[], []]
    for model, weights in zip(models, seen, strict=True):
        model.module[0].register_forward_pre_hook(
            lambda module, args, weights=weights: weights.append(module.weight.detach().clone())
        )
    initial = [[p.detach().clone() for group in o.param_groups for p in group["params"]] for o in optimizers]
    for _ in range(2):
        fabric.backward(models[1](models[0](features)).float().square().mean())
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for optimizer, before, weights in zip(optimizers, initial, seen, strict=True):
        masters = [p for group in optimizer.param_groups for p in group["params"]]
        assert all(p.dtype == torch.float32 and not torch.equal(p, q) for p, q in zip(masters, before, strict=True))
        assert weights[0].dtype == torch.bfloat16
        assert not torch.equal(weights[0], weights[1])  # the second forward computed with the stepped weights
    for model, optimizer in zip(models, optimizers, strict=True):
        state = model.state_dict()
        for name, master in zip(state, [p for group in optimizer.param_groups for p in group["params"]], strict=True):
            assert torch.equal(state[name], master.detach()), name


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


# ------------------------------------------------------------------------------------ forwards without gradients


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
    fit(reference, o2("16-mixed"))
    if where == "training_step":
        model = ProbesInTrainingStep(how)
        fit(model, o2("16-mixed"))
    else:
        model = Net()
        fit(model, o2("16-mixed"), callbacks=[ProbesBeforeBackward(how)])
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
    for features, target in loader(steps):
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
