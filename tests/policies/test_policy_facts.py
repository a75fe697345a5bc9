"""Each fact about an opt level is declared once, by its policy, and every rule that depends on it reads it there."""

from __future__ import annotations

import pytest
import torch

from lightning_mp.plugin.hardware import DeviceCapabilities, precision_for
from lightning_mp.plugin.run import policy_class_for
from lightning_mp.policies import POLICIES
from lightning_mp.policies.sharded import ShardedPrecisionError, refuse_half_weights

EMULATING_CPU = DeviceCapabilities("cpu", native_bf16=False)


@pytest.mark.parametrize("opt_level", list(POLICIES))
def test_auto_keeps_a_half_type_exactly_for_the_levels_that_compute_with_half_weights(opt_level: str) -> None:
    """On a CPU that emulates bf16, "auto" picks fp32 (which runs O0) only for a level whose forward needs no half
    weights; O2, O3 and lean would otherwise lose what they are for."""
    chosen, _ = precision_for(EMULATING_CPU, opt_level)
    assert (chosen == "bf16-mixed") is POLICIES[opt_level].computes_with_half_weights
    assert POLICIES[opt_level].computes_with_half_weights is (
        opt_level in ("O2", "O3", "lean", "lean-kahan", "lean-exact")
    )


@pytest.mark.parametrize("opt_level", list(POLICIES))
def test_a_sharded_model_refuses_exactly_the_levels_without_fp32_masters(opt_level: str) -> None:
    """FSDP2 owns the sharded weights, so the levels whose own weights are half (no masters) are refused by name;
    lean-exact's sharded form keeps FSDP2's fp32 shards as its masters and packs nothing."""
    sharded = policy_class_for(opt_level, sharded=True)
    if sharded.half_weights:
        with pytest.raises(ShardedPrecisionError, match=rf"opt_level={opt_level!r}"):
            refuse_half_weights(sharded, "bf16-mixed")
    else:
        refuse_half_weights(sharded, "bf16-mixed")
    assert sharded.opt_level == opt_level
    assert sharded.half_weights is (opt_level in ("O3", "lean", "lean-kahan"))
    assert not sharded.packs_masters
    assert POLICIES[opt_level].packs_masters is (opt_level == "lean-exact")


def test_the_levels_a_sharding_strategy_gathers_in_half_have_a_sharded_form_under_both_fsdps() -> None:
    """O2 and lean-exact keep their masters as the fp32 shards under FSDP2 and FSDP1: each has a policy there, and
    each FSDP2 policy of theirs gathers half copies."""
    from lightning_mp.fsdp import FSDP_POLICIES
    from lightning_mp.policies import SHARDED_POLICIES
    from lightning_mp.policies.sharded import HALF_GATHERING_LEVELS, fsdp2_mixed_precision_policy

    assert set(SHARDED_POLICIES) == set(FSDP_POLICIES) == set(HALF_GATHERING_LEVELS)
    for opt_level in HALF_GATHERING_LEVELS:
        assert FSDP_POLICIES[opt_level].opt_level == SHARDED_POLICIES[opt_level].opt_level == opt_level
        assert fsdp2_mixed_precision_policy(opt_level, torch.bfloat16).param_dtype == torch.bfloat16
