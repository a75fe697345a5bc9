"""GradientHealthMonitor: true gradient norm, underflow share, fp16 headroom and overflow forensics."""

from __future__ import annotations

import csv
import math
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from tensorboard.backend.event_processing import event_accumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecision
from lightning_mp.callbacks import GradientHealthMonitor
from tests.helpers import fit, read_events, scalars, texts

INIT_SCALE = 2.0**8


class SilentLayerNetwork(LightningModule):
    """A small tanh network plus a layer whose output is multiplied by zero, so its gradients are exactly zero.

    Not :class:`tests.helpers.TinyRegressor`: tanh (unlike ReLU) leaves no other gradient exactly zero, so the zero
    fraction is known in advance, and the inf goes into ``head.weight``, the name the overflow entries must show.
    """

    def __init__(self, inject_at: tuple[int, ...] = ()) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.hidden = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)
        self.silent = nn.Linear(8, 1)
        self.inject_at = inject_at

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        features, target = batch
        prediction = self.head(torch.tanh(self.hidden(features))) + 0.0 * self.silent(features)
        return nn.functional.mse_loss(prediction, target)

    def on_after_backward(self) -> None:
        if self.global_step in self.inject_at:
            self.head.weight.grad[0, 0] = float("inf")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(64, 8, generator=generator), torch.randn(64, 1, generator=generator))
        return DataLoader(data, batch_size=4)


def fit_with_gradient_health_monitor(
    logger: TensorBoardLogger | CSVLogger | bool,
    monitor: GradientHealthMonitor,
    precision: str = "16-mixed",
    inject_at: tuple[int, ...] = (),
    log_every_n_steps: int = 1,
    max_steps: int = 4,
    init_scale: float = INIT_SCALE,
    opt_level: str = "O1",
) -> Trainer:
    """A fresh :class:`SilentLayerNetwork` (an inf at ``inject_at``) fitted with ``monitor``, ``logger`` and a
    MixedPrecision plugin of ``precision``, ``opt_level`` and ``init_scale``; the Trainer."""
    return fit(
        SilentLayerNetwork(inject_at),
        MixedPrecision(precision, opt_level=opt_level, init_scale=init_scale),
        callbacks=[monitor],
        logger=logger,
        log_every_n_steps=log_every_n_steps,
        max_steps=max_steps,
    )


def test_overflow_entry_names_the_parameter_that_overflowed(tmp_path):
    """Each skipped step gets a precision/overflow text entry naming the injected parameter, its shape and step."""
    logger = TensorBoardLogger(tmp_path)
    with pytest.warns(RuntimeWarning, match="head.weight"):
        fit_with_gradient_health_monitor(
            logger, GradientHealthMonitor(), inject_at=(2, 5), log_every_n_steps=10, max_steps=7
        )
    entries = texts(read_events(logger.log_dir), "precision/overflow")
    assert sorted(entries) == [2, 5]
    for step, text in entries.items():
        assert f"Step {step}" in text
        assert "`head.weight` | [1, 16]" in text
        assert "hidden.weight" not in text


def test_overflow_under_o2_names_the_model_parameter_behind_the_fp32_master(tmp_path):
    """Under O2 the gradients live on fp32 masters at the skip; the entry still names the model's parameter."""
    logger = TensorBoardLogger(tmp_path)
    with pytest.warns(RuntimeWarning, match="head.weight"):
        fit_with_gradient_health_monitor(logger, GradientHealthMonitor(), inject_at=(1,), max_steps=2, opt_level="O2")
    assert "`head.weight` | [1, 16]" in texts(read_events(logger.log_dir), "precision/overflow")[1]


def test_warning_comes_once_per_n_skips(tmp_path):
    """With warn_every_n_skips=2, five skips give warnings at the first, third and fifth skip only."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_with_gradient_health_monitor(
            TensorBoardLogger(tmp_path),
            GradientHealthMonitor(warn_every_n_skips=2),
            inject_at=(1, 3, 5, 7, 9),
            log_every_n_steps=50,
            max_steps=11,
        )
    messages = [str(w.message) for w in caught if "were not finite" in str(w.message)]
    assert [message.split(":")[0] for message in messages] == ["Step 1", "Step 5", "Step 9"]
    assert all("head.weight [1, 16]" in message for message in messages)


def test_grad_norm_is_the_true_unscaled_norm(tmp_path):
    """The fp16 grad norm matches an fp32 run's, not the norm of gradients multiplied by the loss scale."""
    half_logger, full_logger = TensorBoardLogger(tmp_path, name="fp16"), TensorBoardLogger(tmp_path, name="fp32")
    fit_with_gradient_health_monitor(half_logger, GradientHealthMonitor(), max_steps=1)
    fit_with_gradient_health_monitor(full_logger, GradientHealthMonitor(), precision="32-true", max_steps=1)
    half_norm = scalars(read_events(half_logger.log_dir), "precision/grad_norm")[0]
    full_norm = scalars(read_events(full_logger.log_dir), "precision/grad_norm")[0]
    assert half_norm == pytest.approx(full_norm, rel=2e-2)


def test_zero_fraction_counts_gradients_that_are_exactly_zero(tmp_path):
    """A layer whose gradients are all exactly zero shows up as its share of all gradient elements."""
    logger = TensorBoardLogger(tmp_path)
    fit_with_gradient_health_monitor(logger, GradientHealthMonitor(), max_steps=2)
    model = SilentLayerNetwork()
    silent_elements = sum(p.numel() for p in model.silent.parameters())
    all_elements = sum(p.numel() for p in model.parameters())
    logged = scalars(read_events(logger.log_dir), "precision/grad_zero_fraction")
    assert logged == {step: pytest.approx(silent_elements / all_elements) for step in (0, 1)}


@pytest.fixture(scope="module")
def low_and_high_scale_runs(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[event_accumulator.EventAccumulator, event_accumulator.EventAccumulator]:
    """One step at loss scale 2**4 and one at 2**8, same model, same data."""
    root = tmp_path_factory.mktemp("scales")
    low_logger, high_logger = TensorBoardLogger(root, name="low"), TensorBoardLogger(root, name="high")
    fit_with_gradient_health_monitor(low_logger, GradientHealthMonitor(), max_steps=1, init_scale=2.0**4)
    fit_with_gradient_health_monitor(high_logger, GradientHealthMonitor(), max_steps=1, init_scale=2.0**8)
    return read_events(low_logger.log_dir), read_events(high_logger.log_dir)


def test_each_doubling_of_the_loss_scale_costs_one_bit_of_headroom(low_and_high_scale_runs):
    """Starting at 16 times the scale leaves 4 fewer doublings before the largest gradient overflows fp16."""
    low, high = (scalars(run, "precision/grad_headroom_log2")[0] for run in low_and_high_scale_runs)
    assert low - high == pytest.approx(4.0, abs=0.01)
    assert 0 < high < math.log2(torch.finfo(torch.float16).max)


def test_magnitude_histogram_shifts_right_with_the_loss_scale(low_and_high_scale_runs):
    """The log2-magnitude histogram counts every non-zero gradient element and moves 4 bins right at 16x scale."""
    low, high = (run.Histograms("precision/grad_log2_magnitude")[0].histogram_value for run in low_and_high_scale_runs)
    model = SilentLayerNetwork()
    nonzero_elements = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in model.silent.parameters())
    assert low.num == high.num == nonzero_elements
    assert sum(high.bucket) == nonzero_elements
    assert high.sum / high.num - low.sum / low.num == pytest.approx(4.0, abs=0.01)
    assert high.max - low.max == pytest.approx(4.0, abs=0.01)


def test_headroom_is_fp16_only(tmp_path):
    """bf16 has no loss scale and fp32's range, so it logs the norm but no fp16 headroom."""
    logger = TensorBoardLogger(tmp_path)
    fit_with_gradient_health_monitor(logger, GradientHealthMonitor(), precision="bf16-mixed", max_steps=2)
    accumulator = read_events(logger.log_dir)
    assert sorted(scalars(accumulator, "precision/grad_norm")) == [0, 1]
    assert "precision/grad_headroom_log2" not in accumulator.Tags()["scalars"]
    assert sorted(event.step for event in accumulator.Histograms("precision/grad_log2_magnitude")) == [0, 1]


def test_histogram_can_be_turned_off(tmp_path):
    """GradientHealthMonitor(log_histogram=False) writes the scalars but no histogram."""
    logger = TensorBoardLogger(tmp_path)
    fit_with_gradient_health_monitor(logger, GradientHealthMonitor(log_histogram=False), max_steps=1)
    accumulator = read_events(logger.log_dir)
    assert "precision/grad_norm" in accumulator.Tags()["scalars"]
    assert accumulator.Tags()["histograms"] == []


def test_scalars_are_logged_on_logging_steps_only(tmp_path):
    """With log_every_n_steps=4 the gradient statistics appear at steps 3 and 7 and nowhere else."""
    logger = TensorBoardLogger(tmp_path)
    fit_with_gradient_health_monitor(logger, GradientHealthMonitor(), log_every_n_steps=4, max_steps=8)
    accumulator = read_events(logger.log_dir)
    for tag in ("precision/grad_norm", "precision/grad_zero_fraction", "precision/grad_headroom_log2"):
        assert sorted(scalars(accumulator, tag)) == [3, 7]


def test_a_nonfinite_step_leaves_no_inf_in_the_charts(tmp_path):
    """On a step whose gradients overflowed, the charts skip the point instead of plotting inf."""
    logger = TensorBoardLogger(tmp_path)
    with pytest.warns(RuntimeWarning, match="not finite"):
        fit_with_gradient_health_monitor(logger, GradientHealthMonitor(), inject_at=(2,), max_steps=4)
    logged = scalars(read_events(logger.log_dir), "precision/grad_norm")
    assert sorted(logged) == [0, 1, 3]
    assert all(math.isfinite(value) for value in logged.values())


def test_csv_logger_gets_the_scalars_and_the_overflow_text_is_skipped(tmp_path):
    """A CSVLogger run records the gradient scalars, and an overflow (text only TensorBoard shows) does not fail."""
    logger = CSVLogger(tmp_path)
    with pytest.warns(RuntimeWarning, match="head.weight"):
        fit_with_gradient_health_monitor(logger, GradientHealthMonitor(), inject_at=(1,), max_steps=3)
    with open(Path(logger.log_dir) / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert {"precision/grad_norm", "precision/grad_zero_fraction", "precision/grad_headroom_log2"} <= set(rows[0])


def test_no_logger_is_a_clear_error():
    """Without a logger the monitor refuses to start, naming itself."""
    with pytest.raises(MisconfigurationException, match="GradientHealthMonitor"):
        fit_with_gradient_health_monitor(False, GradientHealthMonitor(), max_steps=1)


@pytest.mark.parametrize("value", [0, -3, 1.5, True, "10"])
def test_bad_warning_interval_is_rejected(value):
    """warn_every_n_skips must be a positive integer, and the error names the argument and the value."""
    with pytest.raises(ValueError, match=r"`warn_every_n_skips` must be an integer >= 1, got "):
        GradientHealthMonitor(warn_every_n_skips=value)


def test_log_histogram_must_be_a_bool():
    """A log_histogram that is not True or False is rejected with the value shown."""
    with pytest.raises(ValueError, match=r"`log_histogram` must be True or False, got 1"):
        GradientHealthMonitor(log_histogram=1)  # type: ignore[arg-type]


def test_monitor_survives_pickling_after_a_run(tmp_path):
    """The monitor pickles before and after training, as ddp_spawn needs."""
    monitor = GradientHealthMonitor(warn_every_n_skips=3)
    pickle.loads(pickle.dumps(monitor))
    fit_with_gradient_health_monitor(TensorBoardLogger(tmp_path), monitor, max_steps=2)
    assert pickle.loads(pickle.dumps(monitor)).warn_every_n_skips == 3
