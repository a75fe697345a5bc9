"""transformers' Conv1D in FP8: the same matmul as torchao's Float8Linear, the same parameters and checkpoint layout,
under the Trainer and Fabric, and back to Conv1D after fit or a fallback."""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lightning_mp.fp8.convert import fp8_unavailable

if fp8_unavailable() is not None:  # torchao below its torch floor may fail to import with other errors than ImportError
    pytest.skip(f"the FP8 mode {fp8_unavailable()}", allow_module_level=True)
pytest.importorskip("torchao")

from torchao.float8 import Float8LinearConfig, convert_to_float8_training

from lightning_mp import MixedPrecision
from lightning_mp.fp8 import FP8Settings, advise_fp8, fp8_layer_names
from lightning_mp.fp8.convert import convert_to_fp8, restore_linear
from lightning_mp.fp8.quant import cast_stats, recipe_casts
from lightning_mp.fp8.transposed import Float8TransposedLinear
from tests.fp8.lm_models import CONTEXT, VOCAB, Conv1D, Gpt2Shaped, HeadFirstGpt, TinyLm, counting_loader
from tests.fp8.plugin_models import fabric_setup
from tests.helpers import fit

PROJECTIONS = [f"network.h.{block}.{name}" for block in (0, 1) for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc")]
GPT2_FP8 = [
    "network.h.0.attn.c_proj",
    "network.h.0.mlp.c_fc",
    "network.h.0.mlp.c_proj",
    "network.h.1.attn.c_attn",
    "network.h.1.attn.c_proj",
    "network.h.1.mlp.c_fc",
    "network.h.1.mlp.c_proj",
]
"""GPT-2's projections that run FP8: all but the first (h.0.attn.c_attn); the tied lm_head stays bf16 too."""


class Fp8Layers(L.Callback):
    """Records, at every training batch, the FP8 layers and the shapes of the model's state_dict."""

    def __init__(self) -> None:
        self.seen: list[list[str]] = []
        self.shapes: list[dict[str, torch.Size]] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
        self.seen.append(fp8_layer_names(pl_module))
        self.shapes.append({key: value.shape for key, value in pl_module.state_dict().items()})


def _shapes(model: nn.Module) -> dict[str, torch.Size]:
    return {key: value.shape for key, value in model.state_dict().items()}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_a_conv1d_in_fp8_computes_what_a_float8_linear_of_its_transposed_weight_computes(recipe):
    """A Conv1D converted to FP8 gives the outputs and the gradients (input, weight, bias) of torchao's Float8Linear
    holding its transposed weight, bit for bit, under each recipe."""
    torch.manual_seed(0)
    conv = Conv1D(64, 32)
    conv.bias.data.normal_()
    linear = nn.Sequential(nn.Linear(32, 64))
    linear[0].weight.data.copy_(conv.weight.detach().t())
    linear[0].bias.data.copy_(conv.bias.detach())
    convert_to_float8_training(linear, config=Float8LinearConfig.from_recipe_name(recipe))
    model = nn.Sequential(conv)
    convert_to_fp8(model, FP8Settings(recipe=recipe), ["0"])
    assert isinstance(model[0], Float8TransposedLinear) and model[0].weight is conv.weight
    x = torch.randn(4, 5, 32, dtype=torch.bfloat16, requires_grad=True)
    x_linear = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, out_linear = model(x), linear(x_linear)
    gradient = torch.randn_like(out)
    out.backward(gradient)
    out_linear.backward(gradient)
    assert torch.equal(out, out_linear)
    assert torch.equal(x.grad, x_linear.grad)
    assert torch.equal(conv.weight.grad, linear[0].weight.grad.t())
    assert torch.equal(conv.bias.grad, linear[0].bias.grad)


def test_gpt2s_conv1d_projections_train_in_fp8_and_the_model_keeps_its_checkpoint_layout(caplog):
    """fp8='tensorwise' on a GPT-2-shaped model runs every Conv1D projection but the first in FP8, the setup line
    says so, the state_dict keeps transformers' keys and (in, out) shapes throughout, and after fit the projections
    are Conv1D again, holding the same trained parameters, and the weights load into a fresh model."""
    model = TinyLm(Gpt2Shaped)
    parameters = [id(parameter) for parameter in model.parameters()]
    shapes = _shapes(model)
    before = model.network.h[1].attn.c_attn.weight.detach().clone()
    layers = Fp8Layers()
    with caplog.at_level(logging.INFO):
        fit(model, MixedPrecision("bf16-mixed", fp8="tensorwise"), counting_loader(), max_steps=3, callbacks=[layers])
    assert layers.seen == [GPT2_FP8] * 3
    assert all(seen == shapes for seen in layers.shapes)
    line = next(record.getMessage() for record in caplog.records if "FP8 (" in record.getMessage())
    assert "FP8 (tensorwise): 7 of 9 linear layers" in line and "network.h.0.attn.c_attn (first linear)" in line
    assert all(type(model.get_submodule(name)) is Conv1D for name in PROJECTIONS)
    assert [id(parameter) for parameter in model.parameters()] == parameters
    assert not torch.equal(model.network.h[1].attn.c_attn.weight, before)
    fresh = Gpt2Shaped()
    fresh.load_state_dict(model.network.state_dict())
    tokens = torch.arange(CONTEXT).unsqueeze(0)
    torch.testing.assert_close(fresh(tokens), model.network(tokens))


def test_gpt2_in_fp8_trains_within_one_percent_of_bf16():
    """Trained in FP8 (emulated on the CPU), the GPT-2-shaped model learns, and its loss over the last steps is within
    1% of the bf16 run's."""
    losses = {}
    for fp8 in (None, "tensorwise"):
        model = TinyLm(Gpt2Shaped)
        fit(model, MixedPrecision("bf16-mixed", fp8=fp8), counting_loader(), max_steps=40)
        losses[fp8] = sum(model.losses[-10:]) / 10
        assert losses[fp8] < 0.5 * model.losses[0]
    assert losses["tensorwise"] == pytest.approx(losses[None], rel=0.01)


def test_fabric_steps_the_conv1d_weights_its_optimizer_holds_and_teardown_gives_conv1d_back():
    """Under Fabric the optimizer built before setup holds the Conv1D parameters: they train in FP8, and teardown
    puts the Conv1D modules back with them."""
    torch.manual_seed(0)
    network = Gpt2Shaped()
    fabric, plugin, wrapped, optimizer = fabric_setup(network, fp8="rowwise")
    assert plugin.fp8_layers == [name.removeprefix("network.") for name in GPT2_FP8]
    weight = network.h[1].mlp.c_fc.weight
    before = weight.detach().clone()
    for (tokens,) in list(counting_loader())[:3]:
        logits = wrapped(tokens[:, :-1]).float()
        fabric.backward(nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)))
        optimizer.step()
        optimizer.zero_grad()
    assert not torch.equal(weight, before)
    plugin.teardown()
    assert type(network.h[1].mlp.c_fc) is Conv1D and network.h[1].mlp.c_fc.weight is weight


def test_a_conv1d_that_falls_back_is_a_conv1d_again_with_its_parameters():
    """A Conv1D projection returned to bf16 mid-run becomes the Conv1D it was, holding the same parameters, while the
    others stay FP8."""
    torch.manual_seed(0)
    network = Gpt2Shaped()
    _, plugin, wrapped, _ = fabric_setup(network)
    weight = network.h[0].mlp.c_fc.weight
    assert plugin.fallback_layer(wrapped, "h.0.mlp.c_fc", "by hand") is True
    assert type(network.h[0].mlp.c_fc) is Conv1D and network.h[0].mlp.c_fc.weight is weight
    assert "h.0.mlp.c_fc" not in plugin.fp8_layers and len(plugin.fp8_layers) == 6
    plugin.teardown()
    assert restore_linear(network) == []


def test_a_head_first_model_under_the_trainer_keeps_its_input_side_projection_and_head_in_bf16():
    """Registered head first (litgpt's GPT), the model runs FP8 in every projection but the first one after the
    embedding and the output head."""
    layers = Fp8Layers()
    fit(TinyLm(HeadFirstGpt), MixedPrecision("bf16-mixed", fp8="tensorwise"), counting_loader(), max_steps=1,
        callbacks=[layers])  # fmt: skip
    assert "network.lm_head" not in layers.seen[0] and "network.transformer.h.0.attn.qkv" not in layers.seen[0]
    assert len(layers.seen[0]) == 7 and "network.transformer.h.1.mlp.fc" in layers.seen[0]


def test_the_advisor_measures_conv1d_projections_with_their_weight_as_the_matmul_reads_it():
    """advise_fp8 measures GPT-2's Conv1D projections and recommends FP8 for them; a weight's estimate is the cast
    of the (out, in) weight the matmul scales, row by row under rowwise."""
    model = TinyLm(Gpt2Shaped)
    advice = advise_fp8(model, counting_loader(n=32), batches=1, recipes=["rowwise"])
    assert advice.convertible
    measured = {layer.name: layer for layer in advice.layers if not layer.not_measured}
    assert set(measured) == set(GPT2_FP8)
    layer = model.network.h[1].attn.c_attn
    expected = cast_stats(layer.weight.detach().t(), recipe_casts("rowwise").weight)
    assert measured["network.h.1.attn.c_attn"].stats["rowwise"]["weight"]["scale"] == pytest.approx(expected[1].item())
    assert (measured["network.h.1.attn.c_attn"].in_features, measured["network.h.1.attn.c_attn"].out_features) == (
        32,
        96,
    )


def test_the_fp8_monitor_watches_conv1d_projections(tmp_path):
    """FP8Monitor measures each FP8 Conv1D projection's three operands, as it does a Float8Linear's."""
    from lightning.pytorch.loggers import CSVLogger

    from lightning_mp import FP8Monitor

    monitor = FP8Monitor(every_n_steps=2, log_heatmaps=False)
    fit(TinyLm(Gpt2Shaped), MixedPrecision("bf16-mixed", fp8="tensorwise"), counting_loader(), max_steps=2,
        logger=CSVLogger(tmp_path), log_every_n_steps=2, callbacks=[monitor])  # fmt: skip
    assert sorted(monitor.samples[-1].stats) == sorted(GPT2_FP8)
    assert all(set(operands) == {"input", "weight", "grad_output"} for operands in monitor.samples[-1].stats.values())
