"""Unit tests of the scaler's checkpoint validation (lightning_mp.scaling.checkpoint): plain dicts, milliseconds."""

import math

import pytest

from lightning_mp.scaling.checkpoint import validated_state
from lightning_mp.scaling.counters import StepCounters
from lightning_mp.scaling.rules import ScalerSettings, ScaleState

SETTINGS = ScalerSettings(init_scale=2.0**10, growth_interval=10, hysteresis=2, max_consecutive_skips=5)
TORCH_KEYS = {"scale": 256.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 10, "_growth_tracker": 3}


def test_torchs_five_keys_restore_the_scale_and_start_the_counters_from_zero():
    """A torch GradScaler's state dict restores the scale and tracker; the counters start from zero."""
    loaded = validated_state(dict(TORCH_KEYS), SETTINGS)
    assert loaded.scale_state == ScaleState(256.0, 3, 2)
    assert loaded.counters == StepCounters()


def test_counters_and_streaks_restore_as_saved():
    """Saved counters, per-optimizer streaks and last_step_skipped come back as they were saved."""
    counters = {"optimizer_steps": 9, "skipped_steps": 4, "scale_backoffs": 2, "scale_growths": 1}
    saved = {
        **TORCH_KEYS,
        "counters": {**counters, "consecutive_skips": 2},
        "streaks": [2, 0],
        "last_step_skipped": True,
    }
    restored = validated_state(saved, SETTINGS).counters
    assert restored.counters() == {**counters, "consecutive_skips": 2}
    assert restored.streaks == {0: 2, 1: 0} and restored.last_step_skipped is True


def test_a_dict_without_streaks_gives_the_first_optimizer_the_saved_streak():
    """An older checkpoint with only consecutive_skips resumes that streak on the first optimizer."""
    saved = {**TORCH_KEYS, "counters": {"optimizer_steps": 5, "skipped_steps": 3, "consecutive_skips": 3}}
    assert validated_state(saved, SETTINGS).counters.streaks == {0: 3}


def test_static_and_check_modes_keep_their_own_scale():
    """Only dynamic mode restores a scale; a static or check scaler keeps its own."""
    for mode in ("static", "check"):
        settings = ScalerSettings(init_scale=8.0, mode=mode)
        assert validated_state({"scale": math.nan}, settings).scale_state is None


def test_out_of_range_values_are_clamped_with_a_warning_naming_the_key():
    """A scale above max_scale, trackers beyond this run's settings and long streaks are clamped, each warned about."""
    saved = {**TORCH_KEYS, "scale": 2.0**30, "_growth_tracker": 50, "hysteresis_tracker": 7, "streaks": [9]}
    saved["counters"] = {"optimizer_steps": 9, "skipped_steps": 9, "consecutive_skips": 9}
    with pytest.warns(UserWarning) as caught:
        loaded = validated_state(saved, SETTINGS)
    messages = " ".join(str(w.message) for w in caught)
    for key in ("'scale'", "'_growth_tracker'", "'hysteresis_tracker'", "max_consecutive_skips=5"):
        assert key in messages
    assert loaded.scale_state == ScaleState(SETTINGS.max_scale, 9, 2)
    assert loaded.counters.streaks == {0: 4}


def test_changed_settings_are_warned_about_and_this_runs_win():
    """A checkpoint written with other settings loads under this run's settings, with a warning naming both values."""
    with pytest.warns(UserWarning, match=r"growth_interval: 100 -> 10"):
        loaded = validated_state({**TORCH_KEYS, "growth_interval": 100}, SETTINGS)
    assert loaded.scale_state == ScaleState(256.0, 3, 2)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"scale": 0.0}, "'scale'"),
        ({"scale": -1.0}, "'scale'"),
        ({"scale": math.inf}, "'scale'"),
        ({"scale": "big"}, "'scale'"),
        ({"_growth_tracker": -1}, "'_growth_tracker'"),
        ({"hysteresis_tracker": 1.5}, "'hysteresis_tracker'"),
        ({"counters": [1, 2]}, "'counters'"),
        ({"counters": {"skipped_steps": -2}}, "counters['skipped_steps']"),
        ({"counters": {"optimizer_steps": 1, "skipped_steps": 2}}, "inconsistent"),
        ({"streaks": 3}, "'streaks'"),
        ({"streaks": [1, "x"]}, "'streaks[1]'"),
        ({"last_step_skipped": 1}, "'last_step_skipped'"),
    ],
)
def test_a_damaged_field_is_refused_with_its_name(change, field):
    """A malformed field raises a ValueError naming the field and its value."""
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        validated_state({**TORCH_KEYS, **change}, SETTINGS)


def test_a_missing_scale_an_empty_dict_and_a_non_dict_are_refused():
    """No scale, no entries at all, or no dict: each is refused with a message saying what is missing."""
    with pytest.raises(ValueError, match="no key 'scale'"):
        validated_state({"counters": {}}, SETTINGS)
    with pytest.raises(RuntimeError, match="empty"):
        validated_state({}, SETTINGS)
    with pytest.raises(ValueError, match="expected a dict"):
        validated_state([("scale", 1.0)], SETTINGS)
