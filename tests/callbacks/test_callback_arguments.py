"""Every argument of the telemetry callbacks is checked: a bad value is rejected, naming the argument and the rule."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from lightning_mp.callbacks import GradientHealthMonitor, LayerDtypeMonitor, LossScaleMonitor, PrecisionSentinel

BAD_ARGUMENTS = [
    (LossScaleMonitor, "prog_bar", 1, "True or False"),
    (LossScaleMonitor, "prog_bar", "yes", "True or False"),
    (GradientHealthMonitor, "warn_every_n_skips", 0, "an integer >= 1"),
    (GradientHealthMonitor, "warn_every_n_skips", True, "an integer >= 1"),
    (GradientHealthMonitor, "log_histogram", None, "True or False"),
    (LayerDtypeMonitor, "every_n_steps", 2.5, "an integer >= 1"),
    (LayerDtypeMonitor, "every_n_steps", False, "an integer >= 1"),
    (PrecisionSentinel, "every_n_steps", -3, "an integer >= 1"),
    (PrecisionSentinel, "stale_update_share", 2, r"a number in \(0, 1\]"),
    (PrecisionSentinel, "underflow_growth", True, r"a number in \(0, 1\]"),
    (PrecisionSentinel, "headroom_log2", 17.0, r"a number in \(0, 16\]"),
    (PrecisionSentinel, "log_heatmaps", "no", "True or False"),
    (PrecisionSentinel, "heatmap_every_n_samples", 0, "an integer >= 1"),
]


@pytest.mark.parametrize(("callback", "argument", "value", "allowed"), BAD_ARGUMENTS)
def test_bad_argument_is_rejected_with_its_name_value_and_rule(callback: type, argument: str, value: Any, allowed):
    """Each callback refuses a bad value with a ValueError naming the argument, showing the value and the rule."""
    with pytest.raises(ValueError, match=rf"`{argument}` must be {allowed}, got {value!r}"):
        callback(**{argument: value})


@pytest.mark.parametrize("callback", [LossScaleMonitor, GradientHealthMonitor, LayerDtypeMonitor, PrecisionSentinel])
def test_defaults_are_accepted(callback: type):
    """Each callback builds with its defaults."""
    callback()


@pytest.mark.parametrize(
    ("callback", "argument", "value", "expected"),
    [
        (LayerDtypeMonitor, "every_n_steps", np.int64(5), 5),
        (PrecisionSentinel, "every_n_steps", torch.tensor(7), 7),
        (PrecisionSentinel, "stale_update_share", np.float32(0.5), 0.5),
        (PrecisionSentinel, "headroom_log2", torch.tensor(3.0), 3.0),
        (LossScaleMonitor, "prog_bar", np.True_, True),
        (GradientHealthMonitor, "log_histogram", torch.tensor(False), False),
    ],
)
def test_numpy_and_zero_d_tensor_scalars_are_accepted_as_python_values(callback, argument, value, expected):
    """A numpy scalar or a 0-d tensor of the right kind is accepted, and kept as the plain Python value it holds."""
    kept = getattr(callback(**{argument: value}), argument)
    assert kept == expected and type(kept) is type(expected)


@pytest.mark.parametrize(
    ("callback", "argument", "value"),
    [
        (LayerDtypeMonitor, "every_n_steps", torch.tensor(2.0)),
        (PrecisionSentinel, "every_n_steps", np.bool_(True)),
        (LossScaleMonitor, "prog_bar", torch.tensor(1)),
        (PrecisionSentinel, "stale_update_share", torch.tensor([0.5])),
    ],
)
def test_numpy_and_tensor_values_of_the_wrong_kind_are_refused(callback, argument, value):
    """A float tensor for an integer, a boolean for an integer, an integer for a boolean or a 1-d tensor is refused."""
    with pytest.raises(ValueError, match=f"`{argument}` must be"):
        callback(**{argument: value})
