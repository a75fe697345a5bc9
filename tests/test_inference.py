"""to_inference and compare: a half copy that leaves the original alone, and a torchmetrics parity report."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecision
from lightning_mp.inference import ParityReport, ParityTable, compare, to_inference
from tests.helpers import make_trainer


def features(n: int = 64) -> Tensor:
    return torch.randn(n, 8, generator=torch.Generator().manual_seed(1))


class Classifier(LightningModule):
    """Linear, LayerNorm, ReLU, Linear over 4 classes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def classifier_loader() -> DataLoader:
    """:class:`Classifier`'s data: 16 samples of :func:`features`, 2 classes, in 2 batches."""
    x = features(16)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8)


def test_to_inference_returns_a_converted_copy_and_leaves_the_original_untouched() -> None:
    """The copy is half (norms fp32), in eval mode without gradients; the original keeps its dtypes and values."""
    model = Classifier()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    fast = to_inference(model, dtype=torch.float16)
    assert fast is not model
    assert fast.net[0].weight.dtype == fast.net[3].weight.dtype == torch.float16
    assert fast.net[1].weight.dtype == torch.float32
    assert not fast.training and not any(p.requires_grad for p in fast.parameters())
    assert model.training and all(p.requires_grad for p in model.parameters())
    for name, value in model.state_dict().items():
        assert value.dtype == torch.float32 and torch.equal(value, before[name]), name
    assert model(features(4)).dtype == torch.float32  # no hook leaked onto the original


def test_converting_an_inference_model_again_stacks_no_hooks() -> None:
    """to_inference of a model to_inference returned gives the same outputs with as many hooks, not twice as many."""
    fast = to_inference(Classifier(), keep_fp32=["net.3"])
    again = to_inference(fast, keep_fp32=["net.3"])
    hooks = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in fast.modules()]
    assert [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in again.modules()] == hooks
    assert sum(map(sum, hooks)) > 0
    torch.testing.assert_close(again(features(4)), fast(features(4)), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_converted_forward_takes_fp32_or_half_inputs(dtype: torch.dtype) -> None:
    """The converted model accepts fp32 and half inputs alike and returns the same half outputs for both."""
    fast = to_inference(Classifier(), dtype=dtype)
    x = features(8)
    from_fp32, from_half = fast(x), fast(x.to(dtype))
    assert from_fp32.dtype == dtype
    torch.testing.assert_close(from_fp32, from_half, rtol=0, atol=0)


def test_to_inference_honours_keep_fp32() -> None:
    """A keep_fp32 head keeps fp32 weights in the copy and returns fp32 outputs."""
    fast = to_inference(Classifier(), dtype=torch.bfloat16, keep_fp32=["net.3"])
    assert fast.net[3].weight.dtype == torch.float32
    assert fast.net[0].weight.dtype == torch.bfloat16
    assert fast(features(4)).dtype == torch.float32


def test_to_inference_works_on_a_trained_lightning_module() -> None:
    """A LightningModule attached to a Trainer converts without copying the Trainer, and stays attached."""
    model = Classifier()
    fitted = make_trainer(max_steps=2)
    fitted.fit(model, classifier_loader())
    fast = to_inference(model, dtype=torch.bfloat16)
    assert fast._trainer is None and model.trainer is fitted
    assert fast(features(4)).dtype == torch.bfloat16


def test_compare_reports_small_errors_and_top1_agreement_and_prints_it(capsys: pytest.CaptureFixture) -> None:
    """compare prints and returns a frozen report: bf16 errors are small, fp16's smaller, top-1 mostly agrees."""
    model, x = Classifier(), features()
    bf16 = compare(model, to_inference(model, dtype=torch.bfloat16), x)
    printed = capsys.readouterr().out
    assert "Parity of the bfloat16 model against fp32 on 64 samples" in printed
    assert "top-1 agreement" in printed and "max relative error" in printed
    fp16 = compare(model, to_inference(model, dtype=torch.float16), x, verbose=False)
    assert capsys.readouterr().out == ""
    assert isinstance(bf16, ParityReport) and bf16.dtype == torch.bfloat16 and bf16.samples == 64
    assert 0 < fp16.max_abs_error < bf16.max_abs_error  # fp16 keeps 3 more mantissa bits than bf16
    assert bf16.max_rel_error < 0.05
    assert bf16.top1_agreement is not None and bf16.top1_agreement >= 0.9
    with pytest.raises(dataclasses.FrozenInstanceError):
        bf16.max_abs_error = 0.0  # type: ignore[misc]


def test_compare_detects_a_wrong_conversion() -> None:
    """A converted model whose head was tampered with shows a large error and lost top-1 agreement."""
    model, x = Classifier(), features()
    broken = to_inference(model, dtype=torch.bfloat16)
    with torch.no_grad():
        broken.net[3].weight.neg_()
        broken.net[3].bias.neg_()
    report = compare(model, broken, x, verbose=False)
    assert report.max_rel_error > 0.5
    assert report.top1_agreement is not None and report.top1_agreement < 0.5


def test_compare_regression_outputs_have_no_top1() -> None:
    """A one-output regressor gets errors but no top-1 agreement; identical models compare exactly equal."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    report = compare(model, model, features(), verbose=False)
    assert report.top1_agreement is None
    assert report.max_abs_error == report.max_rel_error == 0.0


def test_compare_takes_positional_and_keyword_batches() -> None:
    """A tuple batch is passed as positional inputs and a dict as keyword inputs."""

    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 4)

        def forward(self, a: Tensor, b: Tensor) -> Tensor:
            return self.proj(a) + self.proj(b)

    model, x = TwoInputs(), features()
    fast = to_inference(model, dtype=torch.bfloat16)
    positional = compare(model, fast, (x, x), verbose=False)
    keyword = compare(model, fast, {"a": x, "b": x}, verbose=False)
    assert positional == keyword and positional.max_abs_error > 0


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: to_inference(Classifier(), dtype=torch.float32), r"dtype=torch.float32\) is not allowed"),
        (lambda: to_inference(Classifier(), dtype=np.array([1.0, 2.0])), r"dtype=array\(\[1., 2.\]\)\) is not allowed"),
        (lambda: to_inference("model"), r"to_inference\(model=str\) is not allowed: model must be an nn.Module"),
        (lambda: to_inference(Classifier(), keep_fp32="head"), r"keep_fp32='head' is not allowed"),
        (lambda: compare(Classifier(), None, features()), r"compare\(converted=NoneType\) is not allowed"),
    ],
)
def test_bad_arguments_raise_value_error(call: object, message: str) -> None:
    """Bad arguments raise ValueError naming the argument, the value and what is allowed."""
    with pytest.raises(ValueError, match=message):
        call()  # type: ignore[operator]


def test_trainer_predict_with_the_plugin_runs_under_autocast() -> None:
    """Trainer.predict with MixedPrecision returns bf16 logits: the predict step ran under autocast."""
    predictions = make_trainer(MixedPrecision("bf16-mixed"), max_steps=2).predict(Classifier(), classifier_loader())
    assert predictions is not None and all(p.dtype == torch.bfloat16 for p in predictions)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: compare(Classifier(), Classifier(), b"abc"), TypeError, r"compare\(batch=b'abc'\) is not allowed"),
        (lambda: compare(Classifier(), Classifier(), "x"), TypeError, r"compare\(batch='x'\) is not allowed"),
        (lambda: compare(Classifier(), Classifier(), ()), TypeError, r"holding at least one tensor"),
        (
            lambda: compare(Classifier(), Classifier(), features(), classifier="yes"),
            TypeError,
            r"compare\(classifier='yes'\) is not allowed: classifier must be True or False",
        ),
        (
            lambda: compare(Classifier(), Classifier(), features(), verbose=1),
            TypeError,
            r"compare\(verbose=1\) is not allowed: verbose must be True or False",
        ),
        (
            lambda: to_inference(Classifier(), keep_normalization_fp32="yes"),
            TypeError,
            r"to_inference\(keep_normalization_fp32='yes'\) is not allowed: .* must be True or False",
        ),
        (
            lambda: to_inference(Classifier(), max_rel_error=0.01),
            ValueError,
            r"to_inference\(max_rel_error=0.01, batch=None\) is not allowed",
        ),
        (
            lambda: to_inference(Classifier(), batch=features(), max_rel_error=-1.0),
            ValueError,
            r"to_inference\(max_rel_error=-1.0\) is not allowed: max_rel_error must be None or a finite number > 0",
        ),
        (lambda: to_inference(Classifier(), batch=b"abc"), TypeError, r"to_inference\(batch=b'abc'\) is not allowed"),
    ],
)
def test_bad_argument_types_and_values_are_refused(call: object, error: type, message: str) -> None:
    """Every argument is checked: the error names it, the value and what is allowed."""
    with pytest.raises(error, match=message):
        call()  # type: ignore[operator]


def test_all_nan_half_model_fails_parity() -> None:
    """An fp16 model whose outputs are all NaN reports inf errors and every output as non-finite, never -inf."""
    model = Classifier()
    broken = to_inference(model, dtype=torch.float16)
    with torch.no_grad():
        broken.net[0].weight.fill_(float("nan"))
    report = compare(model, broken, features(16), verbose=False)
    assert report.max_abs_error == report.max_rel_error == float("inf")
    assert report.nonfinite_outputs == 16 * 4 and not report.finite
    assert "FAILED: 64 output value(s)" in str(report)


def test_one_nan_sample_in_sixteen_fails_parity() -> None:
    """A single NaN sample among 16 makes the relative error inf, not a tiny number."""

    class NanOnNegativeFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 4)

        def forward(self, x: Tensor) -> Tensor:
            out = self.proj(x)
            if out.dtype == torch.float16:
                out = out.clone()
                out[0] = float("nan")
            return out

    model = NanOnNegativeFirst()
    report = compare(model, to_inference(model, dtype=torch.float16), features(16), verbose=False)
    assert report.max_rel_error == float("inf") and report.nonfinite_outputs == 4


class Overflowing(nn.Module):
    """stem -> blowup (outputs ~1e5, beyond fp16's 65504) -> scaled back down -> head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(8, 16)
        self.blowup = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        with torch.no_grad():
            self.blowup.weight.mul_(3e5)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.blowup(self.stem(x)) * 1e-5))


def test_error_budget_keeps_the_overflowing_layer_in_fp32_and_meets_the_budget(capsys: pytest.CaptureFixture) -> None:
    """fp16 with a budget keeps the layer whose output overflows in fp32, says so, and the output is in budget."""
    model, x = Overflowing(), features(32)
    plain = to_inference(model, dtype=torch.float16)
    assert plain.parity is None and not compare(model, plain, x, verbose=False).finite
    budgeted = to_inference(model, dtype=torch.float16, batch=x, max_rel_error=0.01)
    table = budgeted.parity
    assert isinstance(table, ParityTable)
    assert [layer.name for layer in table.layers] == ["stem", "blowup", "head"]
    blowup = table.layers[1]
    assert not blowup.finite and blowup.kept_fp32 and blowup.why_kept == "non-finite output"
    assert table.kept_fp32 == ("blowup",)
    assert budgeted.blowup.weight.dtype == torch.float32 and budgeted.head.weight.dtype == torch.float16
    assert table.within_budget and table.output.finite and table.output.max_rel_error <= 0.01
    assert compare(model, budgeted, x, verbose=False) == table.output
    printed = capsys.readouterr().out
    assert "Kept in fp32 for the budget: ['blowup']" in printed and "blowup" in printed


def test_a_tight_budget_keeps_layers_until_the_whole_output_meets_it() -> None:
    """A budget below bf16's rounding error keeps layers, worst first, until the end-to-end error is within it."""
    model, x = Classifier(), features(32)
    table = to_inference(model, dtype=torch.bfloat16, batch=x, max_rel_error=1e-6, verbose=False).parity
    assert table.within_budget and table.output.max_rel_error <= 1e-6
    assert set(table.kept_fp32) == {"net.0", "net.3"}
    loose = to_inference(model, dtype=torch.bfloat16, batch=x, max_rel_error=0.5, verbose=False).parity
    assert loose.kept_fp32 == () and loose.output.max_rel_error > 0


class ReusesInPlace(nn.Module):
    """Linear a, then b on a's output, which is then changed in place and fed to c (a ReLU(inplace=True) pattern)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(8, 32), nn.Linear(32, 4), nn.Linear(32, 4)

    def forward(self, x: Tensor) -> Tensor:
        hidden = self.a(x)
        out = self.b(hidden)
        return out + self.c(hidden.relu_())


def test_layer_errors_are_measured_on_inputs_that_later_in_place_ops_cannot_change() -> None:
    """Each layer's own error is measured on the inputs it really saw, even when they were changed in place later."""
    table = to_inference(ReusesInPlace(), dtype=torch.bfloat16, batch=features(32), verbose=False).parity
    assert [layer.name for layer in table.layers] == ["a", "b", "c"]
    assert all(layer.max_rel_error < 0.02 for layer in table.layers), str(table)


def test_compare_gives_each_model_the_batch_as_given_when_a_model_writes_into_its_input() -> None:
    """An ELU(inplace=True) first layer changes neither the caller's batch nor the converted model's input."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.ELU(inplace=True), nn.Linear(8, 3))
    x = features(64) * 3
    given = x.clone()
    fast = to_inference(model, dtype=torch.float16)
    report = compare(model, fast, x, verbose=False)
    assert torch.equal(x, given)
    with torch.no_grad():
        truth = (fast(given.clone()).float() - model(given.clone())).abs().max() / model(given.clone()).abs().max()
    assert report.max_rel_error == pytest.approx(float(truth), rel=1e-6) and report.max_rel_error < 2e-3
    budgeted = to_inference(model, dtype=torch.float16, batch=x, max_rel_error=2e-3, verbose=False)
    assert torch.equal(x, given)
    assert budgeted.parity.kept_fp32 == () and budgeted[1].weight.dtype == torch.float16


def test_top1_agreement_counts_nan_scores_as_disagreement(capsys: pytest.CaptureFixture) -> None:
    """A half classifier whose scores are all NaN agrees with no sample, even where the fp32 model says class 0."""
    model = nn.Linear(8, 3)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.copy_(torch.tensor([1.0, 0.0, 0.0]))  # always class 0, as argmax of a NaN row is
    broken = to_inference(model, dtype=torch.float16)
    with torch.no_grad():
        broken.bias.fill_(float("nan"))
    report = compare(model, broken, features(16))
    assert report.top1_agreement == 0.0 and report.nonfinite_predictions == 16
    assert "16 prediction(s) with NaN or inf scores count as disagreeing" in capsys.readouterr().out
    one_bad = to_inference(model, dtype=torch.float16)
    with torch.no_grad():
        one_bad.weight[1, 0] = float("inf")  # only samples with x[:, 0] != 0 get an inf score: all 16 here
    assert compare(model, one_bad, features(16), verbose=False).top1_agreement == 0.0


class TiedHead(nn.Module):
    """An embedding whose matrix the output layer reuses, as language models tie them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.mid, self.head = nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.mid(self.embed(tokens)))


@pytest.mark.parametrize("kept", ["head", "embed"])
def test_keep_fp32_on_one_side_of_tied_weights_keeps_the_tie_in_fp32(kept: str) -> None:
    """Keeping one side of a tie in fp32 keeps both (with a warning naming them); the copy runs and stays tied."""
    model, tokens = TiedHead(), torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(0))
    other = "embed" if kept == "head" else "head"
    with pytest.warns(
        UserWarning, match=rf"'{other}' is kept in fp32 too: '{other}.weight' is tied to '{kept}.weight'"
    ):
        fast = to_inference(model, dtype=torch.float16, keep_fp32=[kept])
    assert fast.head.weight is fast.embed.weight and fast.embed.weight.dtype == torch.float32
    assert fast.mid.weight.dtype == torch.float16
    report = compare(model, fast, tokens, verbose=False)
    assert report.finite and report.max_rel_error < 1e-2


def test_an_error_budget_that_keeps_one_side_of_a_tie_keeps_the_other() -> None:
    """A budget that keeps only the tied head in fp32 converts without a dtype error and meets the budget."""
    model, tokens = TiedHead(), torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the embedding and mid are exact in fp16; only the head's sums round
        model.embed.weight.copy_(model.embed.weight.half().float())
        model.mid.weight.copy_(torch.eye(8))
        model.mid.bias.zero_()
    table = to_inference(model, dtype=torch.float16, batch=tokens, max_rel_error=1e-7, verbose=False).parity
    assert table.kept_fp32 == ("head",) and table.within_budget and table.output.finite


@pytest.mark.parametrize("budget", [10**400, float("inf"), float("nan"), "0.1", True])
def test_an_error_budget_outside_the_numbers_is_a_value_error_naming_it(budget: object) -> None:
    """max_rel_error too large for a float, inf, NaN, a string or a bool is refused naming max_rel_error."""
    with pytest.raises(ValueError, match=r"max_rel_error must be None or a finite number > 0"):
        to_inference(Classifier(), batch=features(), max_rel_error=budget)
