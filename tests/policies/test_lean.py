"""Lean: bf16 weights, gradients and optimizer states with stochastic rounding, in real Trainer runs."""

from __future__ import annotations

import copy
import gc
import pickle
import warnings
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import (
    EMAWeightAveraging,
    ModelCheckpoint,
    StochasticWeightAveraging,
    WeightAveraging,
)
from lightning.pytorch.utilities.model_summary import summarize
from torch import Tensor, nn
from torch.nn import functional as F
from torch.optim.swa_utils import get_ema_multi_avg_fn
from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_mp import MixedPrecision
from lightning_mp.bench.opt_level_counts import Task, count_opt_level, markov_counting_task
from lightning_mp.bench.workloads import OPTIMIZER_KINDS, make_optimizer
from lightning_mp.policies.lean import _FOREACH_AVERAGING_DEVICE_TYPES
from lightning_mp.stochastic_rounding import COMPENSATION_KEY, STATE_KEY
from lightning_mp.tasks import TinyTransformerLM
from tests.helpers import TinyRegressor, loader, make_trainer
from tests.test_parity import train_and_validate

ELEMENTWISE_STATES = ("exp_avg", "exp_avg_sq", "momentum_buffer", COMPENSATION_KEY)


class LeanNet(LightningModule):
    """Linear, LayerNorm, ReLU and a head, with a per-step scheduler; optionally an inf gradient at chosen steps."""

    def __init__(self, optimizer: str = "adamw", norm: bool = True, inject_at: tuple[int, ...] = ()) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32) if norm else nn.Identity(), nn.ReLU())
        self.head = nn.Linear(32, 4)
        self.optimizer_name = optimizer
        self.inject_at = set(inject_at)
        self.losses: list[float] = []

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        features, target = batch
        loss = F.cross_entropy(self(features).float(), target)
        self.losses.append(loss.item())
        return loss

    def on_after_backward(self) -> None:
        if self.global_step in self.inject_at:
            self.body[0].weight.grad[0, 0] = float("inf")

    def configure_optimizers(self) -> Any:
        optimizers = {
            "adamw": lambda: torch.optim.AdamW(self.parameters(), lr=3e-2),
            "adamw-fused": lambda: torch.optim.AdamW(self.parameters(), lr=3e-2, fused=True),
            "adam": lambda: torch.optim.Adam(self.parameters(), lr=3e-2, weight_decay=1e-3),
            "sgd": lambda: torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, nesterov=True),
            "rmsprop": lambda: torch.optim.RMSprop(self.parameters(), lr=1e-2),
        }
        optimizer = optimizers[self.optimizer_name]()
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.97**step)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def classification_loader(batches: int = 4) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(8 * batches, 8, generator=generator)
    target = (features[:, :4].argmax(dim=1)).long()
    return DataLoader(TensorDataset(features, target), batch_size=8, shuffle=False)


def optimizer_tensors(trainer: Trainer) -> dict[str, Tensor]:
    optimizer = trainer.optimizers[0]
    state = optimizer.state_dict()
    tensors = {
        f"{index}.{key}": value
        for index, entry in state["state"].items()
        for key, value in entry.items()
        if isinstance(value, Tensor)
    }
    tensors["generator"] = state[STATE_KEY]["generators"]["cpu"]
    return tensors


@pytest.mark.parametrize("optimizer", ["adamw", "adamw-fused", "adam", "sgd"])
def test_lean_trains_in_bf16_with_fp32_norms_and_keep_fp32(optimizer: str) -> None:
    """Weights, gradients and optimizer states are bf16; the LayerNorm and a keep_fp32 head stay fp32; loss falls."""
    model = LeanNet(optimizer)
    plugin = MixedPrecision("bf16-mixed", opt_level="lean", keep_fp32=["head"])
    trainer = make_trainer(plugin, max_epochs=3, max_steps=-1)
    trainer.fit(model, classification_loader())
    optimizer_state = trainer.optimizers[0].state
    linear, norm, head = model.body[0].weight, model.body[1].weight, model.head.weight
    assert linear.dtype is torch.bfloat16 and linear.grad is not None and linear.grad.dtype is torch.bfloat16
    assert {value.dtype for key, value in optimizer_state[linear].items() if key in ELEMENTWISE_STATES} == {
        torch.bfloat16
    }
    for kept in (norm, head):
        assert kept.dtype is torch.float32 and kept.grad.dtype is torch.float32
        assert {value.dtype for key, value in optimizer_state[kept].items() if key in ELEMENTWISE_STATES} == {
            torch.float32
        }
    # The scheduler drives the same optimizer object: 12 steps of decay.
    base_lr = 3e-2 if "adam" in optimizer else 0.1
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(base_lr * 0.97**12)
    assert sum(model.losses[-4:]) < 0.8 * sum(model.losses[:4])


@pytest.mark.parametrize("opt_level", ["lean", "lean-kahan"])
def test_resume_from_a_checkpoint_is_bitwise_exact(tmp_path: Path, opt_level: str) -> None:
    """Two epochs straight, or one, a checkpoint and one more: the same bf16 weights, states and rounding numbers."""
    straight = LeanNet()
    straight_trainer = make_trainer(MixedPrecision("bf16-mixed", opt_level=opt_level), max_epochs=2, max_steps=-1)
    straight_trainer.fit(straight, classification_loader())

    first = LeanNet()
    first_trainer = make_trainer(MixedPrecision("bf16-mixed", opt_level=opt_level), max_epochs=1, max_steps=-1)
    first_trainer.fit(first, classification_loader())
    checkpoint = tmp_path / "epoch1.ckpt"
    first_trainer.save_checkpoint(checkpoint)
    resumed = LeanNet()
    resumed_trainer = make_trainer(MixedPrecision("bf16-mixed", opt_level=opt_level), max_epochs=2, max_steps=-1)
    resumed_trainer.fit(resumed, classification_loader(), ckpt_path=checkpoint)

    for name, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name
    expected, actual = optimizer_tensors(straight_trainer), optimizer_tensors(resumed_trainer)
    assert expected.keys() == actual.keys()
    assert (COMPENSATION_KEY in "".join(expected)) == (opt_level == "lean-kahan")
    for key, value in expected.items():
        assert torch.equal(value, actual[key]), key


class RecordStep(Callback):
    """Keep copies of the weights and the optimizer state around one chosen batch."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.before: dict[str, Tensor] = {}
        self.after: dict[str, Tensor] = {}

    def _snapshot(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Tensor]:
        weights = {name: value.clone() for name, value in pl_module.state_dict().items()}
        state = trainer.optimizers[0].state_dict()
        weights.update({f"{i}.{k}": v.clone() for i, s in state["state"].items() for k, v in s.items()})
        return weights

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.batch:
            self.before = self._snapshot(trainer, pl_module)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.batch:
            self.after = self._snapshot(trainer, pl_module)


def test_a_skipped_step_changes_no_weight_and_no_state() -> None:
    """An inf gradient skips the step: bf16 weights, moments and step counts stay exactly as they were."""
    model = LeanNet(inject_at=(2,))
    plugin = MixedPrecision("bf16-mixed", opt_level="lean")
    recorder = RecordStep(batch=2)
    trainer = make_trainer(plugin, max_steps=4, callbacks=[recorder])
    trainer.fit(model, classification_loader())
    assert plugin.stats.skipped_steps == 1
    assert recorder.before.keys() == recorder.after.keys()
    for key, value in recorder.before.items():
        assert torch.equal(value, recorder.after[key]), key
    assert all(torch.isfinite(parameter).all() for parameter in model.parameters())


@pytest.mark.parametrize("algorithm", ["value", "norm"])
def test_an_inf_gradient_clipped_for_a_fused_optimizer_still_skips_the_step(algorithm: str) -> None:
    """Lean with fused AdamW and gradient clipping: an injected inf is caught before clipping, and the step skipped."""
    plugin = MixedPrecision("bf16-mixed", opt_level="lean")
    model = LeanNet("adamw-fused", inject_at=(2,))
    weights: dict[int, Tensor] = {}

    class RecordWeights(Callback):
        def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
            weights[trainer.global_step] = model.body[0].weight.detach().clone()

    trainer = make_trainer(
        plugin, max_steps=4, gradient_clip_val=0.01, gradient_clip_algorithm=algorithm, callbacks=[RecordWeights()]
    )
    trainer.fit(model, classification_loader())
    assert plugin.stats.skipped_steps == 1
    assert torch.equal(weights[2], weights[3])  # global_step counts the skipped step too
    assert torch.isfinite(model.body[0].weight).all() and not torch.equal(weights[1], weights[2])


@pytest.mark.parametrize("optimizer", ["adamw-fused", "sgd-fused", "adam"])
def test_a_skipped_fabric_step_changes_no_weight_or_state(optimizer: str) -> None:
    """Lean under Fabric, clipped: an inf gradient skips the step; weights, states and Kahan buffers stay put."""
    from lightning.fabric import Fabric

    plugin = MixedPrecision("bf16-mixed", opt_level="lean-kahan")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    module = LeanNet()
    make = {
        "adamw-fused": lambda: torch.optim.AdamW(module.parameters(), lr=3e-2, fused=True),
        "sgd-fused": lambda: torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9, fused=True),
        "adam": lambda: torch.optim.Adam(module.parameters(), lr=3e-2),
    }
    model, fabric_optimizer = fabric.setup(module, make[optimizer]())
    batches = list(classification_loader())

    def step(index: int, inject: bool = False) -> None:
        features, target = batches[index]
        fabric.backward(F.cross_entropy(model(features).float(), target))
        if inject:
            module.body[0].weight.grad[0, 0] = float("inf")
        fabric.clip_gradients(model, fabric_optimizer, max_norm=1.0)
        fabric_optimizer.step()
        fabric_optimizer.zero_grad()

    step(0)
    before = copy.deepcopy(fabric_optimizer.state_dict())
    weights = [parameter.detach().clone() for parameter in module.parameters()]
    step(1, inject=True)
    after = fabric_optimizer.state_dict()
    assert plugin.stats.skipped_steps == 1
    assert all(torch.equal(w, p) for w, p in zip(weights, module.parameters(), strict=True))
    for index, state in before["state"].items():
        for key, value in state.items():
            assert torch.equal(value, after["state"][index][key]), key
    step(2)
    assert not torch.equal(weights[0], module.body[0].weight)
    drawn = fabric_optimizer.state_dict()[STATE_KEY]["generators"]["cpu"]
    assert not torch.equal(after[STATE_KEY]["generators"]["cpu"], drawn)  # a clean step draws random numbers


def test_persistent_bytes_per_parameter_are_8_and_10_with_kahan() -> None:
    """Weight, gradient and AdamW moments take 8 bytes per parameter; Kahan compensation adds 2."""
    for opt_level, expected in (("lean", 8), ("lean-kahan", 10)):
        model = LeanNet(norm=False)
        trainer = make_trainer(MixedPrecision("bf16-mixed", opt_level=opt_level), max_steps=2)
        trainer.fit(model, classification_loader())
        state = trainer.optimizers[0].state
        total = 0
        for parameter in model.parameters():
            total += parameter.nbytes + (parameter.grad.nbytes if parameter.grad is not None else 0)
            total += sum(value.nbytes for key, value in state[parameter].items() if key in ELEMENTWISE_STATES)
        assert total == expected * sum(parameter.numel() for parameter in model.parameters())


def persistent_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of weights, gradients and elementwise optimizer states."""
    total = 0
    for parameter in model.parameters():
        total += parameter.nbytes + (parameter.grad.nbytes if parameter.grad is not None else 0)
        total += sum(value.nbytes for key, value in optimizer.state[parameter].items() if key in ELEMENTWISE_STATES)
    return total


# O2 frees its fp32 gradients after each step, and its half weights when fit ends.
@pytest.mark.parametrize(("opt_level", "bytes_per_parameter"), [("lean", 8), ("O1", 16), ("O2", 12)])
def test_a_lean_kahan_checkpoint_resumed_without_kahan_drops_the_compensation_buffers(
    tmp_path: Path, opt_level: str, bytes_per_parameter: int
) -> None:
    """Resuming lean-kahan under another level warns and keeps no Kahan buffer: memory is that level's own."""
    first = make_trainer(MixedPrecision("bf16-mixed", opt_level="lean-kahan"), max_steps=2)
    first.fit(LeanNet(norm=False), classification_loader())
    checkpoint = tmp_path / "kahan.ckpt"
    first.save_checkpoint(checkpoint)
    model = LeanNet(norm=False)
    trainer = make_trainer(MixedPrecision("bf16-mixed", opt_level=opt_level), max_steps=4)
    with pytest.warns(UserWarning, match=f"Kahan compensation buffers for 4 parameters .*{opt_level!r}.* dropped"):
        trainer.fit(model, classification_loader(), ckpt_path=checkpoint)
    optimizer = trainer.optimizers[0]
    assert not any(COMPENSATION_KEY in state for state in optimizer.state_dict()["state"].values())
    assert persistent_bytes(model, optimizer) == bytes_per_parameter * sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("opt_level", ["lean", "O1"])
def test_fabric_load_of_a_lean_kahan_state_without_kahan_drops_the_compensation_buffers(
    tmp_path: Path, opt_level: str
) -> None:
    """Under Fabric too, a lean-kahan state loaded into another level loses its Kahan buffers at the first step."""
    states = {}
    for level in ("lean-kahan", opt_level):
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("bf16-mixed", opt_level=level)])
        model = LeanNet(norm=False)
        module, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        if level == opt_level:
            fabric.load(tmp_path / "kahan.ckpt", {"model": module, "optimizer": optimizer})
        features, target = next(iter(classification_loader()))
        fabric.backward(F.cross_entropy(module(features).float(), target))
        if level == opt_level:
            with pytest.warns(UserWarning, match="Kahan compensation buffers"):
                optimizer.step()
        else:
            optimizer.step()
            fabric.save(tmp_path / "kahan.ckpt", {"model": module, "optimizer": optimizer})
        states[level] = optimizer.state_dict()["state"]
    assert all(COMPENSATION_KEY in state for state in states["lean-kahan"].values())
    assert not any(COMPENSATION_KEY in state for state in states[opt_level].values())


def test_unsupported_settings_are_refused_with_clear_errors() -> None:
    """fp16, fp32 and optimizers other than Adam, AdamW and SGD are refused, naming what is allowed."""
    for precision in ("16-mixed", "32-true"):  # refused at construction, not first at fit
        with pytest.raises(ValueError, match=f"precision='{precision}'.*Use precision='bf16-mixed'"):
            MixedPrecision(precision, opt_level="lean-kahan")
    trainer = make_trainer(MixedPrecision("bf16-mixed", opt_level="lean"), max_steps=1)
    with pytest.raises(TypeError, match="RMSprop"):
        trainer.fit(LeanNet("rmsprop"), classification_loader())


@pytest.mark.parametrize("opt_level", ["lean", "lean-kahan"])
def test_lean_with_fp16_is_refused_when_the_plugin_is_built(opt_level: str) -> None:
    """MixedPrecision("16-mixed", opt_level="lean") fails in the constructor, naming both arguments and the fix."""
    with pytest.raises(ValueError, match=rf"precision='16-mixed', opt_level='{opt_level}'.*'bf16-mixed'"):
        MixedPrecision("16-mixed", opt_level=opt_level)


def test_the_policy_hooks_drive_lean_without_a_trainer() -> None:
    """Driven only through the policy hooks, as Fabric does, the user's optimizer steps bf16 weights unbiasedly."""
    plugin = MixedPrecision("bf16-mixed", opt_level="lean")
    plugin.setup_for_device("cpu")
    assert plugin.policy is not None
    torch.manual_seed(0)
    model = plugin.policy.convert_module(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    (connected,) = plugin.policy.connect(model, [optimizer])
    assert connected is optimizer
    before = model[0].weight.detach().clone()
    model(torch.randn(2, 4)).float().square().sum().backward()
    optimizer.step()
    assert model[0].weight.dtype is torch.bfloat16 and not torch.equal(before, model[0].weight)
    assert STATE_KEY in optimizer.state_dict()


def test_optimizers_connected_one_at_a_time_all_keep_stochastic_rounding() -> None:
    """Two optimizers connected separately, as Fabric connects a GAN's, both round stochastically."""
    plugin = MixedPrecision("bf16-mixed", opt_level="lean")
    plugin.setup_for_device("cpu")
    assert plugin.policy is not None
    weights = [nn.Parameter(torch.ones(1000, dtype=torch.bfloat16)) for _ in range(2)]
    optimizers = [torch.optim.SGD([weight], lr=1e-4) for weight in weights]
    for optimizer in optimizers:
        plugin.policy.connect(nn.Module(), [optimizer])
    plugin.policy.connect(nn.Module(), optimizers)  # again: no second set of hooks
    for weight, optimizer in zip(weights, optimizers, strict=True):
        weight.grad = -torch.ones_like(weight)
        optimizer.step()
        # 1e-4 is 1.3% of the bf16 gap above 1.0: round-to-nearest would move nothing, a double step twice as much.
        assert weight.double().mean().item() - 1.0 == pytest.approx(1e-4, rel=0.5)


def test_a_reused_plugin_keeps_no_reference_to_the_previous_model() -> None:
    """After a fit, dropping the model and optimizer frees them even though the plugin lives on."""
    plugin = MixedPrecision("bf16-mixed", opt_level="lean")
    model = LeanNet()
    trainer = make_trainer(plugin, max_steps=2)
    trainer.fit(model, classification_loader())
    model_reference = weakref.ref(model.body[0].weight)
    optimizer_reference = weakref.ref(trainer.optimizers[0])
    del model, trainer
    gc.collect()
    assert model_reference() is None and optimizer_reference() is None


@pytest.mark.parametrize("copy_plugin", [lambda plugin: pickle.loads(pickle.dumps(plugin)), copy.deepcopy])
def test_a_plugin_pickles_after_fit_and_the_copy_trains_like_a_fresh_one(copy_plugin: Any) -> None:
    """A lean plugin pickles and deep-copies after fit, as its __getstate__ promises; the copy trains as a new one."""
    plugin = MixedPrecision("bf16-mixed", opt_level="lean-kahan")
    make_trainer(plugin, max_steps=2).fit(LeanNet(), classification_loader())
    trained_by = {}
    for name, each in (("copy", copy_plugin(plugin)), ("fresh", MixedPrecision("bf16-mixed", opt_level="lean-kahan"))):
        trained_by[name] = model = LeanNet()
        make_trainer(each, max_steps=3).fit(model, classification_loader())
    for name, value in trained_by["fresh"].state_dict().items():
        assert torch.equal(trained_by["copy"].state_dict()[name], value), name


def test_a_plugin_pickles_in_the_middle_of_a_fabric_run() -> None:
    """Under Fabric, whose loop never tears the plugin down, the lean plugin pickles between steps."""
    plugin = MixedPrecision("bf16-mixed", opt_level="lean")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = LeanNet()
    module, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    features, target = next(iter(classification_loader()))
    fabric.backward(F.cross_entropy(module(features).float(), target))
    optimizer.step()
    assert pickle.loads(pickle.dumps(plugin)).opt_level == "lean"


def test_an_optimizer_loaded_before_it_is_connected_resumes_exactly_from_the_plugin_state() -> None:
    """Loops that load optimizer states before the first step (Fabric) resume exactly from the plugin's state."""

    def setup(plugin: MixedPrecision) -> tuple[nn.Module, torch.optim.Optimizer]:
        plugin.setup_for_device("cpu")
        assert plugin.policy is not None
        torch.manual_seed(0)
        model = plugin.policy.convert_module(nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 1)))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
        optimizer.zero_grad()
        model(torch.randn(8, 4, generator=torch.Generator().manual_seed(seed))).float().square().mean().backward()
        optimizer.step()

    plugin = MixedPrecision("bf16-mixed", opt_level="lean-kahan")
    model, optimizer = setup(plugin)
    plugin.policy.connect(model, [optimizer])
    step(model, optimizer, 0)
    saved = (
        {k: v.clone() for k, v in model.state_dict().items()},
        copy.deepcopy(optimizer.state_dict()),
        copy.deepcopy(plugin.state_dict()),
    )
    step(model, optimizer, 1)
    step(model, optimizer, 2)

    resumed_plugin = MixedPrecision("bf16-mixed", opt_level="lean-kahan")
    resumed, resumed_optimizer = setup(resumed_plugin)
    resumed.load_state_dict(saved[0])
    resumed_optimizer.load_state_dict(saved[1])  # before connect: torch ignores the rounding entry
    resumed_plugin.load_state_dict(saved[2])
    resumed_plugin.policy.connect(resumed, [resumed_optimizer])
    step(resumed, resumed_optimizer, 1)
    step(resumed, resumed_optimizer, 2)
    for name, value in model.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name


def _fabric_lean_run(
    steps: range, plugin_in_state: bool = True, save: Path | None = None, resume: Path | None = None
) -> tuple[MixedPrecision, nn.Module]:
    """A lean Fabric loop of ``steps``; it saves after them or resumes before them, the plugin in the state or not."""
    plugin = MixedPrecision("bf16-mixed", opt_level="lean")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    state: dict[str, Any] = {"model": model, "optimizer": optimizer}
    if plugin_in_state:
        state["precision"] = plugin
    if resume is not None:
        fabric.load(resume, state)
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        features, target = torch.randn(8, 8, generator=generator), torch.randn(8, 1, generator=generator)
        fabric.backward(F.mse_loss(model(features).float(), target))
        optimizer.step()
        optimizer.zero_grad()
    if save is not None:
        fabric.save(save, state)
    return plugin, model


def test_a_reused_plugin_does_not_carry_a_checkpoints_rounding_state_into_the_next_fit(tmp_path: Path) -> None:
    """A lean plugin that resumed one fit trains the next, unrelated fit exactly as a fresh plugin would."""
    first = make_trainer(MixedPrecision("bf16-mixed", opt_level="lean"), max_steps=2)
    first.fit(LeanNet(), classification_loader())
    checkpoint = tmp_path / "first.ckpt"
    first.save_checkpoint(checkpoint)

    reused = MixedPrecision("bf16-mixed", opt_level="lean")
    make_trainer(reused, max_steps=3).fit(LeanNet(), classification_loader(), ckpt_path=checkpoint)
    gc.collect()  # the resumed fit's optimizer is gone, as in a script that moved on
    by_reused = LeanNet()  # seeds torch: both plugins' rounding generators start from that seed
    make_trainer(reused, max_steps=3).fit(by_reused, classification_loader())
    by_fresh = LeanNet()
    make_trainer(MixedPrecision("bf16-mixed", opt_level="lean"), max_steps=3).fit(by_fresh, classification_loader())
    for name, value in by_fresh.state_dict().items():
        assert torch.equal(value, by_reused.state_dict()[name]), name


def test_a_fabric_resume_without_the_plugin_in_the_state_warns_that_rounding_restarts(tmp_path: Path) -> None:
    """fabric.load of model and optimizer alone warns that lean's rounding restarts; with the plugin it is exact."""
    path = tmp_path / "lean.ckpt"
    _fabric_lean_run(range(3), save=path)
    with pytest.warns(UserWarning, match=r"stochastic rounding restarts.*\"precision\": plugin"):
        _fabric_lean_run(range(3, 5), plugin_in_state=False, resume=path)
    _, straight = _fabric_lean_run(range(5))
    with warnings.catch_warnings():
        # Only the restart warning is an error here: the slow-bf16 advice depends on the CPU the test runs on.
        warnings.filterwarnings("error", message=".*stochastic rounding restarts", category=UserWarning)
        _, resumed = _fabric_lean_run(range(3, 5), resume=path)
    for expected, actual in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(expected, actual)


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        ({"seed": "abc"}, r"\['policy'\]\['rounding'\]\[0\]\['seed'\] holds 'abc'; expected an integer"),
        ({"seed": None}, r"\['seed'\] holds None; expected an integer"),
        ({"generators": None}, r"\['generators'\] holds None; expected a dict"),
        ({"generators": {"cpu": torch.zeros(3, dtype=torch.uint8)}}, r"\['generators'\]\['cpu'\] is not a CPU"),
        ({"generators": {"cpu": [1, 2]}}, r"\['generators'\]\['cpu'\] holds \[1, 2\]; expected a generator state"),
        ({"kahan": "yes"}, r"\['kahan'\] holds 'yes'; expected True or False"),
    ],
)
def test_a_damaged_rounding_state_is_refused_at_fabric_load_naming_the_field(
    tmp_path: Path, damage: dict[str, Any], match: str
) -> None:
    """fabric.load of a checkpoint with a damaged rounding state fails at the load, naming the field and the value."""
    path = tmp_path / "lean.ckpt"
    _fabric_lean_run(range(2), save=path)
    checkpoint = torch.load(path, weights_only=False)
    checkpoint["precision"]["policy"]["rounding"][0].update(damage)
    torch.save(checkpoint, path)
    with pytest.raises(ValueError, match=match):
        _fabric_lean_run(range(0), resume=path)


def test_a_rounding_state_without_a_seed_is_refused_at_load_naming_the_field(tmp_path: Path) -> None:
    """A rounding state that lost its seed fails at fabric.load, naming the field, instead of KeyError: 'seed'."""
    path = tmp_path / "lean.ckpt"
    _fabric_lean_run(range(2), save=path)
    checkpoint = torch.load(path, weights_only=False)
    del checkpoint["precision"]["policy"]["rounding"][0]["seed"]
    checkpoint["optimizer"][STATE_KEY]["generators"] = "garbage"
    torch.save(checkpoint, path)
    with pytest.raises(ValueError, match=r"\['rounding'\]\[0\] holds .*expected a dict with 'seed'"):
        _fabric_lean_run(range(0), resume=path)


def test_a_damaged_rounding_state_in_a_trainer_checkpoint_is_refused_at_resume(tmp_path: Path) -> None:
    """A Trainer checkpoint whose optimizer holds a damaged rounding state fails at resume, naming the field."""
    trainer = make_trainer(MixedPrecision("bf16-mixed", opt_level="lean"), max_steps=2)
    trainer.fit(LeanNet(), classification_loader())
    path = tmp_path / "lean.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    checkpoint["optimizer_states"][0][STATE_KEY]["seed"] = "abc"
    torch.save(checkpoint, path)
    resumed = LeanNet()
    with pytest.raises(ValueError, match=r"optimizer.state_dict\(\)\['stochastic_rounding'\]\['seed'\] holds 'abc'"):
        make_trainer(MixedPrecision("bf16-mixed", opt_level="lean"), max_steps=4).fit(
            resumed, classification_loader(), ckpt_path=path
        )
    assert resumed.losses == []


@pytest.fixture(scope="module")
def reference_losses() -> dict[str, float]:
    return {
        level: train_and_validate(precision, level, steps=60)["val_loss"]
        for precision, level in (("32-true", "O0"), ("bf16-mixed", "O1"))
    }


@pytest.mark.parametrize("opt_level", ["lean", "lean-kahan"])
def test_lean_reaches_the_validation_loss_of_o0_and_o1(reference_losses: dict[str, float], opt_level: str) -> None:
    """On the reference task (60 steps), lean ends within 2% of O0's and 1% of O1's validation loss, never skipping."""
    lean = train_and_validate("bf16-mixed", opt_level, steps=60)
    assert abs(lean["val_loss"] - reference_losses["O0"]) <= 0.02 * reference_losses["O0"]
    assert abs(lean["val_loss"] - reference_losses["O1"]) <= 0.01 * reference_losses["O1"]
    assert lean["skipped_steps"] == 0


def test_lean_under_fabric_trains_bf16_weights_skips_and_resumes_exactly(tmp_path: Path) -> None:
    """Fabric's own loop with lean: bf16 weights, an inf step skipped, and fabric.save/load continues bit for bit."""

    def run(steps: range, checkpoint: Path | None = None, resume: Path | None = None) -> tuple[MixedPrecision, Any]:
        plugin = MixedPrecision("bf16-mixed", opt_level="lean")
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2))
        state = {"model": model, "optimizer": optimizer, "precision": plugin}
        if resume is not None:
            fabric.load(resume, state)
        for step in steps:
            generator = torch.Generator().manual_seed(step)
            features, target = torch.randn(8, 8, generator=generator), torch.randn(8, 1, generator=generator)
            fabric.backward(F.mse_loss(model(features).float(), target))
            if step == 2:
                model.module[0].weight.grad[0, 0] = float("inf")
            optimizer.step()
            optimizer.zero_grad()
        if checkpoint is not None:
            fabric.save(checkpoint, state)
        return plugin, model

    path = tmp_path / "lean.ckpt"
    straight, straight_model = run(range(8))
    run(range(5), checkpoint=path)
    resumed, resumed_model = run(range(5, 8), resume=path)
    assert all(parameter.dtype is torch.bfloat16 for parameter in straight_model.parameters())
    assert straight.stats.skipped_steps == 1 and resumed.stats == straight.stats
    for expected, actual in zip(straight_model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(expected, actual)


def test_ema_weight_averaging_keeps_an_fp32_average_of_the_bf16_weights() -> None:
    """Lightning's EMAWeightAveraging trains with lean: fp32 average, bf16 model, the average copied in at the end."""
    model = LeanNet()
    ema = EMAWeightAveraging(decay=0.5)
    trainer = make_trainer(MixedPrecision("bf16-mixed", opt_level="lean"), callbacks=[ema], max_steps=4)
    trainer.fit(model, classification_loader())
    averaged = ema._average_model
    assert averaged is not None
    assert averaged.module.head.weight.dtype == torch.float32
    assert model.head.weight.dtype == torch.bfloat16
    assert int(averaged.n_averaged) == 4
    assert torch.equal(model.head.weight, averaged.module.head.weight.bfloat16())
    assert not torch.equal(averaged.module.head.weight, averaged.module.head.weight.bfloat16().float())


def test_foreach_weight_averaging_is_refused_at_setup_naming_the_per_tensor_alternative() -> None:
    """WeightAveraging(multi_avg_fn=...) with lean fails before the first step with a ValueError naming avg_fn."""
    model = LeanNet()
    averaging = WeightAveraging(multi_avg_fn=get_ema_multi_avg_fn(0.999))
    trainer = make_trainer(MixedPrecision("bf16-mixed", opt_level="lean"), callbacks=[averaging], max_steps=2)
    with pytest.raises(ValueError, match=r"multi_avg_fn=get_ema_multi_avg_fn.*get_ema_avg_fn\(decay\).*'O2'"):
        trainer.fit(model, classification_loader())
    assert model.losses == []


def test_foreach_averaging_is_refused_on_the_devices_where_torch_averages_with_foreach() -> None:
    """Lean's list of the devices where AveragedModel picks its foreach update is this torch's (older releases list
    no MTIA, where lean then refuses one case more)."""
    expected = set(_get_foreach_kernels_supported_devices())
    ours = {*_FOREACH_AVERAGING_DEVICE_TYPES, torch.device("privateuseone").type}
    assert ours == expected or (ours - expected == {"mtia"} and "mtia" not in expected)


def test_stochastic_weight_averaging_copies_its_average_into_the_bf16_model() -> None:
    """Lightning's StochasticWeightAveraging trains with lean and leaves the bf16 model holding its fp32 average."""
    model = LeanNet()
    swa = StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1)
    trainer = make_trainer(MixedPrecision("bf16-mixed", opt_level="lean"), callbacks=[swa], max_steps=-1, max_epochs=3)
    trainer.fit(model, classification_loader(batches=2))
    average = swa._average_model
    assert average.head.weight.dtype == torch.float32
    assert model.head.weight.dtype == torch.bfloat16
    assert torch.equal(model.head.weight, average.head.weight.bfloat16())
    assert len(model.losses) == 6


def test_resume_with_ema_weight_averaging_restores_the_bf16_model_and_the_fp32_average(tmp_path: Path) -> None:
    """A lean run with EMAWeightAveraging resumed from a mid-run checkpoint ends bitwise equal to an unbroken one."""

    def run(max_steps: int, ckpt_path: Path | None = None, save: bool = False) -> tuple[LeanNet, EMAWeightAveraging]:
        model, ema = LeanNet(), EMAWeightAveraging(decay=0.5)
        callbacks: list[Callback] = [ema]
        if save:
            callbacks.append(ModelCheckpoint(tmp_path, filename="mid", every_n_train_steps=4, save_top_k=-1))
        trainer = make_trainer(
            MixedPrecision("bf16-mixed", opt_level="lean"),
            callbacks=callbacks,
            max_steps=max_steps,
            max_epochs=-1,
            enable_checkpointing=save,
        )
        trainer.fit(model, classification_loader(), ckpt_path=ckpt_path)
        return model, ema

    unbroken_model, unbroken_ema = run(8)
    run(4, save=True)
    resumed_model, resumed_ema = run(8, ckpt_path=tmp_path / "mid.ckpt")
    assert resumed_model.head.weight.dtype == torch.bfloat16
    assert torch.equal(resumed_model.head.weight, unbroken_model.head.weight)
    assert unbroken_ema._average_model is not None and resumed_ema._average_model is not None
    assert resumed_ema._average_model.module.head.weight.dtype == torch.float32
    assert torch.equal(resumed_ema._average_model.module.head.weight, unbroken_ema._average_model.module.head.weight)


class _RecordModelSize(Callback):
    """The model size Lightning's ModelSummary reports at the start of fit, when the precision is set up."""

    def __init__(self) -> None:
        self.megabytes: float | None = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.megabytes = summarize(pl_module).model_size


@pytest.mark.parametrize(
    ("ours", "lightnings"),
    [
        (MixedPrecision("bf16-mixed", opt_level="lean"), "bf16-true"),
        (MixedPrecision("16-mixed", opt_level="O3"), "16-true"),
    ],
)
def test_model_summary_sizes_half_weight_levels_by_their_half_weights(ours: MixedPrecision, lightnings: str) -> None:
    """Lightning's ModelSummary sizes a lean (or O3) model by its half weights, as for bf16-true (16-true), not as fp32;
    the checkpoint still names the mixed precision the plugin was given."""
    sizes = {}
    for name, options in (("ours", {"plugins": [ours]}), ("Lightning's", {"precision": lightnings}), ("fp32", {})):
        recorder = _RecordModelSize()
        # The size is read when fit starts, with the precision set up: no batch needs to run.
        make_trainer(limit_train_batches=0, callbacks=[recorder], **options).fit(TinyRegressor(), loader())
        sizes[name] = recorder.megabytes
    assert sizes["ours"] == sizes["Lightning's"] == pytest.approx(sizes["fp32"] / 2)
    assert ours.state_dict()["precision"] == ours.requested_precision


class CountedLM(TinyTransformerLM):
    """The steady-step counter's tiny LM, trained with the optimizer ``optimizer`` names (no scheduler)."""

    def __init__(self, optimizer: str, **sizes: Any) -> None:
        super().__init__(**sizes)
        self.optimizer_name = optimizer

    @override
    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd-momentum":
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return make_optimizer(self.optimizer_name, self.parameters())  # type: ignore[arg-type]


def counted_task(optimizer: str) -> Task:
    """The counter's Markov-text task, with the model trained by ``optimizer``."""

    def task(steps: int) -> tuple[LightningModule, Any]:
        model, data = markov_counting_task(steps)
        return CountedLM(optimizer, **model.hparams), data

    return task


@pytest.mark.parametrize("optimizer", [*OPTIMIZER_KINDS, "sgd-momentum"])
@pytest.mark.parametrize("opt_level", ["lean", "lean-kahan"])
def test_a_steady_lean_step_makes_no_host_sync_and_casts_each_bf16_weight_twice(opt_level: str, optimizer: str) -> None:
    """Lean with fused, foreach or single-tensor AdamW, or SGD: a steady Trainer step never waits for the device, and
    casts each bf16 weight twice, in the optimizer step only (into the fp32 update, and the rounded result back)."""
    counts = count_opt_level(opt_level, "bf16-mixed", counted_task(optimizer))
    model, _ = markov_counting_task(1)
    bf16_weights = sum(1 for name, _ in model.named_parameters() if "norm" not in name)
    assert counts.syncs == 0
    assert (counts.casts_forward, counts.casts_backward, counts.casts_step) == (0, 0, 2 * bf16_weights)


def test_a_steady_lean_step_dispatches_no_more_ops_than_o1() -> None:
    """Lean's step, the stochastic rounding included, launches no more kernels than O1's on the counter's LM."""
    lean = count_opt_level("lean", "bf16-mixed", counted_task("fused"))
    o1 = count_opt_level("O1", "bf16-mixed", counted_task("fused"))
    assert lean.compute_ops <= o1.compute_ops
