"""Manual optimization with MixedPrecision follows Lightning's recipes: true gradients, one scale per iteration."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lightning_mp import MixedPrecision, NonFiniteStepsError
from tests.helpers import loader, make_trainer

CLIP = 1e-3


OPTIMIZERS = {
    "sgd": lambda parameters: torch.optim.SGD(parameters, lr=1.0),
    "adamw_foreach": lambda parameters: torch.optim.AdamW(parameters, lr=1e-2, foreach=True),
    "adamw_fused": lambda parameters: torch.optim.AdamW(parameters, lr=1e-2, fused=True),
}


class OneLayerManualRegressor(L.LightningModule):
    """One linear layer, plain SGD with lr=1 (unless ``optimizer`` names another of :data:`OPTIMIZERS`): a step
    moves the weights by exactly the gradient, clipped to ``clip_value``; an inf is planted in a gradient at the
    ``inject_at`` batches, after backward."""

    def __init__(
        self,
        clip: str = "none",
        accumulate: int = 1,
        use_closure: bool = False,
        optimizer: str = "sgd",
        inject_at: tuple[int, ...] = (),
        clip_value: float = CLIP,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.layer = nn.Linear(8, 1)
        self.clip = clip
        self.accumulate = accumulate
        self.use_closure = use_closure
        self.optimizer_name = optimizer
        self.inject_at = inject_at
        self.clip_value = clip_value
        self.update_norms: list[float] = []
        self.scales_at_backward: list[float] = []

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.layer(x).float(), y) / self.accumulate

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        plugin = self.trainer.precision_plugin
        self.scales_at_backward.append(plugin.stats.loss_scale)
        if self.use_closure:

            def closure() -> torch.Tensor:
                loss = self._loss(batch)
                opt.zero_grad()
                self.manual_backward(loss)
                return loss

            before = self.layer.weight.detach().clone()
            opt.step(closure=closure)
            self.update_norms.append(float((self.layer.weight - before).norm()))
            return
        self.manual_backward(self._loss(batch))
        if (batch_idx + 1) % self.accumulate:
            return
        if batch_idx in self.inject_at:
            self.layer.weight.grad[0, 0] = float("inf")
        if self.clip == "explicit_unscale":
            plugin.scaler.unscale_(opt.optimizer)
        elif self.clip.startswith(("explicit_unscale_of_the_wrapper", "explicit_unscale_without_clipping")):
            plugin.scaler.unscale_(opt)
        if self.clip == "explicit_unscale_of_the_wrapper_then_torch_clipping":
            torch.nn.utils.clip_grad_norm_(self.parameters(), self.clip_value)
        elif self.clip not in ("none", "explicit_unscale_without_clipping"):
            self.clip_gradients(opt, gradient_clip_val=self.clip_value, gradient_clip_algorithm="norm")
        before = [p.detach().clone() for p in self.parameters()]
        opt.step()
        opt.zero_grad()
        update = torch.cat([(p - b).flatten() for p, b in zip(self.parameters(), before, strict=True)])
        self.update_norms.append(float(update.norm()))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return OPTIMIZERS[self.optimizer_name](self.parameters())


@pytest.mark.parametrize("clip", ["clip_gradients", "explicit_unscale", "explicit_unscale_of_the_wrapper"])
def test_clip_gradients_in_manual_optimization_clips_true_gradients(clip):
    """self.clip_gradients clips the unscaled gradients (the update has the clip norm), also after scaler.unscale_."""
    model = OneLayerManualRegressor(clip=clip)
    make_trainer(MixedPrecision("16-mixed", init_scale=2.0**8), max_steps=3).fit(model, loader())
    assert model.update_norms == pytest.approx([CLIP] * 3, rel=1e-2)


def test_an_explicit_unscale_of_self_optimizers_is_not_repeated_by_the_step():
    """scaler.unscale_(self.optimizers()) then opt.step(): the update is the true gradient, unscaled once."""
    torch.manual_seed(0)
    model = OneLayerManualRegressor(clip="explicit_unscale_without_clipping")
    reference = OneLayerManualRegressor()
    reference.load_state_dict(model.state_dict())
    make_trainer(MixedPrecision("16-mixed", init_scale=2.0**8), max_steps=2).fit(model, loader())
    make_trainer(MixedPrecision("32-true"), max_steps=2).fit(reference, loader())
    assert model.update_norms == pytest.approx(reference.update_norms, rel=2e-2)


@pytest.mark.parametrize(
    "clip",
    [
        "explicit_unscale_without_clipping",
        "explicit_unscale",
        "explicit_unscale_of_the_wrapper",
        "explicit_unscale_of_the_wrapper_then_torch_clipping",
    ],
)
def test_o2_unscale_clip_step_recipe_trains_as_o1(clip):
    """scaler.unscale_(opt), then clipping (or none), then opt.step() under O2 in fp16: the weights stay finite and
    move as O1's do (O2 unscales the gradients its fp32 masters will be stepped with)."""
    moved: dict[str, torch.Tensor] = {}
    for opt_level in ("O1", "O2"):
        torch.manual_seed(0)
        # A threshold the true gradients (norms 9 to 16) reach only on some steps, the scaled ones on every step.
        model = OneLayerManualRegressor(clip=clip, clip_value=10.0)
        before = torch.cat([p.detach().flatten() for p in model.parameters()])
        plugin = MixedPrecision("16-mixed", init_scale=2.0**8, opt_level=opt_level)
        make_trainer(plugin, max_steps=3).fit(model, loader())
        after = torch.cat([p.detach().flatten() for p in model.parameters()])
        assert plugin.stats.skipped_steps == 0 and torch.isfinite(after).all()
        moved[opt_level] = after - before
    # A scaled step would move the weights 256 times too far, one unscaled twice 256 times too little.
    assert float((moved["O2"] - moved["O1"]).norm()) <= 2e-2 * float(moved["O1"].norm())


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize(
    ("precision", "clip", "optimizer"),
    [
        ("16-mixed", "explicit_unscale_without_clipping", "sgd"),
        ("16-mixed", "explicit_unscale_without_clipping", "adamw_foreach"),
        ("16-mixed", "explicit_unscale_of_the_wrapper", "adamw_fused"),
        ("bf16-mixed", "none", "sgd"),
        ("bf16-mixed", "clip_gradients", "adamw_fused"),
    ],
)
def test_an_inf_in_a_gradient_skips_a_manual_step_and_counts_it(opt_level, precision, clip, optimizer):
    """An inf planted after manual_backward, before scaler.unscale_ (fp16) or before the step (bf16): the step is
    skipped and counted, and the weights stay as they were and finite."""
    weights: list[torch.Tensor] = []

    class RecordsWeights(OneLayerManualRegressor):
        def on_train_batch_end(self, *args: Any) -> None:
            weights.append(self.layer.weight.detach().clone())

    model = RecordsWeights(clip=clip, optimizer=optimizer, inject_at=(1,))
    plugin = MixedPrecision(precision, init_scale=2.0**8, opt_level=opt_level)
    make_trainer(plugin, max_steps=3).fit(model, loader())
    assert plugin.stats.skipped_steps == 1
    assert all(torch.isfinite(w).all() for w in weights)
    assert torch.equal(weights[1], weights[0]) and not torch.equal(weights[2], weights[1])


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_clip_gradients_in_manual_optimization_unscaled_precisions(precision):
    """In bf16 and fp32 self.clip_gradients clips as it does without the plugin."""
    model = OneLayerManualRegressor(clip="clip_gradients")
    make_trainer(MixedPrecision(precision), max_steps=2).fit(model, loader())
    assert model.update_norms == pytest.approx([CLIP] * 2, rel=1e-2)


def test_manual_accumulation_uses_one_scale_until_the_step():
    """Stepping every 2 batches: both backwards use the same scale, which moves once per optimizer step."""
    model = OneLayerManualRegressor(accumulate=2)
    plugin = MixedPrecision("16-mixed", init_scale=2.0**8, growth_interval=1)
    make_trainer(plugin, max_steps=3).fit(model, loader())
    assert model.scales_at_backward == [2.0**8, 2.0**8, 2.0**9, 2.0**9, 2.0**10, 2.0**10]
    assert plugin.stats.loss_scale == 2.0**11


def test_manual_step_with_a_closure_is_unscaled():
    """opt.step(closure=...) in manual optimization runs the closure once and steps on unscaled gradients."""
    torch.manual_seed(0)
    model = OneLayerManualRegressor(use_closure=True)
    reference = OneLayerManualRegressor(use_closure=True)
    reference.load_state_dict(model.state_dict())
    make_trainer(MixedPrecision("16-mixed", init_scale=2.0**8), max_steps=2).fit(model, loader())
    make_trainer(MixedPrecision("32-true"), max_steps=2).fit(reference, loader())
    # fp16 and fp32 updates agree to fp16's precision; a scaled update would be 256 times larger.
    assert model.update_norms == pytest.approx(reference.update_norms, rel=2e-2)


class ToggledGAN(L.LightningModule):
    """Lightning's GAN recipe: toggle_optimizer, manual_backward, step, zero_grad, untoggle_optimizer."""

    def __init__(self, overflow_discriminator_at: int = -1) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Linear(8, 8)
        self.discriminator = nn.Linear(8, 1)
        self.overflow_discriminator_at = overflow_discriminator_at
        self.generator_grad_norms: list[float] = []
        self.generator_true_grad_norms: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        x, _ = batch
        self.toggle_optimizer(opt_g)
        g_loss = -self.discriminator(self.generator(x)).float().mean()
        self.manual_backward(g_loss)
        self.clip_gradients(opt_g, gradient_clip_val=1e6, gradient_clip_algorithm="norm")
        self.generator_grad_norms.append(
            float(torch.cat([p.grad.flatten() for p in self.generator.parameters()]).norm())
        )
        with torch.enable_grad():
            true_loss = -self.discriminator(self.generator(x).float()).float().mean()
            grads = torch.autograd.grad(true_loss, list(self.generator.parameters()))
        self.generator_true_grad_norms.append(float(torch.cat([g.flatten() for g in grads]).norm()))
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)
        d_loss = self.discriminator(self.generator(x).detach()).float().mean() - self.discriminator(x).float().mean()
        self.manual_backward(d_loss)
        if batch_idx == self.overflow_discriminator_at:
            self.discriminator.weight.grad[0, 0] = float("inf")
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.generator.parameters(), lr=1e-3), torch.optim.SGD(
            self.discriminator.parameters(), lr=1e-3
        )


def test_two_optimizers_share_one_scale_and_growth_interval_counts_iterations():
    """With two optimizers per batch the scale moves once per batch: growth_interval=2 grows every 2nd batch."""
    model = ToggledGAN()
    plugin = MixedPrecision("16-mixed", init_scale=2.0**8, growth_interval=2)
    make_trainer(plugin, max_steps=8).fit(model, loader())  # Lightning counts both optimizers' steps: 4 batches
    assert plugin.stats.loss_scale == 2.0**10
    assert model.generator_grad_norms == pytest.approx(model.generator_true_grad_norms, rel=2e-2)


def test_an_overflow_of_the_second_optimizer_backs_off_once_after_the_batch():
    """The generator steps with the batch's scale; the discriminator's overflow halves the scale once, afterwards."""
    model = ToggledGAN(overflow_discriminator_at=1)
    plugin = MixedPrecision("16-mixed", init_scale=2.0**8, growth_interval=100)
    make_trainer(plugin, max_steps=6).fit(model, loader())
    assert plugin.stats.loss_scale == 2.0**7
    assert plugin.stats.scale_backoffs == 1
    # Every generator step saw true gradients, before and after the backoff.
    assert model.generator_grad_norms == pytest.approx(model.generator_true_grad_norms, rel=2e-2)


class ZeroGradAfterStep(L.LightningModule):
    """Lightning's manual recipe backward, step, zero_grad, with a NaN planted in ``layer.weight``'s gradient."""

    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.layer = nn.Linear(8, 1)
        self.optimizer_name = optimizer

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        self.manual_backward(nn.functional.mse_loss(self.layer(x).float(), y))
        self.layer.weight.grad[0, 0] = float("nan")
        opt.step()
        opt.zero_grad()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3, fused=self.optimizer_name == "fused-adam")


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
@pytest.mark.parametrize("optimizer", ["adam", "fused-adam"])
def test_never_finite_steps_name_the_parameter_even_when_the_gradients_are_zeroed_after_the_step(precision, optimizer):
    """NonFiniteStepsError names the parameter whose gradient was NaN, though zero_grad() ran before the check."""
    plugin = MixedPrecision(precision, max_consecutive_skips=3)
    with pytest.raises(
        NonFiniteStepsError, match=r"optimizer 0 \(Adam\).*non-finite gradients: layer\.weight \[1, 8\]"
    ):
        make_trainer(plugin, max_steps=8).fit(ZeroGradAfterStep(optimizer), loader())


class ManualWithScheduler(L.LightningModule):
    """Lightning's manual recipe for schedulers: ReduceLROnPlateau gets the metric, any other just ``step()``."""

    def __init__(self, plateau: bool) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.layer = nn.Linear(8, 1)
        self.plateau = plateau
        self.learning_rates: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt, scheduler = self.optimizers(), self.lr_schedulers()
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x).float(), y)
        opt.zero_grad()
        self.manual_backward(loss)
        if batch_idx == 2:
            self.layer.weight.grad[0, 0] = float("inf")
        opt.step()
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            scheduler.step(loss.detach() + 1e3 * batch_idx)  # never improves: the lr falls after every clean step
        else:
            scheduler.step()
        self.learning_rates.append(opt.param_groups[0]["lr"])

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=1.0)
        scheduler: Any = (
            torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
            if self.plateau
            else torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "monitor": "loss"}}


@pytest.mark.parametrize("plateau", [False, True])
def test_manual_scheduler_recipe_works_and_holds_still_on_the_skipped_step(plateau):
    """self.lr_schedulers() passes Lightning's isinstance(ReduceLROnPlateau) recipe and does not advance on a skip."""
    model = ManualWithScheduler(plateau)
    make_trainer(MixedPrecision("16-mixed", init_scale=2.0**8), max_steps=5).fit(model, loader())
    assert isinstance(model.lr_schedulers(), torch.optim.lr_scheduler.StepLR) != plateau
    # Plateau's first call only records the best value; the skipped third step moves neither schedule.
    expected = [1.0, 0.5, 0.5, 0.25, 0.125] if plateau else [0.5, 0.25, 0.25, 0.125, 0.0625]
    assert model.learning_rates == expected


class ClipsAnInfByValue(ZeroGradAfterStep):
    """An inf gradient every step, clipped by value (which makes it finite again) before the step."""

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        self.manual_backward(nn.functional.mse_loss(self.layer(x).float(), y))
        self.layer.weight.grad[0, 0] = float("inf")
        self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="value")
        opt.step()
        opt.zero_grad()


def test_never_finite_steps_whose_gradients_were_clipped_finite_say_so():
    """When clipping by value left no non-finite gradient to name, the error says why instead of blaming names."""
    plugin = MixedPrecision("16-mixed", max_consecutive_skips=2)
    with pytest.raises(NonFiniteStepsError, match=r"could not be named: none was left in this process.*clipped"):
        make_trainer(plugin, max_steps=8).fit(ClipsAnInfByValue("adam"), loader())
