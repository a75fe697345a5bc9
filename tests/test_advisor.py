"""The precision advisor: it names a planted fp16-overflow layer, and its advice makes an fp16 run stop skipping."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from conftest import make_trainer
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecision
from lightning_mp.advisor import FP16_MAX, GRADIENT_HEADROOM, Advice, advise
from lightning_mp.policies.o2 import HalfOverflowError

pytestmark = pytest.mark.filterwarnings("ignore:lightning_mp. (fp16|this CPU)")


class Planted(LightningModule):
    """stem -> blowup (weights x3e5: outputs ~1e5, beyond fp16's 65504) -> LayerNorm -> head; logs its loss."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(8, 16)
        self.blowup = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(16, 4)
        with torch.no_grad():
            self.blowup.weight.mul_(3e5)

    def forward(self, x: Tensor) -> Tensor:
        hidden = self.norm(self.blowup(torch.relu(self.stem(x))))
        return self.head(self.dropout(torch.relu(hidden)))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        features, target = batch
        loss = F.cross_entropy(self(features), target)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def loader() -> DataLoader:
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(x, (x[:, 0] > 0).long())
    return DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1))


def fit_fp16(plugin: MixedPrecision, max_steps: int = 5) -> MixedPrecision:
    trainer = make_trainer(plugin, max_steps=max_steps)
    trainer.fit(Planted(), loader())
    return plugin


@pytest.fixture(scope="module")
def advice() -> Advice:
    return advise(Planted(), loader(), batches=4)


def test_advisor_names_the_planted_overflow_layer(advice: Advice) -> None:
    """The table flags the layer whose outputs overflow fp16 and its consumer, and recommends bf16 and keep_fp32."""
    layers = {layer.name: layer for layer in advice.layers}
    assert list(layers) == ["stem", "blowup", "norm", "dropout", "head"]
    assert layers["blowup"].max_activation > FP16_MAX and layers["blowup"].overflows_fp16
    assert layers["norm"].overflows_fp16  # it receives the overflowing values
    assert not layers["stem"].overflows_fp16 and not layers["head"].overflows_fp16
    assert advice.keep_fp32 == ("blowup", "norm")
    assert advice.precision == "bf16-mixed"
    assert advice.batches == 4
    assert "blowup" in str(advice) and "keep_fp32=['blowup', 'norm']" in str(advice)


def test_init_scale_puts_the_largest_gradient_well_inside_fp16(advice: Advice) -> None:
    """init_scale is the power of two that leaves the largest gradient of the half layers 64x below 65504."""
    largest = max(layer.max_gradient for layer in advice.layers if not layer.keep_fp32)
    assert math.log2(advice.init_scale).is_integer()
    assert FP16_MAX / GRADIENT_HEADROOM / 2 < largest * advice.init_scale <= FP16_MAX / GRADIENT_HEADROOM


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_applying_the_advice_makes_a_skipping_fp16_run_train_without_skips(advice: Advice, opt_level: str) -> None:
    """The fp16 run skips every step (O2 refuses the weights beyond fp16); with the advice it skips none."""
    if opt_level == "O2":
        with pytest.raises(HalfOverflowError, match=r"blowup\.weight"):
            fit_fp16(MixedPrecision("16-mixed", opt_level=opt_level))
    else:
        skipping = fit_fp16(MixedPrecision("16-mixed", opt_level=opt_level))
        assert skipping.stats.skipped_steps == skipping.stats.optimizer_steps == 5
    advised = fit_fp16(MixedPrecision(opt_level=opt_level, **advice.plugin_kwargs("16-mixed")))
    assert advised.stats.optimizer_steps == 5 and advised.stats.skipped_steps == 0


def test_advisor_flags_activations_that_fp16_flushes_to_zero() -> None:
    """A layer whose outputs sit below 2**-24 is reported as flushing to zero and recommended for fp32."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    with torch.no_grad():
        model[0].weight.mul_(1e-9)
        model[0].bias.zero_()
    advice = advise(model, loader(), batches=2, loss_fn=lambda m, batch: F.cross_entropy(m(batch[0]), batch[1]))
    tiny = advice.layers[0]
    assert tiny.name == "0" and tiny.activation_zero_share > 0.5
    assert advice.keep_fp32 == ("0",)


def test_advisor_changes_nothing_it_measures() -> None:
    """The model's weights, buffers, grads and mode, the global RNG and the loader's shuffle order are untouched."""
    model = Planted(dropout=0.5)
    model.eval()
    data = loader()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    rng = torch.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # self.log() without a Trainer must not leak warnings
        advise(model, data, batches=3)
    assert not model.training and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(next(iter(data))[0], next(iter(loader()))[0])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batches": 0}, r"advise\(batches=0\) is not allowed: batches must be an integer >= 1"),
        ({"model": nn.Linear(8, 4)}, r"advise\(model=Linear, loss_fn=None\) is not allowed: .* needs loss_fn"),
        ({"model": "model"}, r"advise\(model=str\) is not allowed"),
        ({"dataloader": 3}, r"advise\(dataloader=3\) is not allowed: dataloader must be an iterable"),
        ({"dataloader": []}, r"the data loader yielded no batch"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs: dict, message: str) -> None:
    """Bad arguments raise ValueError naming the argument, the value and what is allowed."""
    arguments = {"model": Planted(), "dataloader": loader(), "batches": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        advise(**arguments)
