"""O3: pure half weights (norms too, batch norms excepted), no masters, no scaling unless asked for, and a warning."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecision
from lightning_mp._compat import fused_sgd_updates_half
from tests.helpers import fit, make_trainer


class Net(LightningModule):
    """Linear, LayerNorm, ReLU, Linear trained with plain SGD; records the loss of every step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))
        self.losses: list[float] = []

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        features, target = batch
        loss = F.cross_entropy(self(features), target)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        features = torch.randn(8, 8, generator=generator)
        return DataLoader(TensorDataset(features, (features[:, 0] > 0).long() * 3), batch_size=8)


def fit_new_net(plugin: MixedPrecision, max_steps: int = 6) -> tuple[Trainer, Net]:
    """A fresh :class:`Net` fitted with ``plugin`` for ``max_steps`` steps; the Trainer and the net."""
    model = Net()
    return fit(model, plugin, max_steps=max_steps), model


@pytest.mark.parametrize(("precision", "dtype"), [("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)])
def test_o3_trains_pure_half_weights_and_warns(precision: str, dtype: torch.dtype) -> None:
    """O3 casts every weight, norms included, steps the half weights directly, and warns it may not converge."""
    with pytest.warns(UserWarning, match="opt_level='O3' .* may not converge"):
        trainer, model = fit_new_net(MixedPrecision(precision, opt_level="O3"))
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert trainer.optimizers[0].param_groups[0]["params"][0] is model.net[0].weight  # no master copy
    assert trainer.precision_plugin.stats.skipped_steps == 0
    assert trainer.precision_plugin.stats.loss_scale == 1.0  # no scaling unless asked for
    assert model.losses[-1] < model.losses[0]


@pytest.mark.filterwarnings("ignore:lightning_mp. opt_level='O3'")
def test_o3_fp16_scales_only_when_asked() -> None:
    """A static loss_scale is honoured in O3 fp16, and the fp16 gradients are unscaled without error."""
    trainer, model = fit_new_net(MixedPrecision("16-mixed", opt_level="O3", loss_scale=128.0), max_steps=3)
    assert trainer.precision_plugin.stats.loss_scale == 128.0
    assert trainer.precision_plugin.stats.skipped_steps == 0
    assert model.losses[-1] < model.losses[0]


@pytest.mark.filterwarnings("ignore:lightning_mp. opt_level='O3'")
def test_o3_keep_fp32_keeps_the_matched_layer_fp32() -> None:
    """keep_fp32 under O3 leaves the matched layer's weights fp32 while everything else is half."""
    _, model = fit_new_net(MixedPrecision("bf16-mixed", opt_level="O3", keep_fp32=["net.3"]), max_steps=2)
    assert model.net[3].weight.dtype == torch.float32
    assert model.net[1].weight.dtype == model.net[0].weight.dtype == torch.bfloat16


class WithBatchNorm(Net):
    """Linear, BatchNorm1d, ReLU, Linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_o3_keeps_batch_norm_running_statistics_fp32(precision: str) -> None:
    """Under O3 the batch norm's weights and running statistics stay fp32 while it trains; everything else is half."""
    model = WithBatchNorm()
    trainer = make_trainer(MixedPrecision(precision, opt_level="O3"), max_steps=4)
    trainer.fit(model)
    norm = model.net[1]
    assert norm.running_mean.dtype == norm.running_var.dtype == norm.weight.dtype == torch.float32
    assert int(norm.num_batches_tracked) == 4 and bool(torch.isfinite(norm.running_var).all())
    assert model.net[0].weight.dtype == model.net[3].weight.dtype == trainer.precision_plugin.half_dtype
    assert all(torch.isfinite(loss) for loss in map(torch.tensor, model.losses))


class AdamWithDeadInput(Net):
    """Adam with its default eps=1e-8; the first input feature is always 0, so its weights get exactly 0 gradients."""

    def __init__(self, eps: float = 1e-8) -> None:
        super().__init__()
        self.eps = eps

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        features, target = batch
        features = torch.cat([torch.zeros_like(features[:, :1]), features[:, 1:]], dim=1)
        return super().training_step((features, target), batch_idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3, eps=self.eps)


@pytest.mark.filterwarnings("ignore:lightning_mp. opt_level='O3'")
def test_o3_fp16_adam_default_eps_is_corrected_with_a_warning_and_writes_no_nan() -> None:
    """Adam's eps=1e-8 is 0 in fp16: O3 raises it to fp16's smallest normal, warns, and no weight becomes NaN."""
    model = AdamWithDeadInput()
    trainer = make_trainer(MixedPrecision("16-mixed", opt_level="O3"), max_steps=3)
    with pytest.warns(UserWarning, match=r"Adam param group 0 has eps=1e-08, which is 0 in torch.float16"):
        trainer.fit(model)
    assert trainer.optimizers[0].param_groups[0]["eps"] == torch.finfo(torch.float16).tiny
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert trainer.precision_plugin.stats.skipped_steps == 0


@pytest.mark.filterwarnings("ignore:lightning_mp. opt_level='O3'", "error:.*eps=")
@pytest.mark.parametrize(("precision", "eps"), [("bf16-mixed", 1e-8), ("16-mixed", 1e-4)])
def test_o3_keeps_an_eps_the_half_type_represents(precision: str, eps: float) -> None:
    """An eps that is not 0 in the weights' dtype (any eps in bf16, 1e-4 in fp16) is left alone, without warning."""
    model = AdamWithDeadInput(eps=eps)
    trainer = make_trainer(MixedPrecision(precision, opt_level="O3"), max_steps=2)
    trainer.fit(model)
    assert trainer.optimizers[0].param_groups[0]["eps"] == eps


class TiedNet(Net):
    """An embedding whose matrix the output layer reuses (tied weights), over 10 tokens."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 10, bias=False))
        self.net[2].weight = self.net[0].weight

    def train_dataloader(self) -> DataLoader:
        tokens = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(tokens, tokens), batch_size=8)


@pytest.mark.filterwarnings("ignore:lightning_mp. opt_level='O3'")
@pytest.mark.parametrize("opt_level", ["O3", "lean"])
def test_keep_fp32_on_one_side_of_tied_weights_keeps_the_tie_fp32_and_trains(opt_level: str) -> None:
    """keep_fp32 on a tied head keeps the shared matrix fp32 on both sides, says so, and the model trains."""
    model = TiedNet()
    trainer = make_trainer(MixedPrecision("bf16-mixed", opt_level=opt_level, keep_fp32=["net.2"]), max_steps=3)
    with pytest.warns(UserWarning, match=r"'net.0' is kept in fp32 too: 'net.0.weight' is tied to 'net.2.weight'"):
        trainer.fit(model)
    assert model.net[2].weight is model.net[0].weight and model.net[0].weight.dtype == torch.float32
    assert model.net[1].weight.dtype == torch.bfloat16
    assert model.losses[-1] < model.losses[0]


class AddsAFusedSGDGroup(LightningModule):
    """Linear, BatchNorm (fp32 at O3), Linear; a fused SGD over the batch norm only, to which the second batch adds
    the half linear layers as a group."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        if batch_idx == 1:
            linears = [*self.net[0].parameters(), *self.net[3].parameters()]
            self.optimizers().add_param_group({"params": linears})
        features, target = batch
        return F.cross_entropy(self.net(features), target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.net[1].parameters(), lr=0.1, fused=True)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        features = torch.randn(24, 8, generator=generator)
        return DataLoader(TensorDataset(features, (features[:, 0] > 0).long() * 3), batch_size=8)


@pytest.mark.skipif(
    fused_sgd_updates_half("cpu", torch.float16), reason="this torch's fused SGD kernel updates half weights"
)
def test_o3_refuses_a_fused_sgd_group_of_half_weights_added_after_setup_at_its_next_step() -> None:
    """A group of half weights added to a fused SGD with add_param_group is refused before its first step, by name,
    where torch's fused SGD kernel would leave them unchanged; no weight moves."""
    model = AddsAFusedSGDGroup()
    linear = model.net[0].weight.detach().clone()
    with pytest.raises(ValueError, match=r"SGD\(fused=True\) is not allowed over torch.float16 weights"):
        fit(model, MixedPrecision("16-mixed", opt_level="O3"), max_steps=3)
    assert torch.equal(model.net[0].weight.float(), linear.half().float())
