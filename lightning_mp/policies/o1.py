"""O1: fp32 weights, half-precision compute under ``torch.autocast``.

Autocast casts the inputs of each op to the dtype that op runs well and safely in: matrix products and convolutions
in the half type, reductions, norms, softmax and losses in fp32. The weights, their gradients and the optimizer
states stay fp32, so no master copy is needed; in fp16 the loss is scaled dynamically. This is torch's native
mixed precision, and the default level.
"""

from __future__ import annotations

from lightning_mp.policies.base import PrecisionPolicy


class O1Policy(PrecisionPolicy):
    """fp32 weights, autocast compute."""

    opt_level = "O1"
    uses_autocast = True
