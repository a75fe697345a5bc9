"""FSDPMixedPrecision under Lightning's own ``strategy="fsdp"`` on one GPU: Trainer and Fabric, fp16 and bf16, resume.

Lightning runs its FSDPStrategy on GPUs only (the CPU runs, on 2 processes, are in
``tests/distributed/test_fsdp.py``). With one device FSDP keeps whole parameters (``NO_SHARD``), but the wrapping,
FSDP's mixed-precision policy, the plugin's type check, clipping through ``clip_grad_norm_`` and both state-dict types
are the real ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.plugins.precision import FSDPPrecision
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn

from lightning_mp import FSDPMixedPrecision, MixedPrecision
from tests.cuda.matrix import CUDA
from tests.helpers import (
    FEATURES,
    BatchCostRecorder,
    ManualRegressor,
    PluginStateAtStart,
    TinyRegressor,
    loader,
    make_trainer,
)

pytestmark = [
    pytest.mark.cuda,
    CUDA,
    pytest.mark.usefixtures("single_process_group"),
    pytest.mark.filterwarnings("ignore:lightning_mp:UserWarning", "ignore:FSDP is switching to use `NO_SHARD`"),
]

PRECISION_LEVELS = [("16-mixed", "O1"), ("bf16-mixed", "O1"), ("16-mixed", "O2"), ("bf16-mixed", "O2")]
INF_STEP = 2


def counters(plugin: FSDPMixedPrecision) -> tuple[int, int]:
    """Optimizer steps and skipped steps; the state dict waits for the last flag, which a GPU gives one step late."""
    state = plugin.state_dict()["scaler"]["counters"]
    return state["optimizer_steps"], state["skipped_steps"]


@pytest.mark.parametrize(("precision", "opt_level"), PRECISION_LEVELS)
def test_trainer_strategy_fsdp_trains_and_skips(precision: str, opt_level: str) -> None:
    """Trainer(strategy='fsdp') with the plugin trains, clips by norm, and skips the planted inf step only."""
    plugin = FSDPMixedPrecision(precision, opt_level=opt_level, init_scale=2.0**8)
    model = TinyRegressor(inject_at=(INF_STEP,))
    trainer = make_trainer(plugin, accelerator="gpu", devices=1, strategy="fsdp", gradient_clip_val=1.0)
    trainer.fit(model, loader())
    assert counters(plugin) == (8, 1)
    assert all(torch.isfinite(parameter).all() for parameter in model.parameters())


@pytest.mark.parametrize(("precision", "opt_level"), PRECISION_LEVELS)
def test_trainer_strategy_fsdp_manual_optimization_trains_like_the_plain_plugin(precision: str, opt_level: str) -> None:
    """Manual optimization under strategy='fsdp' (manual_backward, clip_gradients, opt.step()) skips the planted inf
    step and follows the same run under the plain plugin on one GPU: same scales and skips, losses within 1e-3."""
    runs = []
    for plugin, strategy in (
        (FSDPMixedPrecision(precision, opt_level=opt_level, init_scale=2.0**8), "fsdp"),
        (MixedPrecision(precision, opt_level=opt_level, init_scale=2.0**8), "auto"),
    ):
        L.seed_everything(0, verbose=False)
        model = ManualRegressor(inject_at=(INF_STEP,))
        trainer = make_trainer(plugin, accelerator="gpu", devices=1, strategy=strategy, use_distributed_sampler=False)
        trainer.fit(model, loader())
        assert counters(plugin) == (8, 1)
        assert all(torch.isfinite(parameter).all() for parameter in model.parameters())
        runs.append(model)
    fsdp, plain = runs
    assert fsdp.steps == plain.steps
    torch.testing.assert_close(fsdp.losses, plain.losses, rtol=0.0, atol=1e-3)


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_trainer_resumes_the_plugin_state_from_fsdp_checkpoints(
    tmp_path: Path, precision: str, state_dict_type: str
) -> None:
    """The scale, counters and skip streak saved in an FSDP checkpoint (full or sharded) come back exactly."""

    def trainer(plugin: FSDPMixedPrecision, max_steps: int, **kwargs: Any) -> L.Trainer:
        strategy = FSDPStrategy(state_dict_type=state_dict_type)
        return make_trainer(plugin, accelerator="gpu", devices=1, strategy=strategy, max_steps=max_steps, **kwargs)

    plugin = FSDPMixedPrecision(precision, init_scale=2.0**8, growth_interval=2)
    first = trainer(plugin, 6)
    first.fit(TinyRegressor(inject_at=(INF_STEP,)), loader())
    checkpoint = tmp_path / "fsdp.ckpt"
    first.save_checkpoint(checkpoint)
    saved = plugin.state_dict()
    recorder = PluginStateAtStart()
    trainer(FSDPMixedPrecision(precision, init_scale=2.0**8, growth_interval=2), 7, callbacks=[recorder]).fit(
        TinyRegressor(), loader(), ckpt_path=checkpoint
    )
    assert recorder.state["scaler"] == saved["scaler"]
    assert recorder.state["precision"] == precision


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
@pytest.mark.parametrize(("precision", "opt_level"), PRECISION_LEVELS)
def test_fabric_strategy_fsdp_trains_skips_and_saves(
    tmp_path: Path, precision: str, opt_level: str, state_dict_type: str
) -> None:
    """Fabric(strategy='fsdp') trains and skips the planted step; fabric.save/load carries the plugin's state."""
    from lightning.fabric.strategies import FSDPStrategy as FabricFSDPStrategy

    plugin = FSDPMixedPrecision(precision, opt_level=opt_level, init_scale=2.0**8)
    strategy = FabricFSDPStrategy(state_dict_type=state_dict_type)
    fabric = Fabric(accelerator="cuda", devices=1, strategy=strategy, plugins=[plugin])
    fabric.launch()
    network = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, 1))
    model, optimizer = fabric.setup(network, torch.optim.SGD(network.parameters(), lr=0.01, momentum=0.9))
    for step, (x, y) in enumerate(loader()):
        x, y = fabric.to_device((x, y))
        fabric.backward(nn.functional.mse_loss(model(x).float(), y))
        if step == INF_STEP:
            next(p.grad for p in network.parameters() if p.grad is not None).view(-1)[0] = float("inf")
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
    fabric.save(tmp_path / "fabric.ckpt", {"model": model, "optimizer": optimizer, "precision": plugin})
    assert counters(plugin) == (8, 1)
    resumed = FSDPMixedPrecision(precision, opt_level=opt_level, init_scale=2.0**8)
    resumed.setup_for_device("cuda")
    state = {"model": model, "optimizer": optimizer, "precision": resumed}
    fabric.load(tmp_path / "fabric.ckpt", state)
    if state["precision"] is not resumed:
        # A sharded checkpoint hands back the entries that are not a module or an optimizer, as saved.
        resumed.load_state_dict(state["precision"])
    assert resumed.state_dict()["scaler"] == plugin.state_dict()["scaler"]
    plugin.teardown()


def test_cpu_offload_trains_and_skips() -> None:
    """strategy='fsdp_cpu_offload' (gradients and the step on the CPU, the loss scale on the GPU) skips the inf step."""
    plugin = FSDPMixedPrecision("16-mixed", init_scale=2.0**8)
    model = TinyRegressor(inject_at=(INF_STEP,))
    make_trainer(plugin, accelerator="gpu", devices=1, strategy="fsdp_cpu_offload").fit(model, loader())
    assert counters(plugin) == (8, 1)
    assert all(torch.isfinite(parameter).all() for parameter in model.parameters())


@pytest.mark.parametrize("optimizer", ["sgd", "fused-adam"])
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_host_syncs_per_step_are_no_more_than_lightnings_fsdp_precision(precision: str, optimizer: str) -> None:
    """A steady-state FSDP step syncs the host no more often than under Lightning's own FSDPPrecision."""
    syncs: dict[str, list[int]] = {}
    for name, plugin in (("ours", FSDPMixedPrecision(precision)), ("lightning", FSDPPrecision(precision))):
        recorder = BatchCostRecorder()
        callbacks = [recorder.opener(), recorder.closer()]
        trainer = make_trainer(plugin, accelerator="gpu", devices=1, strategy="fsdp", callbacks=callbacks)
        trainer.fit(TinyRegressor(optimizer=optimizer), loader())
        # The first steps create the optimizer states (fused SGD's momentum decides its first step on the host).
        syncs[name] = [counts.syncs for counts in recorder.per_batch[3:]]
    assert max(syncs["ours"]) <= min(syncs["lightning"]), syncs


def test_lightnings_own_fsdp_precision_resumes_from_the_plugins_checkpoint(tmp_path: Path) -> None:
    """Lightning's FSDPPrecision('16-mixed') resumes an FSDPMixedPrecision checkpoint at the scale it reached."""
    plugin = FSDPMixedPrecision("16-mixed", init_scale=2.0**8)
    trainer = make_trainer(plugin, accelerator="gpu", devices=1, strategy="fsdp", max_steps=4)
    trainer.fit(TinyRegressor(inject_at=(1,)), loader())
    trainer.save_checkpoint(tmp_path / "fsdp.ckpt")
    lightning = FSDPPrecision("16-mixed")
    make_trainer(lightning, accelerator="gpu", devices=1, strategy="fsdp", max_steps=4).fit(
        TinyRegressor(), loader(), ckpt_path=tmp_path / "fsdp.ckpt"
    )
    assert lightning.scaler is not None
    assert lightning.scaler.get_scale() == 2.0**7
