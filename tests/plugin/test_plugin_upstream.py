"""Lightning's own tests of its AMP plugin, rewritten for lightning_mp's MixedPrecision under the Trainer, on the CPU.

The sources are ``tests_pytorch/plugins/precision/test_amp.py``, ``test_amp_integration.py`` and ``test_all.py``,
``tests_pytorch/plugins/test_amp_plugins.py``, and the fp16 tests of
``tests_pytorch/trainer/optimization/test_manual_optimization.py``. Lightning runs most of them on a GPU with mocks
in place of the scaler. Here they run with real fp16 on the CPU and a real LossScaler; a scaler that counts its calls
is a LossScaler subclass. Every test names the upstream test it adapts. ``tests/upstream_inventory/`` lists each
upstream test as adapted, skipped or deliberately different, with the reason for each. One example: Lightning refuses
to clip the gradients of a fused optimizer, while this plugin unscales them first and then clips.

Lightning runs its tests at its one AMP level. The Trainer scenarios that train here also run at the fp16 opt levels
that change where the gradients live (O2's fp32 masters, O3's half weights), because a recipe can break at an opt
level it was never tested at.
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
from lightning_mp.scaling.steps import Phase
from tests.helpers import make_trainer

pytestmark = pytest.mark.filterwarnings("ignore:.*opt_level='O3' trains pure")


SCALED_LEVELS = ["O1", "O2"]
"""The fp16 opt levels that scale the loss by default (O3 scales only with a static ``loss_scale``)."""
FP16_LEVELS = ["O1", "O2", "O3"]


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
    """clip_val=0 leaves the gradients exactly as they are (still scaled: nothing asked for true gradients).

    Upstream: tests_pytorch/plugins/precision/test_amp.py test_clip_gradients (without mocks: the gradients themselves).
    """
    plugin = _fp16_plugin()
    layer, optimizer = _scaled_gradients(plugin)
    before = [p.grad.clone() for p in layer.parameters()]
    plugin.clip_gradients(optimizer)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, layer.parameters(), strict=True))


@pytest.mark.parametrize("algorithm", [GradClipAlgorithmType.VALUE, GradClipAlgorithmType.NORM])
def test_clip_gradients_by_value_and_by_norm_clip_the_true_gradients(algorithm):
    """Clipping by value bounds every true gradient entry; by norm bounds the true gradients' total norm.

    Upstream: tests_pytorch/plugins/precision/test_amp.py test_clip_gradients (without mocks: the gradients themselves).
    """
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
    """Lightning refuses to clip a fused optimizer; this plugin unscales, clips, and the fused step uses those grads.

    Upstream: tests_pytorch/plugins/precision/test_amp.py test_optimizer_amp_scaling_support_in_step_method (differs).
    """
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
    """A no_grad or inference_mode forward inside forward_context does not stop the next forward's gradients.

    Upstream: tests_pytorch/plugins/precision/test_amp.py test_amp_with_no_grad and test_amp_with_inference_mode.
    """
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
    """Like Lightning's, the plugin's autocast context manager runs without the weight-cast cache.

    Upstream: tests_pytorch/plugins/precision/test_amp.py test_amp_autocast_context_manager_disables_cache.
    """
    plugin = MixedPrecision("bf16-mixed", "cpu")
    with plugin.autocast_context_manager():
        assert not torch.is_autocast_cache_enabled()


def test_the_forward_context_runs_without_the_autocast_cache():
    """The training forward runs under autocast without its cache, as in Lightning 2.6.

    Lightning after 2.6 keeps the cache on in ``forward_context`` and patches ``torch.no_grad`` there instead; this
    plugin keeps 2.6's cache-free autocast, which is what makes a no_grad forward harmless
    (:func:`test_a_no_grad_forward_inside_the_forward_context_keeps_later_gradients`).

    Upstream: tests_pytorch/plugins/precision/test_amp.py test_amp_forward_context_keeps_cache_enabled (differs).
    """
    plugin = MixedPrecision("bf16-mixed", "cpu")
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
    """fp16 training with fused Adam and with plain Adam ends with the same weights.

    Upstream: tests_pytorch/plugins/precision/test_amp_integration.py test_amp_fused_optimizer_parity (fp16 on the CPU).
    """

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


@pytest.mark.filterwarnings("ignore:`training_step` returned `None`")
@pytest.mark.parametrize("opt_level", SCALED_LEVELS)
def test_a_skipped_training_step_skips_the_scaler_too(opt_level):
    """A training_step returning None on odd batches: 5 batches, 3 unscale_/step/update, with clipping on.

    Upstream: tests_pytorch/plugins/precision/test_amp_integration.py test_skip_training_step_with_grad_scaler.
    """

    class EvenBatchesOnly(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return None if batch_idx % 2 else super().training_step(batch, batch_idx)

    scaler = CountingLossScaler("cpu", init_scale=2.0**8)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler, opt_level=opt_level)
    trainer = make_trainer(plugin, max_steps=5, gradient_clip_val=0.5)
    trainer.fit(EvenBatchesOnly())
    assert scaler.calls == {"unscale_": 3, "step": 3, "update": 3}


class ManualOptModel(BoringModel):
    """Manual optimization, two SGD optimizers over the same layer, as in Lightning's manual-optimization tests."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.layer.parameters(), lr=0.1), torch.optim.SGD(self.layer.parameters(), lr=0.1)


@pytest.mark.parametrize("opt_level", FP16_LEVELS)
def test_manual_optimization_steps_several_optimizers_over_shared_parameters(opt_level):
    """opt_a.step(), then two retained backwards and opt_b.step(): runs in fp16, all weights stay finite.

    Upstream: tests_pytorch/trainer/optimization/test_manual_optimization.py test_multiple_optimizers_step.
    """

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
    plugin = MixedPrecision("16-mixed", init_scale=2.0**8, opt_level=opt_level)
    make_trainer(plugin, max_steps=4, limit_train_batches=2).fit(model)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert plugin.stats.skipped_steps == 0


@pytest.mark.parametrize("opt_level", FP16_LEVELS)
def test_manual_optimization_with_accumulated_gradients_steps_every_fourth_batch(opt_level):
    """Stepping every 4th batch in fp16: weights change only on those batches, gradients are zeroed after them.

    Upstream: tests_pytorch/trainer/optimization/test_manual_optimization.py
    test_manual_optimization_and_accumulated_gradient.
    """

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
    plugin = MixedPrecision("16-mixed", init_scale=2.0**8, growth_interval=1, opt_level=opt_level)
    make_trainer(plugin, max_epochs=1, max_steps=-1, limit_train_batches=8).fit(model)
    assert model.weight_changed == [False, False, False, True] * 2
    # two optimizer steps, two iterations that grew the scale; O3 scales only with a static loss_scale
    assert plugin.stats.loss_scale == (2.0**10 if opt_level in SCALED_LEVELS else 1.0)


@pytest.mark.parametrize("opt_level", SCALED_LEVELS)
@pytest.mark.parametrize("manual", [False, True])
def test_gradient_accumulation_unscales_once_per_optimizer_step(manual, opt_level):
    """accumulate_grad_batches=4 (or stepping every 4th batch by hand): one unscale_, step and update per 4 batches.

    Upstream: tests_pytorch/plugins/test_amp_plugins.py test_amp_gradient_unscale (its accumulation).
    """

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
    trainer = make_trainer(
        MixedPrecision("16-mixed", scaler=scaler, opt_level=opt_level),
        max_epochs=1,
        max_steps=-1,
        limit_train_batches=8,
        **options,
    )
    trainer.fit(Accumulating(), train_dataloaders=BoringModel().train_dataloader())
    assert scaler.calls == {"unscale_": 2, "step": 2, "update": 2}


class ClippingSGD(torch.optim.SGD):
    """SGD whose step first lets the module check that the gradients it is about to apply are the clipped ones."""

    def step(self, closure: Any = None, pl_module: Any = None) -> Any:
        pl_module.check_grads_clipped()
        return super().step(closure)


class GradientUnscaleChecks(BoringModel):
    """Records the true gradients after backward; checks them unscaled before the step and clipped in the step.

    Values are compared in fp32: under O2 backward leaves fp16 gradients on the half weights, and the hooks before
    the step see the fp32 masters' gradients.
    """

    def __init__(self) -> None:
        super().__init__()
        self.checked_steps = 0

    def on_after_backward(self) -> None:
        scale = self.trainer.precision_plugin.scaler.get_scale()
        assert scale != 1.0  # the gradients are scaled here
        self.true_grads = [p.grad.float() / scale for p in self.parameters()]

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        assert self.trainer.precision_plugin.scaler.step_phase(optimizer) is Phase.UNSCALED
        for parameter, expected in zip(self.parameters(), self.true_grads, strict=True):
            torch.testing.assert_close(parameter.grad.float(), expected)
        self.clipped = [
            p.grad.clamp(-self.trainer.gradient_clip_val, self.trainer.gradient_clip_val) for p in self.parameters()
        ]

    def configure_gradient_clipping(self, *args: Any, **kwargs: Any) -> None:
        super().configure_gradient_clipping(*args, **kwargs)
        self.check_grads_clipped()

    def check_grads_clipped(self) -> None:
        for parameter, expected in zip(self.parameters(), self.clipped, strict=True):
            torch.testing.assert_close(parameter.grad.float(), expected.float())
        self.checked_steps += 1

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, closure: Any = None) -> None:
        optimizer.step(closure, pl_module=self)  # a keyword the scaler passes on to the optimizer's step

    def configure_optimizers(self) -> Any:
        return ClippingSGD(self.layer.parameters(), lr=0.1)


@pytest.mark.parametrize("opt_level", SCALED_LEVELS)
@pytest.mark.parametrize("accumulate", [1, 2])
def test_hooks_see_unscaled_gradients_and_the_step_gets_the_clipped_ones(accumulate, opt_level):
    """on_before_optimizer_step sees the true gradients; clipping by value clips those; the step receives them.

    Upstream: tests_pytorch/plugins/test_amp_plugins.py test_amp_gradient_unscale (one CPU device, not 2 GPUs).
    """
    model = GradientUnscaleChecks()
    trainer = make_trainer(
        MixedPrecision("16-mixed", init_scale=2.0**8, opt_level=opt_level),
        max_epochs=2,
        max_steps=-1,
        limit_train_batches=2,
        limit_val_batches=0,
        gradient_clip_val=1e-3,
        gradient_clip_algorithm="value",
        accumulate_grad_batches=accumulate,
    )
    trainer.fit(model)
    assert model.checked_steps == 2 * 4 // accumulate  # twice per step: by the clipping hook and by the optimizer


@pytest.mark.parametrize("opt_level", FP16_LEVELS)
def test_an_optimizer_that_never_steps_is_left_alone(opt_level):
    """Manual optimization with two optimizers where only the second steps: only its layer moves, nothing fails.

    Upstream: tests_pytorch/plugins/test_amp_plugins.py test_amp_skip_optimizer.
    """

    class SecondOptimizerOnly(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.layer1 = nn.Linear(32, 32)
            self.layer2 = nn.Linear(32, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer2(self.layer1(x))

        def training_step(self, batch: Any, batch_idx: int) -> None:
            _, second = self.optimizers()
            second.zero_grad()
            self.manual_backward(self.loss(self(batch)))
            second.step()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.layer1.parameters(), lr=0.1), torch.optim.SGD(self.layer2.parameters(), lr=0.1)

    model = SecondOptimizerOnly()
    before = [p.detach().clone() for p in (model.layer1.weight, model.layer2.weight)]
    plugin = MixedPrecision("16-mixed", init_scale=2.0**8, opt_level=opt_level)
    make_trainer(plugin, max_steps=3).fit(model)
    # O3 trains half weights: compare in the dtype the model ends in, so that the cast alone is no change
    assert torch.equal(model.layer1.weight, before[0].to(model.layer1.weight.dtype))
    assert not torch.equal(model.layer2.weight, before[1].to(model.layer2.weight.dtype))
    assert plugin.stats.optimizer_steps == 3 and plugin.stats.skipped_steps == 0


def test_a_bf16_plugin_on_the_cpu_autocasts_to_bf16_without_a_scaler():
    """A bf16 plugin for the CPU has no scaler and its autocast context manager casts to bf16 on the CPU.

    Upstream: tests_pytorch/plugins/test_amp_plugins.py test_cpu_amp_precision_context_manager.
    """
    plugin = MixedPrecision("bf16-mixed", "cpu")
    assert plugin.device == "cpu" and plugin.scaler is None
    context_manager = plugin.autocast_context_manager()
    assert isinstance(context_manager, torch.autocast)
    assert (context_manager.device, context_manager.fast_dtype) == ("cpu", torch.bfloat16)
    plugin.setup_for_device("cpu")
    assert plugin.scaler is None


@pytest.mark.parametrize(("given", "suggestion"), [("16", "16-mixed"), (16, "16-mixed"), ("bf16", "bf16-mixed")])
def test_a_precision_name_lightning_refuses_is_refused_with_the_name_to_use(given, suggestion):
    """'16', 16 and 'bf16' are refused, naming the value, the allowed names and the one meant; the full names pass.

    Lightning's message is ``Passed `MixedPrecision(precision='16')`. Precision must be ...``; this plugin's names the
    argument the same way, lists 'auto' and '32-true' too, and suggests the near miss.

    Upstream: tests_pytorch/plugins/test_amp_plugins.py test_amp_precision_plugin_parameter_validation and
    tests_fabric/plugins/precision/test_amp.py test_amp_precision_parameter_validation (differs).
    """
    MixedPrecision("16-mixed", "cpu")
    MixedPrecision("bf16-mixed", "cpu")
    with pytest.raises(
        ValueError, match=rf"precision={given!r}.*must be one of.*Did you mean precision='{suggestion}'"
    ):
        MixedPrecision(given, "cpu")


@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3", "lean"])
@pytest.mark.parametrize("context", ["module_init_context", "tensor_init_context"])
def test_the_init_contexts_leave_the_default_dtype_fp32_also_after_an_exception(context, opt_level):
    """Modules are created in fp32 at every opt level (the level converts them later); an error inside changes nothing.

    Upstream: tests_pytorch/plugins/precision/test_all.py and tests_fabric/plugins/precision/test_all.py
    test_default_dtype_is_restored.
    """
    plugin = MixedPrecision("bf16-mixed", "cpu", opt_level=opt_level)
    with pytest.raises(RuntimeError, match="inside"), getattr(plugin, context)():
        assert nn.Linear(2, 2).weight.dtype is torch.float32
        raise RuntimeError("inside")
    assert torch.get_default_dtype() is torch.float32


class SubclassedMixedPrecision(MixedPrecision):
    """A user's subclass of the plugin: the Trainer must take it as it is."""


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
@pytest.mark.parametrize("plugin_class", [MixedPrecision, SubclassedMixedPrecision])
def test_the_trainer_keeps_the_plugin_and_its_subclasses_under_ddp(strategy, plugin_class):
    """A Trainer for 2 processes under DDP takes the plugin given (a subclass too) as its precision plugin.

    Upstream: tests_pytorch/plugins/test_amp_plugins.py test_amp_ddp (2 CPU processes, nothing launched; Lightning
    mocks a SLURM job on 2 GPUs).
    """
    plugin = plugin_class("16-mixed")
    trainer = make_trainer(plugin, devices=2, strategy=strategy)
    assert trainer.precision_plugin is plugin
