"""O2: half weights, fp32 norms, fp32 masters and optimizer states, skip safety, checkpoints, a hand-written loop."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_trainer
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecision
from lightning_mp.policies.o2 import O2Policy

pytestmark = pytest.mark.filterwarnings("ignore:lightning_mp. (fp16|this CPU)")

HALF = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
STEPS = 4


def loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(STEPS * 8, 8, generator=generator)
    target = torch.randint(0, 4, (STEPS * 8,), generator=generator)
    return DataLoader(TensorDataset(features, target), batch_size=8)


class Net(LightningModule):
    """Linear, LayerNorm, ReLU, BatchNorm, Linear; Adam by default; can inject an inf loss on chosen steps."""

    def __init__(self, optimizer: str = "adam", inf_at: tuple[int, ...] = ()) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))
        self.optimizer = optimizer
        self.inf_at = inf_at
        self.snapshots: dict[int, dict[str, Any]] = {}

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        features, target = batch
        loss = F.cross_entropy(self(features), target)
        return loss * float("inf") if batch_idx in self.inf_at else loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.snapshots[batch_idx] = {"before": self._state()}

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.snapshots[batch_idx]["after"] = self._state()

    def _state(self) -> dict[str, Any]:
        optimizer = self.trainer.optimizers[0]
        masters = [p.detach().clone() for p in optimizer.param_groups[0]["params"]]
        states = [{k: v.clone() for k, v in optimizer.state[p].items()} for p in optimizer.param_groups[0]["params"]]
        return {"weights": [p.detach().clone() for p in self.parameters()], "masters": masters, "states": states}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        factories = {
            "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
            "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
            "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
            "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
            "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-2),
            "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-1),
        }
        return factories[self.optimizer](self.parameters())

    def train_dataloader(self) -> DataLoader:
        return loader()


def trainer_for(plugin: MixedPrecision, max_steps: int = STEPS, **kwargs: Any) -> Trainer:
    return make_trainer(plugin, max_steps=max_steps, **kwargs)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_o2_weights_are_half_norms_and_optimizer_states_fp32(precision: str) -> None:
    """After O2 training the model is half except its norms, and the optimizer holds fp32 masters and states."""
    model = Net()
    trainer = trainer_for(MixedPrecision(precision, opt_level="O2"), max_steps=2)
    trainer.fit(model)
    half = HALF[precision]
    assert model.net[0].weight.dtype == half and model.net[3].bias.dtype == half
    assert model.net[1].weight.dtype == torch.float32 and model.net[1].bias.dtype == torch.float32
    optimizer = trainer.optimizers[0]
    for master in optimizer.param_groups[0]["params"]:
        assert master.dtype == torch.float32
        assert optimizer.state[master]["exp_avg"].dtype == torch.float32
        assert optimizer.state[master]["exp_avg_sq"].dtype == torch.float32
    assert trainer.precision_plugin.stats.skipped_steps == 0


def test_o2_keeps_batchnorm_parameters_and_running_stats_fp32() -> None:
    """BatchNorm keeps fp32 weights and running statistics in O2, as Apex's keep_batchnorm_fp32, and still learns."""
    model = Net()
    model.net[1] = nn.BatchNorm1d(16)
    trainer_for(MixedPrecision("bf16-mixed", opt_level="O2"), max_steps=2).fit(model)
    norm = model.net[1]
    assert norm.weight.dtype == norm.running_mean.dtype == norm.running_var.dtype == torch.float32
    assert not torch.equal(norm.running_mean, torch.zeros(16))


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_o2_skips_an_injected_overflow_leaving_masters_and_half_weights_unchanged(precision: str) -> None:
    """An inf loss is skipped: masters, half weights and optimizer states are exactly as before; others step."""
    model = Net(inf_at=(1,))
    trainer = trainer_for(MixedPrecision(precision, opt_level="O2", init_scale=2.0**10), max_steps=3)
    trainer.fit(model)
    assert trainer.precision_plugin.stats.skipped_steps == 1
    skipped = model.snapshots[1]
    for key in ("weights", "masters"):
        for before, after in zip(skipped["before"][key], skipped["after"][key], strict=True):
            assert torch.equal(before, after), key
    for before, after in zip(skipped["before"]["states"], skipped["after"]["states"], strict=True):
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    stepped = model.snapshots[2]
    assert not torch.equal(stepped["before"]["masters"][0], stepped["after"]["masters"][0])
    assert all(torch.isfinite(p).all() for p in model.parameters())


def hand_written_o2(dtype: torch.dtype, loss_scale: float) -> list[Tensor]:
    """The O2 algorithm written out by hand for Net, returning the fp32 masters after STEPS Adam steps."""
    reference = Net().net
    first, norm, second = copy.deepcopy(reference[0]), reference[1], copy.deepcopy(reference[3])
    masters = [nn.Parameter(p.detach().clone()) for p in (*first.parameters(), *second.parameters())]
    first.to(dtype)
    second.to(dtype)
    half_weights = [*first.parameters(), *second.parameters()]
    optimizer = torch.optim.Adam([*masters[:2], *norm.parameters(), *masters[2:]], lr=1e-2)
    for features, target in loader():
        hidden = first(features.to(dtype))
        hidden = F.layer_norm(hidden.float(), (16,), norm.weight, norm.bias).to(dtype)
        logits = second(torch.relu(hidden)).float()
        (F.cross_entropy(logits, target) * loss_scale).backward()
        for master, weight in zip(masters, half_weights, strict=True):
            master.grad = weight.grad.float()
            weight.grad = None
        for parameter in [*masters, *norm.parameters()]:
            parameter.grad.mul_(1.0 / loss_scale)
        assert all(torch.isfinite(p.grad).all() for p in [*masters, *norm.parameters()])
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for master, weight in zip(masters, half_weights, strict=True):
                weight.copy_(master)
    return [masters[0], masters[1], *norm.parameters(), masters[2], masters[3]]


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_o2_matches_a_hand_written_o2_loop(precision: str) -> None:
    """The plugin's O2 masters after N steps equal those of the O2 algorithm written out by hand."""
    loss_scale = 2.0**10 if precision == "16-mixed" else 1.0
    model = Net()
    trainer = trainer_for(MixedPrecision(precision, opt_level="O2", init_scale=loss_scale))
    trainer.fit(model)
    assert trainer.precision_plugin.stats.skipped_steps == 0
    expected = hand_written_o2(HALF[precision], loss_scale)
    masters = trainer.optimizers[0].param_groups[0]["params"]
    for got, want in zip(masters, expected, strict=True):
        torch.testing.assert_close(got, want)
    for weight, want in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(weight, want.to(weight.dtype), rtol=0, atol=0)


@pytest.mark.parametrize("optimizer", ["adam_fused", "adamw_foreach", "sgd_momentum", "rmsprop", "adagrad"])
def test_o2_works_with_every_optimizer_and_clipping(optimizer: str) -> None:
    """Common optimizers, fused and foreach included, train under O2 (with clipping where O1 allows it), fp32 states."""
    model = Net(optimizer=optimizer)
    initial = model.net[0].weight.detach().clone()
    clip = None if optimizer == "adam_fused" else 0.5  # fused optimizers unscale inside step: no clipping, as in O1
    trainer = trainer_for(MixedPrecision("bf16-mixed", opt_level="O2"), max_steps=2, gradient_clip_val=clip)
    trainer.fit(model)
    optimizer_ = trainer.optimizers[0]
    states = [v for p in optimizer_.param_groups[0]["params"] for k, v in optimizer_.state[p].items() if k != "step"]
    assert states and all(state.dtype == torch.float32 for state in states if state.is_floating_point())
    assert not torch.equal(model.net[0].weight.float(), initial)
    assert trainer.precision_plugin.stats.skipped_steps == 0


def test_o2_checkpoint_holds_fp32_masters_and_resume_restores_them(tmp_path: Path) -> None:
    """A checkpoint stores the fp32 masters; loading it gives fp32 weights, and resuming restores exact masters."""
    model = Net()
    trainer = trainer_for(MixedPrecision("bf16-mixed", opt_level="O2"), max_steps=STEPS)  # one whole epoch
    trainer.fit(model)
    path = tmp_path / "o2.ckpt"
    trainer.save_checkpoint(path)
    masters = [p.detach().clone() for p in trainer.optimizers[0].param_groups[0]["params"]]
    saved = torch.load(path, weights_only=False)["state_dict"]
    assert all(value.dtype == torch.float32 for value in saved.values())
    torch.testing.assert_close(saved["net.0.weight"], masters[0], rtol=0, atol=0)
    assert not torch.equal(saved["net.0.weight"], saved["net.0.weight"].bfloat16().float())  # not rounded

    loaded = Net.load_from_checkpoint(path)
    assert loaded.net[0].weight.dtype == torch.float32
    torch.testing.assert_close(loaded.net[0].weight, masters[0], rtol=0, atol=0)

    resumed = Net()
    resume = trainer_for(MixedPrecision("bf16-mixed", opt_level="O2"), max_steps=STEPS + 1)
    resume.fit(resumed, ckpt_path=path)
    first_step = resumed.snapshots[min(resumed.snapshots)]["before"]["masters"]  # before the resumed first step
    for got, want in zip(first_step, masters, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_o2_policy_rejects_a_non_half_dtype() -> None:
    """O2 needs a half type; fp32 is refused with a message naming the value and what is allowed."""
    with pytest.raises(ValueError, match=r"half_dtype=torch.float32\) is not allowed: .*float16 or torch.bfloat16"):
        O2Policy(torch.float32)
