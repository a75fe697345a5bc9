"""O0: the fp32 baseline. No autocast and no loss scaling; non-finite steps are still skipped.

It exists so that every comparison (speed, memory, accuracy) has a reference run with the same plugin, the same
telemetry and the same guarantee that a NaN never reaches the weights.
"""

from __future__ import annotations

from lightning_mp.policies.base import PrecisionPolicy


class O0Policy(PrecisionPolicy):
    """fp32 weights, fp32 compute."""

    opt_level = "O0"
    uses_autocast = False
