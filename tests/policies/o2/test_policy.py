"""O2's policy: the model computes with half model parameters and the optimizer steps the fp32 master parameters,
which it holds from ``connect`` on; the loss scaler and the optimizer see fp32 gradients, and teardown leaves the fp32
model it was given."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning
from lightning.pytorch.utilities import grad_norm
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from lightning_mp import MixedPrecision
from lightning_mp.inference import compare, to_inference
from lightning_mp.policies.o2 import O2Policy
from tests.ddp_scripts.launch import reports, run
from tests.helpers import fit, hook_count, make_trainer
from tests.policies.o2.helpers import (
    HALF,
    PRECISIONS,
    STEPS,
    Net,
    StartWeights,
    converted,
    net_loader,
    o2,
    snapshot,
)
from tests.test_parity import train_and_validate


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_computes_with_half_parameters_and_keeps_fp32_states_and_fp32_weights_after_fit(precision: str) -> None:
    """In the step the chosen weights and their gradients are half (norms fp32), the optimizer holds the very same
    objects with fp32 Adam states, and after fit the parameters are fp32 again."""
    model = Net()
    grads: list[torch.dtype] = []
    states: list[torch.dtype] = []

    class Dtypes(L.Callback):
        def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
            grads.extend(p.grad.dtype for p in pl_module.parameters())
            held = [p for group in optimizer.param_groups for p in group["params"]]
            assert held == list(pl_module.parameters())
            states.extend(v.dtype for p in held for k, v in optimizer.state[p].items() if k != "step")

    trainer = fit(model, o2(precision), max_steps=2, callbacks=[Dtypes()])
    half = HALF[precision]
    assert model.dtypes_in_step["net.0.weight"] == model.dtypes_in_step["net.3.bias"] == half
    assert model.dtypes_in_step["net.1.weight"] == torch.float32
    assert model.output_dtype == half
    assert grads == [half, half, torch.float32, torch.float32, half, half] * 2
    assert set(states) == {torch.float32} and len(states) == 2 * 6  # both moments of 6 parameters, before step 2
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    optimizer = trainer.optimizers[0]
    assert optimizer.param_groups[0]["params"] == list(model.parameters())
    assert {v.dtype for p in model.parameters() for k, v in optimizer.state[p].items() if k != "step"} == {
        torch.float32
    }
    assert trainer.precision_plugin.stats.skipped_steps == 0


def hand_written_o2(dtype: torch.dtype, loss_scale: float) -> list[Tensor]:
    """The O2 algorithm by hand with public torch APIs: fp32 parameters, half copies for the forward under autocast."""
    model = Net()
    half_names = {"net.0.weight", "net.0.bias", "net.3.weight", "net.3.bias"}
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for features, target in net_loader():
        weights = {name: p.to(dtype) if name in half_names else p for name, p in model.named_parameters()}
        with torch.autocast("cpu", dtype=dtype):
            loss = F.cross_entropy(functional_call(model, weights, (features,)), target)
        (loss * loss_scale).backward()
        for parameter in model.parameters():
            parameter.grad.mul_(1.0 / loss_scale)
        optimizer.step()
        optimizer.zero_grad()
    return list(model.parameters())


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_matches_a_hand_written_o2_loop(precision: str) -> None:
    """After N steps the plugin's fp32 parameters equal those of O2 written out by hand with functional_call."""
    loss_scale = 2.0**10 if precision == "16-mixed" else 1.0
    model = Net()
    trainer = fit(model, o2(precision), max_steps=STEPS)
    assert trainer.precision_plugin.stats.skipped_steps == 0
    for got, want in zip(model.parameters(), hand_written_o2(HALF[precision], loss_scale), strict=True):
        torch.testing.assert_close(got, want)


def test_o2_grad_norm_sees_every_gradient() -> None:
    """Lightning's grad_norm in on_before_optimizer_step sees all parameters' fp32 gradients."""
    norms: dict[str, Tensor] = {}

    class Norms(L.Callback):
        def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
            norms.update(grad_norm(pl_module, norm_type=2))

    model = Net()
    fit(model, o2("16-mixed"), max_steps=1, callbacks=[Norms()])
    assert len([key for key in norms if key != "grad_2.0_norm_total"]) == 6


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_skips_an_injected_overflow_leaving_weights_and_optimizer_states_unchanged(precision: str) -> None:
    """An inf loss is skipped: fp32 weights and Adam states are as before; the other steps train."""
    model = Net(inf_at=(1,))
    states: dict[int, tuple[dict[str, Tensor], list[Tensor]]] = {}

    class Snapshots(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
            optimizer = trainer.optimizers[0]
            moments = [v.clone() for p in pl_module.parameters() for v in optimizer.state[p].values()]
            states[batch_idx] = (snapshot(pl_module), moments)

    trainer = fit(model, o2(precision), max_steps=3, callbacks=[Snapshots()])
    assert trainer.precision_plugin.stats.skipped_steps == 1
    (before, moments_before), (after, moments_after) = states[1], states[2]
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert all(torch.equal(a, b) for a, b in zip(moments_before, moments_after, strict=True))
    assert not torch.equal(after["net.0.weight"], snapshot(model)["net.0.weight"])


@pytest.mark.parametrize("optimizer", ["adam_fused", "adamw_foreach", "sgd"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_trains_with_fused_and_foreach_optimizers(optimizer: str, precision: str) -> None:
    """Fused and foreach optimizers step the fp32 parameters with fp32 gradients under O2, in fp16 and in bf16."""
    model = Net(optimizer=optimizer)
    initial = snapshot(model)
    clip = None if optimizer == "adam_fused" else 0.5
    trainer = fit(model, o2(precision), max_steps=2, gradient_clip_val=clip)
    assert trainer.precision_plugin.stats.skipped_steps == 0
    assert not torch.equal(model.net[0].weight, initial["net.0.weight"])
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_a_skipped_step_leaves_masters_and_half_weights_unchanged(precision: str) -> None:
    """An inf step changes neither the fp32 masters nor the half weights the next forward computes with."""
    seen: dict[int, tuple[Tensor, Tensor]] = {}

    class Records(Net):
        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            master = self.trainer.optimizers[0].param_groups[0]["params"][0]
            seen[batch_idx] = (master.detach().clone(), self.net[0].weight.detach().clone())
            return super().training_step(batch, batch_idx)

    trainer = fit(Records(inf_at=(1,)), o2(precision), max_steps=3)
    assert trainer.precision_plugin.stats.skipped_steps == 1
    assert torch.equal(seen[1][0], seen[2][0]) and torch.equal(seen[1][1], seen[2][1])
    assert seen[2][1].dtype == HALF[precision] and torch.equal(seen[2][0].to(HALF[precision]), seen[2][1])
    assert not torch.equal(seen[0][0], seen[1][0])


class Backbone(Net):
    def __init__(self) -> None:
        super().__init__(optimizer="sgd")
        self.backbone = self.net[0]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_backbone_finetuning_unfreezes_and_trains_the_backbone(precision: str) -> None:
    """Lightning's BackboneFinetuning adds the backbone's group after setup; it trains in fp32 with no KeyError."""
    model = Backbone()
    initial = model.backbone.weight.detach().clone()
    finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=1.0)
    trainer = fit(model, o2(precision), max_steps=2 * STEPS, max_epochs=2, callbacks=[finetuning])
    groups = trainer.optimizers[0].param_groups
    assert len(groups) == 2 and model.backbone.weight in groups[1]["params"]
    assert model.backbone.weight.dtype == torch.float32
    assert not torch.equal(model.backbone.weight, initial)
    assert trainer.precision_plugin.stats.skipped_steps == 0


class AddsGroup(Net):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.net[0].parameters(), lr=0.1)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.trainer.optimizers[0]
        if batch_idx == 1:
            optimizer.add_param_group({"params": [*self.net[1].parameters(), *self.net[3].parameters()]})


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_add_param_group_after_setup_trains_the_new_fp32_parameters(precision: str) -> None:
    """optimizer.add_param_group after setup: the new parameters get fp32 gradients, are unscaled and step."""
    model = AddsGroup()
    head = model.net[3].weight.detach().clone()
    trainer = fit(model, o2(precision), max_steps=3)
    assert trainer.precision_plugin.stats.skipped_steps == 0
    assert model.net[3].weight.dtype == torch.float32
    assert not torch.equal(model.net[3].weight, head)
    assert torch.isfinite(model.net[3].weight).all()


def test_o2_add_param_group_with_model_parameters_steps_their_masters() -> None:
    """A group added after setup with the model's (half) parameters is stepped in fp32 through their masters, and
    holds the same parameter objects before and after."""
    model, plugin, optimizer = converted()
    optimizer.param_groups[0]["params"] = optimizer.param_groups[0]["params"][:2]
    added = list(model.net[3].parameters())
    optimizer.add_param_group({"params": added})
    policy = plugin.policy
    assert isinstance(policy, O2Policy) and policy.masters is not None
    masters = [policy.masters.master_params[policy.masters.index_of[id(p)]] for p in added]
    before = [m.detach().clone() for m in masters]
    with plugin.forward_context():
        model(torch.randn(4, 8)).float().square().mean().backward()
    optimizer.step()
    assert optimizer.param_groups[1]["params"] == added
    assert all(not torch.equal(m, b) for m, b in zip(masters, before, strict=True))
    assert all(torch.equal(p, m.bfloat16()) for p, m in zip(added, masters, strict=True))
    plugin.teardown()
    assert optimizer.param_groups[1]["params"] == list(model.net[3].parameters())


def test_o2_fabric_optimizer_loaded_while_it_held_half_weights_continues_in_fp32_and_says_so(tmp_path: Path) -> None:
    """An optimizer built after fabric.setup_module and loaded before its first step warns and steps fp32 states."""
    features, target = torch.randn(8, 8), torch.randint(0, 4, (8,))
    states = []
    for run_index in range(2):
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[o2()])
        torch.manual_seed(0)
        model = fabric.setup_module(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
        optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
        if run_index == 1:
            fabric.load(tmp_path / "state.ckpt", {"optimizer": optimizer})
        fabric.backward(F.cross_entropy(model(features), target))
        if run_index == 1:
            with pytest.warns(UserWarning, match="rounded it to the half parameters' dtype; it continues in fp32"):
                optimizer.step()
        else:
            optimizer.step()
        states.append(optimizer.state_dict()["state"])
        fabric.save(tmp_path / "state.ckpt", {"optimizer": optimizer})
    assert {value.dtype for state in states[1].values() for key, value in state.items() if key != "step"} == {
        torch.float32
    }


def test_o2_fabric_trains_two_models_set_up_one_after_the_other() -> None:
    """Two models set up by one Fabric (a GAN's): both compute with half weights that follow their stepped masters."""
    plugin = o2()
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    models, optimizers = [], []
    for _ in range(2):
        network = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        model, optimizer = fabric.setup(network, torch.optim.SGD(network.parameters(), lr=0.1))
        models.append(model)
        optimizers.append(optimizer)
    features = torch.randn(8, 8)
    seen: list[list[Tensor]] = [[], []]
    for model, weights in zip(models, seen, strict=True):
        model.module[0].register_forward_pre_hook(
            lambda module, args, weights=weights: weights.append(module.weight.detach().clone())
        )
    initial = [[p.detach().clone() for group in o.param_groups for p in group["params"]] for o in optimizers]
    for _ in range(2):
        fabric.backward(models[1](models[0](features)).float().square().mean())
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    masters = plugin.policy.masters  # type: ignore[union-attr]
    for optimizer, before, weights in zip(optimizers, initial, seen, strict=True):
        held = [p for group in optimizer.param_groups for p in group["params"]]
        assert all(p.dtype == torch.bfloat16 and not torch.equal(p, q) for p, q in zip(held, before, strict=True))
        assert weights[0].dtype == torch.bfloat16
        assert not torch.equal(weights[0], weights[1])  # the second forward computed with the stepped weights
    for model, optimizer in zip(models, optimizers, strict=True):
        state = model.state_dict()
        held = [p for group in optimizer.param_groups for p in group["params"]]
        for name, param in zip(state, held, strict=True):
            master = masters.master_params[masters.index_of[id(param)]]
            assert state[name].dtype == torch.float32 and torch.equal(state[name], master.detach()), name


def test_o2_an_optimizer_of_fp32_parameters_only_keeps_its_own_state_dict() -> None:
    """An optimizer that steps only the fp32 LayerNorm of an O2 model holds its states in its own ``state`` dict, the
    one a reference taken before training sees."""
    plugin = o2()
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    module, norm_optimizer = fabric.setup(model, torch.optim.AdamW(model[1].parameters(), lr=1e-2))
    own_state = norm_optimizer.optimizer.state
    for _ in range(2):
        fabric.backward(module(torch.randn(3, 4)).float().square().mean())
        norm_optimizer.step()
        norm_optimizer.zero_grad()
    assert norm_optimizer.optimizer.state is own_state
    assert [int(own_state[p]["step"]) for p in model[1].parameters()] == [2, 2]


def test_o2_keep_fp32_regions_stay_attached_across_forwards_until_teardown() -> None:
    """Under Fabric the keep_fp32 region's hooks are attached once at setup, not per forward; teardown removes them."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    plugin = o2(keep_fp32=["2"])
    model = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin]).setup(net)
    hooks_after_setup = dict(net[2]._forward_pre_hooks)
    assert len(hooks_after_setup) == 1 and hook_count(net) == 2
    for _ in range(2):
        assert model(torch.randn(3, 4)).dtype == torch.float32
        assert dict(net[2]._forward_pre_hooks) == hooks_after_setup
    plugin.teardown()
    assert hook_count(net) == 0
    assert all(isinstance(p, nn.Parameter) and p.dtype == torch.float32 for p in net.parameters())


class Explodes(Net):
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        if batch_idx == 1:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_after_fit_and_after_a_crash_the_model_is_fp32_without_hooks(precision: str) -> None:
    """After fit, or after an exception in fit, the model has fp32 parameters, fp32 state_dict and no hooks."""
    finished = Net()
    fit(finished, o2(precision, keep_fp32=["net.3"]), max_steps=2)
    crashed = Explodes()
    with pytest.raises(RuntimeError, match="boom"):
        fit(crashed, o2(precision, keep_fp32=["net.3"]), max_steps=3)
    for model in (finished, crashed):
        assert all(isinstance(p, nn.Parameter) and p.dtype == torch.float32 for p in model.parameters())
        assert {value.dtype for value in model.state_dict().values()} == {torch.float32}
        assert hook_count(model) == 0


@pytest.mark.parametrize("second", ["O2", "O1", "none"])
def test_o2_second_training_stage_starts_from_the_fp32_weights(second: str) -> None:
    """A second stage (a new O2 plugin, O1, or no plugin) starts from the exact fp32 weights and trains cleanly."""
    model = Net()
    fit(model, o2("16-mixed"), max_steps=2)
    after_first = snapshot(model)
    plugin = {"O2": o2("16-mixed"), "O1": MixedPrecision("16-mixed", init_scale=2.0**10), "none": None}[second]
    start = StartWeights()
    trainer = fit(model, plugin, max_steps=2, callbacks=[start])
    assert all(torch.equal(start.weights[name], after_first[name]) for name in after_first)
    if plugin is not None:
        assert trainer.precision_plugin.stats.skipped_steps == 0
    assert model.dtypes_in_step["net.0.weight"] == (torch.float16 if second == "O2" else torch.float32)
    assert not torch.equal(model.net[0].weight, after_first["net.0.weight"])


def test_o2_compare_after_fit_measures_against_fp32() -> None:
    """compare(model, to_inference(model), batch) after an O2 fit compares fp32 with fp16: the error is not 0."""
    model = Net()
    fit(model, o2("16-mixed"), max_steps=2)
    features = next(iter(net_loader()))[0]
    report = compare(model, to_inference(model, dtype=torch.float16), features, verbose=False)
    assert 0 < report.max_rel_error < 0.05


def test_o2_reused_plugin_holds_no_reference_to_the_previous_model() -> None:
    """A plugin reused for a second model lets the first one be garbage-collected."""
    plugin = o2()
    first = Net()
    trainer = fit(first, plugin, max_steps=1)
    references = [weakref.ref(first), weakref.ref(first.net[0]), weakref.ref(first.net[0].weight)]
    del first, trainer  # the Trainer refers to the model; the plugin must not
    gc.collect()
    assert [reference() for reference in references] == [None, None, None]
    second = Net()
    assert fit(second, plugin, max_steps=1).precision_plugin is plugin
    assert second.dtypes_in_step["net.0.weight"] == torch.bfloat16


def test_o2_policy_rejects_a_non_half_dtype() -> None:
    """O2 needs a half type; fp32 is refused with a message naming the value and what is allowed."""
    with pytest.raises(ValueError, match=r"half_dtype=torch.float32\) is not allowed: .*float16 or torch.bfloat16"):
        O2Policy(torch.float32)


@pytest.mark.slow
def test_o2_under_real_ddp_skips_an_overflow_on_one_rank_and_keeps_the_ranks_identical(tmp_path: Path) -> None:
    """Under strategy='ddp' an O2 fp16 overflow on rank 1 is skipped by both ranks, whose parameters stay equal."""
    run(["--strategy", "ddp", "--out", str(tmp_path), "--opt-level", "O2", "--inject-rank", "1", "--inject-at", "2"])
    ranks = reports(tmp_path)
    assert [step - 1 for step, _, skipped in ranks[0]["steps"] if skipped] == [2]
    assert ranks[0]["steps"] == ranks[1]["steps"]
    assert ranks[0]["stats"]["skipped_steps"] == 1 and ranks[0]["stats"]["optimizer_steps"] == 8
    assert len({checksum for rank in ranks for checksum in rank["checksums"]}) == 1


@pytest.mark.slow
def test_o2_under_real_ddp_all_reduces_half_gradients(tmp_path: Path) -> None:
    """Under strategy='ddp' (gloo, 2 ranks) O2's gradient buckets are half: at most 0.55x the bytes O1 all-reduces."""
    precision, reduced = "16-mixed", {}
    for opt_level in ("O1", "O2"):
        out = tmp_path / opt_level
        common = ["--strategy", "ddp", "--max-steps", "4", "--count-reduced-bytes"]
        run([*common, "--out", str(out), "--opt-level", opt_level, "--precision", precision])
        reduced[opt_level] = ranks = reports(out)
        assert ranks[0]["checksums"][0] == ranks[0]["checksums"][1]
        assert ranks[0]["reduced_bytes"] == ranks[1]["reduced_bytes"] > 0
    assert reduced["O1"][0]["reduced_dtypes"] == ["torch.float32"]
    assert reduced["O2"][0]["reduced_dtypes"] == [str(HALF[precision])]
    assert reduced["O2"][0]["reduced_bytes"] <= 0.55 * reduced["O1"][0]["reduced_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_validation_loss_is_within_2_percent_of_o0_on_the_reference_task(precision: str) -> None:
    """On the reference task O2 ends within 2% of the fp32 baseline's validation loss, without a skipped step."""
    baseline = train_and_validate("32-true", "O0", steps=60)
    mixed = train_and_validate(precision, "O2", steps=60)
    assert abs(mixed["val_loss"] - baseline["val_loss"]) <= 0.02 * baseline["val_loss"]
    assert mixed["skipped_steps"] == 0


class ToggledGAN(L.LightningModule):
    """Lightning's GAN recipe (toggle, backward, step, zero_grad, untoggle per optimizer), optionally by closure."""

    def __init__(self, use_closure: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.generator = nn.Linear(8, 8)
        self.discriminator = nn.Linear(8, 1)
        self.use_closure = use_closure

    def _phase(self, optimizer: Any, loss_of: Any) -> None:
        self.toggle_optimizer(optimizer)

        def closure() -> Tensor:
            loss = loss_of()
            optimizer.zero_grad()
            self.manual_backward(loss)
            return loss

        if self.use_closure:
            optimizer.step(closure=closure)
        else:
            closure()
            optimizer.step()
        self.untoggle_optimizer(optimizer)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        x, _ = batch
        self._phase(opt_g, lambda: -self.discriminator(self.generator(x)).float().mean())
        fake = self.generator(x).detach()
        self._phase(
            opt_d,
            lambda: (self.discriminator(fake).float().square() + (self.discriminator(x).float() - 1).square()).mean(),
        )

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.generator.parameters(), lr=1e-2), torch.optim.SGD(
            self.discriminator.parameters(), lr=1e-2
        )


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
@pytest.mark.parametrize("use_closure", [False, True])
def test_o2_trains_a_toggled_gan_like_o1(precision, use_closure):
    """Under O2 the GAN recipe with toggle_optimizer trains both networks, as under O1 (within half precision)."""
    models = {}
    for opt_level in ("O1", "O2"):
        models[opt_level] = model = ToggledGAN(use_closure)
        plugin = MixedPrecision(precision, opt_level=opt_level, init_scale=2.0**8 if precision == "16-mixed" else None)
        make_trainer(plugin, max_steps=8).fit(model, net_loader())
    untrained = ToggledGAN()
    for name, parameter in models["O2"].named_parameters():
        assert not torch.equal(parameter, untrained.get_parameter(name)), f"{name} never trained"
        torch.testing.assert_close(parameter, models["O1"].get_parameter(name), rtol=2e-2, atol=2e-3)


class PerSampleGradNorms(Net):
    """Logs per-sample gradient norms of the head with torch.func inside training_step."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        features, target = batch
        head = self.net[3]
        params = {k: v.detach() for k, v in head.named_parameters()}
        hidden = self.net[:3](features).detach()

        def sample_loss(p: dict[str, Tensor], h: Tensor, t: Tensor) -> Tensor:
            return F.cross_entropy(functional_call(head, p, (h[None],)), t[None])

        grads = torch.func.vmap(torch.func.grad(sample_loss), in_dims=(None, 0, 0))(params, hidden, target)
        self.per_sample_norm = grads["weight"].flatten(1).norm(dim=1)
        return super().training_step(batch, batch_idx)


def test_o2_torch_func_in_the_step_trains() -> None:
    """torch.func (vmap of grad) inside training_step works under O2 as it is: no saved-tensor hook refuses it."""
    model = PerSampleGradNorms()
    fit(model, o2(), max_steps=2)
    assert model.per_sample_norm.shape == (8,) and torch.isfinite(model.per_sample_norm).all()


class Checkpointed(L.LightningModule):
    """A block under torch.utils.checkpoint (non-reentrant), or the same block run plainly."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
        self.head = nn.Linear(8, 4)
        self.checkpointed = checkpointed

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        features, target = batch
        hidden = checkpoint(self.block, features, use_reentrant=False) if self.checkpointed else self.block(features)
        return F.cross_entropy(self.head(hidden), target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_o2_activation_checkpointing_trains_exactly_as_without_it() -> None:
    """Non-reentrant activation checkpointing under O2 recomputes the block in backward and gives the same weights."""
    weights = []
    for checkpointed in (True, False):
        model = Checkpointed(checkpointed)
        make_trainer(o2(), max_steps=STEPS).fit(model, net_loader())
        assert all(p.dtype == torch.float32 for p in model.parameters())
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(weights[0], weights[1])
    assert not torch.equal(weights[0], torch.cat([p.detach().flatten() for p in Checkpointed(False).parameters()]))


class ReplacesItsGroup(Net):
    """Manual optimization whose second step replaces the group's ``params`` list with the head's parameters only."""

    def __init__(self) -> None:
        super().__init__(optimizer="sgd")
        self.automatic_optimization = False

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        optimizer = self.optimizers()
        if batch_idx == 1:
            optimizer.param_groups[0]["params"] = list(self.net[3].parameters())
            self.first_layer = self.state_dict()["net.0.weight"].clone()  # its fp32 master
        optimizer.zero_grad()
        features, target = batch
        self.manual_backward(F.cross_entropy(self(features), target))
        optimizer.step()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_a_group_whose_params_list_is_replaced_steps_the_new_parameters_only(precision: str) -> None:
    """After a group's ``params`` list is replaced mid-training, the step applies to the new parameters (through their
    masters) and no longer to the old ones: nothing stays pointed at what the group held before."""
    model = ReplacesItsGroup()
    head = model.net[3].weight.detach().clone()
    fit(model, o2(precision), max_steps=3)
    assert torch.equal(model.net[0].weight, model.first_layer)  # left the group: never stepped again
    assert not torch.equal(model.net[3].weight, head)
