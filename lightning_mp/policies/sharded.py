"""The opt levels on a sharded model (FSDP2's ``fully_shard``), and the ``MixedPrecisionPolicy`` each maps to.

Under FSDP2 each parameter is a ``DTensor``: every rank stores a shard in fp32, and FSDP2 all-gathers the whole
parameter just before a module's forward (and backward), reduce-scatters its gradient after, and frees the whole
copy again. FSDP2's ``MixedPrecisionPolicy`` casts at exactly that point: ``param_dtype`` is the dtype of the
gathered copy (cast once per gather), ``reduce_dtype`` the dtype of the gradient reduction. That **is** O2 (fp32
master weights, half compute copies that exist only for the pass), built into the sharding. So the plugin does not
make copies of its own on a sharded model; each level maps onto FSDP2 as follows (:func:`fsdp2_mixed_precision_policy`
builds the policy, ``MixedPrecision.fsdp2_policy()`` calls it):

==========  ==========================================  =====================================================
opt level   the plugin                                  ``fully_shard(mp_policy=...)``
==========  ==========================================  =====================================================
O0          nothing (fp32)                              ``MixedPrecisionPolicy()``: no cast
O1          autocast, loss scaler                       ``MixedPrecisionPolicy()``: fp32 gathered, autocast
                                                        casts per op
O2          autocast, loss scaler; checks the weights   ``param_dtype=half, reduce_dtype=half``
            compute in half (:class:`ShardedO2Policy`)
lean-exact  as O2 (:class:`ShardedLeanExactPolicy`)      ``param_dtype=bfloat16, reduce_dtype=bfloat16``
O3, lean    refused (:func:`refuse_half_weights`)       --
==========  ==========================================  =====================================================

lean-exact's contract is O2's numbers with 4 bytes of weight and master per parameter, where unsharded O2 keeps 6
(a bf16 weight beside its fp32 master); it keeps each master as the bf16 weight plus a 16-bit remainder. On a sharded
model there is no second copy to fold away: FSDP2's fp32 shard is the exact master, 4 bytes per parameter stored once
across the ranks, and the bf16 weight exists only while a group is gathered. So lean-exact maps onto the same policy
as O2 and gives FSDP2's O2 results bit for bit, with nothing to pack. (FSDP2 keeps each shard's gradient in the
shard's dtype, fp32, where a packed sharded form could keep it in bf16: 2 bytes per parameter per rank, divided by
the number of ranks.)

O3 and lean keep the weights themselves in half, with no fp32 copy. FSDP2 owns the sharded weights: casting the
model after ``fully_shard`` leaves its fp32 shards as they are, so such a run would silently train fp32 weights.
They are refused at setup, naming O2 (FSDP2 keeps fp32 shards, 1/N of the weights per rank, and gathers half
copies) as the alternative.

Fabric's ``ModelParallelStrategy`` runs its ``parallelize_fn`` after ``fabric.setup`` let the plugin convert the
model, so the order is the other way round there (:func:`refuse_sharding_after_conversion`, at the first forward):
O3's half weights are what FSDP2 shards, and it trains them as O3 promises (half shards, half gradients reduced in
half, the step on the shards). FSDP2 gathers each ``fully_shard`` group in one dtype, so a group holding both O3's
half weights and the fp32 ones it keeps (norms, ``keep_fp32``) is refused by name: each fp32 module needs its own
call. lean's stochastic-rounding step works on whole tensors, not FSDP2's shards, and O2 made its unsharded copies
before the sharding: both are refused there, with the alternatives.

``keep_fp32`` under O2: give each kept subtree its own ``fully_shard`` call with
``mp_policy=plugin.fsdp2_policy(keep_fp32=True)`` (``param_dtype=float32``), before the call on its parent: FSDP2
then gathers that subtree in fp32, and the plugin's fp32 region runs it outside autocast.

:class:`ShardedO2Policy` cannot see the policy a ``fully_shard`` call was given (FSDP2 offers no public getter), so
it checks what the policy does: a one-shot forward pre-hook on every module that owns parameters reads their dtype
at the module's first forward, after FSDP2 gathered them. A module computing in the wrong dtype stops the run there
(:class:`ShardedPrecisionError`), naming the module, the dtype found and the ``fully_shard`` call that fixes it.
Nothing is read on the host but dtypes, and the hooks are gone after the first forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from typing_extensions import override

from lightning_mp.overrides import Fp32Overrides
from lightning_mp.policies.base import PrecisionPolicy
from lightning_mp.policies.o1 import O1Policy
from lightning_mp.scaling.sharded import has_sharded_parameters

HALF_GATHERING_LEVELS = ("O2", "lean-exact")
"""The opt levels whose half weights are the copies a sharding strategy gathers from its fp32 shards (FSDP2's
``param_dtype``, FSDP1's too): their fp32 shards are the masters."""

FSDP2_FIX = (
    "pass mp_policy=plugin.fsdp2_policy() to every fully_shard call in configure_model (and"
    " mp_policy=plugin.fsdp2_policy(keep_fp32=True) to a separate fully_shard call on each keep_fp32 module)"
)
"""The recipe an error about a sharded model's dtypes points to."""


class ShardedPrecisionError(ValueError):
    """A sharded model's parameters compute in a dtype its opt level does not allow; names the module and the fix."""


def refuse_half_weights(policy_class: type[PrecisionPolicy], precision: str) -> None:
    """Refuse an opt level whose policy keeps half weights without fp32 masters (O3, lean) on an FSDP2-sharded model.

    Raises:
        ShardedPrecisionError: naming the combination and the alternatives.

    """
    opt_level = policy_class.opt_level
    if policy_class.half_weights:
        raise ShardedPrecisionError(
            f"MixedPrecision(precision={precision!r}, opt_level={opt_level!r}) is not allowed on a sharded model"
            f" (FSDP2's fully_shard): {opt_level} casts the weights themselves to half, but FSDP2 owns the sharded"
            " weights and keeps them as they were sharded. Use opt_level='O2' with"
            " fully_shard(..., mp_policy=plugin.fsdp2_policy()) (fp32 shards, half compute), or opt_level='O1'."
        )


def fsdp2_mixed_precision_policy(
    opt_level: str, half_dtype: torch.dtype | None, keep_fp32: bool = False
) -> MixedPrecisionPolicy:
    """The FSDP2 ``MixedPrecisionPolicy`` that carries out ``opt_level`` in ``half_dtype`` (table in the module docs).

    Args:
        opt_level: a registered opt level; O2 and ``lean-exact`` gather half copies, the others fp32.
        half_dtype: the plugin's half type; None for fp32 training.
        keep_fp32: the policy for a ``keep_fp32`` subtree's own ``fully_shard`` call: gathered and reduced in fp32.

    Example:
        >>> fsdp2_mixed_precision_policy("O2", torch.bfloat16).param_dtype
        torch.bfloat16

    """
    if keep_fp32:
        return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    if opt_level in HALF_GATHERING_LEVELS and half_dtype is not None:
        return MixedPrecisionPolicy(param_dtype=half_dtype, reduce_dtype=half_dtype)
    return MixedPrecisionPolicy()


class ShardedO2Policy(O1Policy):
    """O2 on an FSDP2-sharded model: FSDP2 gathers the half weights, autocast runs the rest; the dtypes are checked.

    Args:
        half_dtype: ``torch.float16`` or ``torch.bfloat16``.
        keep_fp32: module types, qualified names or ``re:`` patterns whose modules stay in fp32.

    """

    opt_level = "O2"

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Put the ``keep_fp32`` modules in fp32 regions and check every module's dtype at its first forward."""
        super().convert_module(module)
        kept = Fp32Overrides(self.keep_fp32).kept_modules(module)
        names = {child: name for name, child in module.named_modules()}
        for child in module.modules():
            if next(child.parameters(recurse=False), None) is None:
                continue
            expected = torch.float32 if child in kept else self.half_dtype
            check = _FirstForwardDtypeCheck(self.opt_level, names[child] or "<root>", expected, child in kept)
            check.handle = child.register_forward_pre_hook(check)
            self.hook_handles.append(check.handle)
        return module


class ShardedLeanExactPolicy(ShardedO2Policy):
    """``lean-exact`` on an FSDP2-sharded model: O2's sharded form, whose fp32 shards are the exact masters.

    The settings already hold it to bf16. Nothing is packed: the shard is the only stored copy of each weight (module
    docstring), so the results are FSDP2's O2 results, bit for bit.
    """

    opt_level = "lean-exact"


class _FirstForwardDtypeCheck:
    """A forward pre-hook that checks a module's gathered parameters once, then removes itself."""

    def __init__(self, opt_level: str, name: str, expected: torch.dtype | None, kept: bool) -> None:
        self.opt_level = opt_level
        self.name = name
        self.expected = expected
        self.kept = kept
        self.handle: Any = None

    def __call__(self, module: nn.Module, args: Any) -> None:
        self.handle.remove()
        found = {parameter.dtype for parameter in module.parameters(recurse=False) if parameter.is_floating_point()}
        if found <= {self.expected}:
            return
        role = "a keep_fp32 module" if self.kept else "a module outside keep_fp32"
        raise ShardedPrecisionError(
            f"MixedPrecision(opt_level={self.opt_level!r}) on a sharded model: {role}, {self.name!r}"
            f" ({type(module).__name__}), computes with {sorted(map(str, found))} parameters where {self.opt_level}"
            f" needs {self.expected}. Under FSDP2, {self.opt_level}'s half weights are FSDP2's own: {FSDP2_FIX}. Or"
            " use opt_level='O1', which needs no policy."
        )


def refuse_sharding_after_conversion(policy: PrecisionPolicy, modules: list[nn.Module]) -> None:
    """Refuse a model sharded after an opt level that does not combine with sharding converted it for an unsharded run.

    Fabric's ``ModelParallelStrategy`` applies its ``parallelize_fn`` after ``fabric.setup`` let the plugin convert
    the model, so the plugin saw it unsharded. O2's unsharded half copies do not combine with FSDP2's sharding, and
    lean's stochastic-rounding step cannot step FSDP2's shards; O3's half weights are sharded as they are, as long as
    its fp32 modules have ``fully_shard`` groups of their own.

    Raises:
        ShardedPrecisionError: naming the combination and the alternatives.

    """
    if not (policy.opt_level == "O2" or policy.half_weights or policy.packs_masters):
        return
    if isinstance(policy, ShardedO2Policy) or not any(has_sharded_parameters(module) for module in modules):
        return
    if policy.packs_masters:
        raise ShardedPrecisionError(
            f"MixedPrecision(opt_level={policy.opt_level!r}) on a model sharded after fabric.setup converted it"
            " (Fabric's ModelParallelStrategy applies parallelize_fn after the plugin): its masters, packed beside"
            " whole bf16 weights, do not combine with FSDP2's shards. Shard the model before fabric.setup instead"
            " (fully_shard(..., mp_policy=plugin.fsdp2_policy()) after fabric.launch(), with"
            " ModelParallelStrategy(parallelize_fn=lambda model, mesh: model)): FSDP2's fp32 shards are then"
            f" {policy.opt_level}'s exact masters. Or use opt_level='O1'."
        )
    if policy.opt_level == "O3":
        for module in modules:
            _refuse_mixed_dtype_groups(module)
        return
    if policy.opt_level == "O2":
        raise ShardedPrecisionError(
            "MixedPrecision(opt_level='O2') on a model sharded after fabric.setup converted it (Fabric's"
            " ModelParallelStrategy applies parallelize_fn after the plugin): O2's unsharded half weights do not"
            " combine with FSDP2. Shard the model before fabric.setup instead (fully_shard(...,"
            " mp_policy=plugin.fsdp2_policy()) after fabric.launch(), with"
            " ModelParallelStrategy(parallelize_fn=lambda model, mesh: model)), or use opt_level='O1'."
        )
    raise ShardedPrecisionError(
        f"MixedPrecision(opt_level={policy.opt_level!r}) on a model sharded after fabric.setup converted it (Fabric's"
        f" ModelParallelStrategy applies parallelize_fn after the plugin): {policy.opt_level}'s stochastic-rounding"
        " step updates whole bf16 weights and cannot step FSDP2's shards. Use opt_level='O3' for bf16 weights"
        " sharded by FSDP2, or opt_level='O2' with the model sharded before fabric.setup (fully_shard(...,"
        " mp_policy=plugin.fsdp2_policy()) after fabric.launch(), with"
        " ModelParallelStrategy(parallelize_fn=lambda model, mesh: model))."
    )


def _refuse_mixed_dtype_groups(model: nn.Module) -> None:
    """Refuse an O3 model one of whose ``fully_shard`` groups holds both half and fp32 weights (FSDP2 cannot gather it).

    O3 keeps normalisation layers and ``keep_fp32`` modules in fp32; FSDP2 gathers each group in one dtype, so each
    of them needs a ``fully_shard`` call of its own. Torch would stop at the group's first gather with an assertion
    that names neither the group nor the fix.

    Raises:
        ShardedPrecisionError: naming the group, its fp32 modules and the fix.

    """
    names = {module: name for name, module in model.named_modules()}
    for group in (module for module in model.modules() if isinstance(module, FSDPModule)):
        owners = {
            module: {weight.dtype for weight in module.parameters(recurse=False)} for module in _group_modules(group)
        }
        if len(set().union(*owners.values())) < 2:
            continue
        fp32 = [names[module] or "<root>" for module, dtypes in owners.items() if torch.float32 in dtypes]
        raise ShardedPrecisionError(
            f"MixedPrecision(opt_level='O3') on a model sharded after fabric.setup converted it: the fully_shard group"
            f" {names[group] or '<root>'!r} holds half weights and the fp32 weights of {fp32} (O3 keeps normalisation"
            " layers and keep_fp32 modules in fp32), and FSDP2 gathers a group in one dtype. In parallelize_fn, give"
            " each of them its own fully_shard(module, mp_policy=plugin.fsdp2_policy(keep_fp32=True)) before the"
            " call on its parent, or use opt_level='O2' with the model sharded before fabric.setup."
        )


def _group_modules(group: nn.Module) -> list[nn.Module]:
    """The modules whose own parameters a ``fully_shard`` group manages: its subtree, less nested groups."""
    members = [group]
    for child in group.children():
        if not isinstance(child, FSDPModule):
            members.extend(_group_modules(child))
    return members
