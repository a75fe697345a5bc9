"""Lightning's own tests of its FSDP precision plugins, rewritten for lightning_mp's FSDPMixedPrecision on the CPU.

The sources are ``tests_pytorch/plugins/precision/test_fsdp.py``, ``tests_fabric/plugins/precision/test_fsdp.py``
and the FSDP case of both ``test_all.py``. Lightning's unit tests put mocks in place of the scaler, the model and the
optimizer. Here a real FSDP1 run on one CPU process (gloo; the tests' ``CPUFSDPStrategy`` and
``CPUFabricFSDPStrategy``) scales, skips and steps. The opt level decides how FSDP's own mixed precision is set
(:mod:`lightning_mp.fsdp`), so the expected dtypes differ from Lightning's FSDPPrecision where the opt level says so.
Every test names the upstream test it adapts. ``tests/upstream_inventory/`` lists each upstream test as adapted,
skipped or deliberately different, with the reason for each.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from lightning_mp import FSDPMixedPrecision, LossScaler
from tests.helpers import CPUFabricFSDPStrategy, CPUFSDPStrategy, TinyRegressor, loader, make_trainer

pytestmark = pytest.mark.filterwarnings(
    "ignore:FSDP is switching to use `NO_SHARD`",
    "ignore:Please use DTensor instead:FutureWarning",
)

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.mark.parametrize(
    ("precision", "opt_level", "expected"),
    [
        ("16-mixed", "O1", (FP32, FP32, FP32)),
        ("bf16-mixed", "O1", (FP32, FP32, FP32)),
        ("16-mixed", "O2", (FP16, FP32, FP16)),
        ("bf16-mixed", "O2", (BF16, FP32, BF16)),
        ("32-true", "O1", (FP32, FP32, FP32)),
    ],
)
def test_the_fsdp_config_follows_the_opt_level(precision, opt_level, expected):
    """(param, buffer, reduce) dtypes: O1 keeps FSDP in fp32 and autocasts; O2 gathers and reduces in half.

    Lightning's '16-mixed' and 'bf16-mixed' keep fp32 parameters but half buffers and reductions; this plugin's O1
    reduces in fp32, exactly as DDP does, and keeps buffers (BatchNorm statistics) in fp32 at every level. The '-true'
    precisions are O3 and lean here, which FSDP refuses (:func:`test_half_weight_precisions_are_refused_naming_o2`).

    Upstream: tests_pytorch/plugins/precision/test_fsdp.py and tests_fabric/plugins/precision/test_fsdp.py
    test_fsdp_precision_config (differs).
    """
    config = FSDPMixedPrecision(precision, opt_level=opt_level).mixed_precision_config
    assert (config.param_dtype, config.buffer_dtype, config.reduce_dtype) == expected


@pytest.mark.parametrize(("given", "meant"), [("16-true", "16-mixed"), ("bf16-true", "bf16-mixed")])
def test_half_weight_precisions_are_refused_naming_o2(given, meant):
    """'16-true' and 'bf16-true' are not precisions of this plugin: refused, naming the mixed one to use.

    Upstream: tests_pytorch/plugins/precision/test_fsdp.py and tests_fabric/plugins/precision/test_fsdp.py
    test_fsdp_precision_config (its '-true' cases; differs).
    """
    with pytest.raises(ValueError, match=rf"precision={given!r}.*Did you mean precision={meant!r}"):
        FSDPMixedPrecision(given)
    with pytest.raises(ValueError, match=r"opt_level='O2'"):
        FSDPMixedPrecision(meant, opt_level="O3")


def test_the_fp16_scaler_is_a_sharding_aware_loss_scaler_built_at_setup(single_process_group):
    """fp16 under FSDP gets a LossScaler at setup (it checks each rank's shards and agrees on skips), not torch's.

    Lightning builds torch's ``ShardedGradScaler`` in the constructor. This plugin builds its own scaler at setup,
    which checks each rank's shards and makes every rank skip together as ShardedGradScaler does, and adds the
    plugin's hysteresis, bounds and counters.

    Upstream: tests_pytorch/plugins/precision/test_fsdp.py and tests_fabric/plugins/precision/test_fsdp.py
    test_fsdp_precision_default_scaler (differs).
    """
    plugin = FSDPMixedPrecision("16-mixed")
    assert plugin.scaler is None
    fabric = Fabric(accelerator="cpu", devices=1, strategy=CPUFabricFSDPStrategy(), plugins=[plugin])
    fabric.launch()
    fabric.setup_module(TinyRegressor())
    assert isinstance(plugin.scaler, LossScaler) and not isinstance(plugin.scaler, ShardedGradScaler)
    plugin.teardown()


def test_bf16_under_fsdp_refuses_a_scaler_and_has_none():
    """A scaler given with bf16 is refused with Lightning's reason; a bf16 plugin has no scaler.

    Upstream: tests_pytorch/plugins/precision/test_fsdp.py and tests_fabric/plugins/precision/test_fsdp.py
    test_fsdp_precision_scaler_with_bf16.
    """
    with pytest.raises(ValueError, match="`precision='bf16-mixed'` does not use a scaler"):
        FSDPMixedPrecision("bf16-mixed", scaler=torch.amp.GradScaler("cpu"))
    plugin = FSDPMixedPrecision("bf16-mixed")
    plugin.setup_for_device("cpu")
    assert plugin.scaler is None


@pytest.mark.parametrize(("precision", "half"), [("16-mixed", FP16), ("bf16-mixed", BF16)])
def test_the_forward_context_autocasts_in_the_half_dtype(precision, half):
    """Inside the forward context autocast is on in the half dtype, and the default dtype stays fp32.

    Upstream: tests_pytorch/plugins/precision/test_fsdp.py and tests_fabric/plugins/precision/test_fsdp.py
    test_fsdp_precision_forward_context (its mixed cases, on the CPU instead of CUDA).
    """
    plugin = FSDPMixedPrecision(precision)
    plugin.setup_for_device("cpu")
    with plugin.forward_context():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") is half
        assert torch.get_default_dtype() is FP32


def _squared_gradient_norm(module: nn.Module) -> float:
    return sum(float(p.grad.float().pow(2).sum()) for p in module.parameters() if p.grad is not None)


def test_fabric_fsdp_backward_scales_the_loss_and_a_step_skips_an_inf(single_process_group):
    """Under Fabric's FSDP, backward leaves scaled gradients, an inf skips the step, and a clean step moves weights.

    Upstream: tests_fabric/plugins/precision/test_fsdp.py test_fsdp_precision_backward and
    test_fsdp_precision_optimizer_step_with_scaler.
    """
    scale = 2.0**8
    plugin = FSDPMixedPrecision("16-mixed", init_scale=scale, growth_interval=1)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=CPUFabricFSDPStrategy(), plugins=[plugin])
    fabric.launch()
    torch.manual_seed(0)
    reference = TinyRegressor()
    module = fabric.setup_module(copy.deepcopy(reference))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(module.parameters(), lr=0.05))
    x, y = next(iter(loader()))

    fabric.backward(nn.functional.mse_loss(module(x).float(), y))
    with torch.autocast("cpu", dtype=FP16, cache_enabled=False):
        out = reference(x)
    nn.functional.mse_loss(out.float(), y).backward()  # the same loss on the same weights, without FSDP and scaling
    expected = _squared_gradient_norm(reference) * scale**2
    torch.testing.assert_close(_squared_gradient_norm(module), expected, rtol=1e-3, atol=0.0)

    before = [p.detach().clone() for p in module.parameters()]
    next(p for p in module.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
    optimizer.step()
    assert all(torch.equal(b, p) for b, p in zip(before, module.parameters(), strict=True))
    optimizer.zero_grad()
    fabric.backward(nn.functional.mse_loss(module(x).float(), y))
    optimizer.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, module.parameters(), strict=True))
    assert (plugin.stats.optimizer_steps, plugin.stats.skipped_steps) == (2, 1)
    plugin.teardown()


class ScaledGradientsSeen(TinyRegressor):
    """Records whether the gradients after backward are the loss scale times those before the step."""

    def on_after_backward(self) -> None:
        super().on_after_backward()
        self.after_backward = _squared_gradient_norm(self)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.ratios.append(self.after_backward / _squared_gradient_norm(self))

    def on_train_start(self) -> None:
        self.ratios: list[float] = []


def test_trainer_fsdp_scales_before_backward_unscales_before_the_step_and_skips_an_inf(single_process_group):
    """Under the Trainer's FSDP, gradients after backward are scaled, unscaled before the step; an inf step is skipped.

    Upstream: tests_pytorch/plugins/precision/test_fsdp.py test_fsdp_precision_backward and
    test_fsdp_precision_optimizer_step_with_scaler.
    """
    scale = 2.0**8
    plugin = FSDPMixedPrecision("16-mixed", init_scale=scale, growth_interval=100)
    model = ScaledGradientsSeen(inject_at=(2,))
    make_trainer(plugin, strategy=CPUFSDPStrategy(), max_steps=4).fit(model, loader())
    clean = [ratio for step, ratio in enumerate(model.ratios) if step != 2]
    assert clean == pytest.approx([scale**2, scale**2, (scale / 2) ** 2], rel=1e-3)  # backed off after the inf
    assert (plugin.stats.optimizer_steps, plugin.stats.skipped_steps, plugin.stats.loss_scale) == (4, 1, scale / 2)


@pytest.mark.parametrize("front", ["trainer", "fabric"])
def test_bf16_under_fsdp_steps_without_a_scaler(front, single_process_group):
    """In bf16 nothing is scaled: the optimizer steps the weights, and the scale stays 1.

    Upstream: tests_pytorch/plugins/precision/test_fsdp.py and tests_fabric/plugins/precision/test_fsdp.py
    test_fsdp_precision_optimizer_step_without_scaler.
    """
    plugin = FSDPMixedPrecision("bf16-mixed")
    torch.manual_seed(0)
    model = TinyRegressor()
    before = [p.detach().clone() for p in model.parameters()]
    if front == "trainer":
        make_trainer(plugin, strategy=CPUFSDPStrategy(), max_steps=2).fit(model, loader())
        parameters = list(model.parameters())
    else:
        fabric = Fabric(accelerator="cpu", devices=1, strategy=CPUFabricFSDPStrategy(), plugins=[plugin])
        fabric.launch()
        module = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.SGD(module.parameters(), lr=0.05))
        x, y = next(iter(loader()))
        fabric.backward(nn.functional.mse_loss(module(x).float(), y))
        optimizer.step()
        parameters = list(module.parameters())
        plugin.teardown()
    assert plugin.scaler is None and plugin.stats.loss_scale == 1.0
    assert any(not torch.equal(b, p) for b, p in zip(before, parameters, strict=True))


def test_a_precision_fsdp_cannot_run_is_refused_naming_the_allowed_ones():
    """'64-true' is refused at once, naming the value and the precisions allowed; the mixed ones are accepted.

    Upstream: tests_pytorch/plugins/precision/test_fsdp.py and tests_fabric/plugins/precision/test_fsdp.py
    test_invalid_precision_with_fsdp_precision.
    """
    FSDPMixedPrecision("16-mixed")
    FSDPMixedPrecision("bf16-mixed")
    with pytest.raises(ValueError, match=r"precision='64-true'.*must be one of \['auto', '16-mixed', 'bf16-mixed'"):
        FSDPMixedPrecision("64-true")


@pytest.mark.parametrize("context", ["module_init_context", "tensor_init_context"])
def test_the_fsdp_init_contexts_keep_the_default_dtype_fp32_also_after_an_exception(context):
    """Modules are created in fp32 for FSDP to shard as masters, and an error inside the context changes nothing.

    Lightning's '16-true' FSDP plugin switches the default dtype to fp16 there and restores it; this plugin never
    switches it.

    Upstream: tests_pytorch/plugins/precision/test_all.py and tests_fabric/plugins/precision/test_all.py
    test_default_dtype_is_restored (its FSDPPrecision case).
    """
    plugin = FSDPMixedPrecision("bf16-mixed", opt_level="O2")
    with pytest.raises(RuntimeError, match="inside"), getattr(plugin, context)():
        assert nn.Linear(2, 2).weight.dtype is FP32
        raise RuntimeError("inside")
    assert torch.get_default_dtype() is FP32
