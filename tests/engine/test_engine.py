"""The step engines driven directly, without a Trainer or a Fabric: the skip, the scale update, the restore.

These run in milliseconds; the Trainer and Fabric tests are the integration layer above them. The last tests trace
a real Trainer step and a real Fabric step, to show that each front end runs its own engine and never the other's.
"""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any
from unittest import mock

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn
from typing_extensions import override

from lightning_mp import LossScaler, MixedPrecision
from lightning_mp.engine.base import unwrapped
from lightning_mp.engine.fabric import FabricEngine
from lightning_mp.engine.fabric_models import FabricModels
from lightning_mp.engine.running_stats import RunningStats
from lightning_mp.engine.trainer import TrainerEngine
from lightning_mp.policies import POLICIES
from lightning_mp.scaling.steps import Phase
from lightning_mp.scaling.verdict import StepVerdict
from tests.helpers import TinyRegressor, loader, make_trainer


def fabric_engine(model: nn.Module, mode: str = "dynamic", **scaler_fields: Any) -> FabricEngine:
    """Fabric's engine over ``model`` with a CPU scaler in ``mode`` and an O1 policy, as ``fabric.setup`` builds it."""
    half = torch.float16 if mode == "dynamic" else torch.bfloat16
    models = FabricModels(lambda device: "cpu")
    engine = FabricEngine(LossScaler("cpu", mode=mode, **scaler_fields), POLICIES["O1"](half), models)
    engine.add_module(model)
    return engine


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))


def step(engine: FabricEngine, model: nn.Module, optimizer: torch.optim.Optimizer, inject: bool = False) -> None:
    """One iteration as Fabric drives it: forward, backward, optional inf gradient, step."""
    engine.before_forward()
    loss = model(torch.randn(8, 4)).pow(2).mean()
    engine.backward(loss, None)
    if inject:
        model[0].weight.grad[0, 0] = math.inf
    engine.optimizer_step(optimizer, None, None)
    optimizer.zero_grad()


def test_an_inf_gradient_skips_the_step_and_puts_the_running_statistics_back() -> None:
    """A step with an inf gradient leaves weights and BatchNorm's running statistics as they were."""
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = fabric_engine(model, init_scale=2.0**8)
    before = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
    step(engine, model, optimizer, inject=True)
    assert all(torch.equal(a, b) for a, b in zip(before, (*model.parameters(), *model.buffers()), strict=True))
    assert engine.last_step_skipped(optimizer)


def test_the_scale_backs_off_on_a_skip_and_grows_after_clean_steps_once_applied() -> None:
    """The scale moves once per iteration, at the pending update: halved after a skip, doubled after clean steps."""
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    engine = fabric_engine(model, init_scale=2.0**8, growth_interval=2)
    step(engine, model, optimizer, inject=True)
    assert engine.loss_scaler.get_scale() == 2.0**8  # the update waits for the iteration's last step
    engine.apply_pending_update()
    assert engine.loss_scaler.get_scale() == 2.0**7
    for _ in range(2):
        step(engine, model, optimizer)
    engine.apply_pending_update()
    assert engine.loss_scaler.get_scale() == 2.0**8
    assert (engine.loss_scaler.optimizer_steps, engine.loss_scaler.skipped_steps) == (3, 1)


@pytest.mark.parametrize("algorithm", [GradClipAlgorithmType.NORM, GradClipAlgorithmType.VALUE])
def test_clipping_before_the_step_clips_the_true_gradients_once(algorithm: GradClipAlgorithmType) -> None:
    """Lightning's clip_gradients hook under Fabric unscales first, clips, and the step does not unscale again."""
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = fabric_engine(model, init_scale=2.0**8)
    engine.backward(model(torch.randn(8, 4)).pow(2).mean() * 100, None)
    engine.clip_gradients(optimizer, 0.5, algorithm)
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    if algorithm is GradClipAlgorithmType.NORM:
        assert float(grads.norm()) == pytest.approx(0.5, rel=1e-4)
    else:
        assert float(grads.abs().max()) == pytest.approx(0.5)
    before = [p.detach().clone() for p in model.parameters()]
    engine.optimizer_step(optimizer, None, None)
    for weight, moved in zip(before, model.parameters(), strict=True):
        torch.testing.assert_close(weight - moved.detach(), 0.1 * moved.grad)


@pytest.mark.parametrize(
    ("verdict", "restored"),
    [(True, True), (False, False), (None, False), (torch.tensor(1.0), True), (torch.tensor(0.0), False)],
)
def test_running_statistics_go_back_only_for_a_skipped_step(verdict: Any, restored: bool) -> None:
    """A skipped verdict (a bool, or a device flag read without a sync) restores the statistics; others keep them."""
    layer = nn.BatchNorm1d(3)
    stats = RunningStats()
    stats.track(layer)
    stats.save()
    layer(torch.randn(6, 3) + 5.0)
    updated = layer.running_mean.clone()
    stats.restore_if_skipped(StepVerdict.of(verdict))
    assert torch.equal(layer.running_mean, torch.zeros(3) if restored else updated)
    assert int(layer.num_batches_tracked) == (0 if restored else 1)
    assert not stats.saved


def test_running_statistics_go_back_only_for_the_models_the_step_changed() -> None:
    """With two models (a GAN's), a skipped step of one model's optimizer leaves the other's statistics alone."""
    stepped, other = nn.BatchNorm1d(2), nn.BatchNorm1d(2)
    stats = RunningStats()
    for model in (stepped, other):
        stats.track(model)
    stats.save()
    for model in (stepped, other):
        model(torch.randn(4, 2) + 3.0)
    stats.restore_if_skipped(StepVerdict(skipped=True), [stepped])
    assert torch.equal(stepped.running_mean, torch.zeros(2))
    assert not torch.equal(other.running_mean, torch.zeros(2))


def test_a_checked_closure_step_undoes_a_nan_step_and_counts_it() -> None:
    """LBFGS whose closure meets a NaN keeps the weights, its state and the statistics, and counts one skip."""
    model = tiny_model()
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2)
    engine = fabric_engine(model, mode="check")
    x = torch.randn(8, 4)

    def closure(nan: bool) -> Callable[[], torch.Tensor]:
        def evaluate() -> torch.Tensor:
            optimizer.zero_grad()
            engine.before_forward()
            loss = model(x).pow(2).mean() * (math.nan if nan else 1.0)
            engine.backward(loss, None)
            return loss

        return evaluate

    engine.optimizer_step(optimizer, None, closure(nan=False))
    before = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
    engine.optimizer_step(optimizer, None, closure(nan=True))
    assert all(torch.equal(a, b) for a, b in zip(before, (*model.parameters(), *model.buffers()), strict=True))
    assert engine.last_step_skipped(optimizer)
    assert (engine.loss_scaler.optimizer_steps, engine.loss_scaler.skipped_steps) == (2, 1)


def test_a_scaled_loss_refuses_a_closure_step() -> None:
    """fp16 cannot check an optimizer that evaluates its closure itself: the engine refuses before stepping."""
    model = tiny_model()
    optimizer = torch.optim.LBFGS(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match="cannot step LBFGS"):
        fabric_engine(model).optimizer_step(optimizer, None, lambda: model(torch.randn(8, 4)).sum())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def engine_modules_run(run: Callable[[], Any]) -> set[str]:
    """The modules of :mod:`lightning_mp.engine` whose functions ran during ``run()``."""
    seen: set[str] = set()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        name = frame.f_globals.get("__name__", "")
        if event == "call" and name.startswith("lightning_mp.engine."):
            seen.add(name)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return seen


SHARED_ENGINE_MODULES = {"lightning_mp.engine.running_stats"}
"""The piece both engines use besides the contract: the running statistics kept across a step."""


def test_a_trainer_step_runs_the_trainer_engine_and_no_fabric_code() -> None:
    """A Trainer's steps go through the shared contract and the Trainer's engine, never through Fabric's."""
    plugin = MixedPrecision("16-mixed", init_scale=2.0**8)
    trainer = make_trainer(plugin, max_steps=2)
    seen = engine_modules_run(lambda: trainer.fit(TinyRegressor(inject_at=(1,)), loader(n=16)))
    assert seen - SHARED_ENGINE_MODULES == {"lightning_mp.engine.base", "lightning_mp.engine.trainer"}
    assert plugin.stats.skipped_steps == 1


def test_a_fabric_step_runs_the_fabric_engine_and_no_trainer_code() -> None:
    """A Fabric loop's steps go through the shared contract and Fabric's engine, never through the Trainer's."""
    plugin = MixedPrecision("16-mixed", init_scale=2.0**8)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    module = tiny_model()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.01))

    def train() -> None:
        for _ in range(2):
            fabric.backward(model(torch.randn(8, 4)).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()

    seen = engine_modules_run(train)
    assert seen - SHARED_ENGINE_MODULES == {
        "lightning_mp.engine.base",
        "lightning_mp.engine.fabric",
        "lightning_mp.engine.fabric_models",
    }
    assert plugin.stats.optimizer_steps == 2


def test_a_lightning_module_set_up_with_fabric_gets_the_fabric_engine() -> None:
    """A LightningModule under Fabric, whose trainer property answers with a stand-in, still runs Fabric's engine;
    after fitting with a Trainer it runs the Trainer's."""
    plugin = MixedPrecision("bf16-mixed")
    module = TinyRegressor()
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.01))
    fabric.backward(model(torch.randn(4, 8)).pow(2).mean())
    optimizer.step()
    assert isinstance(plugin._engine, FabricEngine) and plugin.stats.optimizer_steps == 1

    trainer_plugin = MixedPrecision("bf16-mixed")
    make_trainer(trainer_plugin, max_steps=1).fit(TinyRegressor(), loader(n=8))
    assert isinstance(trainer_plugin._engine, TrainerEngine) and trainer_plugin.stats.optimizer_steps == 1


# ------------------------------------------------------------------------------------------------ once per step


def record_step_stages(policy: Any, stages: list[str]) -> None:
    """Make ``policy`` append the name of each step hook it runs (and still run it) to ``stages``."""
    for stage in ("prepare_step", "after_optimizer_step"):
        hook = getattr(policy, stage)

        def recorded(*args: Any, _hook: Callable[..., None] = hook, _stage: str = stage, **kwargs: Any) -> None:
            stages.append(_stage)
            _hook(*args, **kwargs)

        setattr(policy, stage, recorded)


class RecordsStepStages(L.Callback):
    """Records, in order, the opt level's step hooks of a fit."""

    def __init__(self) -> None:
        self.stages: list[str] = []

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record_step_stages(trainer.precision_plugin.policy, self.stages)


class ClipsByHand(TinyRegressor):
    """Manual optimization: backward, ``self.clip_gradients``, step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    @override
    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        self.manual_backward(super().training_step(batch, batch_idx))
        self.clip_gradients(optimizer, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        optimizer.step()
        optimizer.zero_grad()


STEP_LEVELS = [("O1", "16-mixed"), ("O2", "bf16-mixed"), ("O2", "16-mixed")]


@pytest.mark.parametrize(("opt_level", "precision"), STEP_LEVELS)
@pytest.mark.parametrize("loop", ["automatic", "automatic, clipped", "manual, clipped"])
def test_the_trainer_prepares_each_steps_gradients_once(opt_level: str, precision: str, loop: str) -> None:
    """The opt level prepares each optimizer step's gradients (O2: moves them to the fp32 masters) once, also where
    the gradients are clipped before the step."""
    recorder = RecordsStepStages()
    plugin = MixedPrecision(precision, opt_level=opt_level)  # type: ignore[arg-type]
    clipping = {"gradient_clip_val": 1.0} if loop == "automatic, clipped" else {}
    trainer = make_trainer(plugin, max_steps=3, callbacks=[recorder], **clipping)
    trainer.fit(ClipsByHand() if loop == "manual, clipped" else TinyRegressor(), loader(n=24))
    assert plugin.stats.optimizer_steps == 3
    assert recorder.stages == ["prepare_step", "after_optimizer_step"] * 3


@pytest.mark.parametrize(("opt_level", "precision"), STEP_LEVELS)
def test_fabric_prepares_each_steps_gradients_once_when_it_clips(opt_level: str, precision: str) -> None:
    """Under Fabric, fabric.clip_gradients before optimizer.step prepares the step's gradients once, not twice."""
    plugin = MixedPrecision(precision, opt_level=opt_level)  # type: ignore[arg-type]
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    module = TinyRegressor()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.01))
    stages: list[str] = []
    record_step_stages(plugin.policy, stages)
    for features, target in loader(n=24):
        fabric.backward(nn.functional.mse_loss(model(features).float(), target))
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
    assert plugin.stats.optimizer_steps == 3
    assert stages == ["prepare_step", "after_optimizer_step"] * 3


class Lookahead(torch.optim.Optimizer):
    """An optimizer of its own class around another, sharing its ``param_groups`` (as torch_optimizer's Lookahead)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.defaults = optimizer.defaults

    def step(self, closure: Any = None) -> Any:
        return self.optimizer.step(closure)


def test_a_front_ends_wrapper_is_the_optimizer_it_wraps_and_a_lookahead_is_an_optimizer_of_its_own() -> None:
    """Lightning's and Fabric's optimizer wrappers count as the optimizer they wrap; an optimizer of another class
    around one (a Lookahead) is the optimizer the scaler and the opt level see, never unwrapped."""
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    fabric = Fabric(accelerator="cpu", devices=1)
    assert unwrapped(LightningOptimizer(optimizer)) is optimizer
    assert unwrapped(fabric.setup_optimizers(optimizer)) is optimizer
    lookahead = Lookahead(optimizer)
    assert unwrapped(lookahead) is lookahead and unwrapped(optimizer) is optimizer


def test_the_engine_replaces_no_scaler_method_and_a_users_unscale_readies_the_step_through_it() -> None:
    """The engine leaves the scaler's methods alone; a user's ``scaler.unscale_`` asks the engine to ready the step
    (once), and neither a copy of the scaler nor the scaler after teardown asks it again."""
    model = tiny_model()
    engine = fabric_engine(model)
    scaler = engine.loss_scaler
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert {"unscale_", "step", "update"}.isdisjoint(vars(scaler))
    readied: list[torch.optim.Optimizer] = []
    ready = engine.prepare_step
    engine.prepare_step = lambda o: (readied.append(o), ready(o))[1]  # type: ignore[method-assign]
    copied = copy.deepcopy(scaler)
    engine.backward(model(torch.ones(2, 4)).sum(), model)
    scaler.unscale_(optimizer)  # a user's "unscale, clip, step"
    assert readied == [optimizer] and scaler.step_phase(optimizer) is Phase.UNSCALED
    engine.optimizer_step(optimizer, model, None)
    assert readied == [optimizer]  # the step found the gradients unscaled and readied
    model(torch.ones(2, 4)).sum().backward()
    copied.unscale_(optimizer)
    engine.teardown()
    model(torch.ones(2, 4)).sum().backward()
    scaler.unscale_(optimizer)
    assert readied == [optimizer]


def test_a_mock_wrapping_the_scalers_unscale_step_and_update_sees_every_call_of_a_trainer_fit() -> None:
    """Lightning's way of watching the scaler: mocks wrapping ``unscale_``, ``step`` and ``update`` on the run's
    scaler see one of each per optimizer step of a fit, as with torch's GradScaler."""

    class WrapScaler(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            scaler = plugin.scaler
            self.mocks = {name: mock.Mock(wraps=getattr(scaler, name)) for name in ("unscale_", "step", "update")}
            for name, wrapper in self.mocks.items():
                setattr(scaler, name, wrapper)

    plugin = MixedPrecision("16-mixed", init_scale=2.0**8)
    watcher = WrapScaler()
    make_trainer(plugins=[plugin], callbacks=[watcher], max_steps=3).fit(TinyRegressor(), loader())
    assert [watcher.mocks[name].call_count for name in ("unscale_", "step", "update")] == [3, 3, 3]
    assert plugin.stats.optimizer_steps == 3
