"""The precision advisor: it names a planted fp16-overflow layer, and its advice makes an fp16 run stop skipping."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecision
from lightning_mp.advisor import FP16_MAX, GRADIENT_HEADROOM, Advice, advise
from lightning_mp.plugin import hardware
from lightning_mp.plugin.hardware import DeviceCapabilities, native_bf16, precision_for
from lightning_mp.policies.o2 import HalfOverflowError
from tests.helpers import fit

NATIVE_CPU = DeviceCapabilities("cpu", native_bf16=True)
EMULATING_CPU = DeviceCapabilities("cpu", native_bf16=False)


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


def planted_loader() -> DataLoader:
    """:class:`Planted`'s data: 64 seeded samples of 8 features and 2 classes, shuffled by a seeded generator."""
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(x, (x[:, 0] > 0).long())
    return DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1))


def fit_fp16(plugin: MixedPrecision, max_steps: int = 5) -> MixedPrecision:
    """A fresh :class:`Planted` fitted on :func:`planted_loader` with ``plugin``; the plugin."""
    fit(Planted(), plugin, planted_loader(), max_steps=max_steps)
    return plugin


@pytest.fixture(scope="module")
def advice() -> Advice:
    return advise(Planted(), planted_loader(), batches=4, capabilities=NATIVE_CPU)


def test_advisor_names_the_planted_overflow_layer(advice: Advice) -> None:
    """On a CPU with native bf16 the table flags the overflowing layer and its consumer, and recommends bf16."""
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
    advice = advise(model, planted_loader(), batches=2, loss_fn=lambda m, batch: F.cross_entropy(m(batch[0]), batch[1]))
    tiny = advice.layers[0]
    assert tiny.name == "0" and tiny.activation_zero_share > 0.5
    assert advice.keep_fp32 == ("0",)


def test_advisor_changes_nothing_it_measures() -> None:
    """The model's weights, buffers, grads and mode, the global RNG and the loader's shuffle order are untouched."""
    model = Planted(dropout=0.5)
    model.eval()
    data = planted_loader()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    rng = torch.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # self.log() without a Trainer must not leak warnings
        advise(model, data, batches=3)
    assert not model.training and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(next(iter(data))[0], next(iter(planted_loader()))[0])


def test_advisor_leaves_batches_alone_when_the_model_writes_into_its_input() -> None:
    """A model with ELU(inplace=True) first, measured on a list of the user's tensors, leaves those tensors alone."""
    model = nn.Sequential(nn.ELU(inplace=True), nn.Linear(8, 2))
    batches = [(torch.randn(8, 8) * 3, torch.randint(0, 2, (8,))) for _ in range(2)]
    before = [x.clone() for x, _ in batches]
    advise(model, batches, batches=2, loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]), capabilities=NATIVE_CPU)
    assert all(torch.equal(x, given) for (x, _), given in zip(batches, before, strict=True))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batches": 0}, r"advise\(batches=0\) is not allowed: batches must be an integer >= 1"),
        ({"model": nn.Linear(8, 4)}, r"advise\(model=Linear, loss_fn=None\) is not allowed: .* needs loss_fn"),
        ({"model": "model"}, r"advise\(model=str\) is not allowed"),
        ({"dataloader": 3}, r"advise\(dataloader=3\) is not allowed: dataloader must be an iterable"),
        ({"dataloader": []}, r"the data loader yielded no batch"),
        ({"batches": np.array([1, 2])}, r"advise\(batches=array\(\[1, 2\]\)\) is not allowed: .* an integer >= 1"),
        ({"batches": 1.0}, r"advise\(batches=1.0\) is not allowed: batches must be an integer >= 1"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs: dict, message: str) -> None:
    """Bad arguments raise ValueError naming the argument, the value and what is allowed."""
    arguments = {"model": Planted(), "dataloader": planted_loader(), "batches": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        advise(**arguments)


def test_numbers_and_choices_of_any_kind_are_checked_naming_the_argument() -> None:
    """A numpy count is a count; an array where a precision belongs is a ValueError naming precision."""
    advice = advise(Planted(), planted_loader(), batches=np.int64(1), capabilities=NATIVE_CPU)
    assert advice.batches == 1 and type(advice.batches) is int
    with pytest.raises(ValueError, match=r"plugin_kwargs\(precision=array\(\[1., 2.\]\)\) is not supported"):
        advice.plugin_kwargs(np.array([1.0, 2.0]))


class ManualPlanted(Planted):
    """Planted with manual optimization: its training_step calls self.optimizers() and self.manual_backward()."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        features, target = batch
        loss = F.cross_entropy(self(features), target)
        self.manual_backward(loss)
        optimizer.step()
        self.log("train_loss", loss)
        return loss.detach()


def test_advisor_measures_a_manual_optimization_module_without_touching_it() -> None:
    """A manual-optimization module is measured through its own training_step; the model keeps its weights."""
    model = ManualPlanted()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    advice = advise(model, planted_loader(), batches=2, capabilities=NATIVE_CPU)
    assert advice.keep_fp32 == ("blowup", "norm")
    assert {layer.name for layer in advice.layers if layer.max_gradient > 0} >= {"stem", "blowup", "head"}
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    assert model.fabric is None and all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    ("capabilities", "precision"),
    [
        (NATIVE_CPU, "bf16-mixed"),
        (EMULATING_CPU, "32-true"),
        (DeviceCapabilities("cuda", native_bf16=True, compute_capability=(8, 0)), "bf16-mixed"),
        (DeviceCapabilities("cuda", native_bf16=False, compute_capability=(7, 5)), "16-mixed"),
    ],
)
def test_advice_matches_the_hardware(capabilities: DeviceCapabilities, precision: str) -> None:
    """Emulated bf16 is never recommended: fp32 on a CPU without native bf16, fp16 on a pre-Ampere GPU."""
    model = nn.Sequential(nn.Linear(8, 4))
    advice = advise(
        model,
        planted_loader(),
        batches=1,
        loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
        capabilities=capabilities,
    )
    assert advice.precision == precision
    assert "'bf16-mixed' on a GPU of compute capability 8.0 or higher" in advice.on_gpu
    assert "'16-mixed' with keep_fp32=[], init_scale=" in advice.on_gpu
    assert "On a GPU:" in str(advice)
    assert advice.plugin_kwargs()["precision"] == precision
    MixedPrecision(**advice.plugin_kwargs())


def test_emulated_bf16_advice_explains_itself_and_still_names_the_fp16_settings() -> None:
    """On a CPU that emulates bf16 with layers at risk: fp32 here, with the GPU and fp16 advice spelled out."""
    advice = advise(Planted(), planted_loader(), batches=2, capabilities=EMULATING_CPU)
    assert advice.precision == "32-true" and "emulates bf16 and fp16" in advice.reason
    assert advice.keep_fp32 == ("blowup", "norm")
    assert "keep_fp32=['blowup', 'norm']" in advice.on_gpu


@pytest.mark.parametrize(
    ("capabilities", "opt_level", "precision"),
    [
        (EMULATING_CPU, "O0", "32-true"),
        (EMULATING_CPU, "O1", "32-true"),
        (EMULATING_CPU, "O2", "bf16-mixed"),
        (EMULATING_CPU, "O3", "bf16-mixed"),
        (EMULATING_CPU, "lean", "bf16-mixed"),
        (EMULATING_CPU, "lean-kahan", "bf16-mixed"),
        (NATIVE_CPU, "O1", "bf16-mixed"),
        (DeviceCapabilities("cuda", False, (7, 0)), "O2", "16-mixed"),
        (DeviceCapabilities("cuda", True, (9, 0)), "O1", "bf16-mixed"),
    ],
)
def test_auto_precision_is_a_function_of_the_hardware(
    capabilities: DeviceCapabilities, opt_level: str, precision: str
) -> None:
    """precision="auto" picks bf16 only where it is native, except for the levels that compute with half weights (O2,
    O3, lean), which fp32 would turn into O0 (and it says so)."""
    chosen, reason = precision_for(capabilities, opt_level)
    assert chosen == precision
    if capabilities is EMULATING_CPU and opt_level not in ("O0", "O1"):
        assert "slower than fp32" in reason and "opt_level='O1'" in reason


def test_native_bf16_reads_compute_capability_and_cpu_flags() -> None:
    """CUDA needs compute capability 8.0; a CPU needs avx512_bf16 or amx_bf16."""
    assert native_bf16("cuda", (8, 0)) and not native_bf16("cuda", (7, 5)) and not native_bf16("cuda", None)
    assert native_bf16("cpu", flags={"avx2", "amx_bf16"}) and not native_bf16("cpu", flags={"avx512f"})


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"loss_fn": 5}, TypeError, r"advise\(loss_fn=5\) is not allowed: loss_fn must be None or a callable"),
        ({"loss_fn": lambda m, b: 1.0}, TypeError, r"loss_fn=\.\.\.\) must return a loss tensor, got float"),
        ({"capabilities": "cpu"}, TypeError, r"advise\(capabilities='cpu'\) is not allowed"),
    ],
)
def test_bad_callables_raise_type_error(kwargs: dict, error: type, message: str) -> None:
    """A loss_fn that is not callable, or returns no tensor, is refused with a message naming it."""
    with pytest.raises(error, match=message):
        advise(Planted(), planted_loader(), batches=1, **kwargs)


class ManualNeedsTrainer(ManualPlanted):
    """A manual-optimization module whose configure_optimizers reads self.trainer."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05 / self.trainer.estimated_stepping_batches)


def test_manual_module_that_needs_a_trainer_gets_a_clear_error_and_works_with_loss_fn() -> None:
    """When the copy cannot configure its optimizers, the error says to pass loss_fn, and loss_fn works."""
    with pytest.raises(ValueError, match=r"configure_optimizers\(\) failed on the advisor's copy.*Pass loss_fn="):
        advise(ManualNeedsTrainer(), planted_loader(), batches=1)
    advice = advise(
        ManualNeedsTrainer(),
        planted_loader(),
        batches=1,
        loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
        capabilities=NATIVE_CPU,
    )
    assert advice.keep_fp32 == ("blowup", "norm")


@pytest.mark.filterwarnings("ignore:lightning_mp. opt_level='O3'")
@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_auto_on_a_cpu_that_emulates_bf16_warns_in_agreement_with_its_choice(monkeypatch, opt_level: str) -> None:
    """On a CPU without AVX512-BF16 or AMX, auto with O2/O3 picks bf16 and its one slowness warning repeats why."""
    monkeypatch.setattr(hardware, "cpu_flags", frozenset)  # a CPU whose kernel reports no bf16 flags
    plugin = MixedPrecision("auto", opt_level=opt_level)
    with pytest.warns(UserWarning, match="emulated") as caught:
        plugin.setup_for_device("cpu")
    assert plugin.half_dtype is torch.bfloat16  # O3 shows Lightning its half weights: "bf16-true"
    (slowness,) = [str(warning.message) for warning in caught if "emulated" in str(warning.message)]
    assert f"precision='auto' chose 'bf16-mixed' because {plugin.precision_reason}." in slowness
    assert "opt_level='O1'" in slowness and "would pick" not in slowness


@pytest.mark.filterwarnings("ignore:lightning_mp. opt_level='O3'")
@pytest.mark.parametrize(
    ("opt_level", "advice"),
    [
        ("O1", "Use precision='32-true' for fp32's speed here."),
        ("O2", "opt_level='O2' keeps the weights in a half type; precision='32-true' with opt_level='O1' trains"),
        ("O3", "opt_level='O3' keeps the weights in a half type"),
        ("lean", "opt_level='lean' keeps the weights in a half type"),
    ],
)
def test_explicit_bf16_on_a_cpu_that_emulates_it_gives_advice_for_what_was_asked(
    monkeypatch, opt_level: str, advice: str
) -> None:
    """precision='bf16-mixed' on a CPU without bf16 warns about its speed without talking as if 'auto' was asked."""
    monkeypatch.setattr(hardware, "cpu_flags", frozenset)  # a CPU whose kernel reports no bf16 flags
    plugin = MixedPrecision("bf16-mixed", opt_level=opt_level)
    with pytest.warns(UserWarning, match="emulated") as caught:
        plugin.setup_for_device("cpu")
    (slowness,) = [str(warning.message) for warning in caught if "emulated" in str(warning.message)]
    assert advice in slowness and "auto" not in slowness


def test_explicit_bf16_on_a_cpu_with_native_bf16_does_not_warn_about_speed(monkeypatch) -> None:
    """On a CPU with AVX512-BF16, precision='bf16-mixed' sets up without a slowness warning."""
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MixedPrecision("bf16-mixed").setup_for_device("cpu")
