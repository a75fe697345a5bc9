"""Every private torch and Lightning name the package relies on, with the reason, in one place.

A private name (a leading underscore, or a module path with one) is not part of torch's or Lightning's API: it may
change in any release, without a deprecation. The policy:

* Use the public API where it exists. A private name is used only where no public API does the job (a fused kernel,
  a hook Lightning calls, torch's own GradScaler bookkeeping that this package's subclass must keep consistent), or
  where the public way costs what the package promises not to spend (one op per tensor instead of one per list).
* Every private name used is one record of :data:`PRIVATE_NAMES`: the name as the source spells it, whose it is,
  the modules that use it, why, and the versions it was checked on. Module docstrings point here instead of keeping
  lists of their own, and the "Private names" table of the contributing page (``docs/contributing.md``) is built
  from this registry when the documentation is built.
* Two records are families rather than single names, because torch documents their members although it spells them
  with an underscore: the ``torch._foreach_*`` ops (torch's reference documentation lists them as "Foreach
  operations", in beta) and the ATen ops the counters recognise (members of torch's documented Core ATen IR opset,
  which torch tags ``torch.Tag.core``). A family record lists each member it covers in ``members``, and its reason
  names them.
* ``tests/test_private_names.py`` reads the package's source and fails when a private torch or Lightning name is
  used without a record here, or when a record names a module that no longer uses it; so the list cannot go stale.
* On a torch or Lightning upgrade, the test suite on CI's version matrix (:data:`CHECKED_ON`) is what checks these
  names still behave as the records say.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["CHECKED_ON", "PRIVATE_NAMES", "PrivateName"]

CHECKED_ON = "torch 2.13.0 / Lightning 2.6.6; CI's floors torch 2.8.0 / Lightning 2.6.0"
"""The versions every record was checked on: the development versions and the oldest versions CI runs."""


@dataclass(frozen=True)
class PrivateName:
    """One private torch or Lightning name the package uses.

    Attributes:
        name: the name as the source spells it, with enough of its path to find it (``torch._foreach_norm``,
            ``GradScaler._scale``).
        owner: ``"torch"`` or ``"lightning"``.
        used_in: the package's modules that use it, relative to ``lightning_mp/``.
        reason: why no public API does instead.
        checked_on: the versions it was checked on.
        members: for a family record (``torch._foreach_*``), every member the package spells, with its path.

    """

    name: str
    owner: Literal["torch", "lightning"]
    used_in: tuple[str, ...]
    reason: str
    checked_on: str = CHECKED_ON
    members: tuple[str, ...] = ()


_FOREACH_OPS = (
    "torch._foreach_norm",
    "torch._foreach_mul_",
    "torch._foreach_sub",
    "torch._foreach_sign_",
    "torch._foreach_copy_",
)
"""The ``torch._foreach_*`` ops the package uses."""
_CORE_ATEN_OPS = ("aten._local_scalar_dense", "aten._to_copy")
"""The ATen ops the op and sync counters recognise by identity."""
_GRAD_SCALER_BOOKKEEPING = (
    "LossScaler is a torch.amp.GradScaler (code that checks isinstance(scaler, GradScaler), Lightning's included,"
    " keeps working) and keeps torch's bookkeeping consistent for the methods it inherits (scale, the getters)"
)

PRIVATE_NAMES: tuple[PrivateName, ...] = (
    # torch: kernels and batched ops
    PrivateName(
        "torch._amp_foreach_non_finite_check_and_unscale_",
        "torch",
        ("scaling/kernels.py",),
        "the fused unscale-and-check kernel GradScaler itself uses; no public equivalent",
    ),
    PrivateName(
        "torch._amp_update_scale_",
        "torch",
        ("scaling/device_rules.py",),
        "torch's device-side scale rule, used when the inf flag is not on the host (fused optimizers)",
    ),
    PrivateName(
        "torch._foreach_*",
        "torch",
        (
            "scaling/gradients.py",
            "scaling/kernels.py",
            "callbacks/_sentinel_measures.py",
            "stochastic_rounding/step.py",
            "bench/counting.py",
            "policies/o2/masters.py",
            "policies/o2/split.py",
        ),
        'a family: documented in torch\'s reference as "Foreach operations" (beta), spelled with an underscore.'
        " One dispatched op for a whole list of tensors, as torch.optim's foreach implementations use them; the"
        " public alternative is one op per tensor (the weight cast counter recognises aten._foreach_copy_; the"
        " precision sentinel copies a list as x - 0.0 in one op, where allocating each copy costs one op per tensor)."
        " The ops used: " + ", ".join(_FOREACH_OPS),
        members=_FOREACH_OPS,
    ),
    # torch: GradScaler internals
    PrivateName(
        "GradScaler._growth_tracker",
        "torch",
        ("plugin/checkpoint.py", "scaler.py", "scaling/checkpoint.py"),
        _GRAD_SCALER_BOOKKEEPING + "; also the key torch's state_dict gives it, which the plugin's checkpoint entry"
        " carries for Lightning's own plugin to resume from",
    ),
    PrivateName(
        "GradScaler._device",
        "torch",
        ("settings.py",),
        "the device a GradScaler was built for (torch has no getter): a scaler= for another device than the run's is"
        " refused at setup, as torch silently disables a CUDA scaler on a CPU run",
    ),
    PrivateName(
        "GradScaler._found_inf_per_device",
        "torch",
        ("scaler.py",),
        "the getter torch's protocol hands an optimizer whose step takes grad_scaler= (it calls"
        " scaler._found_inf_per_device(optimizer)); overridden so that such an optimizer reads this scaler's flags",
    ),
    PrivateName("GradScaler._get_growth_tracker", "torch", ("scaler.py",), _GRAD_SCALER_BOOKKEEPING),
    PrivateName(
        "GradScaler._check_inf_per_device",
        "torch",
        ("scaler.py", "scaling/steps.py"),
        "overridden: torch's check without unscaling, which the fused optimizers' protocol calls",
    ),
    PrivateName(
        "Optimizer._step_supports_amp_scaling",
        "torch",
        ("_compat.py", "scaling/fused_steps.py"),
        "the protocol by which torch's fused optimizers skip a step on the device (found_inf, grad_scale)",
    ),
    # torch: tensors and modules
    PrivateName(
        "Tensor._version",
        "torch",
        ("policies/o2/masters.py", "policies/lean_exact.py"),
        "the in-place version counter autograd checks saved tensors against: O2 finds by it the half model parameters"
        " edited since they were last written (to merge the edit into their fp32 masters) and the half gradients a"
        " user changed after the unscale (which then win over their masters'); lean-exact records it for a packed"
        " weight edited between steps",
    ),
    # torch: device, compile and dispatch
    PrivateName(
        "torch._functorch.config.backward_pass_autocast",
        "torch",
        ("_compat.py", "plugin/compile.py"),
        "the only switch for how AOT autograd traces the backward under autocast; without it keep_fp32 regions lose"
        " fp32 in compiled backward passes",
    ),
    PrivateName(
        "torch.utils._python_dispatch.TorchDispatchMode",
        "torch",
        ("bench/counting.py",),
        "the only way to see every dispatched op (torch's FlopCounterMode uses it), for the op and sync counters",
    ),
    PrivateName(
        "torch.ops.aten._*",
        "torch",
        ("bench/counting.py",),
        "a family: ATen ops of torch's documented Core ATen IR opset (tagged torch.Tag.core), spelled with an"
        " underscore. The op and sync counters recognise them by identity: an op, not an API. The ops used: "
        + ", ".join(_CORE_ATEN_OPS),
        members=_CORE_ATEN_OPS,
    ),
    # Lightning
    PrivateName(
        "Precision._after_closure",
        "lightning",
        ("engine/trainer.py",),
        "the hook that runs Lightning's on_before_optimizer_step and its gradient clipping, which must come after the"
        " gradients are unscaled",
    ),
)
"""The registry, grouped by owner and kind."""
