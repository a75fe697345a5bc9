"""Which parameters O2 gives a half model parameter: normalisation layers, ``keep_fp32`` modules, recurrent layers,
reparametrized weights and sparse embeddings keep computing with their fp32 parameters; ties stay one tensor; fp64
stays fp64; lazy layers are paired once materialised."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_mp import MixedPrecision
from lightning_mp.policies.o2 import computes_weights_in_fp32
from tests.helpers import fit, hook_count, make_trainer
from tests.policies.o2.helpers import HALF, PRECISIONS, Net, net_loader, o2


def test_o2_keeps_batchnorm_fp32_and_its_running_statistics_learn() -> None:
    """BatchNorm keeps fp32 weights and running statistics and computes from half inputs; the model trains."""
    model = Net()
    model.net[1] = nn.BatchNorm1d(16)
    fit(model, o2(), max_steps=2)
    norm = model.net[1]
    assert model.dtypes_in_step["net.1.weight"] == torch.float32
    assert norm.weight.dtype == norm.running_mean.dtype == norm.running_var.dtype == torch.float32
    assert not torch.equal(norm.running_mean, torch.zeros(16))


def test_o2_keep_fp32_module_computes_in_fp32_and_leaves_no_hook() -> None:
    """A keep_fp32 layer keeps fp32 weights in the step and returns fp32; after fit no hook is left on the model."""
    model = Net()
    fit(model, o2(keep_fp32=["net.3"]), max_steps=2)
    assert model.dtypes_in_step["net.3.weight"] == torch.float32
    assert model.dtypes_in_step["net.0.weight"] == torch.bfloat16
    assert model.output_dtype == torch.float32
    assert hook_count(model) == 0


class Recurrent(L.LightningModule):
    """Embedding, LSTM, Linear: the LSTM reads its weights from a cached list, not from the parameters it holds."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(10, 8)
        self.rnn = nn.LSTM(8, 8, batch_first=True)
        self.head = nn.Linear(8, 10)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        tokens = batch[1].reshape(4, 2) % 10
        hidden, _ = self.rnn(self.embedding(tokens))
        self.hidden_dtype = hidden.dtype
        return F.cross_entropy(self.head(hidden).reshape(-1, 10), tokens.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return net_loader()


def test_o2_trains_a_recurrent_layer_in_half_with_fp32_weights() -> None:
    """An LSTM computes in half under O2 (autocast casts its weights per call) and its fp32 weights train."""
    model = Recurrent()
    initial = model.rnn.weight_ih_l0.detach().clone()
    trainer = fit(model, o2(), max_steps=2)
    assert model.hidden_dtype == torch.bfloat16 and model.rnn.weight_ih_l0.dtype == torch.float32
    assert not torch.equal(model.rnn.weight_ih_l0, initial)
    assert trainer.precision_plugin.stats.skipped_steps == 0


class Tied(Recurrent):
    """Embedding and head share one weight, as language models often do."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embedding.weight

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        tokens = batch[1].reshape(4, 2) % 10
        self.shared_copy_is_one_tensor = self.head.weight is self.embedding.weight
        return F.cross_entropy(self.head(self.embedding(tokens)).reshape(-1, 10), tokens.reshape(-1))


def test_o2_tied_weights_share_one_half_copy_and_stay_tied() -> None:
    """A weight shared by two modules is cast once per step, and after fit the two modules still share it."""
    model = Tied()
    initial = model.embedding.weight.detach().clone()
    fit(model, o2(), max_steps=2)
    assert model.shared_copy_is_one_tensor
    assert model.head.weight is model.embedding.weight and isinstance(model.head.weight, nn.Parameter)
    assert not torch.equal(model.embedding.weight, initial)


class WithFp64(Net):
    def __init__(self) -> None:
        super().__init__(optimizer="sgd")
        self.temperature = nn.Parameter(torch.ones((), dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x) / self.temperature.float()


def test_o2_fp64_parameter_stays_fp64() -> None:
    """An fp64 parameter is never cast to half: it stays fp64 inside the step and after, and it trains."""
    model = WithFp64()
    fit(model, o2("16-mixed"), max_steps=2)
    assert model.dtypes_in_step["temperature"] == torch.float64
    assert model.temperature.dtype == torch.float64
    assert model.temperature.item() != 1.0


class WithLayer(L.LightningModule):
    """A layer under test, then a plain linear head; records the head's and the layer's weight dtypes per step."""

    def __init__(self, layer: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer_name = layer
        self.layer = _LAYERS[layer]()
        self.head = nn.Linear(8, 4)
        self.weight_dtypes: list[tuple[torch.dtype, torch.dtype]] = []

    def forward(self, features: Tensor) -> Tensor:
        if isinstance(self.layer, nn.EmbeddingBag):
            hidden = self.layer((features.abs() * 3).long().clamp(max=9))
        elif isinstance(self.layer, nn.Embedding):
            hidden = self.layer((features.abs() * 3).long().clamp(max=9)).mean(1)
        else:
            hidden = self.layer(features)
        self.weight_dtypes.append((self.layer.weight.dtype, self.head.weight.dtype))
        return self.head(hidden)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        features, target = batch
        return F.cross_entropy(self(features).float(), target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


_LAYERS: dict[str, Any] = {
    "spectral_norm": lambda: nn.utils.spectral_norm(nn.Linear(8, 8)),
    "weight_norm": lambda: nn.utils.weight_norm(nn.Linear(8, 8)),
    "parametrizations.spectral_norm": lambda: nn.utils.parametrizations.spectral_norm(nn.Linear(8, 8)),
    "parametrizations.weight_norm": lambda: nn.utils.parametrizations.weight_norm(nn.Linear(8, 8)),
    "sparse_embedding": lambda: nn.Embedding(10, 8, sparse=True),
    "sparse_embedding_bag": lambda: nn.EmbeddingBag(10, 8, sparse=True),
    "lazy_linear": lambda: nn.LazyLinear(8),
}


def fit_layer(layer: str, precision: str, opt_level: str) -> WithLayer:
    model = WithLayer(layer)
    init_scale = 2.0**10 if precision == "16-mixed" else None
    plugin = MixedPrecision(precision, opt_level=opt_level, init_scale=init_scale)  # type: ignore[arg-type]
    make_trainer(plugin, max_steps=4).fit(model, net_loader())
    return model


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize(
    "layer", ["spectral_norm", "weight_norm", "parametrizations.spectral_norm", "parametrizations.weight_norm"]
)
def test_o2_trains_reparametrized_weights_in_fp32_like_o1(layer: str, precision: str) -> None:
    """A spectral- or weight-normalised layer (GAN discriminators) trains under O2 as under O1; the rest is half."""
    o1, o2_model = fit_layer(layer, precision, "O1"), fit_layer(layer, precision, "O2")
    assert o2_model.weight_dtypes[-1] == (torch.float32, HALF[precision])
    for name, tensor in o2_model.state_dict().items():
        assert tensor.dtype == torch.float32, name
        torch.testing.assert_close(tensor, o1.state_dict()[name], rtol=2e-2, atol=2e-3)
    assert not torch.equal(o2_model.head.weight, WithLayer(layer).head.weight)


class Scaled(nn.Linear):
    """A linear layer with a plain constant tensor attribute and parameters whose names end like weight norm's."""

    def __init__(self) -> None:
        super().__init__(8, 8)
        self.scale = torch.full((8,), 0.5)
        self.weight_v = nn.Parameter(torch.ones(8))
        self.bias_g = nn.Parameter(torch.ones(8))


def test_o2_tells_the_older_norm_hooks_from_plain_tensor_attributes() -> None:
    """The older weight and spectral norm hooks keep their layer's weights fp32 under O2; once removed, the layer
    gets half model parameters again; a layer with a constant tensor attribute of its own is not taken for one."""
    weight_norm = nn.utils.weight_norm(nn.Linear(8, 8))
    spectral_norm = nn.utils.spectral_norm(nn.Linear(8, 8))
    removed = nn.utils.remove_spectral_norm(nn.utils.spectral_norm(nn.Linear(8, 8)))
    model = nn.Sequential(weight_norm, spectral_norm, removed, Scaled())
    assert computes_weights_in_fp32(model) == {weight_norm, spectral_norm}


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("layer", ["sparse_embedding", "sparse_embedding_bag"])
def test_o2_trains_sparse_embeddings_with_sgd_like_o1(layer: str, precision: str) -> None:
    """Sparse embeddings train with SGD under O2, as under O1: their fp32 rows get sparse fp32 gradients."""
    o1, o2_model = fit_layer(layer, precision, "O1"), fit_layer(layer, precision, "O2")
    assert o2_model.weight_dtypes[-1] == (torch.float32, HALF[precision])
    assert not torch.equal(o2_model.layer.weight, WithLayer(layer).layer.weight)
    for name, parameter in o2_model.named_parameters():
        torch.testing.assert_close(parameter, o1.get_parameter(name), rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_trains_a_lazy_linear_with_half_copies_after_its_first_forward(precision: str) -> None:
    """A LazyLinear materialises in fp32 at its first forward and then computes with half copies, like O1 trains."""
    o1, o2_model = fit_layer("lazy_linear", precision, "O1"), fit_layer("lazy_linear", precision, "O2")
    assert o2_model.weight_dtypes[0] == (torch.float32, HALF[precision])
    assert o2_model.weight_dtypes[-1] == (HALF[precision], HALF[precision])
    assert o2_model.layer.weight.dtype == torch.float32 and o2_model.layer.weight.shape == (8, 8)
    for name, parameter in o2_model.named_parameters():
        torch.testing.assert_close(parameter, o1.get_parameter(name), rtol=2e-2, atol=2e-3)
