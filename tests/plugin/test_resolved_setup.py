"""What a run's setup resolves once, and the claim of one run at a time: the plugin package's own rules."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from lightning_mp import MixedPrecision
from lightning_mp.plugin.claims import RunClaim
from lightning_mp.plugin.resolved import ResolvedSetup, follow_device, resolve_setup
from lightning_mp.plugin.run import policy_class_for
from lightning_mp.settings import PluginSettings


def resolve(device_type: str = "cpu", **settings: Any) -> ResolvedSetup:
    """The setup a plugin with ``settings`` resolves on ``device_type``."""
    return resolve_setup(PluginSettings(**settings), device_type, lambda level: policy_class_for(level, False))


def test_a_half_weight_level_is_shown_to_lightning_by_its_true_name_and_kept_mixed_for_the_checkpoint() -> None:
    """O3 in fp16 reads "16-true" where Lightning looks, and "16-mixed" is what the run trains in and saves."""
    setup = resolve(precision="16-mixed", opt_level="O3")
    assert (setup.precision, setup.shown_precision, setup.half_dtype) == ("16-mixed", "16-true", torch.float16)
    assert setup.opt_level == "O3" and setup.reason == "asked for"


def test_fp32_runs_the_o0_baseline_whatever_level_was_asked_for() -> None:
    """precision='32-true' with O1 casts nothing: the run's opt level is O0 and it has no half type."""
    setup = resolve(precision="32-true", opt_level="O1")
    assert (setup.opt_level, setup.half_dtype, setup.shown_precision) == ("O0", None, "32-true")


def test_a_given_device_that_fabric_contradicts_is_refused_by_name() -> None:
    """A device= that the model's device contradicts raises, naming both; a setup without one follows the model."""
    given = PluginSettings(precision="bf16-mixed", device="cpu")
    setup = resolve(precision="bf16-mixed", device="cpu")
    with pytest.raises(ValueError, match=r"device='cpu'.*runs on 'cuda'"):
        follow_device(setup, given, "cuda")
    followed = follow_device(resolve(precision="bf16-mixed"), PluginSettings(precision="bf16-mixed"), "cuda")
    assert followed.device == "cuda" and followed.precision == "bf16-mixed"


def test_plugin_precision_is_what_setup_resolved_and_the_request_again_after_a_new_run_starts() -> None:
    """plugin.precision reads the request before setup, the resolved name after it, and the request once more when a
    loaded state starts the next run."""
    plugin = MixedPrecision("16-mixed", opt_level="O3")
    assert plugin.precision == "16-mixed" and plugin.device is None
    plugin.setup_for_device("cpu")
    assert (plugin.precision, plugin.device, repr(plugin)) == (
        "16-true",
        "cpu",
        "MixedPrecision(precision='16-mixed', opt_level='O3')",
    )
    state = plugin.state_dict()
    assert state["precision"] == "16-mixed"
    plugin.teardown()
    plugin.load_state_dict(state)
    assert plugin.precision == "16-mixed" and plugin.device is None


def test_a_run_claimed_by_another_live_thread_refuses_a_second_claim_and_its_release() -> None:
    """While one thread's run holds a plugin, another thread can neither claim it nor release it."""
    claim = RunClaim()
    claimed, release_done = threading.Event(), threading.Event()

    def hold() -> None:
        claim.claim("plugin")
        claimed.set()
        release_done.wait(timeout=30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert claimed.wait(timeout=30)
        with pytest.raises(RuntimeError, match="already driving a run in another thread"):
            claim.claim("plugin")
        assert claim.release(had_run=True) is False and not claim.ended
    finally:
        release_done.set()
        holder.join()
    assert claim.claim("plugin") is False and claim.release(had_run=True) and claim.ended
