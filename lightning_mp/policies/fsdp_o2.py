"""O2 under FSDP1: FSDP's fp32 shards are the masters, and FSDP itself gathers half copies of them for compute.

Standalone O2 (:mod:`lightning_mp.policies.o2`) puts half copies of the weights in place for the forward and backward
passes and steps fp32 masters. FSDP already splits a weight into what is stored and what is computed with: it keeps
fp32 shards and all-gathers them in ``param_dtype`` before a unit's forward and backward. With ``param_dtype`` the
half dtype (:attr:`lightning_mp.fsdp.FSDPMixedPrecision.mixed_precision_config`) that is O2, so this level makes no
copies of its own: it runs the forward under autocast, for the ops that must compute in fp32, and the optimizer
steps FSDP's fp32 shards with the fp32 gradients FSDP reduces.

FSDP gathers all weights of a unit in one dtype, so a ``keep_fp32`` module keeps fp32 weights only as an FSDP unit
of its own with an fp32 policy (:meth:`lightning_mp.fsdp.FSDPMixedPrecision.auto_wrap_policy` makes those units).
As in O1, the module runs outside autocast, on fp32 inputs (:mod:`lightning_mp.overrides`); :attr:`fp32_roots` lists
the outermost such modules, for the plugin to check that each became such a unit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from typing_extensions import override

from lightning_mp.overrides import Fp32Overrides
from lightning_mp.policies.base import PrecisionPolicy


class FSDPO2Policy(PrecisionPolicy):
    """O2 whose half weight copies are FSDP's gathered ``param_dtype`` parameters; autocast around the forward."""

    opt_level = "O2"
    uses_autocast = True

    def __init__(self, half_dtype: torch.dtype | None, keep_fp32: Sequence[type | str] = ()) -> None:
        super().__init__(half_dtype, keep_fp32)
        self.fp32_roots: list[nn.Module] = []
        """The outermost ``keep_fp32`` modules, each of which must be an FSDP unit with an fp32 policy."""

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Put the ``keep_fp32`` modules in fp32 regions until teardown, and remember them for FSDP's wrapping."""
        names = Fp32Overrides(self.keep_fp32).apply(module, self.hook_handles)
        self.fp32_roots = [module.get_submodule(name) for name in names]
        return module

    @override
    def teardown(self) -> None:
        """Forget the modules, and remove the hooks."""
        self.fp32_roots = []
        super().teardown()


class FSDPLeanExactPolicy(FSDPO2Policy):
    """``lean-exact`` under FSDP1: O2's form, whose fp32 shards are the exact masters (nothing to pack)."""

    opt_level = "lean-exact"
