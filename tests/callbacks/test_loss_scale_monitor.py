"""LossScaleMonitor: the loss scale and the overflow counters, read back from real TensorBoard and CSV logs."""

from __future__ import annotations

import csv
import pickle
from pathlib import Path

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_mp import MixedPrecision
from lightning_mp.callbacks import LossScaleMonitor
from tests.helpers import TinyRegressor, fit, loader, make_trainer, read_events, scalars

INIT_SCALE = 2.0**8
GROWTH_INTERVAL = 4
INJECTED_STEPS = (3, 9)
MAX_STEPS = 16
LR = 0.01
BATCH_SIZE = 4
TAGS = (
    "precision/loss_scale",
    "precision/skipped_steps_total",
    "precision/skip_rate",
    "precision/scale_backoffs_total",
    "precision/scale_growths_total",
)


def fit_with_loss_scale_monitor(
    logger: TensorBoardLogger | CSVLogger | bool,
    monitor: LossScaleMonitor,
    precision: str = "16-mixed",
    inject_at: tuple[int, ...] = INJECTED_STEPS,
    log_every_n_steps: int = 1,
    max_steps: int = MAX_STEPS,
) -> Trainer:
    """A fresh :class:`TinyRegressor` (an inf at ``inject_at``) fitted on batches of :data:`BATCH_SIZE` with
    ``monitor``, ``logger`` and a MixedPrecision plugin of ``precision`` (:data:`INIT_SCALE`,
    :data:`GROWTH_INTERVAL`); the Trainer."""
    return fit(
        TinyRegressor(lr=LR, inject_at=inject_at),
        MixedPrecision(precision, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL),
        loader(batch_size=BATCH_SIZE),
        callbacks=[monitor],
        logger=logger,
        log_every_n_steps=log_every_n_steps,
        max_steps=max_steps,
    )


def read_scalars(log_dir: str | Path) -> dict[str, dict[int, float]]:
    """Every scalar tag of the run, each as {step: value}."""
    events = read_events(log_dir)
    return {tag: scalars(events, tag) for tag in events.Tags()["scalars"]}


def expected_scales() -> list[float]:
    """The scale after each step: halved on a skip, doubled after GROWTH_INTERVAL clean steps in a row."""
    scale, clean_in_a_row, scales = INIT_SCALE, 0, []
    for step in range(MAX_STEPS):
        if step in INJECTED_STEPS:
            scale, clean_in_a_row = scale / 2, 0
        else:
            clean_in_a_row += 1
            if clean_in_a_row == GROWTH_INTERVAL:
                scale, clean_in_a_row = scale * 2, 0
        scales.append(scale)
    return scales


@pytest.fixture(scope="module")
def fp16_scalars(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, float]]:
    logger = TensorBoardLogger(tmp_path_factory.mktemp("fp16"))
    fit_with_loss_scale_monitor(logger, LossScaleMonitor())
    return read_scalars(logger.log_dir)


def test_loss_scale_halves_at_each_overflow_and_doubles_after_growth_interval(fp16_scalars):
    """The logged scale halves exactly at the steps that overflowed and doubles after growth_interval clean steps."""
    logged = fp16_scalars["precision/loss_scale"]
    assert sorted(logged) == list(range(MAX_STEPS))
    assert [logged[step] for step in range(MAX_STEPS)] == expected_scales()
    for step in INJECTED_STEPS:
        assert logged[step] == logged.get(step - 1, INIT_SCALE) / 2
    assert logged[INJECTED_STEPS[0] + GROWTH_INTERVAL] == 2 * logged[INJECTED_STEPS[0]]


def test_skipped_steps_total_counts_each_injected_overflow(fp16_scalars):
    """precision/skipped_steps_total ends at the number of overflows and rises at the steps where they happened."""
    skipped = fp16_scalars["precision/skipped_steps_total"]
    assert skipped[MAX_STEPS - 1] == len(INJECTED_STEPS)
    rises = [step for step in range(1, MAX_STEPS) if skipped[step] > skipped[step - 1]]
    assert rises == list(INJECTED_STEPS)


def test_backoffs_and_growths_totals_match_the_scale_history(fp16_scalars):
    """The backoff and growth totals count every halving and doubling of the scale."""
    scales = expected_scales()
    growths = sum(1 for before, after in zip([INIT_SCALE, *scales[:-1]], scales, strict=True) if after > before)
    assert fp16_scalars["precision/scale_backoffs_total"][MAX_STEPS - 1] == len(INJECTED_STEPS)
    assert fp16_scalars["precision/scale_growths_total"][MAX_STEPS - 1] == growths


def test_skipped_step_is_logged_between_logging_intervals(tmp_path):
    """A skip between two logging steps still appears in TensorBoard at the step where it happened."""
    logger = TensorBoardLogger(tmp_path)
    fit_with_loss_scale_monitor(logger, LossScaleMonitor(), inject_at=(3,), log_every_n_steps=10, max_steps=12)
    logged = read_scalars(logger.log_dir)
    assert sorted(logged["precision/loss_scale"]) == [3, 9]
    assert logged["precision/loss_scale"][3] == INIT_SCALE / 2
    assert logged["precision/skipped_steps_total"][3] == 1
    # The first window covers steps 0-3, one of them skipped; the next covers steps 4-9, none skipped.
    assert logged["precision/skip_rate"][3] == pytest.approx(1 / 4)
    assert logged["precision/skip_rate"][9] == 0.0


def test_accumulated_batches_log_once_per_optimizer_step(tmp_path):
    """With accumulate_grad_batches=2 each optimizer step is logged once, and an overflow still halves the scale."""
    logger = TensorBoardLogger(tmp_path)
    trainer = make_trainer(
        MixedPrecision("16-mixed", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL),
        callbacks=[LossScaleMonitor()],
        logger=logger,
        log_every_n_steps=1,
        max_steps=4,
        accumulate_grad_batches=2,
    )
    trainer.fit(TinyRegressor(lr=LR, inject_at=(2,)), loader(batch_size=BATCH_SIZE))
    accumulator = read_events(logger.log_dir)
    steps = [event.step for event in accumulator.Scalars("precision/loss_scale")]
    assert steps == [0, 1, 2, 3]
    assert [event.value for event in accumulator.Scalars("precision/loss_scale")] == [INIT_SCALE] * 2 + [
        INIT_SCALE / 2
    ] * 2


def test_bf16_run_logs_a_loss_scale_of_one(tmp_path):
    """In bf16 nothing is scaled, so the logged loss scale is 1.0 and no step is skipped."""
    logger = TensorBoardLogger(tmp_path)
    fit_with_loss_scale_monitor(logger, LossScaleMonitor(), precision="bf16-mixed", inject_at=(), max_steps=4)
    logged = read_scalars(logger.log_dir)
    assert set(logged["precision/loss_scale"].values()) == {1.0}
    assert set(logged["precision/skipped_steps_total"].values()) == {0.0}


def test_csv_logger_gets_every_scalar_column(tmp_path):
    """With a CSVLogger the five scalars are columns of metrics.csv, and nothing fails."""
    logger = CSVLogger(tmp_path)
    fit_with_loss_scale_monitor(logger, LossScaleMonitor(), inject_at=(2,), max_steps=6)
    with open(Path(logger.log_dir) / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert set(TAGS) <= set(rows[0])
    assert max(float(row["precision/skipped_steps_total"]) for row in rows if row["precision/skipped_steps_total"]) == 1


def test_loss_scale_shows_on_the_progress_bar_when_asked(tmp_path):
    """LossScaleMonitor(prog_bar=True) puts the current loss scale, after the last backoff, on the progress bar."""
    trainer = fit_with_loss_scale_monitor(
        TensorBoardLogger(tmp_path), LossScaleMonitor(prog_bar=True), inject_at=(3,), max_steps=6
    )
    assert trainer.progress_bar_metrics["loss_scale"] == INIT_SCALE / 2


def test_progress_bar_is_left_alone_by_default(tmp_path):
    """Without prog_bar=True the loss scale does not crowd the progress bar."""
    trainer = fit_with_loss_scale_monitor(TensorBoardLogger(tmp_path), LossScaleMonitor(), inject_at=(), max_steps=2)
    assert "loss_scale" not in trainer.progress_bar_metrics


def test_no_logger_is_a_clear_error():
    """Without a logger the monitor refuses to start, naming itself, as LearningRateMonitor does."""
    with pytest.raises(MisconfigurationException, match="LossScaleMonitor"):
        fit_with_loss_scale_monitor(False, LossScaleMonitor(), max_steps=1)


def test_another_precision_plugin_is_a_clear_error(tmp_path):
    """Without lightning_mp's MixedPrecision there are no counters to read, and the error says what to pass."""
    trainer = make_trainer(callbacks=[LossScaleMonitor()], logger=TensorBoardLogger(tmp_path), max_steps=1)
    with pytest.raises(MisconfigurationException, match="MixedPrecision"):
        trainer.fit(TinyRegressor(), loader())


def test_prog_bar_must_be_a_bool():
    """A prog_bar that is not True or False is rejected with the value shown."""
    with pytest.raises(ValueError, match=r"`prog_bar` must be True or False, got 'yes'"):
        LossScaleMonitor(prog_bar="yes")  # type: ignore[arg-type]


def test_monitor_survives_pickling_after_a_run(tmp_path):
    """The monitor pickles before and after training, as ddp_spawn needs."""
    monitor = LossScaleMonitor(prog_bar=True)
    pickle.loads(pickle.dumps(monitor))
    fit_with_loss_scale_monitor(TensorBoardLogger(tmp_path), monitor, inject_at=(1,), max_steps=3)
    restored = pickle.loads(pickle.dumps(monitor))
    assert restored.prog_bar is True
