"""Fabric runs one after another: save and load resume at the same scale, damaged state is refused at load, and a
plugin reused by a new Fabric or Trainer run (or pickled, or copied) starts that run as a new plugin.
"""

from __future__ import annotations

import copy
import pickle
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric

from lightning_mp import MixedPrecision
from tests.engine.fabric_helpers import make_model, setup, train_step
from tests.helpers import TinyRegressor, loader, make_trainer

pytestmark = pytest.mark.filterwarnings("ignore:.*opt_level='O3'")


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_save_and_load_resume_at_the_same_scale(tmp_path: Path, opt_level: str) -> None:
    """fabric.save and fabric.load with the plugin in the state: a fresh run continues at the same scale and weights."""

    def run(steps: range, checkpoint: Path | None = None, resume: Path | None = None) -> tuple[MixedPrecision, Any]:
        plugin = MixedPrecision("16-mixed", opt_level=opt_level, init_scale=2.0**8, growth_interval=2)
        fabric, model, optimizer = setup(plugin, optimizer="adam")
        state = {"model": model, "optimizer": optimizer, "precision": plugin}
        if resume is not None:
            fabric.load(resume, state)
        for step in steps:
            train_step(fabric, model, optimizer, seed=step, inject=step == 2)
        if checkpoint is not None:
            fabric.save(checkpoint, state)
        return plugin, model

    path = tmp_path / "checkpoint.pt"
    straight, straight_model = run(range(8))
    first, _ = run(range(5), checkpoint=path)
    saved_scale = first.stats.loss_scale
    resumed, resumed_model = run(range(5, 8), resume=path)
    assert saved_scale == 2.0**9  # 2 growths, 1 backoff
    assert resumed.stats == straight.stats
    for expected, actual in zip(straight_model.state_dict().values(), resumed_model.state_dict().values(), strict=True):
        assert expected.dtype == torch.float32 and torch.equal(expected, actual)  # O2's fp32 masters, bit for bit


@pytest.mark.parametrize(
    ("state_keys", "warns"),
    [(("model", "optimizer"), True), (("model",), False), (("precision", "model", "optimizer"), False)],
)
def test_resuming_without_the_plugin_state_warns_that_the_scale_restarts(
    tmp_path: Path, state_keys: tuple[str, ...], warns: bool
) -> None:
    """fabric.load of model and optimizer without the plugin warns; with it, or loading weights only, it does not."""
    path = tmp_path / "checkpoint.pt"
    plugin = MixedPrecision("16-mixed", init_scale=2.0**8, growth_interval=1)
    fabric, model, optimizer = setup(plugin, optimizer="adam")
    for step in range(3):
        train_step(fabric, model, optimizer, seed=step)
    fabric.save(path, {"model": model, "optimizer": optimizer, "precision": plugin})
    resumed = MixedPrecision("16-mixed", init_scale=2.0**8, growth_interval=1)
    fabric, model, optimizer = setup(resumed, optimizer="adam")
    objects = {"model": model, "optimizer": optimizer, "precision": resumed}
    fabric.load(path, {key: objects[key] for key in state_keys}, strict=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_step(fabric, model, optimizer, seed=3)
        train_step(fabric, model, optimizer, seed=4)
    restarts = [w for w in caught if "starts again from init_scale=256" in str(w.message)]
    assert len(restarts) == (1 if warns else 0)
    assert resumed.stats.loss_scale == (2.0**13 if "precision" in state_keys else 2.0**10)


def test_the_plugin_pickles_and_deep_copies_mid_run() -> None:
    """After a Fabric step the plugin still pickles and deep-copies, with the step's outcome in the copy."""
    plugin = MixedPrecision("16-mixed", init_scale=2.0**8)
    fabric, model, optimizer = setup(plugin)
    train_step(fabric, model, optimizer, seed=0, inject=True)
    for copied in (pickle.loads(pickle.dumps(plugin)), copy.deepcopy(plugin)):
        assert copied.stats == plugin.stats
        assert copied.stats.skipped_steps == 1
    train_step(fabric, model, optimizer, seed=1)
    assert plugin.stats.optimizer_steps == 2


def test_a_new_fabric_run_with_a_reused_plugin_starts_with_no_skip_streak() -> None:
    """A plugin whose previous Fabric run ended on a skipped step reports consecutive_skips 0 after clean steps."""
    plugin = MixedPrecision("16-mixed", init_scale=2.0**8)
    fabric, model, optimizer = setup(plugin)
    train_step(fabric, model, optimizer, seed=0)
    train_step(fabric, model, optimizer, seed=1, inject=True)
    assert plugin.stats.consecutive_skips == 1
    fabric, model, optimizer = setup(plugin)
    train_step(fabric, model, optimizer, seed=2)
    train_step(fabric, model, optimizer, seed=3)
    assert plugin.stats.consecutive_skips == 0 and not plugin.stats.last_step_skipped


def test_a_reused_plugin_trains_a_new_fabric_run_like_a_fresh_plugin() -> None:
    """A second Fabric run with the same plugin starts from init_scale and zero counters, as a new plugin would."""
    reused = MixedPrecision("16-mixed", init_scale=2.0**8, growth_interval=1)
    fabric, model, optimizer = setup(reused)
    for seed in range(3):
        train_step(fabric, model, optimizer, seed=seed, inject=seed == 2)
    runs = {}
    for name, plugin in (
        ("reused", reused),
        ("fresh", MixedPrecision("16-mixed", init_scale=2.0**8, growth_interval=1)),
    ):
        fabric, model, optimizer = setup(plugin)
        for seed in range(3):
            train_step(fabric, model, optimizer, seed=seed)
        runs[name] = (plugin.stats, [p.detach().clone() for p in model.parameters()])
    assert runs["reused"][0] == runs["fresh"][0]
    for reused_weight, fresh_weight in zip(runs["reused"][1], runs["fresh"][1], strict=True):
        assert torch.equal(reused_weight, fresh_weight)


def _fabric_run(plugin: MixedPrecision, inject_at: tuple[int, ...]) -> list[torch.Tensor]:
    """Eight Fabric steps of a seeded model, an inf planted at ``inject_at``; the weights it ends with."""
    fabric, model, optimizer = setup(plugin)
    for seed in range(8):
        train_step(fabric, model, optimizer, seed=seed, inject=seed in inject_at)
    return [p.detach().clone() for p in model.parameters()]


def _trainer_run(plugin: MixedPrecision, inject_at: tuple[int, ...]) -> list[torch.Tensor]:
    """Eight steps of a Trainer's fit of a seeded model, an inf planted at ``inject_at``; the weights it ends with."""
    torch.manual_seed(0)
    model = TinyRegressor(inject_at=inject_at)
    make_trainer(plugin).fit(model, loader())
    return [p.detach().clone() for p in model.parameters()]


_RUNS = {"fabric": _fabric_run, "trainer": _trainer_run}


@pytest.mark.parametrize("first", ["trainer", "fabric"])
@pytest.mark.parametrize("second", ["trainer", "fabric"])
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_plugin_reused_by_a_trainer_or_fabric_starts_the_next_run_as_a_new_plugin(
    first: str, second: str, opt_level: str
) -> None:
    """After a Trainer's fit or a Fabric loop, a second run of either kind sees init_scale, zero counters and no
    skip streak, and trains the weights a new plugin trains."""
    settings: dict[str, Any] = {"opt_level": opt_level, "init_scale": 2.0**10, "hysteresis": 1}
    reused = MixedPrecision("16-mixed", **settings)
    _RUNS[first](reused, (3, 6, 7))  # ends on a streak of two skips, at a quarter of init_scale
    assert (reused.stats.skipped_steps, reused.stats.consecutive_skips) == (3, 2)
    fresh = MixedPrecision("16-mixed", **settings)
    weights = {name: _RUNS[second](plugin, (1, 4)) for name, plugin in (("reused", reused), ("fresh", fresh))}
    assert reused.stats == fresh.stats
    assert (reused.stats.optimizer_steps, reused.stats.skipped_steps, reused.stats.loss_scale) == (8, 2, 2.0**8)
    for reused_weight, fresh_weight in zip(weights["reused"], weights["fresh"], strict=True):
        assert torch.equal(reused_weight, fresh_weight)


def test_setup_for_device_after_a_fit_starts_a_new_run_as_a_new_plugin() -> None:
    """plugin.setup_for_device after a Trainer's fit (to use it outside both) starts from init_scale, zero counters."""
    reused = MixedPrecision("16-mixed", init_scale=2.0**10)
    _trainer_run(reused, (2, 3))
    assert reused.stats.skipped_steps == 2
    fresh = MixedPrecision("16-mixed", init_scale=2.0**10)
    for plugin in (reused, fresh):
        plugin.setup_for_device("cpu")
    assert reused.stats == fresh.stats
    assert reused.state_dict()["scaler"] == fresh.state_dict()["scaler"]


@pytest.mark.parametrize("load", ["after_setup", "before_setup"])
def test_a_plugin_reused_by_fabric_after_a_trainer_resumes_from_fabric_load(tmp_path: Path, load: str) -> None:
    """A plugin that drove a Trainer's fit, then loaded with a Fabric checkpoint (before or after fabric.setup),
    continues at the checkpoint's scale and counters: the new run starts from the loaded state, not a new one."""
    saver = MixedPrecision("16-mixed", init_scale=2.0**10)
    fabric, model, optimizer = setup(saver)
    for seed in range(3):
        train_step(fabric, model, optimizer, seed=seed, inject=seed == 1)
    path = tmp_path / "state.ckpt"
    fabric.save(path, {"precision": saver})
    saved = saver.state_dict()["scaler"]
    reused = MixedPrecision("16-mixed", init_scale=2.0**10)
    _trainer_run(reused, (2,))
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[reused])
    if load == "before_setup":
        fabric.load(path, {"precision": reused})
    module = make_model()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=1e-2))
    if load == "after_setup":
        fabric.load(path, {"precision": reused})
    assert reused.state_dict()["scaler"] == saved
    train_step(fabric, model, optimizer, seed=3)
    assert (reused.stats.optimizer_steps, reused.stats.skipped_steps) == (4, 1)


def _saved_fabric_state(tmp_path: Path, precision: str = "16-mixed") -> Path:
    plugin = MixedPrecision(precision)
    fabric, model, optimizer = setup(plugin)
    train_step(fabric, model, optimizer, seed=0)
    path = tmp_path / "state.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "precision": plugin})
    return path


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda s: [s["scaler"]], r"MixedPrecision state holds \[\{.*\}\]; expected a dict"),
        (lambda s: None, r"MixedPrecision state holds None; expected a dict"),
        (lambda s: {**s, "scaler": None}, r"'scaler'=None; expected a dict \(the loss scaler's state\)"),
        (lambda s: {**s, "scaler": [1]}, r"'scaler'=\[1\]; expected a dict"),
        (lambda s: {**s, "policy": "O1"}, r"'policy'='O1'; expected a dict \(the opt level's state\)"),
        (lambda s: {**s, "precision": 16}, r"'precision'=16; expected one of \['auto', '16-mixed'"),
        (lambda s: {**s, "opt_level": None}, r"'opt_level'=None; expected one of \['O0'"),
        (lambda s: {**s, "scaler": {**s["scaler"], "counters": "x"}}, r"key 'counters' holds 'x'"),
    ],
)
def test_damaged_plugin_state_is_refused_at_fabric_load_naming_the_field(
    tmp_path: Path, damage: Any, match: str
) -> None:
    """fabric.load of a checkpoint whose plugin state is damaged raises a ValueError naming the field and value."""
    path = _saved_fabric_state(tmp_path)
    checkpoint = torch.load(path, weights_only=False)
    checkpoint["precision"] = damage(checkpoint["precision"])
    torch.save(checkpoint, path)
    plugin = MixedPrecision("16-mixed")
    fabric, model, optimizer = setup(plugin)
    with pytest.raises(ValueError, match=match):
        fabric.load(path, {"model": model, "optimizer": optimizer, "precision": plugin})


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_a_scale_that_training_cannot_make_is_refused_at_fabric_load(tmp_path: Path, scale: float) -> None:
    """A checkpoint whose loss scale is 0, negative or not finite is refused at fabric.load, naming 'scale'."""
    path = _saved_fabric_state(tmp_path)
    checkpoint = torch.load(path, weights_only=False)
    checkpoint["precision"]["scaler"]["scale"] = scale
    torch.save(checkpoint, path)
    plugin = MixedPrecision("16-mixed")
    fabric, model, optimizer = setup(plugin)
    with pytest.raises(ValueError, match=rf"key 'scale' holds {scale}; expected a finite positive number"):
        fabric.load(path, {"model": model, "optimizer": optimizer, "precision": plugin})
    assert plugin.stats.loss_scale == 2.0**16


def test_a_fabric_run_in_another_thread_is_refused_while_one_runs() -> None:
    """fabric.setup with a plugin that another live thread's loop drives raises; after its teardown it works."""
    plugin = MixedPrecision("16-mixed")
    fabric, model, optimizer = setup(plugin)
    train_step(fabric, model, optimizer, seed=0)
    outcome: list[Any] = []

    def other_run() -> None:
        try:
            other_fabric, other_model, other_optimizer = setup(plugin)
            train_step(other_fabric, other_model, other_optimizer, seed=1)
            outcome.append(plugin.stats.optimizer_steps)
        except RuntimeError as error:
            outcome.append(error)

    for _ in range(2):
        thread = threading.Thread(target=other_run)
        thread.start()
        thread.join(timeout=60)
        plugin.teardown()
    assert isinstance(outcome[0], RuntimeError) and "already driving a run in another thread" in str(outcome[0])
    assert outcome[1] == 1
