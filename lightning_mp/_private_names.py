"""Every private torch and Lightning name the package relies on, with the reason, in one place.

A private name (a leading underscore, or a module path with one) is not part of torch's or Lightning's API: it may
change in any release, without a deprecation. The policy:

* Use the public API where it exists. A private name is used only where no public API does the job (a fused kernel,
  a hook Lightning calls, torch's own GradScaler bookkeeping that this package's subclass must keep consistent), or
  where the public way costs what the package promises not to spend (one op per tensor instead of one per list).
* Every private name used is one record of :data:`PRIVATE_NAMES`: the name as the source spells it, whose it is,
  the modules that use it, why, and the versions it was checked on. Module docstrings point here instead of keeping
  lists of their own, and the README's "Private names" section is this table.
* ``tests/test_private_names.py`` reads the package's source and fails when a private torch or Lightning name is
  used without a record here, when a record names a module that no longer uses it, or when the README's table
  differs from this registry; so the list cannot go stale.
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

    """

    name: str
    owner: Literal["torch", "lightning"]
    used_in: tuple[str, ...]
    reason: str
    checked_on: str = CHECKED_ON


_FOREACH = (
    "one dispatched op for a whole list of tensors, the batched op behind torch.optim's foreach implementations;"
    " the public alternative is one op per tensor"
)
_GRAD_SCALER_BOOKKEEPING = (
    "LossScaler is a torch.amp.GradScaler (code that checks isinstance(scaler, GradScaler), Lightning's included,"
    " keeps working) and keeps torch's bookkeeping consistent for the methods it inherits (scale, the getters)"
)
_MEMORY_TIMELINE = "torch offers no public way to read the profiler's categorised memory timeline (the benchmark)"
_COUNTED_OP = "the aten op that the op and sync counters recognise; an op name, not an API"

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
        "torch._foreach_norm",
        "torch",
        ("_gradients.py", "scaling/kernels.py", "callbacks/precision_sentinel.py"),
        _FOREACH,
    ),
    PrivateName(
        "torch._foreach_mul_",
        "torch",
        ("callbacks/precision_sentinel.py", "scaling/kernels.py", "stochastic_rounding.py"),
        _FOREACH,
    ),
    PrivateName("torch._foreach_mul", "torch", ("callbacks/precision_sentinel.py",), _FOREACH),
    PrivateName("torch._foreach_sign", "torch", ("callbacks/precision_sentinel.py",), _FOREACH),
    PrivateName("torch._foreach_sign_", "torch", ("callbacks/precision_sentinel.py",), _FOREACH),
    PrivateName("torch._foreach_sub", "torch", ("callbacks/precision_sentinel.py",), _FOREACH),
    PrivateName("torch._foreach_copy_", "torch", ("policies/o2.py", "stochastic_rounding.py"), _FOREACH),
    PrivateName("torch._foreach_zero_", "torch", ("stochastic_rounding.py",), _FOREACH),
    PrivateName("torch._foreach_neg_", "torch", ("stochastic_rounding.py",), _FOREACH),
    PrivateName("torch._foreach_add_", "torch", ("stochastic_rounding.py",), _FOREACH),
    # torch: GradScaler internals
    PrivateName(
        "GradScaler._growth_tracker",
        "torch",
        ("plugin.py", "scaler.py", "scaling/checkpoint.py"),
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
        ("scaler.py",),
        "overridden: torch's check without unscaling, which the fused optimizers' protocol calls",
    ),
    PrivateName(
        "Optimizer._step_supports_amp_scaling",
        "torch",
        ("_compat.py", "scaling/hand_off.py"),
        "the protocol by which torch's fused optimizers skip a step on the device (found_inf, grad_scale)",
    ),
    PrivateName(
        "Optimizer._need_device_dtype_check_for_fused",
        "torch",
        ("scaling/hand_off.py",),
        "written by SGD and Adagrad during a step handed to their fused kernel; removed again afterwards",
    ),
    # torch: tensors and modules
    PrivateName(
        "Tensor._values",
        "torch",
        ("scaling/kernels.py",),
        "the stored values of a sparse gradient, which are what needs unscaling and checking, as in torch's unscale_",
    ),
    PrivateName(
        "Tensor._version",
        "torch",
        ("policies/o2.py",),
        "the in-place version counter autograd checks saved tensors against: O2 finds by it the half weights and fp32"
        " masters edited between steps, to copy each edit to the other side",
    ),
    PrivateName(
        "nn.Module._parameters",
        "torch",
        ("policies/o2.py",),
        "O2 swaps each slot between the fp32 master and its half twin at every forward; setattr would run two"
        " Python calls per slot (Module.__setattr__, register_parameter) and keep the parameter order the same",
    ),
    PrivateName(
        "nn.Module._forward_pre_hooks",
        "torch",
        ("overrides.py", "policies/casting.py", "policies/o2.py"),
        "read only: nn.Module has no public way to list hooks, needed to attach ours once and to find the legacy"
        " spectral and weight norm hooks",
    ),
    PrivateName(
        "nn.Module._forward_hooks",
        "torch",
        ("policies/casting.py",),
        "read only: nn.Module has no public way to list hooks, needed to attach ours once",
    ),
    # torch: device, compile and dispatch
    PrivateName(
        "torch._C._get_privateuse1_backend_name",
        "torch",
        ("overrides.py",),
        "the name of an out-of-tree device type, whose autocast keep_fp32 regions must switch off too",
    ),
    PrivateName(
        "torch._functorch.config.backward_pass_autocast",
        "torch",
        ("_compat.py", "_compile.py"),
        "the only switch for how AOT autograd traces the backward under autocast; without it keep_fp32 regions lose"
        " fp32 in compiled backward passes",
    ),
    PrivateName(
        "torch.utils._python_dispatch.TorchDispatchMode",
        "torch",
        ("counting.py",),
        "the only way to see every dispatched op (torch's FlopCounterMode uses it), for the op and sync counters",
    ),
    PrivateName(
        "torch.utils._foreach_utils._get_foreach_kernels_supported_devices",
        "torch",
        ("policies/lean.py",),
        "the devices where AveragedModel picks its foreach update, so lean's refusal matches torch's own choice",
    ),
    PrivateName("aten._local_scalar_dense", "torch", ("counting.py",), _COUNTED_OP),
    PrivateName("aten._to_copy", "torch", ("counting.py",), _COUNTED_OP),
    PrivateName("torch.profiler.profile._memory_profile", "torch", ("bench/memory.py",), _MEMORY_TIMELINE),
    PrivateName(
        "torch.profiler._memory_profiler.MemoryProfileTimeline", "torch", ("bench/memory.py",), _MEMORY_TIMELINE
    ),
    PrivateName("MemoryProfileTimeline._coalesce_timeline", "torch", ("bench/memory.py",), _MEMORY_TIMELINE),
    PrivateName("torch.profiler._memory_profiler.Category", "torch", ("bench/memory.py",), _MEMORY_TIMELINE),
    PrivateName("torch.profiler._memory_profiler._CATEGORY_TO_INDEX", "torch", ("bench/memory.py",), _MEMORY_TIMELINE),
    # Lightning
    PrivateName(
        "LightningModule._trainer",
        "lightning",
        ("plugin.py",),
        "read with getattr: whether a Trainer drives the run, which chooses the engine; the public trainer property"
        " raises when none is attached",
    ),
    PrivateName(
        "Precision._after_closure",
        "lightning",
        ("engine/trainer.py",),
        "the hook that runs Lightning's on_before_optimizer_step and its gradient clipping, which must come after the"
        " gradients are unscaled",
    ),
    PrivateName(
        "lightning.fabric.plugins.precision.amp._optimizer_handles_unscaling",
        "lightning",
        ("engine/trainer.py", "callbacks/gradient_health_monitor.py"),
        "Lightning's own test for optimizers that unscale inside their step (fused Adam/AdamW/SGD)",
    ),
    PrivateName(
        "WeightAveraging._average_model",
        "lightning",
        ("policies/lean.py",),
        "Lightning keeps the averaged copy only there; lean checks how it will be averaged",
    ),
    PrivateName(
        "Trainer._logger_connector",
        "lightning",
        ("callbacks/_logging.py",),
        "should_update_logs: log_every_n_steps as the Trainer applies it; Lightning's LearningRateMonitor reads it too",
    ),
    PrivateName(
        "fit_loop.epoch_loop._batches_that_stepped",
        "lightning",
        ("callbacks/_logging.py",),
        "the step self.log writes at; Lightning's DeviceStatsMonitor reads it too",
    ),
    PrivateName(
        "fit_loop.epoch_loop._should_accumulate",
        "lightning",
        ("callbacks/precision_sentinel.py",),
        "whether the current batch only accumulates gradients, to carry a sample over the micro-batches of a step",
    ),
)
"""The registry, grouped by owner and kind."""
