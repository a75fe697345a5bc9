"""Lean across runs: checkpoints resume bit for bit, the rounding state is checked at load, and a pickled, copied or
reused plugin starts its next run as a fresh one.
"""

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
from torch import nn
from torch.nn import functional as F

from lightning_mp import MixedPrecision
from lightning_mp.stochastic_rounding import COMPENSATION_KEY, STATE_KEY
from tests.helpers import make_trainer
from tests.policies.lean_helpers import (
    LeanNet,
    classification_loader,
    optimizer_tensors,
    persistent_bytes,
)


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


# O2 frees its gradients with each step, and its half weights when fit ends.
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
