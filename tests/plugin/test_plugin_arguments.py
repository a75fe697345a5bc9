"""MixedPrecision's arguments: every one checked once, clear errors with "did you mean", Lightning's signature."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision as LightningMixedPrecision

from lightning_mp import LossScaler, MixedPrecision
from tests.helpers import TinyRegressor, loader, make_trainer

NEAR_MISSES = [
    ("precision", "16", "16-mixed"),
    ("precision", 16, "16-mixed"),
    ("precision", "fp16", "16-mixed"),
    ("precision", "bf16", "bf16-mixed"),
    ("precision", "bf16-true", "bf16-mixed"),
    ("precision", "32", "32-true"),
    ("precision", 32, "32-true"),
    ("precision", "16-mxied", "16-mixed"),
    ("opt_level", "o2", "O2"),
    ("opt_level", 1, "O1"),
    ("device", "cuda0", "cuda"),
]


@pytest.mark.parametrize(("argument", "value", "meant"), NEAR_MISSES)
def test_near_misses_say_did_you_mean(argument, value, meant):
    """A near miss names the argument, the value, what is allowed, and suggests the intended value."""
    with pytest.raises(ValueError, match="Did you mean") as caught:
        MixedPrecision(**{argument: value})
    message = str(caught.value)
    assert f"{argument}={value!r}" in message
    assert f"Did you mean {argument}={meant!r}?" in message
    assert "must be one of" in message


@pytest.mark.parametrize("argument", ["consecutive_hysteresis", "skip_scheduler_on_overflow"])
@pytest.mark.parametrize("value", ["no", "False", 0, 1, None, 1.0])
def test_booleans_must_be_true_or_false(argument, value):
    """A string such as 'no' (truthy in Python) or a number is refused for a boolean argument."""
    with pytest.raises(ValueError, match=rf"{argument}={value!r}.*must be True or False"):
        MixedPrecision(**{argument: value})


def test_numpy_and_zero_dim_tensor_scalars_are_accepted():
    """numpy scalars and 0-d tensors are accepted as the numbers and flags they hold."""
    plugin = MixedPrecision(
        "16-mixed",
        init_scale=np.float32(2.0**10),
        growth_factor=torch.tensor(2.0),
        backoff_factor=np.float64(0.25),
        growth_interval=np.int64(3),
        hysteresis=torch.tensor(2),
        max_consecutive_skips=np.int32(7),
        consecutive_hysteresis=np.bool_(True),
        skip_scheduler_on_overflow=torch.tensor(False),
    )
    make_trainer(plugin, max_steps=1).fit(TinyRegressor(), loader())
    scaler = plugin.scaler
    assert scaler.get_scale() == 2.0**10
    assert scaler.get_backoff_factor() == 0.25 and scaler.get_growth_interval() == 3
    assert plugin.skip_scheduler_on_overflow is False


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"growth_interval": np.float64(2.5)}, "growth_interval"),
        ({"hysteresis": torch.tensor(1.5)}, "hysteresis"),
        ({"init_scale": torch.tensor([1.0, 2.0])}, "init_scale"),
        ({"growth_factor": "2"}, "growth_factor"),
        ({"max_consecutive_skips": True}, "max_consecutive_skips"),
    ],
)
def test_numbers_of_the_wrong_kind_name_the_argument(kwargs, argument):
    """A fractional count, a vector, a string or a bool where a number belongs fails naming the argument."""
    with pytest.raises(ValueError, match=argument):
        MixedPrecision(**kwargs)


@pytest.mark.parametrize("array", [np.array([1.0, 2.0]), np.array(["16-mixed"]), torch.tensor([1.0, 2.0])])
@pytest.mark.parametrize("argument", ["precision", "opt_level", "device", "on_min_scale", "loss_scale", "init_scale"])
def test_an_array_where_a_choice_or_a_number_belongs_names_the_argument(argument, array):
    """An array (even one holding an allowed string) is refused with a ValueError naming the argument and the value."""
    precision = {"precision": array} if argument == "precision" else {"precision": "16-mixed"}
    with pytest.raises(
        ValueError, match=rf"MixedPrecision\({argument}=(array|tensor)\(.*\) is not (allowed|supported)"
    ):
        MixedPrecision(**{**precision, **({} if argument == "precision" else {argument: array})})


@pytest.mark.parametrize("argument", ["hysteresis", "max_consecutive_skips", "growth_interval"])
def test_count_limits_are_printed_exactly_and_the_limit_itself_is_accepted(argument):
    """Counts up to 2**31 - 1 are accepted; beyond, the message prints the limit as 2147483647, not 2.14748e+09."""
    MixedPrecision("16-mixed", **{argument: 2**31 - 1})
    with pytest.raises(
        ValueError, match=rf"{argument}=1000000000000000000\) .* must be an integer >= 1 and <= 2147483647\.$"
    ):
        MixedPrecision("16-mixed", **{argument: 10**18})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_scale": 1e-9}, r"min_scale must be a finite number >= 2\*\*-24 and <= 3\.4028234663852886e\+38\.$"),
        ({"init_scale": 2.0**25}, r"\[min_scale, max_scale\] = \[2\*\*-24, 16777216\]"),
        ({"loss_scale": 2.0**-127}, r"'dynamic' or a static scale, a finite number >= 2\*\*-126 and <= 3\.40282"),
        ({"loss_scale": "Dynamic"}, r"loss_scale='Dynamic'\) is not allowed: loss_scale must be 'dynamic' or"),
    ],
)
def test_scale_limits_are_printed_exactly(kwargs, message):
    """The scale bounds in messages read back exactly: 2**-24, float32's largest in full, 16777216."""
    with pytest.raises(ValueError, match=message):
        MixedPrecision("16-mixed", **kwargs)


def test_a_static_loss_scale_below_the_dynamic_floor_is_used_as_given():
    """loss_scale=2**-25 (a normal float32 with a finite inverse) trains with exactly that fixed scale."""
    plugin = MixedPrecision("16-mixed", loss_scale=2.0**-25)
    make_trainer(plugin, max_steps=2).fit(TinyRegressor(), loader())
    assert plugin.stats.loss_scale == 2.0**-25 and plugin.stats.skipped_steps == 0


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_static_loss_scale_without_fp16_fails_in_the_constructor(precision):
    """MixedPrecision('32-true', loss_scale=128.0) fails when built, not later at fit."""
    with pytest.raises(ValueError, match=rf"precision='{precision}', loss_scale=128\.0"):
        MixedPrecision(precision, loss_scale=128.0)


def test_signature_is_lightnings_with_the_settings_keyword_only():
    """precision, device and scaler are positional as in Lightning's plugin; everything else is keyword-only."""
    ours = inspect.signature(MixedPrecision).parameters
    theirs = inspect.signature(LightningMixedPrecision).parameters
    assert list(ours)[:3] == list(theirs)[:3] == ["precision", "device", "scaler"]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in list(ours.values())[3:])
    with pytest.raises(TypeError):
        MixedPrecision("16-mixed", "cpu", None, "O2")  # type: ignore[misc]


@pytest.mark.parametrize(
    "args",
    [
        ("16-mixed", "cpu"),
        ("bf16-mixed", "cpu"),
        ("16-mixed", "cpu", None),
        ("16-mixed", "cuda"),
        ("16-mixed", "cuda:0"),
    ],
)
def test_every_call_lightnings_plugin_accepts_is_accepted(args):
    """The positional calls Lightning's plugin accepts build ours with the same precision and autocast device."""
    LightningMixedPrecision(*args)
    ours = MixedPrecision(*args)
    assert (ours.precision, ours.device) == (args[0], args[1].split(":")[0])


def test_a_torch_gradscaler_passed_as_scaler_has_its_settings_honoured():
    """GradScaler(init_scale, growth_factor, backoff_factor, growth_interval) sets the plugin's scaler."""
    given = torch.amp.GradScaler("cpu", init_scale=2.0**9, growth_factor=4.0, backoff_factor=0.25, growth_interval=2)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=given)
    model = TinyRegressor(inject_at=(2,))
    make_trainer(plugin, max_steps=4).fit(model, loader())
    # Steps 0 and 1 clean: grows x4 after two; step 2 overflows: x0.25; step 3 clean.
    assert plugin.stats.loss_scale == 2.0**9 * 4 * 0.25
    assert plugin.scaler.get_growth_factor() == 4.0 and plugin.scaler.get_growth_interval() == 2


def test_a_disabled_gradscaler_turns_scaling_off():
    """GradScaler(enabled=False) means no loss scaling, as in Lightning; non-finite steps are still skipped."""
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", enabled=False))
    make_trainer(plugin, max_steps=3).fit(TinyRegressor(inject_at=(1,)), loader())
    assert plugin.scaler is None
    assert plugin.stats.skipped_steps == 1


@pytest.mark.filterwarnings("ignore:torch.cuda.amp.GradScaler is enabled, but CUDA is not available")
def test_a_gradscaler_for_another_device_is_refused_instead_of_training_unscaled():
    """GradScaler() (built for CUDA, which torch disables without CUDA) on a CPU run is an error naming both devices."""
    plugin = MixedPrecision("16-mixed", scaler=torch.amp.GradScaler())
    with pytest.raises(
        ValueError, match=r"scaler=GradScaler\('cuda'\)\) cannot scale a run on 'cpu'.*GradScaler\('cpu'"
    ):
        make_trainer(plugin, max_steps=1).fit(TinyRegressor(), loader())


def test_a_loss_scaler_passed_as_scaler_is_used_as_it_is():
    """A LossScaler given as scaler keeps its own settings (hysteresis included)."""
    given = LossScaler("cpu", init_scale=2.0**8, hysteresis=2, growth_interval=100)
    plugin = MixedPrecision("16-mixed", scaler=given)
    make_trainer(plugin, max_steps=3).fit(TinyRegressor(inject_at=(1,)), loader())
    assert plugin.scaler is given
    assert plugin.stats.loss_scale == 2.0**8  # one overflow is tolerated by hysteresis=2


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (("bf16-mixed", "cpu", torch.amp.GradScaler("cpu")), {}, "does not use a scaler"),
        (("32-true", None, torch.amp.GradScaler("cpu")), {}, "does not use a scaler"),
        (("16-mixed", "cpu", torch.amp.GradScaler("cpu")), {"init_scale": 8.0}, "init_scale"),
        (("16-mixed", "cpu", torch.amp.GradScaler("cpu")), {"loss_scale": 8.0}, "loss_scale"),
        (("16-mixed", "cpu", "scaler"), {}, "scaler"),
    ],
)
def test_a_scaler_that_cannot_apply_is_a_clear_error(args, kwargs, match):
    """A scaler with bf16/fp32, beside the settings it replaces, or of the wrong type fails in the constructor."""
    with pytest.raises((ValueError, TypeError), match=match):
        MixedPrecision(*args, **kwargs)
