"""Opt levels: one policy module per level, registered by name."""

from lightning_mp.policies.base import PrecisionPolicy
from lightning_mp.policies.lean import LeanKahanPolicy, LeanPolicy
from lightning_mp.policies.lean_exact import LeanExactPolicy
from lightning_mp.policies.o0 import O0Policy
from lightning_mp.policies.o1 import O1Policy
from lightning_mp.policies.o2 import O2Policy
from lightning_mp.policies.o3 import O3Policy
from lightning_mp.policies.sharded import ShardedLeanExactPolicy, ShardedO2Policy

POLICIES: dict[str, type[PrecisionPolicy]] = {
    "O0": O0Policy,
    "O1": O1Policy,
    "O2": O2Policy,
    "O3": O3Policy,
    "lean": LeanPolicy,
    "lean-kahan": LeanKahanPolicy,
    "lean-exact": LeanExactPolicy,
}
"""The registered opt levels by name: ``MixedPrecision(opt_level=...)`` takes any key, and a policy class added here
(a :class:`PrecisionPolicy` subclass) becomes an opt level."""
SHARDED_POLICIES: dict[str, type[PrecisionPolicy]] = {"O2": ShardedO2Policy, "lean-exact": ShardedLeanExactPolicy}
"""The opt levels whose form on an FSDP2-sharded model differs (:mod:`lightning_mp.policies.sharded`)."""

__all__ = [
    "POLICIES",
    "SHARDED_POLICIES",
    "LeanExactPolicy",
    "LeanKahanPolicy",
    "LeanPolicy",
    "O0Policy",
    "O1Policy",
    "O2Policy",
    "O3Policy",
    "PrecisionPolicy",
    "ShardedLeanExactPolicy",
    "ShardedO2Policy",
]
