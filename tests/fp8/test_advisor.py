"""The FP8 advisor: the outlier layer kept in bf16, the layers FP8 would not take named, the model left as it was.

The advisor needs only torch, so these tests run without torchao."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mp.fp8.advisor import advise_fp8
from tests.fp8.fp8_models import TinyFp8Net, data_loader


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def test_the_outlier_layer_is_kept_in_bf16_under_tensorwise():
    """A layer whose input has one feature 1e4 times larger is recommended to stay bf16 under tensorwise scaling, in
    the table and in the ready-to-paste argument; without the outlier no layer is."""
    advice = advise_fp8(TinyFp8Net(recipe=None, outlier=True), data_loader(), batches=2, keep_first_last=False)
    assert advice.exclude["tensorwise"] == ("net.fc2",)
    assert "exclude=['net.fc2']" in advice.argument("tensorwise")
    fc2 = next(layer for layer in advice.layers if layer.name == "net.fc2")
    assert "input underflow share" in fc2.keep_bf16["tensorwise"]
    # Rowwise scales give the outlier's rows their own scale: fewer values flush to zero.
    rowwise, tensorwise = (fc2.stats[recipe]["input"]["underflow_share"] for recipe in ("rowwise", "tensorwise"))
    assert rowwise < tensorwise
    assert "net.fc2" in advice.to_markdown() and "bf16" in str(advice)
    clean = advise_fp8(TinyFp8Net(recipe=None), data_loader(), batches=2, keep_first_last=False)
    assert clean.exclude == {recipe: () for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp")}
    assert (
        clean.argument() == "MixedPrecision('bf16-mixed', fp8=FP8Settings(recipe='tensorwise', keep_first_last=False))"
    )


def test_layers_fp8_would_not_take_are_named_with_the_reason_and_not_measured():
    """With the FP8 mode's default, the first and last linear layers stay bf16, as does one whose dims are not
    multiples of 16; the table says why, and only the middle layer is measured."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 24), nn.Linear(24, 16))
    batches = [(torch.randn(16, 16), torch.randn(16, 16))]
    advice = advise_fp8(model, batches, loss_fn=mse, recipes=["tensorwise"])
    reasons = {layer.name: layer.not_measured for layer in advice.layers}
    assert reasons == {"0": "first linear", "2": "", "3": "dims not divisible by 16", "4": "last linear"}
    assert [layer.name for layer in advice.layers if layer.stats] == ["2"]
    assert set(advice.layers[1].stats["tensorwise"]) == {"input", "weight", "grad_output"}


def test_the_weight_estimate_is_the_weights_own_cast():
    """The weight's amax and SQNR under tensorwise scaling are those of the model's own weight cast to e4m3."""
    model = TinyFp8Net(recipe=None)
    advice = advise_fp8(model, data_loader(), batches=1, recipes=["tensorwise"], keep_first_last=False)
    weight = model.net.fc2.weight.detach()
    scale = 448 / weight.abs().max()
    restored = (weight * scale).to(torch.float8_e4m3fn).float() / scale
    sqnr = 10 * torch.log10(weight.pow(2).sum() / (weight - restored).pow(2).sum())
    measured = advice.layers[1].stats["tensorwise"]["weight"]
    assert measured["amax"] == pytest.approx(weight.abs().max().item())
    assert measured["sqnr_db"] == pytest.approx(sqnr.item(), rel=1e-5)


def test_the_model_and_random_state_are_left_as_they_were():
    """Advising runs a LightningModule's own training_step on a copy: weights, gradients and the RNG are unchanged."""
    model = TinyFp8Net(recipe=None)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    rng = torch.get_rng_state()
    advise_fp8(model, data_loader(), batches=2, recipes=["rowwise"])
    assert all(torch.equal(p, before[name]) and p.grad is None for name, p in model.named_parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_bad_arguments_are_refused_by_name():
    """Each bad argument is refused with its name, the value and what is allowed."""
    model, data = TinyFp8Net(recipe=None), data_loader()
    with pytest.raises(ValueError, match=r"recipes.*'delayed'"):
        advise_fp8(model, data, recipes=["delayed"])
    with pytest.raises(ValueError, match=r"recipes='rowwise'.*list"):
        advise_fp8(model, data, recipes="rowwise")
    with pytest.raises(ValueError, match=r"advise_fp8\(batches=0\)"):
        advise_fp8(model, data, batches=0)
    with pytest.raises(ValueError, match=r"advise_fp8\(max_underflow=1\.5\)"):
        advise_fp8(model, data, max_underflow=1.5)
    with pytest.raises(ValueError, match=r"advise_fp8\(model=Linear, loss_fn=None\)"):
        advise_fp8(nn.Linear(16, 16), data)
    with pytest.raises(ValueError, match=r"advise_fp8\(dataloader=\.\.\.\).*no batch"):
        advise_fp8(model, [])
    with pytest.raises(TypeError, match=r"advise_fp8\(loss_fn=\.\.\.\) must return a loss tensor"):
        advise_fp8(model, data, batches=1, loss_fn=lambda model, batch: 1.0)
    advice = advise_fp8(model, data, batches=1, recipes=["tensorwise"])
    with pytest.raises(ValueError, match="rowwise"):
        advice.argument("rowwise")


def test_a_model_fp8_cannot_convert_is_advised_to_train_without_fp8():
    """When no layer would run FP8 (dims not multiples of 16, or only the first and last), the advice is bf16
    without fp8, not an FP8 setting that converts nothing."""
    model = nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 24), nn.GELU(), nn.Linear(24, 16))
    advice = advise_fp8(model, data_loader(), batches=1, loss_fn=mse)
    assert advice.convertible is False
    assert advice.argument() == "MixedPrecision('bf16-mixed')"
    assert "no linear layer of this model can run FP8" in advice.reason
    assert "MixedPrecision('bf16-mixed')" in advice.to_markdown()
