"""O2 with tied weights: ``keep_fp32`` on one side of a tie keeps both sides fp32, the optimizer holds a tied master
once, and a weight tied to a module that computes in fp32 gets no half copy.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers import make_trainer
from tests.policies.o2.helpers import PRECISIONS
from tests.policies.o2.user_path_helpers import (
    BATCHES,
    TOLERANCE,
    Regressor,
    holds_each_tensor_once,
    largest_relative_error,
    plugin,
    weights,
)


class TiedLanguageModel(L.LightningModule):
    """GPT-2's layout in small: a token embedding ``wte``, the 3-layer MLP, and an ``lm_head`` tied to ``wte``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(16, 8)
        self.mlp = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
        self.lm_head = nn.Linear(8, 16, bias=False)
        self.lm_head.weight = self.wte.weight
        self.tie_in_step: list[tuple[bool, torch.dtype]] = []

    def forward(self, tokens: Tensor) -> Tensor:
        return self.lm_head(self.mlp(self.wte(tokens)))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self.tie_in_step.append((self.wte.weight is self.lm_head.weight, self.lm_head.weight.dtype))
        tokens, target = batch
        return F.cross_entropy(self(tokens).float(), target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return tokens()


def tokens() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    sequence = torch.randint(0, 16, (BATCHES * 8 + 1,), generator=generator)
    return DataLoader(TensorDataset(sequence[:-1], sequence[1:]), batch_size=8)


SIDES = {"wte": "lm_head", "lm_head": "wte"}
"""The side of the tie that ``keep_fp32`` names -> the other side, which the warning names."""


@pytest.mark.parametrize("kept", list(SIDES))
@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_keep_fp32_on_one_side_of_a_tie_keeps_both_sides_fp32_and_trains_like_fp32(
    precision: str, kept: str
) -> None:
    """``keep_fp32`` on either side of a tied weight keeps the tie one fp32 weight (with a warning naming the other
    side); the optimizer the Trainer builds after the conversion holds it once, and the weights train like fp32's."""
    fp32 = TiedLanguageModel()
    make_trainer(max_steps=-1, max_epochs=1).fit(fp32)
    model = TiedLanguageModel()
    trainer = make_trainer(plugin(precision, keep_fp32=[kept]), max_steps=-1, max_epochs=1)
    with pytest.warns(UserWarning, match=rf"'{SIDES[kept]}' is kept in fp32 too: .*tied to '{kept}.weight'"):
        trainer.fit(model)
    assert holds_each_tensor_once(trainer.optimizers[0])
    assert set(model.tie_in_step) == {(True, torch.float32)}
    assert model.wte.weight is model.lm_head.weight
    assert largest_relative_error(weights(model), weights(fp32)) < TOLERANCE[precision]


def fabric_tied_weights(precision: str, kept: str | None) -> tuple[dict[str, Tensor], bool]:
    """A Fabric loop whose optimizer is built after ``fabric.setup`` (as litgpt's pretraining does): the trained
    weights, and whether the optimizer held each tensor once."""
    mixed = plugin(precision, keep_fp32=[kept]) if kept is not None else plugin(precision)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[mixed] if mixed is not None else None)
    net = TiedLanguageModel()
    model = fabric.setup(net)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for source, target in tokens():
        fabric.backward(F.cross_entropy(model(source).float(), target))
        optimizer.step()
        optimizer.zero_grad()
    once = holds_each_tensor_once(optimizer.optimizer)
    if mixed is not None:
        mixed.teardown()
    return weights(net), once


@pytest.mark.parametrize("kept", list(SIDES))
@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_fabric_optimizer_built_after_setup_holds_a_kept_tie_once_and_trains_like_fp32(
    precision: str, kept: str
) -> None:
    """Under Fabric, an optimizer built on the model's parameters after setup holds a tie kept on one side once, and
    the weights train like fp32's."""
    expected, _ = fabric_tied_weights("32-true", None)
    with pytest.warns(UserWarning, match=rf"'{SIDES[kept]}' is kept in fp32 too"):
        actual, once = fabric_tied_weights(precision, kept)
    assert once
    assert largest_relative_error(actual, expected) < TOLERANCE[precision]


class AddsAHeldLayerAgain(Regressor):
    """Manual optimization that adds, inside its training step, a group with a layer the optimizer holds already."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        self.manual_backward(self.loss(batch))
        if batch_idx == 1:
            optimizer.add_param_group({"params": list(self.net[0].parameters())})
        optimizer.step()
        optimizer.zero_grad()


def test_o2_a_group_adding_a_parameter_the_optimizer_holds_is_refused_by_torch_as_in_fp32() -> None:
    """A group added with parameters the optimizer holds already is refused by torch's own check, as in fp32: O2's
    parameters are the optimizer's own objects, so nothing can make it hold one twice."""
    trainer = make_trainer(plugin("bf16-mixed"), max_steps=-1, max_epochs=1)
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        trainer.fit(AddsAHeldLayerAgain())


class SparseTiedLanguageModel(TiedLanguageModel):
    """The tied model with a sparse embedding, which O2 keeps computing with its fp32 weight; plain SGD."""

    def __init__(self) -> None:
        super().__init__()
        self.wte.sparse = True

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_a_weight_tied_to_a_module_that_computes_in_fp32_gets_no_half_copy(precision: str) -> None:
    """A head tied to a sparse embedding (which O2 leaves fp32) shares its fp32 weight, with a warning naming both;
    the optimizer holds it once and it trains like fp32."""
    fp32 = SparseTiedLanguageModel()
    make_trainer(max_steps=-1, max_epochs=1).fit(fp32)
    model = SparseTiedLanguageModel()
    trainer = make_trainer(plugin(precision), max_steps=-1, max_epochs=1)
    with pytest.warns(UserWarning, match=r"'lm_head.weight' stays an fp32 weight .* tied to 'wte.weight'"):
        trainer.fit(model)
    assert holds_each_tensor_once(trainer.optimizers[0])
    assert set(model.tie_in_step) == {(True, torch.float32)}
    assert largest_relative_error(weights(model), weights(fp32)) < TOLERANCE[precision]
