"""Checkpoints keep the loss scaler's state: DDP resume, SIGTERM, Ctrl+C, Lightning's own plugin, and warnings."""

from __future__ import annotations

import signal
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision as LightningMixedPrecision

from lightning_mp import MixedPrecision
from tests.ddp_scripts.launch import finish, reports, run, start, stop
from tests.helpers import TinyRegressor, loader, make_trainer

MISSING_STATE = "holds no loss-scaler state"


class FirstScale(L.Callback):
    """Records the loss scale the first training step of a (resumed) run uses."""

    def __init__(self) -> None:
        self.scale: float | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.scale = trainer.precision_plugin.stats.loss_scale


class InterruptAt(L.Callback):
    """Raises KeyboardInterrupt at the start of a chosen step, as Ctrl+C would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise KeyboardInterrupt


def _saved_scale(path: Path) -> float:
    checkpoint = torch.load(path, weights_only=False)
    return checkpoint["MixedPrecision"]["scaler"]["scale"]


@pytest.mark.slow
def test_ddp_resume_continues_exactly(tmp_path):
    """A DDP run resumed from its step-8 checkpoint ends with the scale, counters and parameters of a straight run."""
    arguments = ["--out", str(tmp_path), "--inject-rank", "1", "--inject-at", "2,5,9,10", "--hysteresis", "2"]
    arguments += ["--max-steps", "16", "--checkpoint-every", "8", "--then-resume-from", "step=8"]
    run(arguments, timeout=60)
    straight, resumed = reports(tmp_path), reports(tmp_path, tag="resumed_")
    assert _saved_scale(tmp_path / "checkpoints" / "step=8.ckpt") == 2.0**7
    for before, after in zip(straight, resumed, strict=True):
        assert after["first_scale"] == 2.0**7, "the resumed run did not start from the checkpoint's scale"
        assert after["stats"] == before["stats"]
        assert after["scaler_state"] == before["scaler_state"]
        assert after["steps"] == before["steps"][8:]
        assert after["checksums"] == before["checksums"]
    assert straight[0]["stats"]["skipped_steps"] == 4
    assert len(set(straight[0]["checksums"])) == 1


@pytest.mark.slow
def test_sigterm_saves_last_ckpt_and_resume_keeps_the_scale(tmp_path):
    """A run stopped by SIGTERM saves last.ckpt; resuming from it starts at the scale it had, not at 65536."""
    arguments = ["--strategy", "auto", "--devices", "1", "--out", str(tmp_path), "--inject-at", "0,1,2"]
    arguments += ["--inject-rank", "0", "--init-scale", "65536", "--growth-interval", "2000"]
    arguments += ["--max-steps", "10000", "--step-delay", "0.05", "--save-on-exception"]
    process = start(arguments)
    progress = tmp_path / "progress.txt"
    try:
        deadline = time.monotonic() + 60
        while not (progress.exists() and int(progress.read_text() or 0) >= 5):
            assert process.poll() is None, process.communicate()[0][-4000:]
            assert time.monotonic() < deadline, "the run never reached step 5"
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        finish(process, timeout=60)
    finally:
        stop(process)
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert last.exists()
    checkpoint = torch.load(last, weights_only=False)
    assert 5 <= checkpoint["global_step"] < 10000
    assert checkpoint["MixedPrecision"]["scaler"]["scale"] == 2.0**13
    assert checkpoint["MixedPrecision"]["scaler"]["counters"]["skipped_steps"] == 3

    first = FirstScale()
    plugin = MixedPrecision("16-mixed")
    trainer = make_trainer(plugin, max_steps=checkpoint["global_step"] + 2, callbacks=[first])
    trainer.fit(TinyRegressor(), loader(), ckpt_path=last)
    assert first.scale == 2.0**13
    assert plugin.stats.loss_scale == 2.0**13
    assert plugin.stats.skipped_steps == 3


def test_keyboard_interrupt_saves_last_ckpt_and_resume_keeps_the_scale(tmp_path):
    """Ctrl+C during training saves last.ckpt (save_on_exception); the resumed run continues at the reached scale."""
    checkpoints = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_on_exception=True)
    plugin = MixedPrecision("16-mixed")
    trainer = make_trainer(plugin, max_steps=100, callbacks=[checkpoints, InterruptAt(6)], enable_checkpointing=True)
    sigint_handler = signal.getsignal(signal.SIGINT)
    try:
        # Lightning shuts down gracefully and then exits with status 1.
        with pytest.raises(SystemExit):
            trainer.fit(TinyRegressor(inject_at=(0, 1, 2)), loader())
    finally:
        # Lightning ignores further Ctrl+C while it shuts down; give the test session its handler back.
        signal.signal(signal.SIGINT, sigint_handler)
    assert plugin.stats.loss_scale == 2.0**13
    assert _saved_scale(tmp_path / "last.ckpt") == 2.0**13

    first = FirstScale()
    resumed = MixedPrecision("16-mixed")
    make_trainer(resumed, max_steps=8, callbacks=[first]).fit(
        TinyRegressor(), loader(), ckpt_path=tmp_path / "last.ckpt"
    )
    assert first.scale == 2.0**13
    assert resumed.stats.skipped_steps == 3
    assert resumed.stats.optimizer_steps == 8


def _lightning_builtin_checkpoint(tmp_path: Path) -> Path:
    """A checkpoint from Lightning's own fp16 plugin, whose scaler backed off twice: scale 2**8."""
    builtin = LightningMixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
    checkpoints = ModelCheckpoint(dirpath=tmp_path, filename="builtin")
    make_trainer(builtin, max_steps=4, callbacks=[checkpoints], enable_checkpointing=True).fit(
        TinyRegressor(inject_at=(1, 2)), loader()
    )
    path = tmp_path / "builtin.ckpt"
    assert set(torch.load(path, weights_only=False)["MixedPrecision"]) == {
        "scale",
        "growth_factor",
        "backoff_factor",
        "growth_interval",
        "_growth_tracker",
    }
    return path


def test_checkpoint_of_lightnings_builtin_plugin_loads(tmp_path):
    """A checkpoint written by Lightning's MixedPrecision (torch's five-key dict) resumes at its scale, silently."""
    path = _lightning_builtin_checkpoint(tmp_path)
    first = FirstScale()
    plugin = MixedPrecision("16-mixed")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(plugin, max_steps=6, callbacks=[first]).fit(TinyRegressor(), loader(), ckpt_path=path)
    assert first.scale == 2.0**8
    assert plugin.stats.loss_scale == 2.0**8
    assert not [w for w in caught if MISSING_STATE in str(w.message)]


def test_legacy_native_amp_scaling_state_is_loaded(tmp_path):
    """An old Lightning checkpoint that keeps the scaler under 'native_amp_scaling_state' resumes at its scale."""
    path = _lightning_builtin_checkpoint(tmp_path)
    checkpoint = torch.load(path, weights_only=False)
    checkpoint["native_amp_scaling_state"] = checkpoint.pop("MixedPrecision")
    torch.save(checkpoint, path)
    first = FirstScale()
    make_trainer(MixedPrecision("16-mixed"), max_steps=6, callbacks=[first]).fit(
        TinyRegressor(), loader(), ckpt_path=path
    )
    assert first.scale == 2.0**8


def test_checkpoint_without_scaler_state_warns(tmp_path):
    """Resuming fp16 from a checkpoint with no precision state warns that the scale restarts from init_scale."""
    checkpoints = ModelCheckpoint(dirpath=tmp_path, filename="fp32")
    make_trainer(max_steps=4, callbacks=[checkpoints], enable_checkpointing=True).fit(TinyRegressor(), loader())
    first = FirstScale()
    with pytest.warns(UserWarning, match=MISSING_STATE):
        make_trainer(MixedPrecision("16-mixed", init_scale=2.0**9), max_steps=6, callbacks=[first]).fit(
            TinyRegressor(), loader(), ckpt_path=tmp_path / "fp32.ckpt"
        )
    assert first.scale == 2.0**9


def test_bf16_checkpoint_into_fp16_warns(tmp_path):
    """Resuming a bf16 checkpoint in fp16 warns that bf16 models often overflow in fp16; counters carry over."""
    checkpoints = ModelCheckpoint(dirpath=tmp_path, filename="bf16")
    make_trainer(MixedPrecision("bf16-mixed"), max_steps=4, callbacks=[checkpoints], enable_checkpointing=True).fit(
        TinyRegressor(inject_at=(1,)), loader()
    )
    first = FirstScale()
    plugin = MixedPrecision("16-mixed", init_scale=2.0**9)
    with pytest.warns(UserWarning, match="written in bf16.*overflow in fp16"):
        make_trainer(plugin, max_steps=6, callbacks=[first]).fit(
            TinyRegressor(), loader(), ckpt_path=tmp_path / "bf16.ckpt"
        )
    assert first.scale == 2.0**9
    assert (plugin.stats.optimizer_steps, plugin.stats.skipped_steps) == (6, 1)


def _our_checkpoint(tmp_path: Path, precision: str) -> Path:
    """A lightning_mp checkpoint; in fp16 the scaler backed off once from 2**9 to 2**8."""
    checkpoints = ModelCheckpoint(dirpath=tmp_path, filename=f"ours-{precision}")
    settings = {"init_scale": 2.0**9, "growth_interval": 100} if precision == "16-mixed" else {}
    make_trainer(
        MixedPrecision(precision, **settings), max_steps=3, callbacks=[checkpoints], enable_checkpointing=True
    ).fit(TinyRegressor(inject_at=(1,)), loader())
    return tmp_path / f"ours-{precision}.ckpt"


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "32-true"])
def test_torchs_gradscaler_loads_our_checkpoint_entry(tmp_path, precision):
    """torch.amp.GradScaler.load_state_dict accepts the plugin's entry: our scale in fp16, a fresh one otherwise."""
    entry = torch.load(_our_checkpoint(tmp_path, precision), weights_only=False)["MixedPrecision"]
    scaler = torch.amp.GradScaler("cpu")
    scaler.load_state_dict(entry)
    assert scaler.get_scale() == (2.0**8 if precision == "16-mixed" else 2.0**16)
    assert scaler.get_growth_interval() == (100 if precision == "16-mixed" else 2000)


def test_lightnings_bf16_plugin_resumes_from_our_fp16_checkpoint(tmp_path):
    """Lightning's bf16 MixedPrecision (no scaler) resumes from our fp16 checkpoint and trains on."""
    path = _our_checkpoint(tmp_path, "16-mixed")
    model = TinyRegressor()
    make_trainer(LightningMixedPrecision("bf16-mixed", "cpu"), max_steps=5).fit(model, loader(), ckpt_path=path)
    assert model.global_step == 5


def test_our_resume_from_our_checkpoint_with_torchs_keys_still_restores_everything(tmp_path):
    """The top-level torch keys do not shadow our state: counters and scale come back exactly."""
    path = _our_checkpoint(tmp_path, "16-mixed")
    first = FirstScale()
    plugin = MixedPrecision("16-mixed", init_scale=2.0**9, growth_interval=100)
    make_trainer(plugin, max_steps=5, callbacks=[first]).fit(TinyRegressor(), loader(), ckpt_path=path)
    assert first.scale == 2.0**8
    assert (plugin.stats.optimizer_steps, plugin.stats.skipped_steps) == (5, 1)


def _fp16_checkpoint(tmp_path: Path) -> Path:
    checkpoints = ModelCheckpoint(dirpath=tmp_path, filename="fp16")
    plugin = MixedPrecision("16-mixed", init_scale=2.0**9)
    make_trainer(plugin, max_steps=2, callbacks=[checkpoints], enable_checkpointing=True).fit(TinyRegressor(), loader())
    return tmp_path / "fp16.ckpt"


def _resume_with_entry(path: Path, entry: Any) -> None:
    checkpoint = torch.load(path, weights_only=False)
    checkpoint["MixedPrecision"] = entry(checkpoint["MixedPrecision"])
    torch.save(checkpoint, path)
    make_trainer(MixedPrecision("16-mixed"), max_steps=4).fit(TinyRegressor(), loader(), ckpt_path=path)


@pytest.mark.parametrize("scale", [0.0, -4.0])
def test_a_scale_that_training_cannot_make_is_refused_at_resume(tmp_path, scale):
    """A checkpoint whose loss scale is 0 or negative is refused, naming 'scale' and the value, not clamped."""
    path = _fp16_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=rf"key 'scale' holds {scale}; expected a finite positive number"):
        _resume_with_entry(path, lambda entry: {**entry, "scaler": {**entry["scaler"], "scale": scale}})


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        (lambda entry: None, r"MixedPrecision state holds None; expected a dict"),
        (lambda entry: "garbage", r"MixedPrecision state holds 'garbage'; expected a dict"),
        (lambda entry: [], r"MixedPrecision state holds \[\]; expected a dict"),
        (lambda entry: {**entry, "scaler": "abc"}, r"'scaler'='abc'; expected a dict \(the loss scaler's state\)"),
    ],
)
def test_a_malformed_plugin_entry_is_refused_naming_the_field(tmp_path, entry, match):
    """A checkpoint whose MixedPrecision entry is malformed fails with a ValueError naming the field and the value."""
    path = _fp16_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=match):
        _resume_with_entry(path, entry)


def test_a_reused_plugin_starts_each_fit_as_a_fresh_plugin_would(tmp_path):
    """After a resumed fit, a reused plugin trains an unrelated fit with the initial scale and zero counters."""
    path = _fp16_checkpoint(tmp_path)
    reused = MixedPrecision("16-mixed", init_scale=2.0**7, growth_interval=1)
    make_trainer(reused, max_steps=4).fit(TinyRegressor(), loader(), ckpt_path=path)
    assert reused.stats.optimizer_steps == 4
    fresh = MixedPrecision("16-mixed", init_scale=2.0**7, growth_interval=1)
    models = {}
    for name, plugin in (("reused", reused), ("fresh", fresh)):
        torch.manual_seed(0)
        models[name] = TinyRegressor(inject_at=(1,))
        make_trainer(plugin, max_steps=3).fit(models[name], loader())
    assert reused.stats == fresh.stats
    for name, value in models["fresh"].state_dict().items():
        assert torch.equal(value, models["reused"].state_dict()[name]), name
