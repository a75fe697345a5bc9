"""Settings declared once: the plugin, the scaler and the rules share one default, text and check per setting."""

from __future__ import annotations

import inspect
import threading
from dataclasses import fields

import pytest
import torch

from lightning_mp import LossScaler, MixedPrecision
from lightning_mp.arguments.checks import UNNAMED_CALLER, arguments_of, caller, check_flag, exact
from lightning_mp.fp8 import FP8Settings
from lightning_mp.scaling.rules import ScalerSettings
from lightning_mp.settings import TORCH_SCALER_SETTINGS, PluginSettings
from tests.helpers import TinyRegressor, loader, make_trainer

SCALER_SETTINGS = [field.name for field in fields(ScalerSettings)]
PLUGIN_SETTINGS = [field.name for field in fields(PluginSettings) if "check" in field.metadata]


def documented(cls: type, name: str) -> str:
    """The text the docstring of ``cls`` gives for the argument ``name``, on one line."""
    lines = inspect.getdoc(cls).splitlines()
    start = next(index for index, line in enumerate(lines) if line.startswith(f"    {name}: "))
    text = [lines[start].split(": ", 1)[1]]
    for line in lines[start + 1 :]:
        if not line.startswith("        "):
            break
        text.append(line.strip())
    return " ".join(text)


@pytest.mark.parametrize("name", SCALER_SETTINGS)
def test_the_scaler_and_the_plugin_document_each_setting_with_the_same_text(name):
    """help(LossScaler) and help(MixedPrecision) say the same thing about a scaler setting, the settings' own text."""
    text = " ".join(next(f for f in fields(ScalerSettings) if f.name == name).metadata["doc"].split())
    assert documented(LossScaler, name).startswith(text)
    if name != "mode":  # the plugin chooses the mode from the precision
        assert documented(MixedPrecision, name).startswith(text)


@pytest.mark.parametrize("name", SCALER_SETTINGS)
def test_a_setting_left_out_has_the_settings_default_in_the_scaler_and_the_plugin(name):
    """LossScaler() and MixedPrecision("16-mixed") use the defaults ScalerSettings declares."""
    default = getattr(ScalerSettings(), name)
    assert inspect.signature(LossScaler).parameters[name].default == default
    plugin = MixedPrecision("16-mixed")
    plugin.setup_for_device("cpu")
    assert plugin.scaler is not None and getattr(plugin.scaler.settings, name) == default
    if name in TORCH_SCALER_SETTINGS:
        assert inspect.signature(MixedPrecision).parameters[name].default is None
        assert documented(MixedPrecision, name).endswith(f"None means {exact(default)}.")
    elif name != "mode":
        assert inspect.signature(MixedPrecision).parameters[name].default == default


@pytest.mark.parametrize("name", PLUGIN_SETTINGS)
def test_the_plugins_own_settings_have_their_settings_default_and_text(name):
    """MixedPrecision's own arguments default to, and are documented by, PluginSettings."""
    setting = next(f for f in fields(PluginSettings) if f.name == name)
    assert inspect.signature(MixedPrecision).parameters[name].default == setting.default
    assert documented(MixedPrecision, name).startswith(" ".join(setting.metadata["doc"].split()))


def test_a_torch_gradscaler_is_translated_into_the_scaler_settings():
    """The settings of a GradScaler given as scaler= are the settings the plugin holds, before any run."""
    given = torch.amp.GradScaler("cpu", init_scale=2.0**9, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    settings = MixedPrecision("16-mixed", scaler=given).settings
    assert settings.scaler.init_scale == 2.0**9 and settings.scaler.growth_factor == 4.0
    assert settings.scaler.backoff_factor == 0.25 and settings.scaler.growth_interval == 3
    assert settings.torch_scaler_device == "cpu" and not settings.scaling_disabled


def test_the_settings_are_frozen_and_validated_once_built():
    """A settings object cannot be changed after its checks ran, and a bad setting fails when it is built."""
    settings = PluginSettings(precision="16-mixed")
    with pytest.raises(AttributeError):
        settings.opt_level = "O7"  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"PluginSettings\(opt_level='o2'\) is not supported.*Did you mean"):
        PluginSettings(opt_level="o2")


def test_lean_with_fp16_is_refused_with_the_lean_message():
    """MixedPrecision("16-mixed", opt_level="lean") says lean keeps bf16 states and points to bf16 or O2."""
    with pytest.raises(ValueError, match=r"lean keeps weights and optimizer states in bf16.*or opt_level='O2'"):
        MixedPrecision("16-mixed", opt_level="lean")


def test_a_device_the_trainer_does_not_run_on_is_refused_at_setup():
    """MixedPrecision(device="cuda") on a CPU Trainer fails at setup, naming both devices, before any step."""
    plugin = MixedPrecision("bf16-mixed", device="cuda")
    with pytest.raises(ValueError, match=r"MixedPrecision\(device='cuda'\) does not match .* runs on 'cpu'"):
        make_trainer(plugin, max_steps=1).fit(TinyRegressor(), loader())


@pytest.mark.parametrize(
    ("build", "named"),
    [
        (lambda: MixedPrecision("16-mixed", growth_factor=0.5), r"MixedPrecision\(growth_factor=0\.5\)"),
        (lambda: LossScaler(growth_factor=0.5), r"LossScaler\(growth_factor=0\.5\)"),
        (lambda: ScalerSettings(growth_factor=0.5), r"ScalerSettings\(growth_factor=0\.5\)"),
        (lambda: PluginSettings(opt_level="O9"), r"PluginSettings\(opt_level='O9'\)"),
        (lambda: FP8Settings(fallback_patience=0), r"FP8Settings\(fallback_patience=0\)"),
    ],
)
def test_a_refused_argument_names_the_call_the_user_wrote(build, named):
    """The message names the class the user called, even where that class builds another's settings for it."""
    with pytest.raises(ValueError, match=named):
        build()


def test_a_refused_scale_update_or_checkpoint_names_the_scaler_method():
    """LossScaler.update(new_scale=...) and LossScaler.load_state_dict name themselves, not the constructor."""
    scaler = LossScaler(init_scale=2.0**8, device="cpu")
    with pytest.raises(ValueError, match=r"LossScaler\.update\(new_scale=-1\.0\) is not allowed"):
        scaler.update(new_scale=-1.0)
    with pytest.raises(ValueError, match=r"LossScaler\.load_state_dict: the dict has no key 'scale'"):
        scaler.load_state_dict({"counters": {}})


def test_each_thread_names_its_own_caller():
    """Two threads checking arguments at once each report their own call (the caller lives in a context variable)."""
    barrier = threading.Barrier(2)
    messages: dict[str, str] = {}

    def check_as(name: str) -> None:
        with arguments_of(name):
            barrier.wait()
            try:
                check_flag("enabled", "yes")
            except ValueError as error:
                messages[name] = str(error)

    threads = [threading.Thread(target=check_as, args=(name,)) for name in ("First", "Second")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert messages == {
        name: f"{name}(enabled='yes') is not allowed: enabled must be True or False." for name in ("First", "Second")
    }
    assert caller() == UNNAMED_CALLER
