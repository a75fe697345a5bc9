"""O1: fp32 weights, half-precision compute under ``torch.autocast``.

Autocast casts the inputs of each op to the dtype that op runs well and safely in: matrix products and convolutions
in the half type, reductions, norms, softmax and losses in fp32. The weights, their gradients and the optimizer
states stay fp32, so no master copy is needed; in fp16 the loss is scaled dynamically. This is torch's native
mixed precision, and the default level.

Modules matched by ``keep_fp32`` run outside autocast, on fp32 inputs, and return fp32
(:mod:`lightning_mp.overrides`); their hooks are removed at teardown.
"""

from __future__ import annotations

from torch import nn
from typing_extensions import override

from lightning_mp.overrides import Fp32Overrides
from lightning_mp.policies.base import PrecisionPolicy


class O1Policy(PrecisionPolicy):
    """fp32 weights, autocast compute."""

    opt_level = "O1"
    uses_autocast = True

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Put the ``keep_fp32`` modules in fp32 regions until teardown; the weights stay as they are."""
        Fp32Overrides(self.keep_fp32).apply(module, self.hook_handles)
        return module
