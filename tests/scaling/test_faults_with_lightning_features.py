"""A bad step beside Lightning's features: clipping (manual and automatic), fused optimizers, LBFGS, BatchNorm's running
statistics, skip-aware schedulers, Lightning's own plugin and throughput monitor, zero-element parameters; and a plugin
that concurrent fits share.
"""

from __future__ import annotations

import csv
import math
import re
import subprocess
import sys
import threading
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import ModelCheckpoint, ThroughputMonitor
from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.plugins.precision import MixedPrecision as LightningMixedPrecision
from torch import nn

from lightning_mp import MixedPrecision
from lightning_mp.callbacks import GradientHealthMonitor
from tests.helpers import TinyRegressor, loader, make_trainer

PRECISIONS = ["16-mixed", "bf16-mixed", "32-true"]


def _plugin(precision: str, **settings: Any) -> MixedPrecision:
    """fp16 starts from a scale the tiny models never overflow at; bf16 and fp32 have no scale."""
    if precision == "16-mixed":
        settings.setdefault("init_scale", 2.0**8)
    return MixedPrecision(precision, **settings)


class StepWatch(L.Callback):
    """Copies the parameters before each batch and records, per step, whether they changed."""

    def __init__(self) -> None:
        self.changed: list[bool] = []
        self._before: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._before = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        now = list(pl_module.parameters())
        self.changed.append(not all(torch.equal(a, b) for a, b in zip(self._before, now, strict=True)))
        assert all(torch.isfinite(p).all() for p in now)


class ManualClipper(TinyRegressor):
    """Manual optimization with self.clip_gradients; plain SGD with lr=1 so the update is the clipped gradient."""

    def __init__(self, inject_at: tuple[int, ...] = ()) -> None:
        super().__init__(lr=1.0, inject_at=inject_at)
        self.automatic_optimization = False
        self.update_norms: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        if batch_idx in self.inject_at:
            self.first.weight.grad[0, 0] = math.inf
        self.clip_gradients(opt, gradient_clip_val=1e-3, gradient_clip_algorithm="norm")
        before = torch.cat([p.detach().flatten().clone() for p in self.parameters()])
        opt.step()
        self.update_norms.append(float((torch.cat([p.detach().flatten() for p in self.parameters()]) - before).norm()))

    def on_after_backward(self) -> None:
        """Injection happens in training_step, where the batch index is known."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def test_defect_5_manual_clip_gradients_clips_true_gradients_and_skips_overflows():
    """Manual optimization: clip_gradients gives updates of the clip norm (not 1/256 of it); an inf step is skipped."""
    model = ManualClipper(inject_at=(1,))
    plugin = _plugin("16-mixed")
    make_trainer(plugin, max_steps=4).fit(model, loader())
    assert model.update_norms[0] == pytest.approx(1e-3, rel=1e-2)
    assert model.update_norms[1] == 0.0
    assert model.update_norms[2:] == pytest.approx([1e-3] * 2, rel=1e-2)
    assert plugin.stats.skipped_steps == 1


class FusedAdam(TinyRegressor):
    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2, fused=True)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_defect_6_fused_optimizer_with_gradient_clipping_trains_like_without_the_plugin(precision):
    """A Trainer with a fused optimizer and gradient_clip_val that works without the plugin works with it."""
    torch.manual_seed(0)
    model = FusedAdam()
    reference = FusedAdam()
    reference.load_state_dict(model.state_dict())
    make_trainer(max_steps=4, gradient_clip_val=0.1).fit(reference, loader())
    make_trainer(_plugin(precision), max_steps=4, gradient_clip_val=0.1).fit(model, loader())
    tolerance = {"16-mixed": 5e-3, "bf16-mixed": 2e-2, "32-true": 1e-6}[precision]
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=tolerance, atol=tolerance)


class FusedMomentumSGD(TinyRegressor):
    def __init__(self, fused: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fused = fused

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9, fused=self.fused)


@pytest.mark.parametrize(
    ("precision", "clip"), [("16-mixed", None), ("16-mixed", "norm"), ("16-mixed", "value"), ("bf16-mixed", None)]
)
def test_fused_sgd_with_momentum_survives_an_overflow_on_its_first_step(precision, clip):
    """Fused SGD with momentum whose first step overflows trains exactly like the unfused SGD, clipped or not."""
    torch.manual_seed(0)
    fused = FusedMomentumSGD(fused=True, inject_at=(0,))
    unfused = FusedMomentumSGD(fused=False, inject_at=(0,))
    unfused.load_state_dict(fused.state_dict())
    clipping = {"gradient_clip_val": 0.5, "gradient_clip_algorithm": clip} if clip else {}
    plugins = [MixedPrecision(precision), MixedPrecision(precision)]
    for model, plugin in zip((fused, unfused), plugins, strict=True):
        make_trainer(plugin, max_steps=5, **clipping).fit(model, loader())
    assert plugins[0].stats.skipped_steps == plugins[1].stats.skipped_steps >= 1
    for ours, theirs in zip(fused.parameters(), unfused.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("algorithm", ["norm", "value"])
@pytest.mark.parametrize("optimizer", ["sgd", "fused-adam"])
def test_gradient_clipping_never_hides_an_inf_gradient_from_the_step(precision, algorithm, optimizer):
    """An inf gradient skips its step in every precision and optimizer, even where clipping by value makes it finite."""
    torch.manual_seed(0)
    model = TinyRegressor(inject_at=(3,), optimizer=optimizer)
    watch = StepWatch()
    plugin = _plugin(precision)
    trainer = make_trainer(
        plugin, max_steps=5, gradient_clip_val=0.1, gradient_clip_algorithm=algorithm, callbacks=[watch]
    )
    trainer.fit(model, loader())
    assert plugin.stats.skipped_steps == 1
    assert watch.changed == [True, True, True, False, True]


class LBFGSRegressor(TinyRegressor):
    """LBFGS with a NaN loss or a NaN gradient at one chosen step (in every closure evaluation of that step)."""

    def __init__(self, fault: str, fault_step: int = 1) -> None:
        super().__init__()
        self.fault, self.fault_step = fault, fault_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * math.nan if self.fault == "loss" and self.global_step == self.fault_step else loss

    def on_after_backward(self) -> None:
        if self.fault == "grad" and self.global_step == self.fault_step:
            self.second.bias.grad[0] = math.nan

    def configure_optimizers(self) -> Any:
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
@pytest.mark.parametrize("fault", ["loss", "grad"])
def test_defect_8_lbfgs_leaves_the_weights_on_a_nonfinite_step_and_counts_it(precision, fault):
    """LBFGS meeting a NaN loss or gradient keeps the weights and its state, and the step counts as skipped."""
    model, watch = LBFGSRegressor(fault), StepWatch()
    plugin = _plugin(precision)
    make_trainer(plugin, max_steps=3, callbacks=[watch]).fit(model, loader())
    assert watch.changed == [True, False, True]
    assert plugin.stats.skipped_steps == 1
    assert plugin.stats.optimizer_steps == 3


def test_defect_8_lbfgs_in_fp16_is_refused_at_setup_with_the_reason():
    """fp16 cannot check an LBFGS step before it is taken: the run stops before training, saying what to use."""
    model = LBFGSRegressor("none")
    with pytest.raises(Exception, match=r"cannot train with LBFGS.*bf16-mixed") as caught:
        make_trainer(_plugin("16-mixed"), max_steps=1).fit(model, loader())
    assert model.global_step == 0
    assert "LBFGS" in str(caught.value)


class BatchNormRegressor(TinyRegressor):
    """A BatchNorm between the layers; a NaN input at one step makes that step's loss and gradients NaN."""

    def __init__(self, nan_at: int) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(16)
        self.nan_at = nan_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.norm(self.first(x))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.global_step == self.nan_at:
            x = x.clone()
            x[0, 0] = math.nan
        return nn.functional.mse_loss(self(x).float(), y)


class RunningStatsWatch(L.Callback):
    """The BatchNorm's running statistics before and after each step."""

    def __init__(self) -> None:
        self.before: list[list[torch.Tensor]] = []
        self.after: list[list[torch.Tensor]] = []

    @staticmethod
    def _stats(module: BatchNormRegressor) -> list[torch.Tensor]:
        norm = module.norm
        return [norm.running_mean.clone(), norm.running_var.clone(), norm.num_batches_tracked.clone()]

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        self.before.append(self._stats(pl_module))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        self.after.append(self._stats(pl_module))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_defect_9_a_skipped_step_leaves_batchnorm_running_statistics_as_they_were(precision):
    """A step skipped for a NaN input leaves running_mean/var/num_batches_tracked unchanged; eval stays finite."""
    model, watch = BatchNormRegressor(nan_at=2), RunningStatsWatch()
    plugin = _plugin(precision)
    make_trainer(plugin, max_steps=4, callbacks=[watch]).fit(model, loader())
    assert plugin.stats.skipped_steps == 1
    for before, after in zip(watch.before[2], watch.after[2], strict=True):
        assert torch.equal(before, after)
    assert not torch.equal(watch.before[3][0], watch.after[3][0])  # clean steps still update them
    assert int(model.norm.num_batches_tracked) == 3
    model.eval()
    assert torch.isfinite(model(torch.randn(4, 8))).all()


def test_defect_9_with_accumulation_the_statistics_return_to_before_the_first_micro_batch():
    """With accumulate_grad_batches=2, a skipped step restores the statistics from before both micro-batches."""
    model, watch = BatchNormRegressor(nan_at=1), RunningStatsWatch()
    plugin = _plugin("16-mixed")
    make_trainer(plugin, max_steps=3, accumulate_grad_batches=2, callbacks=[watch]).fit(model, loader())
    # Batches 2 and 3 form optimizer step 1, which the NaN in batch 2 or 3 makes skip.
    assert plugin.stats.skipped_steps == 1
    for before, after in zip(watch.before[2], watch.after[3], strict=True):
        assert torch.equal(before, after)


@pytest.mark.slow
def test_defect_11_a_skip_aware_scheduler_saved_whole_loads_in_a_fresh_process(tmp_path):
    """torch.save of the step scheduler (as Lightning hands it out) loads where lightning_mp was never imported."""
    model = TinyRegressor(inject_at=(0,), scheduler=True)
    make_trainer(_plugin("16-mixed"), max_steps=3).fit(model, loader())
    scheduler = model.lr_schedulers()
    assert scheduler.last_epoch == 2  # three steps, the first skipped
    torch.save(scheduler, tmp_path / "scheduler.pt")
    torch.save(scheduler.optimizer, tmp_path / "optimizer.pt")
    script = (
        "import sys, torch\n"
        f"scheduler = torch.load({str(tmp_path / 'scheduler.pt')!r}, weights_only=False)\n"
        f"torch.load({str(tmp_path / 'optimizer.pt')!r}, weights_only=False)\n"
        "assert not any(name.startswith('lightning') for name in sys.modules), sorted(sys.modules)\n"
        "print(type(scheduler).__name__, scheduler.last_epoch, scheduler.get_last_lr()[0])\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["StepLR", "2", str(model.lr * 0.25)]
    assert type(model.trainer.lr_scheduler_configs[0].scheduler).__name__ == "SkipAwareScheduler"
    assert not any("lightning_mp" in name for name in vars(scheduler.optimizer))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"skip_scheduler_on_overflow": "no"}, "skip_scheduler_on_overflow='no'"),
        ({"growth_interval": np.int64(10), "init_scale": torch.tensor(8.0)}, None),
        ({"precision": "fp16"}, "Did you mean precision='16-mixed'"),
        ({"precision": "32-true", "loss_scale": 128.0}, "loss_scale=128.0"),
    ],
)
def test_defect_12_arguments_are_checked_when_the_plugin_is_built(kwargs, match):
    """'no' for a bool, a near-miss precision and a static scale in fp32 fail at construction; numpy/0-d pass."""
    if match is None:
        plugin = MixedPrecision("16-mixed", **kwargs)
        make_trainer(plugin, max_steps=1).fit(TinyRegressor(), loader())
        assert plugin.stats.loss_scale == 8.0
        return
    with pytest.raises(ValueError, match=re.escape(match)):
        MixedPrecision(**kwargs)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_defect_13_lightnings_own_plugin_resumes_from_our_checkpoint(tmp_path, precision):
    """Lightning's MixedPrecision resuming from a lightning_mp checkpoint continues (fp16) or starts cleanly (bf16)."""
    checkpoints = ModelCheckpoint(dirpath=tmp_path, filename="ours")
    make_trainer(
        _plugin(precision, growth_interval=100), max_steps=3, callbacks=[checkpoints], enable_checkpointing=True
    ).fit(TinyRegressor(inject_at=(1,)), loader())
    theirs = LightningMixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**4))
    resumed_scales: list[float] = []
    record = L.Callback()
    record.on_train_start = lambda trainer, module: resumed_scales.append(trainer.precision_plugin.scaler.get_scale())
    make_trainer(theirs, max_steps=5, callbacks=[record]).fit(
        TinyRegressor(), loader(), ckpt_path=tmp_path / "ours.ckpt"
    )
    expected = 2.0**7 if precision == "16-mixed" else 2.0**16  # our backed-off scale, or a fresh fp16 scaler's
    assert resumed_scales == [expected]
    assert theirs.scaler.get_scale() > 0  # and it trained on from there


@pytest.mark.parametrize(("precision", "dtype"), [("16-mixed", torch.float16), ("bf16-mixed", torch.bfloat16)])
def test_defect_13_throughput_monitor_counts_the_half_dtype(tmp_path, precision, dtype):
    """Lightning's ThroughputMonitor, in a real run, maps the plugin to its half dtype (not fp32) and logs."""
    monitor = ThroughputMonitor(batch_size_fn=lambda batch: batch[0].shape[0], window_size=2)
    logger = CSVLogger(tmp_path, name="throughput")
    trainer = make_trainer(_plugin(precision), max_steps=4, callbacks=[monitor], logger=logger, log_every_n_steps=1)
    trainer.fit(TinyRegressor(), loader())
    # The private function is the one ThroughputMonitor.setup calls to pick the dtype of the device's peak FLOPs.
    assert _plugin_to_compute_dtype(trainer.precision_plugin) is dtype
    with open(f"{logger.log_dir}/metrics.csv") as file:
        rows = list(csv.DictReader(file))
    assert any(row.get("train/samples") for row in rows)


class ManualNanClipper(ManualClipper):
    """Manual optimization that clips with a chosen threshold."""

    def __init__(self, clip_val: float) -> None:
        super().__init__()
        self.clip_val = clip_val

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        self.manual_backward(TinyRegressor.training_step(self, batch, batch_idx))
        self.clip_gradients(opt, gradient_clip_val=self.clip_val, gradient_clip_algorithm="norm")
        opt.step()


@pytest.mark.parametrize("clip_val", [math.nan, -1.0])
def test_manual_clip_gradients_refuses_a_nan_or_negative_threshold(clip_val):
    """self.clip_gradients(opt, gradient_clip_val=nan) raises a ValueError naming it; no weight becomes NaN."""
    torch.manual_seed(0)
    model = ManualNanClipper(clip_val)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=rf"gradient_clip_val={clip_val}\) is not allowed: expected a number >= 0"):
        make_trainer(_plugin("16-mixed"), max_steps=2).fit(model, loader())
    for parameter, weight in zip(model.parameters(), before, strict=True):
        assert torch.equal(parameter, weight)


class NumberBackward(TinyRegressor):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        self.manual_backward(super().training_step(batch, batch_idx).item())


def test_manual_backward_of_a_number_names_the_argument():
    """self.manual_backward(loss.item()) raises a TypeError naming the argument and the fix."""
    with pytest.raises(TypeError, match=r"manual_backward\(tensor=.*\) is not allowed: .*not its \.item\(\)"):
        make_trainer(_plugin("16-mixed"), max_steps=1).fit(NumberBackward(), loader())


class WaitForRefusal(L.Callback):
    """Holds the first training step until the other thread's fit was refused, so that the two fits overlap."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.refused = threading.Event()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.started.set()
        assert self.refused.wait(timeout=60)


def test_a_plugin_shared_by_two_concurrent_fits_refuses_the_second():
    """Two threads fitting with one plugin: the second is refused clearly; the first trains like a solo run."""
    torch.manual_seed(0)
    solo = TinyRegressor()
    make_trainer(MixedPrecision("16-mixed", init_scale=2.0**8), max_steps=6).fit(solo, loader())

    shared = MixedPrecision("16-mixed", init_scale=2.0**8)
    gate, errors = WaitForRefusal(), {}
    torch.manual_seed(0)
    first = TinyRegressor()

    def fit_keeping_the_error(name: str, model: TinyRegressor, callbacks: list[L.Callback]) -> None:
        try:
            make_trainer(shared, max_steps=6, callbacks=callbacks).fit(model, loader())
        except RuntimeError as error:
            errors[name] = error
        finally:
            if name == "second":
                gate.refused.set()

    threads = [threading.Thread(target=fit_keeping_the_error, args=("first", first, [gate]))]
    threads[0].start()
    assert gate.started.wait(timeout=60)
    threads.append(threading.Thread(target=fit_keeping_the_error, args=("second", TinyRegressor(), [])))
    threads[1].start()
    for thread in threads:
        thread.join(timeout=120)
    assert list(errors) == ["second"]
    assert "already driving a run in another thread" in str(errors["second"])
    assert shared.stats == solo.trainer.precision_plugin.stats
    for name, value in solo.state_dict().items():
        assert torch.equal(value, first.state_dict()[name]), name


def test_a_plugin_reused_by_fits_in_threads_one_after_the_other_trains_each():
    """Fits that take turns with one plugin, each in its own thread, all train: only concurrent use is refused."""
    shared = MixedPrecision("16-mixed")
    steps_per_fit = []

    def fit_and_count_steps() -> None:
        make_trainer(shared, max_steps=2).fit(TinyRegressor(), loader())
        steps_per_fit.append(shared.stats.optimizer_steps)

    for _ in range(2):
        thread = threading.Thread(target=fit_and_count_steps)
        thread.start()
        thread.join(timeout=120)
    fit_and_count_steps()
    assert steps_per_fit == [2, 2, 2]


class _WithEmptyParameter(TinyRegressor):
    """TinyRegressor plus a zero-element parameter that takes part in the loss, so it gets an empty gradient."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.empty = nn.Parameter(torch.zeros(0))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) + self.empty.sum()


@pytest.mark.parametrize(
    ("precision", "opt_level", "optimizer"),
    [
        ("bf16-mixed", "O1", "foreach AdamW"),
        ("bf16-mixed", "O1", "single-tensor SGD"),
        ("bf16-mixed", "O2", "foreach AdamW"),
        ("bf16-mixed", "lean", "foreach AdamW"),
        ("32-true", "O1", "foreach AdamW"),
        ("16-mixed", "O1", "foreach AdamW"),
    ],
)
def test_a_zero_element_parameter_trains_and_an_overflow_is_still_skipped(tmp_path, precision, opt_level, optimizer):
    """A parameter with no elements (an empty gradient, as on a rank holding an empty shard) neither crashes the
    check nor the gradient monitor, and an inf in another gradient is still skipped."""
    plugin = MixedPrecision(precision, opt_level=opt_level, init_scale=2.0**8 if precision == "16-mixed" else None)
    model = _WithEmptyParameter(inject_at=(1,), optimizer=optimizer)
    logger = TensorBoardLogger(tmp_path)
    trainer = make_trainer(plugin, max_steps=3, logger=logger, callbacks=[GradientHealthMonitor()], log_every_n_steps=1)
    trainer.fit(model, loader())
    assert plugin.stats.optimizer_steps == 3 and plugin.stats.skipped_steps == 1
    assert all(torch.isfinite(parameter).all() for parameter in model.parameters())


def test_a_zero_element_parameter_trains_under_fabric() -> None:
    """Under Fabric too, in bf16 with a foreach AdamW, an empty gradient is no reason to fail the step's check."""
    plugin = MixedPrecision("bf16-mixed")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    module = nn.Linear(4, 1)
    module.empty = nn.Parameter(torch.zeros(0))
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), foreach=True))
    for _ in range(2):
        fabric.backward(model(torch.ones(8, 4)).square().mean() + module.empty.sum())
        optimizer.step()
        optimizer.zero_grad()
    assert plugin.stats.optimizer_steps == 2 and plugin.stats.skipped_steps == 0
