"""O2 under FSDP1: FSDP's fp32 shards are the masters, and FSDP itself gathers half copies of them for compute.

Standalone O2 (:mod:`lightning_mp.policies.o2`) puts half copies of the weights in place for the forward and backward
passes and steps fp32 masters. FSDP already splits a weight into what is stored and what is computed with: it keeps
fp32 shards and all-gathers them in ``param_dtype`` before a unit's forward and backward. With ``param_dtype`` the
half dtype (:attr:`lightning_mp.fsdp.FSDPMixedPrecision.mixed_precision_config`) that is O2, so this level makes no
copies of its own: it runs the forward under autocast, for the ops that must compute in fp32, and the optimizer
steps FSDP's fp32 shards with the fp32 gradients FSDP reduces.
"""

from __future__ import annotations

from lightning_mp.policies.base import PrecisionPolicy


class FSDPO2Policy(PrecisionPolicy):
    """O2 whose half weight copies are FSDP's gathered ``param_dtype`` parameters; autocast around the forward."""

    opt_level = "O2"
    uses_autocast = True
