"""The conversion adapter: torchao's FP8 layers in, plain nn.Linear layers back, with the same Parameter objects."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mp.fp8.convert import fp8_unavailable

if fp8_unavailable() is not None:  # torchao below its torch floor may fail to import with other errors than ImportError
    pytest.skip(f"the FP8 mode {fp8_unavailable()}", allow_module_level=True)
pytest.importorskip("torchao")

from lightning_mp.fp8 import FP8Settings, fp8_layer_names
from lightning_mp.fp8.convert import convert_to_fp8, fallback_layer, is_fp8_linear, restore_linear
from tests.fp8.plugin_models import mlp


def test_convert_then_restore_keeps_every_parameter_object_and_the_outputs():
    """Converted layers keep their weight and bias objects; restored, they are plain nn.Linear with the same outputs."""
    model = mlp()
    parameters = list(model.parameters())
    x = torch.randn(4, 16)
    expected = model(x)
    assert convert_to_fp8(model, FP8Settings(recipe="rowwise"), ["2", "4"]) == ["2", "4"]
    assert is_fp8_linear(model[2]) and not is_fp8_linear(model[0])
    assert [id(parameter) for parameter in model.parameters()] == [id(parameter) for parameter in parameters]
    assert restore_linear(model) == ["2", "4"]
    assert [type(layer) for layer in model if isinstance(layer, nn.Linear)] == [nn.Linear] * 4
    assert [id(parameter) for parameter in model.parameters()] == [id(parameter) for parameter in parameters]
    torch.testing.assert_close(model(x), expected)


def test_restore_of_a_layer_that_is_not_fp8_names_the_fp8_layers():
    """Restoring a name that is not an FP8 layer fails, listing the FP8 layers."""
    model = mlp()
    convert_to_fp8(model, FP8Settings(), ["2"])
    with pytest.raises(ValueError, match=r"names=\['0'\].*FP8 layers are \['2'\]"):
        restore_linear(model, ["0"])


def test_fallback_layer_on_a_bare_model_restores_that_layer_only():
    """Outside a Trainer, fallback_layer returns the one layer to a plain Linear, once."""
    model = mlp()
    convert_to_fp8(model, FP8Settings(), ["2", "4"])
    weight = model[2].weight
    assert fallback_layer(model, "2", "test") is True
    assert type(model[2]) is nn.Linear and model[2].weight is weight and fp8_layer_names(model) == ["4"]
    assert fallback_layer(model, "2", "test") is False
