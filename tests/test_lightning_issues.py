"""Lightning's precision issues, each rebuilt here and answered by the plugin (the FAQ lists them).

Each test names the issue, rebuilds its scenario with the plugin in place of Lightning's own precision, and asserts
what the issue asked for. Where the plugin needs an optional extra (FP8: torchao), the test skips without it.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard

from lightning_mp import FSDPMixedPrecision, MixedPrecision
from lightning_mp.fp8.convert import fp8_unavailable
from tests.helpers import CPUFSDPStrategy, TinyRegressor, loader, make_trainer

SCHEDULER_ORDER_WARNING = "Detected call of `lr_scheduler.step()` before `optimizer.step()`"


class OverflowingFirstStep(TinyRegressor):
    """The issues' model: its loss is multiplied up so that fp16's first backward overflows, with a step scheduler."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(scheduler=True, **kwargs)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * (1e8 if self.global_step == 0 else 1.0)


@pytest.mark.parametrize("issue", [5558, 21339, 16228, 18828])
def test_issue_5558_a_skipped_step_holds_the_scheduler_without_torchs_order_warning(issue: int) -> None:
    """Lightning #5558, #21339, #16228, #18828: fp16 skips the first step, Lightning still steps the scheduler and
    torch warns "lr_scheduler.step() before optimizer.step()". Here the scheduler is held on the skipped step, so the
    learning rate moves only with the steps taken, and torch has nothing to warn about."""
    plugin = MixedPrecision("16-mixed", init_scale=2.0**8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(plugin, max_steps=4)
        trainer.fit(OverflowingFirstStep(), loader())
    assert not [w for w in caught if SCHEDULER_ORDER_WARNING in str(w.message)]
    assert (plugin.stats.optimizer_steps, plugin.stats.skipped_steps) == (4, 1)
    # StepLR(gamma=0.5) halves per step taken: three of the four, from 0.05.
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == 3 and trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 / 8)


def test_issue_17272_the_scalers_settings_are_the_users() -> None:
    """Lightning #17272: the plugin built its GradScaler with torch's defaults only. Here every setting is an argument,
    and a torch GradScaler given as ``scaler=`` is honoured as it was built."""
    by_argument = MixedPrecision("16-mixed", init_scale=2.0**10, growth_interval=2)
    by_scaler = MixedPrecision("16-mixed", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2))
    for plugin in (by_argument, by_scaler):
        make_trainer(plugin, max_steps=4).fit(TinyRegressor(), loader())
        # 1024 grows once after two clean iterations and again after four.
        assert plugin.stats.loss_scale == 2.0**12 and plugin.stats.scale_growths == 2


def test_issue_19803_fsdp_keeps_a_custom_scaler(single_process_group: None) -> None:
    """Lightning #19803: FSDPPrecision dropped a scaler given for "16-mixed". Here the FSDP form takes it, and the run
    under FSDPStrategy scales from its settings."""
    plugin = FSDPMixedPrecision("16-mixed", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**9, growth_interval=3))
    make_trainer(plugin, strategy=CPUFSDPStrategy(), max_steps=3).fit(TinyRegressor(), loader())
    assert plugin.stats.loss_scale == 2.0**10 and plugin.stats.optimizer_steps == 3


def test_issue_21815_fsdp_autocasts_on_the_cpu() -> None:
    """Lightning #21815: FSDPPrecision hardcodes "cuda" in its forward context, so bf16 autocast is off on a CPU. Here
    autocast runs on the run's device."""
    plugin = FSDPMixedPrecision("bf16-mixed", device="cpu")
    plugin.setup_for_device("cpu")
    with plugin.forward_context():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert (torch.randn(2, 4) @ torch.randn(4, 2)).dtype == torch.bfloat16


class GradientNorms(TinyRegressor):
    """Records the gradient norm a user logs in ``on_before_optimizer_step`` (the hook Lightning documents for it)."""

    def __init__(self) -> None:
        super().__init__(lr=0.0)
        self.norms: list[float] = []

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.norms.append(torch.nn.utils.get_total_norm([p.grad for p in self.parameters()]).item())


@pytest.mark.parametrize("issue", [11407, 4151, 9205])
def test_issue_11407_gradients_are_read_and_logged_unscaled(issue: int) -> None:
    """Lightning #11407, #4151, #9205: with fp16 the gradients logged were the scaled ones, 65536 times too large.
    Here ``on_before_optimizer_step`` reads the true gradients: the norms are fp32's within fp16's rounding."""
    fp16, fp32 = GradientNorms(), GradientNorms()
    fp32.load_state_dict(fp16.state_dict())
    make_trainer(MixedPrecision("16-mixed", init_scale=2.0**8), max_steps=3).fit(fp16, loader())
    make_trainer(MixedPrecision("32-true"), max_steps=3).fit(fp32, loader())
    assert fp16.norms == pytest.approx(fp32.norms, rel=1e-2)


@pytest.mark.parametrize("issue", [9330, 9694])
def test_issue_9330_clipping_clips_the_true_gradients(issue: int) -> None:
    """Lightning #9330, #9694: gradients were clipped while still scaled, so clipping did almost nothing. Here the
    clipped norm that the step applies is the clip value, as in fp32."""
    model = GradientNorms()

    class AfterClipping(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
            grads = [p.grad for p in pl_module.parameters()]
            model.norms.append(-torch.nn.utils.get_total_norm(grads).item())

    plugin = MixedPrecision("16-mixed", init_scale=2.0**8)
    make_trainer(plugin, max_steps=3, gradient_clip_val=1e-3, callbacks=[AfterClipping()]).fit(model, loader())
    clipped = [-norm for norm in model.norms if norm < 0]
    assert clipped == pytest.approx([1e-3] * 3, rel=1e-2)


def test_issue_18510_fabric_16_mixed_scales_the_loss() -> None:
    """Lightning #18510: Fabric's "16-mixed" stepped without a loss scale. Here ``fabric.backward`` scales the loss,
    the step unscales, and a planted overflow is skipped."""
    plugin = MixedPrecision("16-mixed", init_scale=2.0**8)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model, optimizer = fabric.setup(nn.Linear(4, 1), torch.optim.SGD(nn.Linear(4, 1).parameters(), lr=0.1))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(3):
        loss = model(torch.randn(8, 4)).float().pow(2).mean() * (1e8 if step == 1 else 1.0)
        fabric.backward(loss)
        assert step == 1 or model.weight.grad.abs().max() > 0
        optimizer.step()
        optimizer.zero_grad()
    assert (plugin.stats.optimizer_steps, plugin.stats.skipped_steps) == (3, 1)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_issue_19902_fp16_with_a_scaler_under_fsdp2(single_process_group: None) -> None:
    """Lightning #19902: fp16 with a loss scaler under FSDP2 (ModelParallelStrategy). Here the plugin scales, checks the
    sharded gradients and skips a step whose gradients overflowed, leaving the shards finite."""
    plugin = MixedPrecision("16-mixed", init_scale=2.0**8)

    def shard(module: nn.Module, device_mesh: Any) -> nn.Module:
        return fully_shard(module, mesh=device_mesh["data_parallel"], mp_policy=plugin.fsdp2_policy())

    strategy = ModelParallelStrategy(parallelize_fn=shard, data_parallel_size=1, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, plugins=[plugin])
    fabric.launch()
    model = fabric.setup_module(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    for step in range(3):
        loss = model(torch.randn(4, 8)).float().pow(2).mean() * (1e8 if step == 1 else 1.0)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    assert (plugin.stats.optimizer_steps, plugin.stats.skipped_steps) == (3, 1)
    assert all(torch.isfinite(p.full_tensor()).all() for p in model.parameters())


def test_issue_20606_evaluation_in_its_own_precision() -> None:
    """Lightning #20606: validate in another precision than training. Here ``eval_precision`` does, and training is
    unaffected (tests/plugin/test_eval_precision.py checks that bitwise)."""
    seen: list[torch.dtype] = []

    class Validated(TinyRegressor):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            seen.append(self(batch[0]).dtype)

    make_trainer(MixedPrecision("16-mixed", eval_precision="bf16-true"), max_steps=2).fit(
        Validated(), loader(), loader(16)
    )
    assert seen and set(seen) == {torch.bfloat16}


@pytest.mark.skipif(fp8_unavailable() is not None, reason=f"the FP8 mode {fp8_unavailable()}")
@pytest.mark.parametrize("issue", [18679, 21425])
def test_issue_18679_fp8_in_the_same_plugin(issue: int) -> None:
    """Lightning #18679, #21425: FP8 training from Lightning's own precision flag. Here ``fp8=`` in the same plugin
    trains the linear layers in FP8 (torchao's float8 linears during fit, plain linears after)."""
    from lightning_mp.fp8.convert import is_fp8_linear

    seen: list[bool] = []

    class Wide(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            seen.append(is_fp8_linear(self.net[2]))
            return self.net(batch[0]).float().pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 32)), batch_size=16)
    model = Wide()
    make_trainer(MixedPrecision("bf16-mixed", fp8="tensorwise"), max_steps=2).fit(model, data)
    assert seen == [True, True] and not is_fp8_linear(model.net[2])
