"""lean-exact: O2's numbers bit for bit with 4 bytes of weight and master per parameter instead of 6.

Every test trains the same seed and batches at O2 and at lean-exact and compares weights, optimizer states and losses
with ``torch.equal``: the packed master is exact, so nothing may differ by a bit.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_mp import MixedPrecision
from lightning_mp.policies.lean_exact import RemainderMasters
from lightning_mp.policies.o2.split import join, remainder_of, round_to_bf16
from tests.helpers import make_trainer
from tests.policies.lean_helpers import (
    CHUNK_NUMEL,
    OPTIMIZERS,
    LeanNet,
    assert_same_run,
    classification_loader,
    fabric_run,
)


def test_a_master_is_its_bf16_weight_plus_a_16_bit_remainder_exactly() -> None:
    """Every fp32 pattern class rebuilds bit for bit: normal, tiny, huge, negative, zero, and exact ties."""
    generator = torch.Generator().manual_seed(0)
    spread = torch.randn(200_000, generator=generator) * torch.logspace(
        -40, 37, 200_000
    )  # finite: an inf master has no bf16 weight
    tops = (torch.randn(1000, generator=generator).to(torch.bfloat16).view(torch.int16).to(torch.int32)) << 16
    ties = torch.cat([(tops + 0x8000), (tops - 0x8000)]).view(torch.float32)
    edges = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 3.3e38, -3.3e38, 1.0, -1.0])
    master = torch.cat([spread, ties, edges])
    weight = round_to_bf16(master)
    remainder = remainder_of(master, weight)
    assert remainder.dtype == torch.int16
    assert torch.equal(bits(join(weight, remainder)), bits(master))
    differs = weight != master.to(torch.bfloat16)
    assert differs.any()  # ties away from zero, not to even...
    assert torch.equal(bits(master)[differs] & 0xFFFF, torch.full_like(bits(master)[differs], 0x8000))  # ...only there
    nearest_even = master.to(torch.bfloat16).float()
    assert torch.equal((weight.float() - master).abs(), (nearest_even - master).abs())  # a nearest value everywhere


def bits(tensor: Tensor) -> Tensor:
    return tensor.view(torch.int32)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_lean_exact_is_o2_bit_for_bit_with_every_optimizer_form(optimizer: str) -> None:
    """Losses, fp32 weights, bf16 weights and optimizer states equal O2's, through accumulation, clipping and a skip,
    with the step cut into chunks of masters (one weight larger than a chunk)."""
    o2 = fabric_run("O2", optimizer)
    exact = fabric_run("lean-exact", optimizer, master_chunk_numel=CHUNK_NUMEL)
    assert exact["skipped"] == o2["skipped"] == 1
    assert_same_run(exact, o2)


def test_between_steps_each_master_costs_its_2_byte_remainder_and_no_fp32_storage() -> None:
    """After a step the bf16 weight and the int16 remainder are all a chosen parameter keeps: 4 bytes, not O2's 6."""
    plugin = MixedPrecision("bf16-mixed", opt_level="lean-exact")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    module, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    fabric.backward(module(torch.randn(4, 64)).float().square().mean())
    opt.step()
    opt.zero_grad()
    masters = plugin.policy.masters  # type: ignore[union-attr]
    assert isinstance(masters, RemainderMasters)
    numel = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.untyped_storage().nbytes() for p in model.parameters())
    remainder_storages = {
        r.untyped_storage().data_ptr(): r.untyped_storage().nbytes() for r in masters.remainders if r is not None
    }
    remainder_bytes = sum(remainder_storages.values())  # views of one int16 tensor per chunk of weights
    master_bytes = sum(m.untyped_storage().nbytes() for m in masters.master_params)
    assert weight_bytes + remainder_bytes == 4 * numel
    assert master_bytes == 4 * len(masters)  # one fp32 zero each, expanded to the master's shape
    assert all(state["exp_avg"].dtype == torch.float32 for state in opt.state.values())
    plugin.teardown()
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_trainer_resume_in_the_middle_is_bit_for_bit_and_an_o2_checkpoint_resumes_at_lean_exact(
    tmp_path: Path,
) -> None:
    """Straight O2, straight lean-exact, and lean-exact resumed from a lean-exact and from an O2 checkpoint agree."""

    def fit(opt_level: str, epochs: int, ckpt_path: Path | None = None) -> tuple[LeanNet, L.Trainer]:
        model = LeanNet()
        trainer = make_trainer(MixedPrecision("bf16-mixed", opt_level=opt_level), max_steps=-1, max_epochs=epochs)
        trainer.fit(model, classification_loader(), ckpt_path=ckpt_path)
        return model, trainer

    o2, o2_trainer = fit("O2", 3)
    exact, exact_trainer = fit("lean-exact", 3)
    for level in ("lean-exact", "O2"):
        _, first = fit(level, 2)
        first.save_checkpoint(tmp_path / f"{level}.ckpt")
        checkpoint = torch.load(tmp_path / f"{level}.ckpt", weights_only=False)
        assert {value.dtype for value in checkpoint["state_dict"].values()} == {torch.float32}
        resumed, resumed_trainer = fit("lean-exact", 3, tmp_path / f"{level}.ckpt")
        for name, value in o2.state_dict().items():
            assert torch.equal(exact.state_dict()[name], value), name
            assert torch.equal(resumed.state_dict()[name], value), (level, name)
        expected = o2_trainer.optimizers[0].state_dict()["state"]
        for trainer in (exact_trainer, resumed_trainer):
            for index, entries in trainer.optimizers[0].state_dict()["state"].items():
                for key, value in entries.items():
                    assert torch.equal(value, expected[index][key]), (level, index, key)
        assert resumed.losses[-4:] == o2.losses[-4:]


def test_a_lean_exact_checkpoint_loads_into_a_plain_fp32_model() -> None:
    """``state_dict()`` after fit gives the exact fp32 masters, which a model without the plugin loads as they are."""
    model = LeanNet()
    trainer = make_trainer(MixedPrecision("bf16-mixed", opt_level="lean-exact"), max_steps=4)
    trainer.fit(model, classification_loader())
    plain = LeanNet()
    plain.load_state_dict(model.state_dict())
    assert all(p.dtype == torch.float32 for p in plain.parameters())
    for (name, value), other in zip(model.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(value, other), name


def test_a_gradient_hook_registered_before_fit_fires_and_reads_bf16_gradients() -> None:
    """The user's parameter is one object for the whole run: a hook from ``__init__`` fires at every backward."""
    model = LeanNet()
    seen: list[torch.dtype] = []
    model.head.weight.register_hook(lambda grad: seen.append(grad.dtype))
    make_trainer(MixedPrecision("bf16-mixed", opt_level="lean-exact"), max_steps=3).fit(model, classification_loader())
    assert seen == [torch.bfloat16] * 3


@pytest.mark.parametrize("precision", ["16-mixed", "32-true"])
def test_lean_exact_refuses_every_precision_but_bf16_by_name(precision: str) -> None:
    with pytest.raises(ValueError, match=r"opt_level='lean-exact'\) is not allowed: .*top half of an fp32.*Use"):
        MixedPrecision(precision, opt_level="lean-exact")  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [0, -4, 2.5, "4096", True])
def test_a_chunk_that_is_not_a_positive_integer_is_refused_by_name(value: Any) -> None:
    """``master_chunk_numel`` takes an integer >= 1; anything else fails naming the argument, the value and the rule."""
    with pytest.raises(ValueError, match=rf"master_chunk_numel={re.escape(repr(value))}\) is not allowed: .*>= 1"):
        MixedPrecision("bf16-mixed", opt_level="lean-exact", master_chunk_numel=value)


@pytest.mark.parametrize("opt_level", ["O1", "O2", "lean"])
def test_a_chunk_given_to_a_level_that_packs_no_masters_is_refused(opt_level: str) -> None:
    """A chunk of masters means nothing where no master is packed: the error names both and the way out."""
    refusal = rf"opt_level='{opt_level}', master_chunk_numel=64\) is not allowed.*opt_level='lean-exact'"
    with pytest.raises(ValueError, match=refusal):
        MixedPrecision("bf16-mixed", opt_level=opt_level, master_chunk_numel=64)


def test_packing_a_chunk_of_weights_in_any_layout_rebuilds_every_master_exactly() -> None:
    """The remainder is the master's low 16 bits; taking it, rounding and rebuilding (from remainders side by side in
    one buffer or apart, which it leaves as they were) work on contiguous, ``channels_last`` and transposed weights
    alike, in one chunk or several."""
    from lightning_mp.policies.o2.split import round_into, take_remainders, unpack

    generator = torch.Generator().manual_seed(0)
    masters = [
        torch.randn(4, 3, 5, 5, generator=generator).contiguous(memory_format=torch.channels_last),
        torch.randn(7, 9, generator=generator).t(),
        torch.randn(130, generator=generator),
    ]
    originals = [master.clone() for master in masters]
    for chunk_numel in (1, 1 << 22):
        weights = [torch.empty_like(master, dtype=torch.bfloat16) for master in masters]
        working = [master.clone() for master in originals]
        remainders = take_remainders(working, chunk_numel)
        for master, remainder in zip(originals, remainders, strict=True):
            flat = master.permute(*sorted(range(master.ndim), key=lambda d: -master.stride(d))).reshape(-1)
            assert torch.equal(remainder, remainder_of(flat, round_to_bf16(flat)))
        round_into(weights, working, chunk_numel)
        rebuilt = unpack(weights, remainders, chunk_numel)
        for master, weight, value in zip(originals, weights, rebuilt, strict=True):
            assert torch.equal(weight, round_to_bf16(master))
            assert value.stride() == master.stride()
            assert torch.equal(bits(value), bits(master))
        apart = [remainder.clone() for remainder in remainders]  # not side by side in one buffer
        for master, value in zip(originals, unpack(weights, apart, chunk_numel), strict=True):
            assert torch.equal(bits(value), bits(master))
            assert value.stride() == master.stride()
        for remainder, kept in zip(remainders, apart, strict=True):
            assert torch.equal(remainder, kept)  # the rebuild reads the remainders and leaves them as they were


class TiedLM(L.LightningModule):
    """An embedding whose weight the output head shares (one parameter, two uses), as GPT-2 and Llama do."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(64, 32)
        self.body = nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.GELU())
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.embedding.weight

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        logits = self.head(self.body(self.embedding(batch[:, :-1])))
        return F.cross_entropy(logits.float().reshape(-1, 64), batch[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


@pytest.mark.parametrize("model_name", ["transformer-lm", "cnn-batch-norm", "tied-embeddings"])
def test_real_models_train_at_lean_exact_as_at_o2_bit_for_bit(model_name: str) -> None:
    """The benchmark's transformer LM (embeddings, attention, LayerNorm), its ResNet (batch norm, channels_last
    convolutions) and an LM whose head shares the embedding's weight train to the same weights and running statistics
    at lean-exact as at O2."""
    from lightning_mp.bench.memory import CNN_SHAPE
    from lightning_mp.bench.workloads import SIZES, RepeatedBatch, WorkloadModule, markov_task

    def train(opt_level: str) -> dict[str, Tensor]:
        L.seed_everything(0, verbose=False)
        if model_name == "cnn-batch-norm":
            module: L.LightningModule = WorkloadModule(CNN_SHAPE.build(), "foreach")
            data: dict[str, Any] = {"train_dataloaders": RepeatedBatch(CNN_SHAPE, 6, torch.device("cpu"), 0)}
        elif model_name == "tied-embeddings":
            module = TiedLM()
            tokens = torch.randint(0, 64, (48, 9), generator=torch.Generator().manual_seed(0))
            data = {"train_dataloaders": torch.utils.data.DataLoader(tokens, batch_size=8)}
        else:
            datamodule, module = markov_task(SIZES["tiny"], 6, 0)
            data = {"datamodule": datamodule}
        trainer = make_trainer(MixedPrecision("bf16-mixed", opt_level=opt_level), max_steps=6)
        trainer.fit(module, **data)
        return {name: value.clone() for name, value in module.state_dict().items()}

    o2, exact = train("O2"), train("lean-exact")
    assert o2.keys() == exact.keys()
    if model_name == "tied-embeddings":
        assert torch.equal(exact["embedding.weight"], exact["head.weight"])  # still one weight
    for name, value in o2.items():
        assert value.dtype == exact[name].dtype, name
        assert torch.equal(value, exact[name]), name


def test_fabric_save_and_load_in_the_middle_resume_bit_for_bit(tmp_path: Path) -> None:
    """Fabric's save and load of model, optimizer and plugin (the optimizer loaded before the plugin connects it)
    continue a lean-exact run exactly as the uninterrupted one."""

    def run(steps: range, load: bool = False, save: bool = False) -> tuple[Tensor, dict[str, Tensor]]:
        plugin = MixedPrecision("bf16-mixed", opt_level="lean-exact")
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4))
        module, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        state = {"model": module, "optimizer": optimizer, "precision": plugin}
        if load:
            fabric.load(tmp_path / "checkpoint.pt", state)
        losses = []
        for step in steps:
            generator = torch.Generator().manual_seed(step)
            features, target = torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator)
            loss = F.cross_entropy(module(features).float(), target)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        if save:
            fabric.save(tmp_path / "checkpoint.pt", state)
        weights = {name: value.clone() for name, value in module.state_dict().items()}
        plugin.teardown()
        return torch.stack(losses), weights

    straight_losses, straight = run(range(6))
    run(range(3), save=True)
    resumed_losses, resumed = run(range(3, 6), load=True)
    assert torch.equal(resumed_losses, straight_losses[3:])
    for name, value in straight.items():
        assert torch.equal(resumed[name], value), name
