"""Unit tests of the scaler's ledger of counters and streaks (lightning_mp.scaling.ledger): no torch, milliseconds."""

import pickle
from dataclasses import fields

from lightning_mp.scaling.ledger import StepLedger


def test_each_optimizer_counts_its_own_streak_and_a_clean_step_ends_it():
    """A skipped step extends only its optimizer's streak; a clean one ends it; every step counts once."""
    ledger = StepLedger()
    ledger.record_iteration(stepped={0, 1}, skipped={1})
    ledger.record_iteration(stepped={0, 1}, skipped={1})
    assert ledger.streaks == {0: 0, 1: 2} and ledger.consecutive_skips == 2
    assert (ledger.optimizer_steps, ledger.skipped_steps, ledger.last_step_skipped) == (4, 2, True)
    ledger.record_iteration(stepped={0, 1}, skipped=set())
    assert ledger.consecutive_skips == 0 and ledger.last_step_skipped is False
    assert (ledger.optimizer_steps, ledger.skipped_steps) == (6, 2)


def test_an_optimizer_that_did_not_step_keeps_its_streak():
    """An iteration without an optimizer's step neither extends nor ends that optimizer's streak."""
    ledger = StepLedger()
    ledger.record_iteration(stepped={0}, skipped={0})
    ledger.record_iteration(stepped={1}, skipped=set())
    assert ledger.streaks == {0: 1, 1: 0}


def test_a_clean_step_forgets_the_culprits_remembered_for_its_streak():
    """The parameter names kept for a streak error are dropped once the optimizer steps cleanly."""
    ledger = StepLedger()
    ledger.last_culprits[0] = [("layer.weight", (2, 2))]
    ledger.record_iteration(stepped={0}, skipped=set())
    assert ledger.last_culprits == {}


def test_scale_moves_count_as_backoffs_and_growths():
    """A scale that moved down counts a backoff, up a growth, and an unmoved one neither."""
    ledger = StepLedger()
    for before, after in ((8.0, 4.0), (4.0, 4.0), (4.0, 8.0), (8.0, 16.0)):
        ledger.record_scale_move(before, after)
    assert (ledger.scale_backoffs, ledger.scale_growths) == (1, 2)


def test_streak_limit_is_reached_per_optimizer_and_near_it_two_steps_early():
    """The streak guard names each optimizer at its limit, warns two steps ahead, and is off without a limit."""
    ledger = StepLedger(streaks={0: 3, 1: 5})
    assert ledger.streaks_reaching(5) == [(1, 5)]
    assert ledger.streaks_reaching(None) == []
    assert ledger.near_streak_limit(0, 5) and not ledger.near_streak_limit(0, 6)
    assert not ledger.near_streak_limit(1, None)


def test_counters_are_declared_once_by_the_fields():
    """The checkpoint's counters are the ledger's counter fields in order, then the derived consecutive_skips."""
    counters = [f.name for f in fields(StepLedger) if f.metadata.get("counter")]
    assert StepLedger.counter_names() == (*counters, "consecutive_skips")
    assert StepLedger.counter_names() == (
        "optimizer_steps",
        "skipped_steps",
        "scale_backoffs",
        "scale_growths",
        "consecutive_skips",
    )
    ledger = StepLedger(optimizer_steps=7, skipped_steps=3, streaks={0: 0, 1: 2})
    assert ledger.counters() == {
        "optimizer_steps": 7,
        "skipped_steps": 3,
        "scale_backoffs": 0,
        "scale_growths": 0,
        "consecutive_skips": 2,
    }


def test_streak_list_has_one_entry_per_optimizer():
    """The checkpoint's streaks list every optimizer the scaler knows, 0 for one that never skipped."""
    ledger = StepLedger(streaks={0: 0, 1: 4})
    assert ledger.streak_list(optimizers=3) == [0, 4, 0]
    assert ledger.streak_list(optimizers=0) == [0, 4]  # an unpickled scaler knows no optimizer yet


def test_a_restored_ledger_round_trips_its_checkpoint_and_pickles():
    """A ledger rebuilt from its own counters and streaks counts on exactly as the original, pickled or not."""
    ledger = StepLedger()
    ledger.record_iteration(stepped={0, 1}, skipped={0})
    ledger.record_scale_move(4.0, 2.0)
    restored = StepLedger.restored(ledger.counters(), ledger.streak_list(2), ledger.last_step_skipped)
    assert restored == ledger
    assert pickle.loads(pickle.dumps(restored)) == ledger
