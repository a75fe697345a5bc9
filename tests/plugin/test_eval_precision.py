"""eval_precision: validation, test and predict in their own precision, and training bitwise as without them."""

from __future__ import annotations

import weakref
from typing import Any

import lightning as L
import pytest
import torch
import torchmetrics
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecision
from lightning_mp.fsdp import FSDPMixedPrecision
from lightning_mp.plugin.evaluation import refuse_swapped_weights_when_sharded
from lightning_mp.policies import POLICIES
from lightning_mp.policies.evaluation import EvalMode, eval_mode
from tests.helpers import make_trainer

EVAL_PRECISIONS = [None, "16-mixed", "bf16-mixed", "32-true", "16-true", "bf16-true"]
LEVELS = [
    ("O1", "16-mixed"),
    ("O2", "16-mixed"),
    ("O2", "bf16-mixed"),
    ("O3", "bf16-mixed"),
    ("lean", "bf16-mixed"),
    ("lean-exact", "bf16-mixed"),
]
FAST_LEVELS = [("O1", "16-mixed"), ("O2", "bf16-mixed")]

# What a validation step sees: (first weight's dtype, the LayerNorm weight's dtype, output dtype, autocast on).
EXPECTED_STEP = {
    "16-mixed": (torch.float32, torch.float32, torch.float16, True),
    "bf16-mixed": (torch.float32, torch.float32, torch.bfloat16, True),
    "32-true": (torch.float32, torch.float32, torch.float32, False),
    "16-true": (torch.float16, torch.float32, torch.float16, False),
    "bf16-true": (torch.bfloat16, torch.float32, torch.bfloat16, False),
}


def assert_same(value: Any, reference: Any) -> None:
    """``value`` is ``reference``, tensors bitwise, through nested dicts and lists."""
    if isinstance(value, torch.Tensor):
        assert value.dtype == reference.dtype and torch.equal(value, reference)
    elif isinstance(value, dict):
        assert value.keys() == reference.keys()
        for key in value:
            assert_same(value[key], reference[key])
    elif isinstance(value, list | tuple):
        assert len(value) == len(reference)
        for item, reference_item in zip(value, reference, strict=True):
            assert_same(item, reference_item)
    else:
        assert value == reference


def data(n: int = 48, seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=generator)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16)


class Classifier(L.LightningModule):
    """Linear, LayerNorm, linear; records what each evaluation step computes with."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 2))
        self.metric = torchmetrics.MeanMetric()
        self.seen: list[tuple[torch.dtype, torch.dtype, torch.dtype, bool]] = []
        self.weight_tensors: list[Any] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x).float(), y)

    def _evaluate(self, batch: Any) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        self.seen.append(
            (self.net[0].weight.dtype, self.net[1].weight.dtype, logits.dtype, torch.is_autocast_enabled("cpu"))
        )
        self.weight_tensors.append(self.net[0].weight.data.untyped_storage().data_ptr())
        loss = nn.functional.cross_entropy(logits.float(), y)
        self.metric.update(logits.softmax(-1)[:, 1])
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._evaluate(batch))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self._evaluate(batch))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._evaluate(batch)
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(level: str, precision: str, eval_precision: str | None, validate: bool) -> tuple[Classifier, L.Trainer]:
    torch.manual_seed(0)
    model = Classifier()
    plugin = MixedPrecision(precision, opt_level=level, eval_precision=eval_precision, init_scale=2.0**8)
    trainer = make_trainer(
        plugin,
        max_steps=-1,
        max_epochs=2,
        limit_val_batches=2 if validate else 0,
        num_sanity_val_steps=1 if validate else 0,
    )
    trainer.fit(model, data(), data(32, seed=1) if validate else None)
    return model, trainer


def _assert_training_unchanged(level: str, precision: str, eval_precision: str | None) -> tuple[Classifier, L.Trainer]:
    """Fit with validation in ``eval_precision`` and without validation: the same weights, states and scaler.

    The random number generators are compared with a run validating in the training precision: a DataLoader draws a
    seed from them for each of its iterators, so a run without validation draws fewer, whatever the plugin does.
    """
    evaluated, with_eval = _fit(level, precision, eval_precision, validate=True)
    rng_with_eval = torch.get_rng_state()
    _fit(level, precision, None, validate=True)
    assert torch.equal(rng_with_eval, torch.get_rng_state())
    plain, without_eval = _fit(level, precision, eval_precision, validate=False)
    for (name, tensor), (_, reference) in zip(evaluated.state_dict().items(), plain.state_dict().items(), strict=True):
        assert tensor.dtype == reference.dtype and torch.equal(tensor, reference), name
    states = with_eval.optimizers[0].state_dict()["state"]
    reference_states = without_eval.optimizers[0].state_dict()["state"]
    for index, state in states.items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(reference_states[index][key])), (index, key)
    assert_same(with_eval.precision_plugin.state_dict(), without_eval.precision_plugin.state_dict())
    return evaluated, with_eval


@pytest.mark.parametrize("eval_precision", EVAL_PRECISIONS)
@pytest.mark.parametrize(("level", "precision"), FAST_LEVELS)
def test_evaluation_leaves_training_bitwise_unchanged(level: str, precision: str, eval_precision: str | None) -> None:
    """Weights, masters, optimizer states, the scaler and the RNG after fit are bitwise a run's without validation."""
    evaluated, _ = _assert_training_unchanged(level, precision, eval_precision)
    expected = EXPECTED_STEP.get(eval_precision or "")
    if expected is not None and eval_precision != precision:
        assert set(evaluated.seen) == {expected}


@pytest.mark.parametrize("eval_precision", EVAL_PRECISIONS)
@pytest.mark.parametrize(("level", "precision"), [lp for lp in LEVELS if lp not in FAST_LEVELS])
def test_evaluation_leaves_training_bitwise_unchanged_at_every_level(
    level: str, precision: str, eval_precision: str | None
) -> None:
    """The same at O2 fp16, O3 and lean, whose evaluation weights come from masters or from half weights."""
    evaluated, _ = _assert_training_unchanged(level, precision, eval_precision)
    if eval_precision in ("32-true", "16-true", "bf16-true") or (eval_precision == "16-mixed" != precision):
        expected = EXPECTED_STEP[eval_precision]
        first, _, output, autocast = expected
        output = torch.float32 if level == "O3" else output  # O3's model returns fp32 outputs, in evaluation too
        assert {(s[0], s[2], s[3]) for s in evaluated.seen} == {(first, output, autocast)}


@pytest.mark.parametrize("eval_precision", ["32-true", "bf16-true", "16-mixed"])
def test_standalone_validate_test_and_predict_run_in_the_eval_precision(eval_precision: str) -> None:
    """trainer.validate, test and predict evaluate in eval_precision too; predictions come back in it."""
    torch.manual_seed(0)
    model = Classifier()
    trainer = make_trainer(MixedPrecision("bf16-mixed", opt_level="O2", eval_precision=eval_precision))
    trainer.validate(model, data(32))
    trainer.test(model, data(32))
    predictions = trainer.predict(model, data(32))
    assert set(model.seen) == {EXPECTED_STEP[eval_precision]}
    assert {p.dtype for p in predictions} == {EXPECTED_STEP[eval_precision][2]}
    assert model.net[0].weight.dtype == torch.float32  # after the run the model is fp32 again, as without eval


def test_the_half_copy_is_made_once_per_evaluation_run_and_freed_after_it() -> None:
    """A -true evaluation computes every batch of a run with the same copy, made once, and drops it afterwards."""
    torch.manual_seed(0)
    model = Classifier()
    plugin = MixedPrecision("16-mixed", opt_level="O1", eval_precision="bf16-true")
    copies: list[weakref.ref] = []

    class Watch(L.Callback):
        def on_validation_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            copies.append(weakref.ref(plugin.evaluation_weights))

    trainer = make_trainer(plugin, callbacks=[Watch()], max_steps=-1, max_epochs=2, num_sanity_val_steps=0)
    trainer.fit(model, data(), data(48, seed=1))
    # Two validation runs of three batches each: one copy per run, its storage shared by its batches.
    assert len(copies) == 6 and len({id(ref()) for ref in copies[:3]}) == 1
    assert len(set(model.weight_tensors[:3])) == 1 and len(set(model.weight_tensors[3:])) == 1
    assert all(ref() is None for ref in copies)  # freed when training resumed and when fit ended
    weights = copies[0]
    assert weights() is None


@pytest.mark.parametrize(
    ("precision", "level", "eval_precision"),
    [("bf16-mixed", "O2", "bf16-true"), ("bf16-mixed", "O2", "32-true"), ("16-mixed", "O2", "16-mixed")],
)
def test_o2s_weights_serve_evaluation_without_a_copy(precision: str, level: str, eval_precision: str) -> None:
    """O2's half weights serve a -true evaluation in their dtype, and its fp32 masters a 32-true or -mixed one."""
    torch.manual_seed(0)
    model = Classifier()
    plugin = MixedPrecision(precision, opt_level=level, eval_precision=eval_precision)
    copied: list[int] = []

    class Watch(L.Callback):
        def on_validation_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            weights = plugin.evaluation_weights
            copied.append(0 if weights is None else weights.copied_bytes)

    make_trainer(plugin, callbacks=[Watch()], max_steps=2, num_sanity_val_steps=0, val_check_interval=2).fit(
        model, data(), data(16, seed=1)
    )
    assert copied == [0]


def test_torchmetrics_states_stay_fp32_under_a_half_evaluation() -> None:
    """A metric updated with bf16 outputs keeps its fp32 state, as the plugin leaves the default dtype alone."""
    torch.manual_seed(0)
    model = Classifier()
    make_trainer(MixedPrecision("16-mixed", eval_precision="bf16-true")).validate(model, data(32))
    assert model.seen[0][2] == torch.bfloat16
    assert model.metric.mean_value.dtype == torch.float32 and model.metric.compute().dtype == torch.float32


def test_a_failing_evaluation_step_leaves_the_training_weights_in_place() -> None:
    """An exception inside a validation step still points every parameter back at its training tensor."""

    class Failing(Classifier):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self._evaluate(batch)
            raise RuntimeError("planted")

    torch.manual_seed(0)
    model = Failing()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    plugin = MixedPrecision("bf16-mixed", opt_level="O2", eval_precision="16-true")
    with pytest.raises(RuntimeError, match="planted"):
        make_trainer(plugin).validate(model, data(32))
    assert model.seen[0][0] == torch.float16
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == before[name].dtype and torch.equal(tensor, before[name]), name
    assert not any(hook for m in model.modules() for hook in m._forward_pre_hooks.values())


@pytest.mark.parametrize("eval_precision", ["32-true", "bf16-true", "16-mixed"])
def test_fabric_evaluates_inside_plugin_evaluation_without_changing_training(eval_precision: str) -> None:
    """Under Fabric, ``with plugin.evaluation():`` runs forwards in eval_precision; training is bitwise as without."""

    def train(evaluate: bool) -> tuple[nn.Module, torch.optim.Optimizer, MixedPrecision, list[Any]]:
        plugin = MixedPrecision("bf16-mixed", opt_level="O2", eval_precision=eval_precision)
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 2))
        seen: list[Any] = []
        net[3].register_forward_hook(
            lambda m, a, out: seen.append((m.weight.dtype, out.dtype, torch.is_autocast_enabled("cpu")))
        )
        model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        for x, y in data():
            loss = nn.functional.cross_entropy(model(x).float(), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if evaluate:
                seen.clear()
                model.eval()
                with torch.no_grad(), plugin.evaluation():
                    outputs = model(x)
                model.train()
                assert outputs.dtype == torch.float32  # Fabric hands back fp32, as with its own precisions
                assert plugin.evaluation_weights is None
        return net, optimizer, plugin, seen

    evaluated, optimizer, plugin, seen = train(evaluate=True)
    plain, reference_optimizer, reference_plugin, _ = train(evaluate=False)
    weight, output, autocast = seen[-1]
    expected = EXPECTED_STEP[eval_precision]
    assert (weight, output, autocast) == (expected[0], expected[2], expected[3])
    for tensor, reference in zip(evaluated.state_dict().values(), plain.state_dict().values(), strict=True):
        assert torch.equal(tensor, reference)
    assert_same(optimizer.state_dict(), reference_optimizer.state_dict())
    assert_same(plugin.state_dict(), reference_plugin.state_dict())


def test_plugin_evaluation_before_setup_says_what_to_do() -> None:
    plugin = MixedPrecision("bf16-mixed", eval_precision="32-true")
    with pytest.raises(RuntimeError, match=r"evaluation\(\) needs a set-up run.*fabric.setup"), plugin.evaluation():
        pass


@pytest.mark.parametrize(
    ("value", "hint"), [("fp16", "16-true"), ("bf16", "bf16-true"), ("16", "16-true"), ("O2", None), (3.5, None)]
)
def test_a_wrong_eval_precision_is_refused_by_name(value: Any, hint: str | None) -> None:
    with pytest.raises(ValueError, match=r"eval_precision") as error:
        MixedPrecision("16-mixed", eval_precision=value)
    assert repr(value) in str(error.value) and "bf16-true" in str(error.value)
    if hint is not None:
        assert f"Did you mean eval_precision={hint!r}" in str(error.value)


def test_fsdp1_refuses_evaluation_that_needs_other_weights() -> None:
    with pytest.raises(ValueError, match=r"eval_precision='bf16-true'.*FSDP"):
        FSDPMixedPrecision("16-mixed", eval_precision="bf16-true")
    with pytest.raises(ValueError, match=r"opt_level='O2', eval_precision='32-true'"):
        FSDPMixedPrecision("16-mixed", opt_level="O2", eval_precision="32-true")
    assert FSDPMixedPrecision("16-mixed", eval_precision="bf16-mixed").settings.eval_precision == "bf16-mixed"


def test_a_sharded_model_refuses_evaluation_that_needs_other_weights() -> None:
    half = EvalMode("bf16-true", False, weight_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"eval_precision='bf16-true'.*sharded"):
        refuse_swapped_weights_when_sharded(half, POLICIES["O1"])
    autocast_only = EvalMode("16-mixed", False, weight_dtype=torch.float32, autocast_dtype=torch.float16)
    refuse_swapped_weights_when_sharded(autocast_only, POLICIES["O1"])


def test_eval_mode_follows_the_table() -> None:
    """None and training's own precision run as training; auto is what precision='auto' chooses."""
    assert eval_mode(None, ["bf16-mixed"], lambda: "16-mixed").as_training
    assert eval_mode("bf16-true", ["bf16-mixed", "bf16-true"], lambda: "16-mixed").as_training
    assert eval_mode("auto", ["16-mixed"], lambda: "16-mixed").as_training
    auto = eval_mode("auto", ["16-mixed"], lambda: "bf16-mixed")
    assert (auto.precision, auto.weight_dtype, auto.autocast_dtype) == ("bf16-mixed", torch.float32, torch.bfloat16)
    fp32 = eval_mode("32-true", ["16-mixed"], lambda: "16-mixed")
    assert (fp32.weight_dtype, fp32.autocast_dtype) == (torch.float32, None)
