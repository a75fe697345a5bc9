"""MixedPrecision inside real Trainer runs: exactness against torch and Lightning, skipped steps, hooks, resume."""

from __future__ import annotations

import copy
import csv
import dataclasses
import math
import warnings
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision as LightningMixedPrecision
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_mp import LossScaleCollapseError, MixedPrecision, NonFiniteStepsError, ScalerView
from tests.helpers import TinyRegressor, assert_within_rounding, loader, make_trainer


class ScaleRecorder(L.Callback):
    """Records the plugin's stats after every batch."""

    def __init__(self) -> None:
        self.scales: list[float] = []
        self.skipped: list[bool] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        stats = trainer.precision_plugin.stats
        self.scales.append(stats.loss_scale)
        self.skipped.append(stats.last_step_skipped)


def _reference_fp16_loop(
    model: TinyRegressor, steps: int, init_scale: float, growth_interval: int, accumulate: int = 1
):
    """The hand-written torch loop the plugin must match bit for bit."""
    optimizer = torch.optim.SGD(model.parameters(), lr=model.lr, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    batches = list(loader())
    scales = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for micro in range(accumulate):
            x, y = batches[(step * accumulate + micro) % len(batches)]
            with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
                loss = nn.functional.mse_loss(model(x).float(), y) / accumulate
            scaler.scale(loss).backward()
        if step in model.inject_at:
            model.first.weight.grad[0, 0] = float("inf")
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def test_fp16_matches_a_hand_written_autocast_gradscaler_loop_bit_for_bit():
    """fp16 on the CPU gives exactly the parameters and scales of torch.autocast + torch.amp.GradScaler."""
    torch.manual_seed(0)
    model = TinyRegressor(inject_at=(5,))
    reference = copy.deepcopy(model)
    recorder = ScaleRecorder()
    plugin = MixedPrecision("16-mixed", init_scale=2.0**10, growth_interval=3)
    make_trainer(plugin, max_steps=12, callbacks=[recorder]).fit(model, loader())
    reference_scales = _reference_fp16_loop(reference, 12, init_scale=2.0**10, growth_interval=3)
    assert recorder.scales == reference_scales
    assert recorder.scales[:3] == [2.0**10, 2.0**10, 2.0**11]  # grows after growth_interval clean steps
    assert recorder.scales[5] == recorder.scales[4] / 2  # backs off on the overflow
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=False):
        assert torch.equal(ours, theirs)


def test_accumulation_unscales_once_and_matches_the_reference():
    """With accumulate_grad_batches=2 the plugin matches a loop that unscales once per optimizer step."""
    torch.manual_seed(1)
    model = TinyRegressor()
    reference = copy.deepcopy(model)
    plugin = MixedPrecision("16-mixed", init_scale=2.0**10, growth_interval=2)
    make_trainer(plugin, max_steps=4, accumulate_grad_batches=2).fit(model, loader())
    _reference_fp16_loop(reference, 4, init_scale=2.0**10, growth_interval=2, accumulate=2)
    assert plugin.stats.optimizer_steps == 4
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=False):
        assert torch.equal(ours, theirs)


def test_fp16_on_cpu_is_real_fp16():
    """precision='16-mixed' on the CPU runs matrix products in float16, not silently in bf16."""
    dtypes = []

    class Probe(TinyRegressor):
        def training_step(self, batch, batch_idx):
            dtypes.append(self.first(batch[0]).dtype)
            return super().training_step(batch, batch_idx)

    make_trainer(MixedPrecision("16-mixed"), max_steps=1).fit(Probe(), loader())
    assert dtypes == [torch.float16]


def test_bf16_defaults_equal_lightning_builtin_bf16():
    """With defaults and bf16 the parameters equal those of Lightning's precision='bf16-mixed', up to rounding.

    The plugin takes SGD's step through torch's fused kernel of the same rule (no host sync), whose rounding differs
    from the foreach kernel's by an ulp; with ``skip_nonfinite=False`` it steps exactly as Lightning does.
    """
    torch.manual_seed(2)
    ours, exact = TinyRegressor(), TinyRegressor()
    exact.load_state_dict(ours.state_dict())
    theirs = copy.deepcopy(ours)
    make_trainer(MixedPrecision("bf16-mixed"), max_steps=6).fit(ours, loader())
    make_trainer(MixedPrecision("bf16-mixed", skip_nonfinite=False), max_steps=6).fit(exact, loader())
    builtin = LightningMixedPrecision("bf16-mixed", device="cpu")
    make_trainer(builtin, max_steps=6).fit(theirs, loader())
    for a, b, c in zip(ours.parameters(), theirs.parameters(), exact.parameters(), strict=True):
        assert_within_rounding(a, b)
        assert torch.equal(c, b)


class StateSnapshot(L.Callback):
    """Snapshots parameters, optimizer state and LR at the start of a chosen step, and compares at its end."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.unchanged: dict[str, bool] = {}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step:
            optimizer = trainer.optimizers[0]
            self.params = [p.detach().clone() for p in pl_module.parameters()]
            self.opt_state = copy.deepcopy(optimizer.state_dict()["state"])
            self.lr = optimizer.param_groups[0]["lr"]
            self.epoch = trainer.lr_scheduler_configs[0].scheduler.last_epoch

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step - 1 == self.step:
            optimizer = trainer.optimizers[0]
            state = optimizer.state_dict()["state"]
            self.unchanged = {
                "params": all(torch.equal(a, b) for a, b in zip(self.params, pl_module.parameters(), strict=False)),
                "optimizer": state.keys() == self.opt_state.keys()
                and all(torch.equal(state[k][name], self.opt_state[k][name]) for k in state for name in state[k]),
                "lr": optimizer.param_groups[0]["lr"] == self.lr,
                "scheduler": trainer.lr_scheduler_configs[0].scheduler.last_epoch == self.epoch,
            }


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "32-true"])
def test_injected_nonfinite_gradient_skips_the_step_without_touching_state(precision):
    """A step with an inf gradient changes no parameter, no Adam moment or step count, and no LR schedule."""
    snapshot = StateSnapshot(step=3)
    model = TinyRegressor(inject_at=(3,), optimizer="adam", scheduler=True)
    plugin = MixedPrecision(precision, init_scale=2.0**8, growth_interval=100)
    make_trainer(plugin, max_steps=6, callbacks=[snapshot]).fit(model, loader())
    assert snapshot.unchanged == {"params": True, "optimizer": True, "lr": True, "scheduler": True}
    stats = plugin.stats
    assert (stats.optimizer_steps, stats.skipped_steps) == (6, 1)
    assert stats.scale_backoffs == (1 if precision == "16-mixed" else 0)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_skipped_first_step_never_triggers_torchs_scheduler_warning():
    """Skipping the very first step does not cause 'lr_scheduler.step() before optimizer.step()'."""
    model = TinyRegressor(inject_at=(0,), scheduler=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(MixedPrecision("16-mixed", init_scale=2.0**8), max_steps=3).fit(model, loader())
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    scheduler = model.trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == 2  # three steps, one skipped


def test_gradient_clipping_sees_unscaled_gradients():
    """Hooks and clipping see true gradients: the clipped update has the clip norm, not clip/scale."""
    norms: list[float] = []

    class Recorder(TinyRegressor):
        def on_before_optimizer_step(self, optimizer):
            norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in self.parameters()])))

    torch.manual_seed(3)
    fp16, fp32 = Recorder(lr=1.0), None
    fp32 = copy.deepcopy(fp16)
    before = [p.detach().clone() for p in fp16.parameters()]
    clip = 1e-3
    make_trainer(MixedPrecision("16-mixed", init_scale=2.0**8), max_steps=1, gradient_clip_val=clip).fit(fp16, loader())
    make_trainer(MixedPrecision("32-true"), max_steps=1).fit(fp32, loader())
    assert norms[0] == pytest.approx(norms[1], rel=1e-2)  # same true norm in fp16 and fp32
    update = torch.cat([(a - b).flatten() for a, b in zip(fp16.parameters(), before, strict=False)]).norm()
    assert float(update) == pytest.approx(clip, rel=1e-3)


class TwoOptimizerGAN(L.LightningModule):
    """Manual optimization with two optimizers, generator and discriminator style."""

    def __init__(self, inject_generator_at: int | None = None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Linear(8, 8)
        self.discriminator = nn.Linear(8, 1)
        self.inject_generator_at = inject_generator_at
        self.generator_unchanged_on_injection: bool | None = None

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        x, _ = batch
        fake = self.generator(x)
        g_loss = -self.discriminator(fake).float().mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        if batch_idx == self.inject_generator_at:
            self.generator.weight.grad[0, 0] = float("nan")
            before = self.generator.weight.detach().clone()
        opt_g.step()
        if batch_idx == self.inject_generator_at:
            self.generator_unchanged_on_injection = torch.equal(before, self.generator.weight)
        d_loss = self.discriminator(fake.detach()).float().mean() - self.discriminator(x).float().mean()
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()

    def configure_optimizers(self):
        return (
            torch.optim.Adam(self.generator.parameters(), lr=1e-3),
            torch.optim.Adam(self.discriminator.parameters(), lr=1e-3),
        )


def test_manual_optimization_with_two_optimizers():
    """GAN-style manual optimization goes through the scaler: both optimizers step, a NaN step is skipped."""
    model = TwoOptimizerGAN(inject_generator_at=2)
    start_d = model.discriminator.weight.detach().clone()
    plugin = MixedPrecision("16-mixed", init_scale=2.0**8, growth_interval=100)
    make_trainer(plugin, max_steps=8).fit(model, loader())
    # One iteration overflowed: it is skipped once and the scale backs off once, not once per optimizer.
    assert plugin.stats.skipped_steps == 1 and plugin.stats.scale_backoffs == 1
    assert plugin.stats.loss_scale == 2.0**7
    assert model.generator_unchanged_on_injection is True
    assert not torch.equal(start_d, model.discriminator.weight)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_training_step_returning_none_skips_the_optimizer():
    """A training_step that returns None runs no optimizer step and counts none."""

    class Sometimes(TinyRegressor):
        def training_step(self, batch, batch_idx):
            return None if batch_idx % 2 else super().training_step(batch, batch_idx)

    model = Sometimes()
    before = [p.detach().clone() for p in model.parameters()]
    plugin = MixedPrecision("16-mixed", init_scale=2.0**8)
    make_trainer(plugin, max_steps=4).fit(model, loader())
    # Lightning counts all four batches as steps; only the two with a loss reached the optimizer.
    assert (plugin.stats.optimizer_steps, plugin.stats.skipped_steps) == (2, 0)
    assert not any(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=False))


def test_scale_collapse_stops_training_with_a_clear_error():
    """Gradients that always overflow end with LossScaleCollapseError naming the parameter."""
    model = TinyRegressor(inject_at=tuple(range(100)))
    plugin = MixedPrecision("16-mixed", init_scale=8.0, min_scale=1.0)
    with pytest.raises(LossScaleCollapseError, match=r"first\.weight \[16, 8\]"):
        make_trainer(plugin, max_steps=100).fit(model, loader())
    assert plugin.stats.skipped_steps == 4


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_gradients_that_are_never_finite_stop_unscaled_runs_too(precision):
    """bf16 and fp32 have no scale to collapse, yet always-inf gradients stop with a clear error, not skip forever."""
    model = TinyRegressor(inject_at=tuple(range(100)))
    plugin = MixedPrecision(precision, max_consecutive_skips=5)
    with pytest.raises(NonFiniteStepsError, match=r"5 optimizer steps in a row.*first\.weight \[16, 8\]"):
        make_trainer(plugin, max_steps=100).fit(model, loader())
    assert plugin.stats.skipped_steps == 5
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_lbfgs_with_fp16_is_rejected_but_runs_in_bf16():
    """LBFGS cannot be loss-scaled (clear error in fp16) but still trains in bf16."""

    class WithLBFGS(TinyRegressor):
        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=2)

    with pytest.raises(MisconfigurationException, match="LBFGS"):
        make_trainer(MixedPrecision("16-mixed"), max_steps=1).fit(WithLBFGS(), loader())
    plugin = MixedPrecision("bf16-mixed")
    make_trainer(plugin, max_steps=2).fit(WithLBFGS(), loader())
    assert plugin.stats.optimizer_steps == 2


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "32-true"])
def test_clipping_with_a_fused_optimizer_clips_true_gradients(precision):
    """A fused optimizer with gradient_clip_val trains in every precision, and its update is clipped."""

    class Fused(TinyRegressor):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1.0, fused=True)

    settings = {"init_scale": 2.0**8} if precision == "16-mixed" else {}
    model = Fused()
    before = [p.detach().clone() for p in model.parameters()]
    make_trainer(MixedPrecision(precision, **settings), max_steps=1, gradient_clip_val=1e-3).fit(model, loader())
    # Plain SGD with lr=1 moves the weights by exactly the clipped gradient: its norm is the clip value.
    update = torch.cat([(a - b).flatten() for a, b in zip(before, model.parameters(), strict=True)])
    assert float(update.norm()) == pytest.approx(1e-3, rel=1e-2)
    plugin = MixedPrecision(precision, **settings)
    make_trainer(plugin, max_steps=3, gradient_clip_val=1.0).fit(Fused(inject_at=(1,)), loader())
    assert plugin.stats.skipped_steps == 1


def test_resume_from_checkpoint_continues_exactly(tmp_path):
    """Resume from a mid-run checkpoint: scale, trackers and counters continue, parameters equal the straight run.

    The checkpoint is taken at an epoch boundary because Lightning restarts a plain DataLoader from its first batch
    when resuming mid-epoch, which would change the data order, not the scaler.
    """
    torch.manual_seed(4)
    settings = {"init_scale": 2.0**8, "growth_interval": 3, "hysteresis": 2}
    initial = TinyRegressor(inject_at=(2, 3, 9, 10))
    straight, resumed = copy.deepcopy(initial), copy.deepcopy(initial)
    checkpoints = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=8, save_top_k=-1)
    straight_plugin = MixedPrecision("16-mixed", **settings)
    make_trainer(straight_plugin, max_steps=16, callbacks=[checkpoints], enable_checkpointing=True).fit(
        straight, loader()
    )
    resumed_plugin = MixedPrecision("16-mixed", **settings)
    make_trainer(resumed_plugin, max_steps=16).fit(resumed, loader(), ckpt_path=tmp_path / "step=8.ckpt")
    assert resumed_plugin.stats == straight_plugin.stats
    assert resumed_plugin.stats.skipped_steps == 4
    assert resumed_plugin.scaler.state_dict() == straight_plugin.scaler.state_dict()
    for a, b in zip(resumed.parameters(), straight.parameters(), strict=False):
        assert torch.equal(a, b)


def test_auto_precision_logs_its_choice(caplog):
    """precision='auto' resolves at setup for the Trainer's device and says what it chose and why."""
    plugin = MixedPrecision()
    with caplog.at_level("INFO"):
        make_trainer(plugin, max_steps=1).fit(TinyRegressor(), loader())
    assert plugin.precision in ("bf16-mixed", "32-true")
    assert any("precision='auto' chose" in record.getMessage() for record in caplog.records)


BAD_ARGUMENTS = [
    ({"precision": "16"}, "precision"),
    ({"opt_level": "O9"}, "opt_level"),
    ({"device": "tpu"}, "device"),
    ({"growth_factor": 0.5}, "growth_factor"),
    ({"backoff_factor": 1.5}, "backoff_factor"),
    ({"growth_interval": 0}, "growth_interval"),
    ({"hysteresis": 0}, "hysteresis"),
    ({"init_scale": -1.0}, "init_scale"),
    ({"init_scale": math.nan}, "init_scale"),
    ({"min_scale": 4.0, "max_scale": 2.0, "init_scale": 2.0}, "min_scale"),
    ({"init_scale": 2.0**30}, "init_scale"),
    ({"on_min_scale": "ignore"}, "on_min_scale"),
    ({"loss_scale": -2.0, "precision": "16-mixed"}, "loss_scale"),
    ({"loss_scale": 128.0, "precision": "bf16-mixed"}, "loss_scale"),
    ({"precision": "16-mixed", "opt_level": "O0"}, "opt_level"),
    ({"max_consecutive_skips": 0}, "max_consecutive_skips"),
]


@pytest.mark.parametrize(("kwargs", "argument"), BAD_ARGUMENTS)
def test_bad_input_raises_value_error_naming_the_argument(kwargs, argument):
    """Every invalid argument raises ValueError naming the argument and the value given."""
    with pytest.raises(ValueError, match=argument) as caught:
        MixedPrecision(**kwargs)
    value = kwargs.get(argument, None)
    if value is not None:
        assert repr(value) in str(caught.value)


def test_device_that_disagrees_with_the_trainer_is_a_clear_error():
    """device='cuda' on a CPU Trainer fails at setup, naming both."""
    with pytest.raises(ValueError, match=r"device='cuda'.*'cpu'"):
        make_trainer(MixedPrecision("16-mixed", device="cuda"), max_steps=1).fit(TinyRegressor(), loader())


def test_static_loss_scale_with_auto_that_resolves_without_fp16_is_a_clear_error():
    """'auto' never picks fp16 on a CPU, so a static loss_scale is refused at setup, naming the argument."""
    with pytest.raises(ValueError, match=r"loss_scale=128\.0.*needs fp16"):
        make_trainer(MixedPrecision(loss_scale=128.0), max_steps=1).fit(TinyRegressor(), loader())


class DefaultsCompatible(TinyRegressor):
    """One model for several Trainer recipes that work without the plugin."""

    def __init__(self, recipe: str) -> None:
        super().__init__(scheduler=recipe == "batchnorm_scheduler_accumulation")
        self.recipe = recipe
        self.automatic_optimization = recipe not in ("manual_clip", "manual_step_without_backward")
        self.norm = nn.BatchNorm1d(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.first(x)
        if self.recipe == "batchnorm_scheduler_accumulation":
            hidden = self.norm(hidden)
        return self.second(torch.relu(hidden))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.recipe == "returns_none_on_odd_batches" and batch_idx % 2:
            return None
        loss = super().training_step(batch, batch_idx)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        if self.recipe == "manual_clip":
            self.manual_backward(loss)
            self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        elif batch_idx % 2 == 0:
            self.manual_backward(loss)
        opt.step()
        opt.zero_grad()
        return None

    def configure_optimizers(self) -> Any:
        if self.recipe == "fused_adam_clipping":
            return torch.optim.Adam(self.parameters(), lr=1e-2, fused=True)
        if self.recipe == "lbfgs":
            return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=2)
        return super().configure_optimizers()


RECIPES = {
    "fused_adam_clipping": {"gradient_clip_val": 1.0},
    "manual_clip": {},
    "manual_step_without_backward": {},
    "lbfgs": {"gradient_clip_val": 0.5},
    "batchnorm_scheduler_accumulation": {"accumulate_grad_batches": 2},
    "returns_none_on_odd_batches": {"gradient_clip_val": 0.5},
}


@pytest.mark.parametrize("precision", ["auto", "32-true"])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_adding_the_plugin_with_defaults_never_breaks_a_working_trainer(recipe, precision):
    """Each recipe trains without the plugin; with MixedPrecision() added it trains too, to nearly the same weights."""
    torch.manual_seed(0)
    model, reference = DefaultsCompatible(recipe), DefaultsCompatible(recipe)
    reference.load_state_dict(model.state_dict())
    make_trainer(max_steps=4, **RECIPES[recipe]).fit(reference, loader())
    plugin = MixedPrecision(precision)
    make_trainer(plugin, max_steps=4, **RECIPES[recipe]).fit(model, loader())
    tolerance = 1e-6 if plugin.precision == "32-true" else 5e-2
    for ours, theirs in zip(model.state_dict().values(), reference.state_dict().values(), strict=True):
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=tolerance, atol=tolerance)


def test_skip_aware_scheduler_works_with_learning_rate_monitor_and_resume(tmp_path):
    """LearningRateMonitor logs the held-back rate, and a checkpoint resumes the scheduler where it stood."""
    logger = CSVLogger(tmp_path, name="lr")
    checkpoints = ModelCheckpoint(dirpath=tmp_path, filename="scheduler")
    make_trainer(
        MixedPrecision("16-mixed", init_scale=2.0**8),
        max_steps=4,
        logger=logger,
        log_every_n_steps=1,
        callbacks=[LearningRateMonitor("step"), checkpoints],
        enable_checkpointing=True,
    ).fit(TinyRegressor(inject_at=(1,), scheduler=True), loader())
    with open(f"{logger.log_dir}/metrics.csv") as file:
        rates = [float(row["lr-SGD"]) for row in csv.DictReader(file) if row.get("lr-SGD")]
    assert rates == [0.05, 0.025, 0.025, 0.0125]  # the skipped step 1 did not halve the rate
    resumed = TinyRegressor(scheduler=True)
    make_trainer(MixedPrecision("16-mixed", init_scale=2.0**8), max_steps=6).fit(
        resumed, loader(), ckpt_path=tmp_path / "scheduler.ckpt"
    )
    assert resumed.lr_schedulers().last_epoch == 5


@pytest.mark.parametrize(
    ("precision", "scales_loss", "max_scale"), [("16-mixed", True, 2.0**20), ("bf16-mixed", False, None)]
)
def test_scaler_view_tells_telemetry_how_the_loss_is_scaled_read_only(precision, scales_loss, max_scale):
    """plugin.scaler_view gives whether the loss is scaled, the scale's ceiling and this rank's overflows; read-only."""
    plugin = MixedPrecision(precision, max_scale=2.0**20)
    assert plugin.scaler_view == ScalerView(local_overflows=0, max_scale=None, scales_loss=False)
    make_trainer(plugin, max_steps=3).fit(TinyRegressor(inject_at=(1,)), loader())
    view = plugin.scaler_view
    assert (view.scales_loss, view.max_scale) == (scales_loss, max_scale)
    assert int(view.local_overflows) == plugin.stats.skipped_steps >= 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.scales_loss = not scales_loss  # type: ignore[misc]
