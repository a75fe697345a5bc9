"""to_inference and compare: a half copy that leaves the original alone, and a torchmetrics parity report."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import make_trainer
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecision
from lightning_mp.inference import ParityReport, compare, to_inference

pytestmark = pytest.mark.filterwarnings("ignore:lightning_mp. (fp16|this CPU)")


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


def loader() -> DataLoader:
    x = features(16)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8)


def trainer(plugin: MixedPrecision | None = None, max_steps: int = 2) -> Trainer:
    return make_trainer(plugin, max_steps=max_steps)


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
    fitted = trainer()
    fitted.fit(model, loader())
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
        (lambda: to_inference("model"), r"to_inference\(model=str\) is not allowed: model must be an nn.Module"),
        (lambda: to_inference(Classifier(), keep_fp32="head"), r"keep_fp32='head' is not allowed"),
        (lambda: compare(Classifier(), Classifier(), "x"), r"compare\(batch=str\) is not allowed"),
        (lambda: compare(Classifier(), None, features()), r"compare\(converted=NoneType\) is not allowed"),
    ],
)
def test_bad_arguments_raise_value_error(call: object, message: str) -> None:
    """Bad arguments raise ValueError naming the argument, the value and what is allowed."""
    with pytest.raises(ValueError, match=message):
        call()  # type: ignore[operator]


def test_trainer_predict_with_the_plugin_runs_under_autocast() -> None:
    """Trainer.predict with MixedPrecision returns bf16 logits: the predict step ran under autocast."""
    predictions = trainer(MixedPrecision("bf16-mixed")).predict(Classifier(), loader())
    assert predictions is not None and all(p.dtype == torch.bfloat16 for p in predictions)
