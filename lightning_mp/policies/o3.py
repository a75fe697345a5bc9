"""O3: pure half precision. Every weight, norms included, is fp16 or bf16; no master weights, no autocast.

The one exception is batch normalisation (BatchNorm, SyncBatchNorm): its running mean and variance are averages
accumulated over the whole run, which half precision rounds away, so batch norms stay fp32, as with Apex's
``keep_batchnorm_fp32``.

O3 is a speed and memory baseline, as in Apex: the optimizer steps the half weights directly and keeps its states
in the half type, so small updates can round away and training may stall or diverge. The policy warns about it.
Only ``keep_fp32`` subtrees stay fp32, running in fp32 regions (:mod:`lightning_mp.overrides`).

The module is converted as in O2 (:func:`~lightning_mp.policies.o2.convert_to_half`) except that normalisation
layers are cast too: modules with half weights cast their floating inputs to the half type, and the root returns
fp32 outputs so that the loss is computed in fp32.

fp16 gradients are unscaled and checked in place, so the loss scaler accepts them (``allow_fp16_gradients``). Loss
scaling is off unless asked for with a static ``MixedPrecision(loss_scale=...)``; non-finite steps are still
skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_mp.overrides import Fp32Overrides
from lightning_mp.policies.base import PrecisionPolicy
from lightning_mp.policies.o2 import check_half_dtype, convert_to_half


class O3Policy(PrecisionPolicy):
    """Half weights everywhere except ``keep_fp32``; no masters; a baseline that may not converge.

    Args:
        half_dtype: ``torch.float16`` or ``torch.bfloat16``.
        keep_fp32: module types, qualified names or ``re:`` patterns whose modules stay fp32.

    Raises:
        ValueError: if ``half_dtype`` is not a half type, or a ``keep_fp32`` entry is invalid.

    """

    opt_level = "O3"
    uses_autocast = False
    scales_by_default = False
    half_gradients: ClassVar[bool] = True
    """The optimizer steps half gradients, which the loss scaler must accept."""

    def __init__(self, half_dtype: torch.dtype | None, keep_fp32: Sequence[type | str] = ()) -> None:
        super().__init__(check_half_dtype(type(self).__name__, half_dtype), keep_fp32)
        self.overrides = Fp32Overrides(self.keep_fp32)
        rank_zero_warn(
            f"lightning_mp: opt_level='O3' trains pure {self.half_dtype} weights without fp32 master weights. It is a"
            " speed baseline and may not converge; use opt_level='O2' or 'O1' for real training."
        )

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Cast every weight and floating buffer outside ``keep_fp32`` and batch norms to the half type, in place."""
        assert self.half_dtype is not None
        convert_to_half(
            module,
            self.half_dtype,
            self.overrides,
            keep_normalization_fp32=False,
            keep_batch_normalization_fp32=True,
        )
        return module


__all__ = ["O3Policy"]
