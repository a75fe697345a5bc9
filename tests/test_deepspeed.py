"""DeepSpeedMixedPrecision: the plugin's settings become DeepSpeed's, DeepSpeed's skips become the plugin's counters,
and a skipped step holds the learning rate, on real DeepSpeed engines (ZeRO 1-3, fp16 and bf16) on the CPU."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import DeepSpeedMixedPrecision, LossScaleMonitor, MixedPrecision
from lightning_mp.deepspeed import deepspeed_precision_config
from tests.ddp_scripts.launch import clean_environment, free_port, reports, run
from tests.deepspeed_helpers import (
    CPUDeepSpeedStrategy,
    CPUFabricDeepSpeedStrategy,
    deepspeed_on_cpu,
    deepspeed_trainer,
)
from tests.helpers import read_events, scalars

PLANTED_AT = 3
LR = 1e-2


@pytest.fixture(autouse=True)
def functional_linear_restored() -> Any:
    """ZeRO 3 replaces torch.nn.functional.linear with DeepSpeed's own for the rest of the process (its
    ``memory_efficient_linear``, "persists unless manually reset"): put torch's back for the tests that follow."""
    linear = torch.nn.functional.linear
    yield
    torch.nn.functional.linear = linear


def test_the_plugins_settings_become_deepspeeds_precision_section() -> None:
    fp16 = DeepSpeedMixedPrecision("16-mixed", init_scale=2.0**12, growth_interval=50, hysteresis=3, min_scale=2.0)
    assert deepspeed_precision_config(fp16.settings) == {
        "fp16": {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": 12,
            "loss_scale_window": 50,
            "hysteresis": 3,
            "consecutive_hysteresis": False,
            "min_loss_scale": 2.0,
        }
    }
    static = DeepSpeedMixedPrecision("16-mixed", loss_scale=128.0)
    assert deepspeed_precision_config(static.settings)["fp16"]["loss_scale"] == 128.0
    bf16 = DeepSpeedMixedPrecision("bf16-mixed")
    assert deepspeed_precision_config(bf16.settings) == {"bf16": {"enabled": True, "check_grad_overflow": True}}
    assert deepspeed_precision_config(DeepSpeedMixedPrecision("32-true").settings) == {}


@pytest.mark.parametrize(
    ("precision", "arguments", "named"),
    [
        ("16-mixed", {"opt_level": "O1"}, "opt_level='O1'"),
        ("bf16-mixed", {"opt_level": "lean-exact"}, "opt_level='lean-exact'"),
        ("16-mixed", {"growth_factor": 4.0}, "growth_factor=4.0"),
        ("16-mixed", {"backoff_factor": 0.25}, "backoff_factor=0.25"),
        ("16-mixed", {"init_scale": 1000.0}, "init_scale=1000.0"),
        ("16-mixed", {"max_scale": 2.0**20}, "max_scale=1048576.0"),
        ("bf16-mixed", {"keep_fp32": ["head"]}, "keep_fp32="),
        ("bf16-mixed", {"eval_precision": "32-true"}, "eval_precision='32-true'"),
        ("16-mixed", {"scale_per_optimizer": True}, "scale_per_optimizer=True"),
        ("bf16-mixed", {"fp8": "tensorwise"}, "fp8='tensorwise'"),
        ("16-mixed", {"scaler": torch.amp.GradScaler("cpu")}, "scaler=..."),
        ("bf16-true", {}, "precision="),
    ],
)
def test_what_deepspeed_cannot_express_is_refused_by_name(
    precision: str, arguments: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValueError, match=rf"DeepSpeedMixedPrecision\({named}.*is not (allowed|supported)"):
        DeepSpeedMixedPrecision(precision, **arguments)


def test_counters_resume_from_the_plugins_state_and_a_malformed_one_is_refused() -> None:
    plugin = DeepSpeedMixedPrecision("16-mixed")
    plugin.load_state_dict(
        {
            "counters": {
                "optimizer_steps": 7,
                "skipped_steps": 2,
                "scale_backoffs": 1,
                "scale_growths": 0,
                "consecutive_skips": 0,
            },
            "loss_scale": 32768.0,
        }
    )
    assert (plugin.stats.optimizer_steps, plugin.stats.skipped_steps, plugin.stats.loss_scale) == (7, 2, 32768.0)
    assert DeepSpeedMixedPrecision("16-mixed").state_dict()["counters"]["optimizer_steps"] == 0
    with pytest.raises(ValueError, match=r"counters\['skipped_steps'\]=None"):
        plugin.load_state_dict({"counters": {"optimizer_steps": 1}})


class Regression(L.LightningModule):
    """A small MLP with a per-step scheduler that halves the learning rate; a NaN loss at one global step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        self.planted = False

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        features, target = batch
        loss = nn.functional.mse_loss(self.net(features).float(), target)
        if self.global_step == PLANTED_AT and not self.planted:
            self.planted = True
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=LR)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(64, 16, generator=generator)
    return DataLoader(TensorDataset(features, features[:, :1] * 2), batch_size=8)


def fit(plugin: Any, tmp_path: Path, stage: int = 2, **strategy: Any) -> L.Trainer:
    deepspeed_on_cpu()
    trainer = deepspeed_trainer(
        plugin,
        CPUDeepSpeedStrategy(stage=stage, **strategy),
        logger=L.pytorch.loggers.TensorBoardLogger(tmp_path, name="", version=""),
        callbacks=[LossScaleMonitor()],
        log_every_n_steps=1,
    )
    trainer.fit(Regression(), loader())
    return trainer


@pytest.mark.parametrize(
    ("precision", "stage"),
    [
        ("bf16-mixed", 2),
        pytest.param("bf16-mixed", 1, marks=pytest.mark.slow),
        pytest.param("bf16-mixed", 3, marks=pytest.mark.slow),
        pytest.param("16-mixed", 2, marks=pytest.mark.slow),
    ],
)
def test_a_step_deepspeed_skips_is_counted_logged_and_holds_the_learning_rate(
    precision: str, stage: int, tmp_path: Path
) -> None:
    """The planted NaN is skipped by DeepSpeed; the plugin counts what the engine counted, LossScaleMonitor logs it,
    and the learning rate halved once per applied step only (Lightning alone would halve it at every step)."""
    plugin = DeepSpeedMixedPrecision(precision)
    trainer = fit(plugin, tmp_path, stage)
    engine: Any = trainer.strategy.model
    stats = plugin.stats
    assert stats.optimizer_steps == 6
    assert stats.skipped_steps == engine.skipped_steps >= 1
    applied = stats.optimizer_steps - stats.skipped_steps
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(LR * 0.5**applied)
    if precision == "16-mixed":
        assert stats.loss_scale == engine.optimizer.loss_scale < 2.0**16
        assert stats.scale_backoffs >= 1
    else:
        assert stats.loss_scale == 1.0
        assert stats.skipped_steps == 1
    assert all(torch.isfinite(p).all() for p in engine.module.parameters())
    events = read_events(tmp_path)
    skipped, scales = scalars(events, "precision/skipped_steps_total"), scalars(events, "precision/loss_scale")
    assert skipped[max(skipped)] == stats.skipped_steps
    assert scales[max(scales)] == stats.loss_scale


def test_a_precision_section_of_the_strategys_own_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"DeepSpeedStrategy has a 'fp16' precision section of its own"):
        fit(DeepSpeedMixedPrecision("16-mixed"), tmp_path, loss_scale=128.0)


def test_mixed_precision_under_deepspeed_is_refused_naming_the_deepspeed_plugin(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"DeepSpeedMixedPrecision\('bf16-mixed'\)"):
        fit(MixedPrecision("bf16-mixed"), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_a_nan_on_one_of_two_ranks_skips_the_step_on_both_and_holds_both_learning_rates(
    precision: str, tmp_path: Path
) -> None:
    """Two CPU processes (gloo) under ZeRO 2: DeepSpeed decides the skip over both ranks; the ranks agree."""
    deepspeed_on_cpu()
    script = Path(__file__).resolve().parent / "ddp_scripts" / "deepspeed_train.py"
    env = clean_environment(MASTER_PORT=str(free_port()), DS_ACCELERATOR="cpu")
    run(["--out", str(tmp_path), "--precision", precision], timeout=120, env=env, script=script)
    ranks = reports(tmp_path)
    assert ranks[0] == ranks[1]
    assert ranks[0]["skipped_steps"] == ranks[0]["engine_skipped_steps"] >= 1
    assert ranks[0]["finite"]
    applied = ranks[0]["optimizer_steps"] - ranks[0]["skipped_steps"]
    assert ranks[0]["lr"] == pytest.approx(LR * 0.5**applied)


def test_with_gradient_accumulation_only_the_boundary_steps_are_counted(tmp_path: Path) -> None:
    """accumulate_grad_batches=2: DeepSpeed steps every second batch, and the plugin counts those steps only."""
    plugin = DeepSpeedMixedPrecision("bf16-mixed")
    trainer = deepspeed_trainer(plugin, max_steps=4, accumulate_grad_batches=2)
    trainer.fit(Regression(), loader())
    assert plugin.stats.optimizer_steps == trainer.global_step == 4
    assert plugin.stats.skipped_steps == 1  # the planted NaN
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(LR * 0.5**3)


def test_a_resumed_run_continues_the_counters_deepspeeds_scale_and_the_held_schedule(tmp_path: Path) -> None:
    """Lightning's DeepSpeed checkpoint keeps the plugin's counters and DeepSpeed's own scaler; resumed, the counts
    go on from there and the learning rate has halved once per applied step over both runs."""
    first = DeepSpeedMixedPrecision("16-mixed")
    trainer = deepspeed_trainer(first, max_steps=4)
    trainer.fit(Regression(), loader())
    trainer.save_checkpoint(tmp_path / "checkpoint")
    saved = first.stats
    resumed = DeepSpeedMixedPrecision("16-mixed")
    trainer = deepspeed_trainer(resumed, max_steps=6)
    model = Regression()
    model.planted = True  # the NaN belongs to the first run's step 3
    trainer.fit(model, loader(), ckpt_path=tmp_path / "checkpoint")
    engine: Any = trainer.strategy.model
    assert resumed.stats.optimizer_steps == 6
    assert resumed.stats.skipped_steps >= saved.skipped_steps >= 1
    assert resumed.stats.loss_scale == engine.optimizer.loss_scale <= saved.loss_scale
    applied = resumed.stats.optimizer_steps - resumed.stats.skipped_steps
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(LR * 0.5**applied)


def assert_first_fabric_backward_refused(plugin: Any, error: type[Exception], match: str) -> None:
    """Under Fabric's DeepSpeedStrategy (ZeRO 2, its own loss-scale arguments), the first backward raises ``error``
    matching ``match``, and the weights are untouched."""
    deepspeed_on_cpu()
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=CPUFabricDeepSpeedStrategy(stage=2), plugins=[plugin])
    fabric.launch()
    torch.manual_seed(0)
    model = nn.Linear(16, 1)
    module, _ = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(error, match=match):
        fabric.backward(module(torch.randn(8, 16)).float().square().mean())
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))


def test_under_fabrics_deepspeed_strategy_mixed_precision_is_refused_naming_the_deepspeed_plugin() -> None:
    """Fabric's DeepSpeedStrategy casts and scales with DeepSpeed's engine: MixedPrecision there would scale twice.
    It is refused at the first backward, before any step, naming the plugin that runs there."""
    match = r"does not run under Fabric's DeepSpeedStrategy.*DeepSpeedMixedPrecision"
    assert_first_fabric_backward_refused(MixedPrecision("16-mixed"), TypeError, match)


def fabric_run(plugin: DeepSpeedMixedPrecision, strategy: Any, steps: int = 6) -> tuple[Any, Any, list[float]]:
    """Train :class:`Regression`'s network under Fabric for ``steps`` steps, a NaN loss planted at step 3, with the
    step scheduler given to ``fabric.setup``; returns the engine, the scheduler and the losses."""
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy, plugins=[plugin])
    fabric.launch()
    torch.manual_seed(0)
    network = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(network.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = fabric.setup(network, optimizer, scheduler=scheduler)
    losses = []
    for step, (features, target) in zip(range(steps), loader(), strict=False):
        loss = nn.functional.mse_loss(model(features).float(), target)
        fabric.backward(loss * float("nan") if step == PLANTED_AT else loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return strategy.model, scheduler, losses


@pytest.mark.parametrize(
    ("precision", "stage"),
    [("bf16-mixed", 2), ("16-mixed", 2), pytest.param("16-mixed", 3, marks=pytest.mark.slow)],
)
def test_under_fabric_the_deepspeed_plugin_counts_deepspeeds_skip_and_deepspeed_holds_the_scheduler(
    precision: str, stage: int
) -> None:
    """Fabric's DeepSpeedStrategy built from the plugin's arguments trains; the planted NaN is skipped by DeepSpeed,
    counted by the plugin, and the scheduler given to fabric.setup halves the rate once per applied step only."""
    deepspeed_on_cpu()
    scaler = {"init_scale": 2.0**12, "hysteresis": 1} if precision == "16-mixed" else {}
    plugin = DeepSpeedMixedPrecision(precision, **scaler)
    strategy = CPUFabricDeepSpeedStrategy(stage=stage, **plugin.strategy_arguments())
    engine, scheduler, losses = fabric_run(plugin, strategy)
    stats = plugin.stats
    assert stats.optimizer_steps == 6
    assert stats.skipped_steps == engine.skipped_steps == 1
    assert scheduler.get_last_lr()[0] == pytest.approx(LR * 0.5**5)
    assert all(torch.isfinite(p).all() for p in engine.module.parameters())
    assert sum(math.isnan(loss) for loss in losses) == 0  # the NaN was planted in the backward's loss only
    if precision == "16-mixed":
        assert stats.loss_scale == engine.optimizer.loss_scale == 2.0**11
        assert stats.scale_backoffs == 1
    assert plugin.state_dict()["counters"]["skipped_steps"] == 1


def test_under_fabric_a_strategy_built_without_the_plugins_settings_stops_before_the_first_step() -> None:
    """The strategy's own loss-scale arguments (2**16) against the plugin's init_scale=2**12: refused at the first
    backward, naming the setting and how to pass the plugin's; the weights are untouched."""
    plugin = DeepSpeedMixedPrecision("16-mixed", init_scale=2.0**12)
    match = r"init_scale=65536, plugin 4096.*plugin\.strategy_arguments\(\)"
    assert_first_fabric_backward_refused(plugin, ValueError, match)


def test_strategy_arguments_carry_the_fp16_settings_and_refuse_what_the_strategy_cannot_take() -> None:
    arguments = DeepSpeedMixedPrecision("16-mixed", init_scale=2.0**10, growth_interval=50, min_scale=4.0)
    assert arguments.strategy_arguments() == {
        "loss_scale": 0,
        "initial_scale_power": 10,
        "loss_scale_window": 50,
        "hysteresis": 2,
        "min_loss_scale": 4.0,
    }
    assert DeepSpeedMixedPrecision("bf16-mixed").strategy_arguments() == {}
    with pytest.raises(ValueError, match=r"consecutive_hysteresis=True.*config="):
        DeepSpeedMixedPrecision("16-mixed", consecutive_hysteresis=True).strategy_arguments()


def test_under_fabric_the_plugins_counters_go_into_fabric_save_and_come_back_with_fabric_load(tmp_path: Path) -> None:
    """The plugin is a stateful object of fabric.save's state under DeepSpeed; a new plugin loads its counters and
    the last scale seen, and DeepSpeed's own checkpoint keeps its scaler."""
    deepspeed_on_cpu()
    plugin = DeepSpeedMixedPrecision("16-mixed", init_scale=2.0**12, hysteresis=1)
    fabric = L.Fabric(
        accelerator="cpu",
        devices=1,
        strategy=CPUFabricDeepSpeedStrategy(stage=2, **plugin.strategy_arguments()),
        plugins=[plugin],
    )
    fabric.launch()
    torch.manual_seed(0)
    network = nn.Linear(16, 1)
    model, optimizer = fabric.setup(network, torch.optim.AdamW(network.parameters(), lr=LR))
    for step in range(3):
        loss = model(torch.randn(8, 16)).float().square().mean()
        fabric.backward(loss * float("nan") if step == 1 else loss)
        optimizer.step()
        optimizer.zero_grad()
    fabric.save(tmp_path / "checkpoint", {"model": model, "optimizer": optimizer, "plugin": plugin})
    resumed = DeepSpeedMixedPrecision("16-mixed", init_scale=2.0**12, hysteresis=1)
    fabric.load(tmp_path / "checkpoint", {"model": model, "optimizer": optimizer, "plugin": resumed})
    assert resumed.stats == plugin.stats
    assert (resumed.stats.optimizer_steps, resumed.stats.skipped_steps) == (3, 1)
    assert resumed.stats.loss_scale == 2.0**11


def test_under_fabric_a_step_with_a_closure_is_refused_by_name() -> None:
    """DeepSpeed's engine takes no closure: optimizer.step(closure) under Fabric says so instead of a TypeError from
    inside DeepSpeed."""
    deepspeed_on_cpu()
    plugin = DeepSpeedMixedPrecision("bf16-mixed")
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=CPUFabricDeepSpeedStrategy(stage=2), plugins=[plugin])
    fabric.launch()
    model = nn.Linear(16, 1)
    module, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))

    def closure() -> Tensor:
        loss = module(torch.randn(8, 16)).float().square().mean()
        fabric.backward(loss)
        return loss

    closure()
    with pytest.raises(TypeError, match=r"optimizer\.step\(closure\) is not allowed under DeepSpeedStrategy"):
        optimizer.step(closure)
