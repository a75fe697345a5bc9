"""PrecisionSentinel: each silent failure warned about once, with its fix, on a model built to have it."""

from __future__ import annotations

import io
import pickle
import warnings
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins.precision import MixedPrecision as LightningMixedPrecision
from matplotlib.image import imread
from matplotlib.text import Text
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecision, PrecisionSentinel
from lightning_mp.callbacks._sentinel_rules import (
    RunFacts,
    misconfigurations,
    overflow_risk_finding,
    stale_update_finding,
    underflow_finding,
)
from lightning_mp.callbacks.precision_sentinel import HEADROOM_STYLE, STALE_STYLE, UNDERFLOW_STYLE
from lightning_mp.measuring.heatmaps import heatmap_figure
from tests.helpers import make_trainer, read_events

HEATMAP_TAGS = (
    "precision_sentinel/activation_headroom_log2",
    "precision_sentinel/grad_underflow_share",
    "precision_sentinel/stale_update_share",
)


class Regressor(pl.LightningModule):
    """Two linear layers with settings that each break one precision property.

    Args:
        lr: SGD learning rate (tiny: updates fall below half an ulp of half weights).
        loss_decay_log2: the loss is multiplied by ``2 ** -(loss_decay_log2 * step)``, so gradients shrink until fp16
            flushes them to zero.
        activation_gain: the first layer's weights are multiplied by this, so its outputs approach fp16's limit.
        inner_bf16: wrap the forward in ``torch.autocast("cpu", dtype=torch.bfloat16)`` inside the plugin's autocast.

    """

    def __init__(
        self, lr: float = 1e-2, loss_decay_log2: float = 0.0, activation_gain: float = 1.0, inner_bf16: bool = False
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(8, 16)
        self.second = nn.Linear(16, 1)
        with torch.no_grad():
            self.first.weight.mul_(activation_gain)
        self.lr = lr
        self.loss_decay_log2 = loss_decay_log2
        self.inner_bf16 = inner_bf16

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        features, target = batch
        if self.inner_bf16:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                prediction = self.second(torch.relu(self.first(features)))
        else:
            prediction = self.second(torch.relu(self.first(features)))
        loss = nn.functional.mse_loss(prediction.float(), target.float())
        return loss * 2.0 ** (-self.loss_decay_log2 * self.global_step)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(64, 8, generator=generator), torch.randn(64, 1, generator=generator))
        return DataLoader(data, batch_size=4)


def sentinel_warnings(
    tmp_path,
    model: pl.LightningModule,
    plugin: Any = None,
    max_steps: int = 4,
    callbacks: tuple[pl.Callback, ...] = (),
    **trainer_options: Any,
) -> tuple[dict[str, str], PrecisionSentinel, TensorBoardLogger]:
    """Fit with a sentinel sampling every step (before ``callbacks``); return its warnings by kind, the sentinel and
    the logger."""
    sentinel = PrecisionSentinel(every_n_steps=1, heatmap_every_n_samples=2)
    logger = TensorBoardLogger(tmp_path)
    trainer = make_trainer(
        plugin, max_steps=max_steps, logger=logger, callbacks=[sentinel, *callbacks], **trainer_options
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    found = {}
    for warning in caught:
        message = str(warning.message)
        if message.startswith("PrecisionSentinel ["):
            kind = message.split("[", 1)[1].split("]", 1)[0]
            assert kind not in found, f"{kind} was warned about twice"
            found[kind] = message
    return found, sentinel, logger


@pytest.mark.slow  # trains until the sentinel has something to say
def test_healthy_fp16_run_gets_no_warning(tmp_path):
    """A plain fp16 O1 run with a sane learning rate and scale draws no sentinel warning."""
    found, sentinel, _ = sentinel_warnings(tmp_path, Regressor(), MixedPrecision("16-mixed"))
    assert found == {}
    assert len(sentinel.samples) == 4


@pytest.mark.slow  # trains until the sentinel has something to say
def test_bf16_weights_with_a_small_learning_rate_warn_of_stale_updates(tmp_path):
    """O3 in bf16 (bf16 weights) with lr=1e-4: most updates fall below half an ulp; the warning names the layers."""
    found, sentinel, _ = sentinel_warnings(tmp_path, Regressor(lr=1e-4), MixedPrecision("bf16-mixed", opt_level="O3"))
    assert set(found) == {"stale_updates"}
    assert "first (" in found["stale_updates"] and "fp32 master weights" in found["stale_updates"]
    assert all(sample.stale["first"] > 0.5 for sample in sentinel.samples)


class PerTensorShares(pl.Callback):
    """The sentinel's per-layer shares computed the plain way, one tensor and one element comparison at a time."""

    def __init__(self) -> None:
        self.underflow: list[dict[str, float]] = []
        self.stale: list[dict[str, float]] = []
        self._before: list[tuple[str, torch.Tensor, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._before = [
            (name.rsplit(".", 1)[0], parameter.grad != 0, parameter.detach().clone())
            for name, parameter in pl_module.named_parameters()
        ]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        totals: dict[str, list[int]] = {}
        for (layer, with_gradient, before), after in zip(self._before, pl_module.parameters(), strict=True):
            total = totals.setdefault(layer, [0, 0, 0])
            total[0] += with_gradient.numel()
            total[1] += int(with_gradient.sum())
            total[2] += int((with_gradient & (after != before)).sum())
        self.underflow.append({layer: 1.0 - active / size for layer, (size, active, _) in totals.items()})
        self.stale.append({layer: (active - moved) / active for layer, (_, active, moved) in totals.items()})


@pytest.mark.slow  # trains until the sentinel has something to say
def test_stale_and_underflow_shares_match_a_per_tensor_count(tmp_path):
    """Each sample's per-layer shares are exactly those counted element by element on the same steps."""
    reference = PerTensorShares()
    _, sentinel, _ = sentinel_warnings(
        tmp_path, Regressor(lr=1e-3), MixedPrecision("bf16-mixed", opt_level="O3"), callbacks=(reference,)
    )
    assert len(sentinel.samples) == len(reference.stale) == 4
    for sample, stale, underflow in zip(sentinel.samples, reference.stale, reference.underflow, strict=True):
        assert {layer: sample.underflow[layer] for layer in underflow} == underflow
        assert sample.stale == stale
    assert any(0 < share < 1 for sample in sentinel.samples for share in sample.stale.values())
    assert any(share > 0 for sample in sentinel.samples for share in sample.underflow.values())


@pytest.mark.slow  # trains until the sentinel has something to say
def test_fp32_master_weights_keep_the_same_updates(tmp_path):
    """The same learning rate under O2 (fp32 masters) loses almost no update: no stale-update warning."""
    found, sentinel, _ = sentinel_warnings(tmp_path, Regressor(lr=1e-4), MixedPrecision("bf16-mixed", opt_level="O2"))
    assert "stale_updates" not in found
    assert all(sample.stale["first"] < 0.1 for sample in sentinel.samples)


@pytest.mark.slow  # trains until the sentinel has something to say
def test_stochastic_rounding_lowers_the_stale_update_share_the_sentinel_reports(tmp_path):
    """Same bf16 weights and learning rate: lean's stochastic rounding loses fewer updates than O3's to-nearest."""
    shares = {}
    for opt_level in ("O3", "lean"):
        _, sentinel, _ = sentinel_warnings(
            tmp_path / opt_level, Regressor(lr=1e-3), MixedPrecision("bf16-mixed", opt_level=opt_level)
        )
        shares[opt_level] = [sample.stale["first"] for sample in sentinel.samples]
    assert len(shares["lean"]) == len(shares["O3"]) == 4
    assert all(lean <= nearest for lean, nearest in zip(shares["lean"], shares["O3"], strict=True))
    assert sum(shares["lean"]) / 4 < sum(shares["O3"]) / 4 - 0.05


@pytest.mark.slow  # trains until the sentinel has something to say
def test_shrinking_gradients_at_the_scale_ceiling_warn_of_underflow(tmp_path):
    """Gradients that shrink 2**-8 per step, with the scale pinned at max_scale, flush to zero: underflow warning."""
    plugin = MixedPrecision("16-mixed", init_scale=1.0, max_scale=1.0)
    found, sentinel, _ = sentinel_warnings(tmp_path, Regressor(loss_decay_log2=8.0), plugin, max_steps=5)
    assert "underflow" in found
    assert "ceiling (1)" in found["underflow"] and "max_scale" in found["underflow"]
    shares = [sample.underflow["(all layers)"] for sample in sentinel.samples]
    assert shares[-1] > shares[0] + 0.5


@pytest.mark.slow  # trains until the sentinel has something to say
def test_underflow_is_not_blamed_while_the_scale_can_still_grow(tmp_path):
    """The same shrinking gradients with room above the scale draw no underflow warning: the scaler can react."""
    plugin = MixedPrecision("16-mixed", init_scale=1.0, max_scale=2.0**24)
    found, _, _ = sentinel_warnings(tmp_path, Regressor(loss_decay_log2=8.0), plugin, max_steps=5)
    assert "underflow" not in found


@pytest.mark.slow  # trains until the sentinel has something to say
def test_activations_near_the_fp16_limit_warn_before_they_overflow(tmp_path):
    """A layer whose outputs come within 2 doublings of 65504 warns of overflow risk, naming it."""
    found, sentinel, _ = sentinel_warnings(
        tmp_path, Regressor(activation_gain=25000.0), MixedPrecision("16-mixed"), max_steps=1
    )
    assert "overflow_risk" in found
    assert found["overflow_risk"].startswith("PrecisionSentinel [overflow_risk]: activations are close to overflowing")
    assert "first (" in found["overflow_risk"]
    assert 0 < sentinel.samples[0].headroom["first"] < 2


@pytest.mark.slow  # trains until the sentinel has something to say
def test_activations_far_from_the_fp16_limit_raise_no_overflow_risk(tmp_path):
    """The same model with outputs 2**4 below fp16's limit draws no overflow-risk warning."""
    found, sentinel, _ = sentinel_warnings(
        tmp_path, Regressor(activation_gain=4000.0), MixedPrecision("16-mixed"), max_steps=1
    )
    assert "overflow_risk" not in found
    assert sentinel.samples[0].headroom["first"] > 2


@pytest.mark.slow  # trains until the sentinel has something to say
def test_autocast_for_another_device_is_a_misconfiguration(tmp_path):
    """Lightning's plugin with device='cuda' on a CPU model runs no half precision at all: autocast_device warning."""
    plugin = LightningMixedPrecision("bf16-mixed", device="cuda")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CUDA is not available.*")
        found, _, _ = sentinel_warnings(tmp_path, Regressor(), plugin, max_steps=1)
    assert set(found) == {"autocast_device"}
    assert "'cuda'" in found["autocast_device"] and "'cpu'" in found["autocast_device"]


@pytest.mark.slow  # trains until the sentinel has something to say
def test_a_loss_scaler_over_bf16_compute_is_a_misconfiguration(tmp_path):
    """fp16 mixed precision with a dynamic scaler, but a bf16 autocast inside training_step: scaler_in_bf16."""
    found, _, _ = sentinel_warnings(tmp_path, Regressor(inner_bf16=True), MixedPrecision("16-mixed"), max_steps=1)
    assert set(found) == {"scaler_in_bf16"}
    assert "precision='bf16-mixed'" in found["scaler_in_bf16"]


@pytest.mark.slow  # trains until the sentinel has something to say
def test_fp16_without_a_loss_scaler_is_a_misconfiguration(tmp_path):
    """Trainer(precision='16-true') trains fp16 weights with nothing scaling the loss: fp16_without_scaling."""
    found, _, _ = sentinel_warnings(tmp_path, Regressor(), max_steps=1, precision="16-true")
    assert "fp16_without_scaling" in found
    assert "dynamic loss scale" in found["fp16_without_scaling"]


@pytest.mark.slow  # trains until the sentinel has something to say
def test_heatmaps_are_written_to_tensorboard_as_images(tmp_path):
    """Three per-layer heatmaps come back from the event file as images, redrawn every 2 samples and at the end."""
    _, sentinel, logger = sentinel_warnings(
        tmp_path, Regressor(lr=1e-4), MixedPrecision("bf16-mixed", opt_level="O3"), max_steps=5
    )
    accumulator = read_events(logger.log_dir)
    assert set(HEATMAP_TAGS) <= set(accumulator.Tags()["images"])
    for tag in HEATMAP_TAGS:
        images = accumulator.Images(tag)
        assert [image.step for image in images] == [1, 3, 4]
        pixels = imread(io.BytesIO(images[-1].encoded_image_string), format="png")
        assert pixels.shape[:2] == (images[-1].height, images[-1].width)
        assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 10, "the image is blank"
    assert [sample.step for sample in sentinel.samples] == [0, 1, 2, 3, 4]
    scalars = accumulator.Tags()["scalars"]
    assert "precision_sentinel/max_stale_update_share" in scalars
    assert "precision_sentinel/min_activation_headroom_log2" in scalars
    assert "precision_sentinel/total_grad_underflow_share" in scalars
    assert not set(scalars) & set(accumulator.Tags()["images"]), "TensorBoard shows one plugin per tag"


@pytest.mark.parametrize("style", [HEADROOM_STYLE, UNDERFLOW_STYLE, STALE_STYLE], ids=lambda style: style.label)
@pytest.mark.parametrize(
    ("layers", "steps"), [pytest.param(2, 3, id="small"), pytest.param(40, 100, id="large", marks=pytest.mark.slow)]
)
def test_every_part_of_a_heatmap_lies_inside_the_image(style, layers, steps):
    """The colour bar's label, the title, the layer names and the step axis are drawn whole, none cut off at an edge."""
    names = [f"model.blocks.{index}.attention.query.weight" for index in range(layers)]
    values = [[float(index % 17) / 17 for index in range(steps)] for _ in range(layers)]
    figure = heatmap_figure(style, names, list(range(steps)), values)
    renderer = figure.canvas.get_renderer()  # type: ignore[attr-defined]
    heatmap_axes, colorbar_axes = figure.axes
    parts = {
        "colour bar label": colorbar_axes.yaxis.label,
        "title": next(text for text in figure.findobj(Text) if text.get_text() == style.title),
        "step label": heatmap_axes.xaxis.label,
        **{f"layer name {label.get_text()}": label for label in heatmap_axes.get_yticklabels()[:1]},
    }
    assert colorbar_axes.yaxis.label.get_text() == style.label
    for name, part in parts.items():
        box = part.get_window_extent(renderer)
        inside = box.x0 >= 0 and box.y0 >= 0 and box.x1 <= figure.bbox.x1 and box.y1 <= figure.bbox.y1
        assert inside, f"the {name} reaches {box.bounds} beyond the image {figure.bbox.bounds}"


def test_rules_are_pure_functions_of_the_measurements():
    """Each rule fires on its failure and stays quiet on a healthy measurement."""
    assert stale_update_finding({"a": 0.3}, threshold=0.25) is not None
    assert stale_update_finding({"a": 0.2}, threshold=0.25) is None
    assert underflow_finding(0.5, 0.1, growth=0.1, scale=2.0**24, ceiling=2.0**24) is not None
    assert underflow_finding(0.15, 0.1, growth=0.1, scale=2.0**24, ceiling=2.0**24) is None
    assert overflow_risk_finding({"a": 1.0}, threshold_log2=2.0) is not None
    assert overflow_risk_finding({"a": 3.0}, threshold_log2=2.0) is None
    healthy = RunFacts("cuda", "cuda", frozenset({"float16"}), plugin_mixed=True, scaler_active=True, outputs_seen=True)
    assert misconfigurations(healthy) == []


@pytest.mark.parametrize(
    ("argument", "value", "allowed"),
    [
        ("every_n_steps", 0, "integer >= 1"),
        ("every_n_steps", True, "integer >= 1"),
        ("stale_update_share", 0.0, r"number in \(0, 1\]"),
        ("stale_update_share", "0.5", r"number in \(0, 1\]"),
        ("underflow_growth", 1.5, r"number in \(0, 1\]"),
        ("headroom_log2", -1.0, r"number in \(0, 16\]"),
        ("log_heatmaps", 1, "True or False"),
        ("heatmap_every_n_samples", 2.0, "integer >= 1"),
    ],
)
def test_every_argument_is_checked(argument, value, allowed):
    """A bad argument is rejected with its name, the value and what is allowed."""
    with pytest.raises(ValueError, match=rf"`{argument}` must be (an? )?{allowed}, got {value!r}"):
        PrecisionSentinel(**{argument: value})


@pytest.mark.slow  # trains until the sentinel has something to say
def test_sentinel_pickles_after_a_run(tmp_path):
    """After fit the sentinel pickles (ddp_spawn and checkpoints need it) and keeps its samples and warnings."""
    _, sentinel, _ = sentinel_warnings(tmp_path, Regressor(lr=1e-4), MixedPrecision("bf16-mixed", opt_level="O3"))
    restored = pickle.loads(pickle.dumps(sentinel))
    assert restored.warned == {"stale_updates"}
    assert [sample.step for sample in restored.samples] == [sample.step for sample in sentinel.samples]


@pytest.mark.slow  # trains until the sentinel has something to say
def test_accumulated_steps_are_sampled_once_with_their_optimizer_step(tmp_path):
    """With accumulate_grad_batches=2 each sampled optimizer step gives one sample, stale shares included."""
    _, sentinel, _ = sentinel_warnings(
        tmp_path,
        Regressor(lr=1e-4),
        MixedPrecision("bf16-mixed", opt_level="O3"),
        max_steps=3,
        accumulate_grad_batches=2,
    )
    assert [sample.step for sample in sentinel.samples] == [0, 1, 2]
    assert all(sample.stale and sample.headroom for sample in sentinel.samples)
