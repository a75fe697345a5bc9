"""Unit tests of the scaler's step counters and streaks (lightning_mp.scaling.counters): no torch, milliseconds."""

import pickle
from dataclasses import fields

from lightning_mp.scaling.counters import StepCounters


def test_each_optimizer_counts_its_own_streak_and_a_clean_step_ends_it():
    """A skipped step extends only its optimizer's streak; a clean one ends it; every step counts once."""
    counters = StepCounters()
    counters.record_iteration(stepped={0, 1}, skipped={1})
    counters.record_iteration(stepped={0, 1}, skipped={1})
    assert counters.streaks == {0: 0, 1: 2} and counters.consecutive_skips == 2
    assert (counters.optimizer_steps, counters.skipped_steps, counters.last_step_skipped) == (4, 2, True)
    counters.record_iteration(stepped={0, 1}, skipped=set())
    assert counters.consecutive_skips == 0 and counters.last_step_skipped is False
    assert (counters.optimizer_steps, counters.skipped_steps) == (6, 2)


def test_an_optimizer_that_did_not_step_keeps_its_streak():
    """An iteration without an optimizer's step neither extends nor ends that optimizer's streak."""
    counters = StepCounters()
    counters.record_iteration(stepped={0}, skipped={0})
    counters.record_iteration(stepped={1}, skipped=set())
    assert counters.streaks == {0: 1, 1: 0}


def test_a_clean_step_forgets_the_nonfinite_parameters_remembered_for_its_streak():
    """The parameter names kept for a streak error are dropped once the optimizer steps cleanly."""
    counters = StepCounters()
    counters.last_nonfinite[0] = [("layer.weight", (2, 2))]
    counters.record_iteration(stepped={0}, skipped=set())
    assert counters.last_nonfinite == {}


def test_scale_moves_count_as_backoffs_and_growths():
    """A scale that moved down counts a backoff, up a growth, and an unmoved one neither."""
    counters = StepCounters()
    for before, after in ((8.0, 4.0), (4.0, 4.0), (4.0, 8.0), (8.0, 16.0)):
        counters.record_scale_move(before, after)
    assert (counters.scale_backoffs, counters.scale_growths) == (1, 2)


def test_streak_limit_is_reached_per_optimizer_and_near_it_two_steps_early():
    """The streak guard names each optimizer at its limit, warns two steps ahead, and is off without a limit."""
    counters = StepCounters(streaks={0: 3, 1: 5})
    assert counters.streaks_reaching(5) == [(1, 5)]
    assert counters.streaks_reaching(None) == []
    assert counters.near_streak_limit(0, 5) and not counters.near_streak_limit(0, 6)
    assert not counters.near_streak_limit(1, None)


def test_counters_are_declared_once_by_the_fields():
    """The checkpoint's counters are the counters's counter fields in order, then the derived consecutive_skips."""
    counters = [f.name for f in fields(StepCounters) if f.metadata.get("counter")]
    assert StepCounters.counter_names() == (*counters, "consecutive_skips")
    assert StepCounters.counter_names() == (
        "optimizer_steps",
        "skipped_steps",
        "scale_backoffs",
        "scale_growths",
        "consecutive_skips",
    )
    counters = StepCounters(optimizer_steps=7, skipped_steps=3, streaks={0: 0, 1: 2})
    assert counters.counters() == {
        "optimizer_steps": 7,
        "skipped_steps": 3,
        "scale_backoffs": 0,
        "scale_growths": 0,
        "consecutive_skips": 2,
    }


def test_streak_list_has_one_entry_per_optimizer():
    """The checkpoint's streaks list every optimizer the scaler knows, 0 for one that never skipped."""
    counters = StepCounters(streaks={0: 0, 1: 4})
    assert counters.streak_list(optimizers=3) == [0, 4, 0]
    assert counters.streak_list(optimizers=0) == [0, 4]  # an unpickled scaler knows no optimizer yet


def test_a_restored_ledger_round_trips_its_checkpoint_and_pickles():
    """A counters rebuilt from its own counters and streaks counts on exactly as the original, pickled or not."""
    counters = StepCounters()
    counters.record_iteration(stepped={0, 1}, skipped={0})
    counters.record_scale_move(4.0, 2.0)
    restored = StepCounters.restored(counters.counters(), counters.streak_list(2), counters.last_step_skipped)
    assert restored == counters
    assert pickle.loads(pickle.dumps(restored)) == counters
