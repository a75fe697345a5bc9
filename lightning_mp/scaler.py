"""Dynamic loss scaling with hysteresis, bounds, a static and a check-only mode, and per-optimizer skip counters.

Why scale at all: fp16 keeps 5 exponent bits, so gradients smaller than 2**-24 flush to zero and the model stops
learning from them. Multiplying the loss by a large factor ``S`` before ``backward`` shifts every gradient up by
``S`` into fp16's range; dividing the fp32 gradients by ``S`` before the optimizer step undoes it exactly.

One iteration (any number of optimizers, torch's contract: ``update()`` once, after the last ``step``):

* ``unscale_`` (explicit, or implicit in ``step``) runs one fused kernel per device and dtype over the optimizer's
  gradients: in fp16 it multiplies them by the preallocated ``1/S`` and sets that optimizer's preallocated inf flag;
  in bf16 and fp32 ("check" mode, nothing scaled) it takes the inf-norm of each gradient and checks the norms, so the
  gradients are read and never rewritten. bf16 gradients' norms come out in float32: CUDA's check kernel refuses
  bf16 (:data:`UNSCALE_KERNEL_DTYPES`); scaled bf16 gradients are multiplied, then checked, for the same reason.
  Under DDP the flag is all-reduced (max) right there, on every path, so
  every rank takes the same decision: one collective per step, always issued in the same order, no deadlock.
* ``step`` of a fused optimizer (Adam, AdamW, SGD, Adagrad with ``fused=True``, or any optimizer that declares
  ``_step_supports_amp_scaling``) follows torch's ``GradScaler.step``: the optimizer gets the flag as ``found_inf``
  and, when nothing unscaled its gradients yet, the scale as ``grad_scale`` (times a ``grad_scale`` the user set),
  and skips the update on the device; one whose ``step`` takes ``grad_scaler=`` gets the scaler instead.
* In check mode (bf16, fp32), Adam, AdamW, SGD and Adagrad in their foreach or single-tensor form are **handed to
  torch's fused kernel of the same update rule**: for that one step their param groups read ``fused=True``, they get
  the flag as ``found_inf``, and the kernel skips on the device (:func:`_has_fused_form`). No host sync, where
  reading the flag cost one per step: on a GPU the host keeps queueing kernels while backward runs, which is what
  makes Lightning's unchecked ``bf16-mixed`` fast. The user's optimizer object, its ``param_groups`` (restored after
  the step), its state layout and its checkpoints stay those of the form the user chose; two things differ. The
  trajectory is the fused kernel's: the same rule evaluated in another order, so single roundings differ (within a
  few float32 roundings of the weights, tested). And ``state["step"]``, which the foreach and single-tensor forms
  keep on the CPU, moves once to the parameter's device as the fused kernel needs it; torch loads a checkpoint's
  step count onto either device for every form, so checkpoints resume both ways. The flag stays allocated
  between iterations (one float32 per optimizer and device, as for fused optimizers). Two alternatives were measured on
  the CPU (``lightning_mp.counting``, foreach AdamW on a 30-tensor LM): the hand-off adds 0 syncs and runs the
  update in 5 ops against foreach's 11; a device-side select of the old or the new weights and states would cost
  253 ops and 2x the state's memory, and still read the CPU step count on the host.
* Everything else decides on the host: ``step`` reads the flag (the one host sync, which torch's recipe makes too)
  and skips ``optimizer.step()`` when it is set. That is fp16 with a non-fused optimizer, and in check mode the
  optimizers torch cannot skip on the device: custom optimizers without the protocol, subclasses of torch's (their
  ``step`` may differ), complex parameters, sparse gradients, ``differentiable=True``, and fused SGD's first step
  with momentum (:func:`_skips_safely_on_device`). In check mode in one process such an optimizer gets no flag at
  all: ``unscale_`` stacks its gradients' inf-norms (one op, as the flag check was) and ``step`` reads them on the
  host (the same one sync), so nothing the scaler keeps between iterations is touched. ``skip_nonfinite=False``
  turns the check off in check mode, as Lightning's bf16 and fp32 plugins have none: no op and no sync for any
  optimizer, and a non-finite step then reaches the weights.
* ``update`` moves the scale by the pure rules of :mod:`lightning_mp._scale_rules` (hysteresis, growth capped at
  ``max_scale``, backoff, collapse at the floor). Where every flag of the iteration is already on the host they run
  there and the device scale is rewritten only when it changes; otherwise (fused optimizers) they run on the device
  (:mod:`lightning_mp._device_rules`: torch's ``_amp_update_scale_``, a clamp to ``[floor, max_scale]`` and the
  new ``1/scale``; a few more ops with ``hysteresis > 1``).
  The host replays the same rules on the flags once it can read them without waiting: at once on the CPU, one
  iteration late on an accelerator (a non-blocking copy). That replay keeps :meth:`LossScaler.get_scale` and
  :meth:`LossScaler.stats` free, and raises :class:`~lightning_mp.errors.LossScaleCollapseError` and
  :class:`~lightning_mp.errors.NonFiniteStepsError` at most one iteration late.

Skips and streaks are counted per optimizer: an optimizer whose gradients are never finite stops the run even if
another one steps cleanly, and the error names it.

Private torch names used, and why:

* ``torch.amp.grad_scaler.OptState`` and ``_refresh_per_optimizer_state``, the GradScaler attributes ``_scale``,
  ``_growth_tracker``, ``_init_scale``, ``_device``, ``_growth_factor``, ``_backoff_factor``, ``_growth_interval``
  and ``_per_optimizer_states``, and the overridden ``_lazy_init_scale_growth_tracker`` and
  ``_get_growth_tracker``: this class is a ``GradScaler`` (code that checks ``isinstance(scaler, GradScaler)``,
  Lightning's included, keeps working) and keeps torch's bookkeeping so that the methods it inherits (``scale``,
  the getters) see a consistent object.
* ``torch._amp_foreach_non_finite_check_and_unscale_``: the fused unscale-and-check kernel (no public equivalent).
* ``torch._amp_update_scale_``: torch's device-side scale rule, used when the flag is not on the host.
* ``torch._foreach_norm``: one kernel for the inf-norms of all gradients in check mode, and in
  :meth:`LossScaler.recheck_gradients`.
* ``torch._foreach_mul_``: one kernel to unscale bf16 gradients, which the unscale kernel refuses on CUDA.
* ``Tensor._values()``: the stored values of a sparse gradient, which are what needs unscaling and checking, as in
  torch's own ``unscale_``.
* The ``grad_scale``/``found_inf`` attributes and ``_step_supports_amp_scaling``: the protocol by which torch's
  fused optimizers skip a step on the device; set for the duration of ``step`` only, exactly as torch does.
  Fused SGD's first momentum step is the exception, decided on the host (:func:`_skips_safely_on_device`). The
  overridden ``_check_inf_per_device`` is torch's check without unscaling, which that protocol calls.
* The param-group keys ``fused`` and ``foreach``, set for the duration of a handed-off step (there is no public way
  to run an optimizer's fused kernel on its own state), and the attribute ``_need_device_dtype_check_for_fused``
  that SGD and Adagrad then write on the optimizer, removed again afterwards.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import warnings
import weakref
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state
from typing_extensions import override

from lightning_mp._device_rules import update_scale_on_device
from lightning_mp._gradients import nonfinite_gradients
from lightning_mp._host_mirror import HostMirror, Reader
from lightning_mp._knobs import with_knob_docs
from lightning_mp._scale_rules import (
    COLLAPSE_FLOOR,
    FLOAT32_MAX,
    SCALER_DEFAULTS,
    STATIC_SCALE_FLOOR,
    OnMinScale,
    ScalerSettings,
    ScaleState,
    ScalingMode,
    float32_within,
    next_state,
)
from lightning_mp._validation import check_number
from lightning_mp.errors import LossScaleCollapseError, NonFiniteStepsError
from lightning_mp.stats import PrecisionStats

__all__ = ["COLLAPSE_FLOOR", "LossScaler", "OnMinScale", "ScalerSettings", "ScalingMode"]

_COUNTERS = ("optimizer_steps", "skipped_steps", "scale_backoffs", "scale_growths", "consecutive_skips")
_UNCHECKED = -1
"""The optimizer index of steps taken without a check (LBFGS): never skipped, never in a streak."""


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


_FUSED_FORMS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)
"""torch optimizers whose fused kernel applies the same update rule as their foreach and single-tensor forms."""
_FUSED_DEVICE_TYPES = ("cpu", "cuda")


def _has_fused_form(optimizer: torch.optim.Optimizer) -> bool:
    """Whether torch's fused kernel of ``optimizer``'s own update rule can take its step (and skip it on the device).

    Only the exact torch classes (a subclass may override ``step``), not configured ``fused`` already, not
    ``differentiable``, with dense floating gradients of their parameter's dtype on a CPU or CUDA device: the cases
    the fused kernels accept. Complex parameters and sparse gradients stay with the optimizer's own form.
    """
    if type(optimizer) not in _FUSED_FORMS:
        return False
    for group in optimizer.param_groups:
        if group.get("fused") or group.get("differentiable"):
            return False
        for parameter in group["params"]:
            grad = parameter.grad
            if grad is None:
                continue
            if (
                grad.is_sparse
                or not parameter.is_floating_point()
                or parameter.device.type not in _FUSED_DEVICE_TYPES
                or (grad.dtype, grad.device) != (parameter.dtype, parameter.device)
            ):
                return False
    return True


def _skips_safely_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` can skip its step on the device, told through ``found_inf``, and leave its state intact.

    True for fused optimizers (``_step_supports_amp_scaling``) and for those with a fused form
    (:func:`_has_fused_form`). Fused SGD with momentum allocates its momentum buffers uninitialised on its first step
    and fills them inside the kernel, which returns early on ``found_inf``: a first step skipped on the device would
    leave garbage buffers that wreck every later step (torch's own GradScaler included). That one step is decided on
    the host instead.
    """
    if not (getattr(optimizer, "_step_supports_amp_scaling", False) or _has_fused_form(optimizer)):
        return False
    if not isinstance(optimizer, torch.optim.SGD):
        return True
    return all(
        group["momentum"] == 0 or optimizer.state.get(parameter, {}).get("momentum_buffer") is not None
        for group in optimizer.param_groups
        for parameter in group["params"]
        if parameter.grad is not None
    )


UNSCALE_KERNEL_DTYPES = frozenset({torch.float16, torch.float32, torch.float64})
"""The dtypes CUDA's ``_amp_foreach_non_finite_check_and_unscale_`` takes (``AT_DISPATCH_FLOATING_TYPES_AND_HALF`` in
torch's ``aten/src/ATen/native/cuda/AmpKernels.cu``): bf16 is refused there, although the CPU kernel accepts it."""


def _inf_norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The inf-norm of each tensor (all of one dtype), in a dtype CUDA's check kernel takes: one kernel, no cast.

    bf16 norms come out in float32; other dtypes keep theirs: torch refuses to narrow float64 norms to float32, and
    the norms of complex tensors are already real (complex64's are float32).
    """
    dtype = torch.float32 if tensors[0].dtype is torch.bfloat16 else None
    return list(torch._foreach_norm(tensors, math.inf, dtype=dtype))


def _place_steps_for_fused(optimizer: torch.optim.Optimizer) -> None:
    """Move step counters to where the fused kernels keep them: a float32 on the parameter's device.

    The foreach and single-tensor forms keep ``state["step"]`` on the CPU; on a CPU run nothing moves. On an
    accelerator each counter moves once, at the first step handed to the fused kernel. torch's ``load_state_dict``
    accepts a counter on either device for every form, so checkpoints load both ways.
    """
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            state = optimizer.state.get(parameter)
            step = state.get("step") if state is not None else None
            if isinstance(step, torch.Tensor) and (step.device, step.dtype) != (parameter.device, torch.float32):
                optimizer.state[parameter]["step"] = step.to(device=parameter.device, dtype=torch.float32)


@contextlib.contextmanager
def _configured_fused(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Run ``optimizer`` as its fused form for the duration of the block; its param_groups then read as before."""
    groups = optimizer.param_groups
    configured = [(group.get("foreach"), group.get("fused")) for group in groups]
    # SGD and Adagrad remember on the optimizer that they checked their parameters for the fused kernel.
    remembered = "_need_device_dtype_check_for_fused" in vars(optimizer)
    for group in groups:
        group["foreach"], group["fused"] = False, True
    try:
        yield
    finally:
        for group, (foreach, fused) in zip(groups, configured, strict=True):
            group["foreach"], group["fused"] = foreach, fused
        if not remembered:
            vars(optimizer).pop("_need_device_dtype_check_for_fused", None)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _check_device(owner: str, device: Any) -> str:
    """The device type of ``device`` (a string or a ``torch.device``); ValueError if unknown or unavailable."""
    try:
        device_type = torch.device(device).type
    except (RuntimeError, TypeError):
        raise ValueError(
            f"{owner}(device={device!r}) is not allowed: device must be a device type such as 'cpu' or 'cuda'."
        ) from None
    backend = getattr(torch, device_type, None)
    available = device_type == "cpu" or (backend is not None and getattr(backend, "is_available", lambda: False)())
    if not available:
        raise ValueError(
            f"{owner}(device={device!r}) is not available on this machine; use device='cpu', or leave device=None"
            f" to pick {_default_device()!r}."
        )
    return device_type


class _IterationRecord:
    """The inf flags of one iteration, kept until the host can read them without a sync."""

    def __init__(self) -> None:
        self.device_flags: dict[int, torch.Tensor] = {}
        """Optimizer index -> its inf flag on the device (or a host copy in flight)."""
        self.host_flags: dict[int, float] = {}
        """Optimizer index -> its inf flag, where the step already read it."""
        self.stepped: set[int] = set()
        self.flag_slots: dict[int, list[Any]] = {}
        """Optimizer index -> the preallocated flags it used."""
        self.readers: dict[int, Reader] = {}
        """Optimizer index -> a reader of its flag's host copy, once published."""
        self.norms: dict[int, torch.Tensor] = {}
        """Optimizer index -> the inf-norms of its gradients, where its step reads them on the host (check mode)."""
        self.new_scale: float | None = None
        self.device_ruled = False
        self.ready: torch.cuda.Event | None = None

    @property
    def checked(self) -> bool:
        return bool(self.device_flags or self.host_flags or self.norms)

    def verdict_from_norms(self, index: int) -> float:
        """Optimizer ``index``'s verdict on the host (1.0: skip); from its gradient norms, read once (one sync)."""
        found_inf = self.host_flags.get(index)
        if found_inf is None:
            found_inf = self.host_flags[index] = float(not all(map(math.isfinite, self.norms[index].tolist())))
        return found_inf

    @property
    def on_host(self) -> bool:
        """Whether every flag was already read by a step (so the rules can run on the host)."""
        return set(self.device_flags) <= set(self.host_flags)

    def read(self) -> dict[int, bool]:
        for index in self.norms:  # an unscale_ whose step never came
            self.verdict_from_norms(index)
        if self.ready is not None:
            self.ready.synchronize()
        flags = {index: bool(read()) for index, read in self.readers.items()}
        flags.update((index, bool(flag)) for index, flag in self.host_flags.items())
        return flags


@with_knob_docs(ScalerSettings)
class LossScaler(torch.amp.GradScaler):
    """A ``torch.amp.GradScaler`` with hysteresis, scale bounds, static and check-only modes, and counters.

    The module docstring describes the algorithm. Use it through :class:`~lightning_mp.MixedPrecision`, or by hand
    exactly like a GradScaler::

        scaler = LossScaler("cpu", growth_interval=1000, hysteresis=2)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)          # optional: clip here, gradients are true
        scaler.step(optimizer)              # skipped when a gradient is inf/NaN
        scaler.update()                     # once per iteration, after the last step

    Args:
        device: the device type of the gradients (``"cpu"``, ``"cuda"``, ...); None picks ``"cuda"`` when it is
            available, else ``"cpu"``.
        init_scale: <knob>
        growth_factor: <knob>
        backoff_factor: <knob>
        growth_interval: <knob>
        hysteresis: <knob>
        consecutive_hysteresis: <knob>
        min_scale: <knob>
        max_scale: <knob>
        on_min_scale: <knob>
        mode: <knob>
        max_consecutive_skips: <knob>
        skip_nonfinite: <knob>

    Each knob is declared, documented and checked once, in :class:`~lightning_mp._scale_rules.ScalerSettings`;
    :attr:`settings` holds them as validated.

    Raises:
        ValueError: for any argument outside its allowed range, naming it, its value and what is allowed.

    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        init_scale: float = SCALER_DEFAULTS.init_scale,
        growth_factor: float = SCALER_DEFAULTS.growth_factor,
        backoff_factor: float = SCALER_DEFAULTS.backoff_factor,
        growth_interval: int = SCALER_DEFAULTS.growth_interval,
        hysteresis: int = SCALER_DEFAULTS.hysteresis,
        consecutive_hysteresis: bool = SCALER_DEFAULTS.consecutive_hysteresis,
        min_scale: float | None = SCALER_DEFAULTS.min_scale,
        max_scale: float = SCALER_DEFAULTS.max_scale,
        on_min_scale: OnMinScale = SCALER_DEFAULTS.on_min_scale,
        mode: ScalingMode = SCALER_DEFAULTS.mode,
        max_consecutive_skips: int | None = SCALER_DEFAULTS.max_consecutive_skips,
        skip_nonfinite: bool = SCALER_DEFAULTS.skip_nonfinite,
    ) -> None:
        settings = ScalerSettings(
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            consecutive_hysteresis=consecutive_hysteresis,
            min_scale=min_scale,
            max_scale=max_scale,
            on_min_scale=on_min_scale,
            mode=mode,
            max_consecutive_skips=max_consecutive_skips,
            skip_nonfinite=skip_nonfinite,
            owner=type(self).__name__,
        )
        self._setup(device, settings)

    @classmethod
    def from_settings(cls, settings: ScalerSettings, device: str | torch.device | None = None) -> LossScaler:
        """A scaler with already validated settings (what :class:`~lightning_mp.MixedPrecision` uses)."""
        if not isinstance(settings, ScalerSettings):
            raise TypeError(f"LossScaler.from_settings(settings={settings!r}): expected a ScalerSettings.")
        scaler = cls.__new__(cls)
        scaler._setup(device, settings)
        return scaler

    def _setup(self, device: str | torch.device | None, settings: ScalerSettings) -> None:
        device_type = _check_device(type(self).__name__, _default_device() if device is None else device)
        if not settings.skip_nonfinite and settings.scales_loss:
            raise ValueError(
                f"{type(self).__name__}(mode={settings.mode!r}, skip_nonfinite=False) is not allowed: a scaled step"
                " whose gradients overflowed must be skipped. Use skip_nonfinite=False with mode='check' (bf16, fp32)."
            )
        self.settings = settings
        self._state = settings.initial_state()
        super().__init__(
            device_type,
            init_scale=self._state.scale,
            growth_factor=settings.growth_factor,
            backoff_factor=settings.backoff_factor,
            growth_interval=settings.growth_interval,
            enabled=True,
        )
        self.allow_fp16_gradients = False
        """Set by opt levels whose gradients are fp16 themselves (O3): torch refuses to unscale those by default."""
        self.param_names: dict[int, str] = {}
        """``id(parameter) -> qualified name``, so that errors can name the parameters that overflowed."""
        self.optimizer_steps = 0
        self.skipped_steps = 0
        self.scale_backoffs = 0
        self.scale_growths = 0
        self.last_step_skipped = False
        self._streaks: dict[int, int] = {}
        self._last_culprits: dict[int, list[tuple[str, tuple[int, ...]]]] = {}
        """Per optimizer, the non-finite gradients seen at a skipped step near the streak limit, for the error: a
        manual loop that zeroes the gradients after ``step`` leaves none to inspect once the streak is counted."""
        self._optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        """Weak references, so that a plugin reused for another model keeps no optimizer (or model) alive."""
        self._index_by_id: dict[int, int] = {}
        self._flags: dict[tuple[int, torch.device, int], torch.Tensor] = {}
        self._clean_flags: set[tuple[int, torch.device, int]] = set()
        """Flags known to hold 0 (read by the host since their last use): reused without a ``zero_`` op."""
        self._parity = 0
        self._inv_scale: torch.Tensor | None = None
        self._one: torch.Tensor | None = None
        self._hysteresis_tensor: torch.Tensor | None = None
        self._device_trackers_current = True
        self._iteration = _IterationRecord()
        self._pending: _IterationRecord | None = None
        self._mirror = HostMirror()
        self._local_overflows: torch.Tensor | None = None

    # ------------------------------------------------------------------------------------------------ knobs

    @property
    def mode(self) -> ScalingMode:
        """``"dynamic"``, ``"static"`` or ``"check"``."""
        return self.settings.mode

    @property
    def hysteresis(self) -> int:
        """Overflows tolerated before the scale backs off."""
        return self.settings.hysteresis

    @property
    def min_scale(self) -> float | None:
        """The floor asked for; None means ``2**-24``."""
        return self.settings.min_scale

    @property
    def max_scale(self) -> float:
        """The ceiling."""
        return self.settings.max_scale

    @property
    def max_consecutive_skips(self) -> int | None:
        """Skipped steps in a row of one optimizer that stop the run; None never stops."""
        return self.settings.max_consecutive_skips

    @property
    def scales_loss(self) -> bool:
        """Whether the loss is multiplied at all (dynamic or static mode)."""
        return self.settings.scales_loss

    def set_growth_factor(self, new_factor: float) -> None:
        """Set ``growth_factor``, validated like the constructor's argument."""
        self._replace_settings(growth_factor=new_factor)

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set ``backoff_factor``, validated like the constructor's argument."""
        self._replace_settings(backoff_factor=new_factor)

    def set_growth_interval(self, new_interval: int) -> None:
        """Set ``growth_interval``, validated like the constructor's argument."""
        self._replace_settings(growth_interval=new_interval)

    def _replace_settings(self, **changes: Any) -> None:
        self.settings = replace(self.settings, init_scale=self._state.scale, owner=type(self).__name__, **changes)
        self._growth_factor = self.settings.growth_factor
        self._backoff_factor = self.settings.backoff_factor
        self._growth_interval = self.settings.growth_interval
        self._state = replace(self._state, growth_tracker=min(self._state.growth_tracker, self._growth_interval - 1))
        self._device_trackers_current = False

    # ------------------------------------------------------------------------------------------------ device state

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        self._scale = torch.full((), self._state.scale, dtype=torch.float32, device=dev)
        self._growth_tracker = torch.full((), self._state.growth_tracker, dtype=torch.int32, device=dev)
        inverse = 1.0 / self._state.scale if self.scales_loss else 1.0
        self._inv_scale = torch.full((), inverse, dtype=torch.float32, device=dev)
        self._one = torch.ones((), dtype=torch.float32, device=dev)
        self._hysteresis_tensor = torch.full((), float(self._state.hysteresis_left), device=dev)

    def _ensure_device_state(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        if self._scale is None:
            device = next(
                (p.device for group in optimizer.param_groups for p in group["params"] if p.grad is not None),
                torch.device(self._device),
            )
            self._lazy_init_scale_growth_tracker(device)
        assert self._scale is not None
        return self._scale

    def _write_scale(self) -> None:
        # fill_ from a Python float is an asynchronous kernel launch: no synchronisation.
        if self._scale is None:
            self._init_scale = self._state.scale
            return
        assert self._inv_scale is not None
        self._scale.fill_(self._state.scale)
        self._inv_scale.fill_(1.0 / self._state.scale if self.scales_loss else 1.0)

    def _write_trackers(self) -> None:
        if self._scale is not None and not self._device_trackers_current:
            assert self._hysteresis_tensor is not None and self._growth_tracker is not None
            self._growth_tracker.fill_(self._state.growth_tracker)
            self._hysteresis_tensor.fill_(float(self._state.hysteresis_left))
        self._device_trackers_current = True

    # ------------------------------------------------------------------------------------------------ the step

    def scale(self, outputs: Any) -> Any:
        """Multiply the loss by the current scale; in check mode return it unchanged."""
        if not self.scales_loss:
            return outputs
        return super().scale(outputs)

    def is_unscaled(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether :meth:`unscale_` already ran for ``optimizer`` in this iteration (a second call would raise).

        Asking records nothing for an optimizer the scaler has not seen.
        """
        state = self._per_optimizer_states.get(id(optimizer))
        return state is not None and state["stage"] is OptState.UNSCALED

    def found_inf(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the gradients unscaled for ``optimizer`` in this iteration hold an inf or NaN: its step is skipped.

        False before :meth:`unscale_` ran for it. Asking records nothing for an optimizer the scaler has not seen.

        .. warning:: Reads the device flag on the host: a synchronisation on CUDA.
        """
        if self._per_optimizer_states.get(id(optimizer)) is None:
            return False
        return bool(self.step_verdict(optimizer))

    def step_verdict(self, optimizer: torch.optim.Optimizer) -> bool | torch.Tensor | None:
        """Whether ``optimizer``'s step of this iteration is (or will be) skipped, without waiting for a device.

        Returns:
            a bool where the host already knows; else the device flag (a 0-d tensor, 1.0 when skipped), for
            sync-free use such as ``torch.where``; None before :meth:`unscale_` ran for it.

        """
        index = self._index_by_id.get(id(optimizer.param_groups))
        if index is None:
            return None
        record = self._iteration
        if index in record.host_flags or index in record.norms:
            return bool(record.verdict_from_norms(index))
        return record.device_flags.get(index)

    def _optimizer_index(self, optimizer: torch.optim.Optimizer) -> int:
        # Keyed by the param_groups list, which a wrapper (Lightning's LightningOptimizer) shares with the optimizer
        # it wraps: an unscale_ through the wrapper and a step of the optimizer are the same optimizer here.
        key = id(optimizer.param_groups)
        index = self._index_by_id.get(key)
        known = self._optimizer_at(index) if index is not None else None
        if index is not None and known is not None and known.param_groups is optimizer.param_groups:
            return index
        index = len(self._optimizers)
        self._optimizers.append(weakref.ref(optimizer))
        self._index_by_id[key] = index
        return index

    def _optimizer_at(self, index: int) -> torch.optim.Optimizer | None:
        """The optimizer recorded under ``index``, or None when there is none or it no longer exists."""
        return self._optimizers[index]() if 0 <= index < len(self._optimizers) else None

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place (fp16) and check them for inf/NaN.

        In check mode (bf16, fp32) the gradients are only read. Runs at most once per optimizer and iteration, like
        torch's (use :meth:`is_unscaled` to ask first). Under DDP the flag is all-reduced with ``max``.

        Raises:
            RuntimeError: when called twice for ``optimizer`` in one iteration, or after its ``step``.

        """
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        self._ensure_device_state(optimizer)
        index = self._optimizer_index(optimizer)
        if not self.settings.skip_nonfinite:
            # Lightning's bf16 and fp32: nothing is checked, and every step is taken.
            state["found_inf_per_device"] = {}
            state["stage"] = OptState.UNSCALED
            self._iteration.host_flags[index] = 0.0
            return
        per_device = self._check_gradients(optimizer, index)
        if _distributed():
            for flag in per_device.values():
                self._count_local_overflow(flag)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        state["found_inf_per_device"] = per_device
        state["stage"] = OptState.UNSCALED
        combined = next(iter(per_device.values())) if len(per_device) == 1 else self._combine(per_device)
        if combined is not None:
            self._iteration.device_flags[index] = combined

    def recheck_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Check ``optimizer``'s unscaled gradients again before its step, and skip the step if one is now inf or NaN.

        For code that changes the gradients between :meth:`unscale_` and :meth:`step`: clipping with a NaN
        threshold, for one, turns finite gradients into NaN after they were checked. The new check is folded into
        the step's verdict, so such a step is skipped and counted like an overflow. Does nothing before
        :meth:`unscale_`. Under DDP the gradients were already averaged, so every rank finds the same.

        .. warning:: Where the verdict is a device flag, it is updated on the device (no sync). Where the host
            already read it (bf16 and fp32 with an optimizer that is not fused), the step reads it once more.

        """
        index = self._index_by_id.get(id(optimizer.param_groups))
        record = self._iteration
        if index is None or index in record.stepped or not (index in record.norms or index in record.device_flags):
            return
        grads: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    grad = param.grad._values() if param.grad.is_sparse else param.grad
                    grads[grad.device].append(grad)
        home = record.device_flags[index].device if index in record.device_flags else None
        norms = [
            torch.stack(torch._foreach_norm(tensors, math.inf)).float().to(home or device, non_blocking=True)
            for device, tensors in grads.items()
        ]
        if not norms:
            return
        if index in record.norms:
            if not record.host_flags.get(index):  # a skip already decided stays one; else read again at the step
                record.host_flags.pop(index, None)
                record.norms[index] = torch.cat([record.norms[index], *norms])
            return
        flag = record.device_flags[index]
        nonfinite = (~torch.isfinite(torch.cat(norms))).any()
        flag.copy_(torch.maximum(flag, nonfinite.to(flag.dtype)))

    @staticmethod
    def _combine(per_device: dict[torch.device, torch.Tensor]) -> torch.Tensor | None:
        if not per_device:
            return None
        home = next(iter(per_device.values()))
        return torch.stack([f.to(home.device, non_blocking=True) for f in per_device.values()]).amax()

    def _check_gradients(self, optimizer: torch.optim.Optimizer, index: int) -> dict[torch.device, torch.Tensor]:
        grads: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if self.scales_loss and not self.allow_fp16_gradients and grad.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
                if grad.is_sparse:
                    if grad.dtype is torch.float16:
                        param.grad = grad = grad.coalesce()
                    grad = grad._values()
                grads[grad.device][grad.dtype].append(grad)
        per_device: dict[torch.device, torch.Tensor] = {}
        if not self.scales_loss and len(grads) == 1 and not _distributed() and not _skips_safely_on_device(optimizer):
            (per_dtype,) = grads.values()
            if len(per_dtype) == 1:
                # The step decides on the host anyway: it reads these norms (its one sync), and no flag is kept.
                (tensors,) = per_dtype.values()
                self._iteration.norms[index] = torch.stack(_inf_norms(tensors))
                return per_device
        for device, per_dtype in grads.items():
            flag = per_device[device] = self._zeroed_flag(index, device)
            inv_scale, one = self._inv_scale, self._one
            assert inv_scale is not None and one is not None
            for dtype, tensors in per_dtype.items():
                if self.scales_loss and dtype in UNSCALE_KERNEL_DTYPES:
                    torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, inv_scale.to(device))
                    continue
                if self.scales_loss:
                    # bf16 gradients under a loss scale: CUDA's unscale kernel refuses them, so multiply, then check.
                    torch._foreach_mul_(tensors, inv_scale.to(device))
                # Check mode reads the gradients: inf-norms in one kernel (float32, which every device's check
                # kernel takes), then the flag from those norms.
                torch._amp_foreach_non_finite_check_and_unscale_(_inf_norms(tensors), flag, one.to(device))
        if not per_device and _distributed():
            # Every rank must join the all-reduce, even one whose optimizer has no gradient this iteration.
            assert self._scale is not None
            per_device[self._scale.device] = self._zeroed_flag(index, self._scale.device)
        return per_device

    def _zeroed_flag(self, index: int, device: torch.device) -> torch.Tensor:
        """The preallocated inf flag of this optimizer on ``device``, holding 0 (zeroed only if it may not)."""
        # On an accelerator the host reads a flag one iteration late, so two alternate.
        slot = (index, device, self._parity if device.type != "cpu" else 0)
        flag = self._flags.get(slot)
        if flag is None:
            flag = self._flags[slot] = torch.zeros((), dtype=torch.float32, device=device)
        elif slot in self._clean_flags:
            self._clean_flags.discard(slot)
        else:
            flag.zero_()
        self._iteration.flag_slots.setdefault(index, []).append(slot)
        return flag

    def _count_local_overflow(self, flag: torch.Tensor) -> None:
        # Kept on the device (no sync); read only when telemetry asks for it.
        if self._local_overflows is None:
            self._local_overflows = torch.zeros((), dtype=torch.float32, device=flag.device)
        self._local_overflows.add_(flag)

    @property
    def local_overflow_count(self) -> torch.Tensor | int:
        """This rank's overflow count as :meth:`local_overflows` counts it, read without a synchronisation.

        A 0-d device tensor where the scaler counts on the device (under DDP), else the host count; for telemetry
        that gathers it with other counters in one collective.
        """
        return self._local_overflows if self._local_overflows is not None else self.skipped_steps

    def local_overflows(self) -> int:
        """Iterations on which this rank's own gradients overflowed, before the DDP all-reduce.

        .. warning:: Under DDP this reads a device counter and synchronises; call it on logging steps only.
        """
        if self._local_overflows is None:
            return self.skipped_steps
        return int(self._local_overflows.item())

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale if needed, then run ``optimizer.step()`` unless a gradient is inf or NaN.

        Fused optimizers (``_step_supports_amp_scaling``, a custom one included) follow torch's protocol: they get
        ``found_inf`` and ``grad_scale`` (the scale times a ``grad_scale`` the user set, when nothing unscaled the
        gradients yet; else the user's own) and skip on the device; an optimizer whose ``step`` takes
        ``grad_scaler=`` gets this scaler instead. In check mode (bf16, fp32) Adam, AdamW, SGD and Adagrad in
        their foreach or single-tensor form take their step through torch's fused kernel of the same rule, given
        ``found_inf``, so they skip on the device too (:func:`_has_fused_form`). Other optimizers skip on the host.

        .. warning:: An optimizer that cannot skip on the device (fp16 with a non-fused optimizer, custom optimizers
            without the protocol, complex parameters, sparse gradients, fused SGD's first momentum step) reads the
            inf flag: one host sync, as in torch.

        Raises:
            RuntimeError: when called twice for ``optimizer`` in one iteration, or with a ``closure``.

        """
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._fused_protocol_step(optimizer, state, *args, **kwargs)
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        index = self._optimizer_index(optimizer)
        self._iteration.stepped.add(index)
        state["stage"] = OptState.STEPPED
        flag = self._iteration.device_flags.get(index)
        if flag is not None and not self.scales_loss and _skips_safely_on_device(optimizer):
            # Check mode hands the step to torch's fused kernel of the same rule, which skips it on the device.
            return self._step_on_device(optimizer, index, flag, None, *args, **kwargs)
        if self._host_verdict(index, flag):
            return None
        return optimizer.step(*args, **kwargs)

    def _host_verdict(self, index: int, flag: torch.Tensor | None) -> float:
        """Optimizer ``index``'s verdict read on the host (1.0: skip); remembers the culprits of a skip."""
        if index in self._iteration.norms:
            found_inf = self._iteration.verdict_from_norms(index)  # check mode's one host read
        elif flag is None:
            # No gradient at all: torch's optimizers skip such parameters, so there is nothing to check.
            found_inf = self._iteration.host_flags[index] = 0.0
        else:
            found_inf = self._iteration.host_flags[index] = float(flag.item())
        if found_inf:
            self._remember_culprits_near_limit(index, found_inf)
        return found_inf

    def _fused_protocol_step(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any], *args: Any, **kwargs: Any
    ) -> Any:
        """Step an optimizer that declares ``_step_supports_amp_scaling``, exactly as torch's ``GradScaler.step``."""
        index = self._optimizer_index(optimizer)
        self._iteration.stepped.add(index)
        if "grad_scaler" in inspect.signature(optimizer.step).parameters:
            warnings.warn(
                "GradScaler is going to stop passing itself as a keyword argument to the passed optimizer. In the"
                " near future GradScaler registers `grad_scale: Tensor` and `found_inf: Tensor` to the passed"
                " optimizer and let the optimizer use them directly.",
                FutureWarning,
                stacklevel=3,
            )
            # torch's Optimizer.step declares no grad_scaler; this optimizer's own step does.
            output = optimizer.step(*args, **kwargs, grad_scaler=self)  # type: ignore[call-overload]
            state["stage"] = OptState.STEPPED
            return output
        user_scale = getattr(optimizer, "grad_scale", None)
        grad_scale = user_scale
        if state["stage"] is OptState.READY:
            # The kernel unscales: the gradients are only checked here, and it divides them by the scale.
            self._check_inf_per_device(optimizer)
            if self.scales_loss:
                assert self._scale is not None
                grad_scale = self._scale if user_scale is None else self._scale * user_scale
        state["stage"] = OptState.STEPPED
        flag = self._iteration.device_flags.get(index)
        if flag is not None and _skips_safely_on_device(optimizer):
            return self._step_on_device(optimizer, index, flag, grad_scale, *args, **kwargs)
        if self._host_verdict(index, flag):
            return None
        return self._step_with_protocol(optimizer, grad_scale, flag, *args, **kwargs)

    def _step_on_device(
        self,
        optimizer: torch.optim.Optimizer,
        index: int,
        flag: torch.Tensor,
        grad_scale: torch.Tensor | None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """Hand ``flag`` to the fused kernel, which skips the step on the device: no host sync."""
        if flag.device.type == "cpu":
            self._remember_culprits_near_limit(index, flag)  # a CPU flag reads without waiting for a device
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._step_with_protocol(optimizer, grad_scale, flag, *args, **kwargs)
        _place_steps_for_fused(optimizer)
        with _configured_fused(optimizer):
            return self._step_with_protocol(optimizer, grad_scale, flag, *args, **kwargs)

    @staticmethod
    def _step_with_protocol(
        optimizer: torch.optim.Optimizer,
        grad_scale: torch.Tensor | None,
        found_inf: torch.Tensor | None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        # torch's fused-step protocol (module docstring): attributes torch.optim does not declare, set for one step.
        optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
        optimizer.found_inf = found_inf  # type: ignore[attr-defined]
        try:
            return optimizer.step(*args, **kwargs)
        finally:
            # As torch's GradScaler does: the protocol's attributes live only for the duration of the step.
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]

    @override
    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Check ``optimizer``'s gradients for inf/NaN without unscaling them (torch's check before a fused step).

        The same pass as :meth:`unscale_`, multiplying by one; fp16 gradients are allowed, as in torch.
        """
        self._ensure_device_state(optimizer)
        inv_scale, allow_fp16_gradients = self._inv_scale, self.allow_fp16_gradients
        self._inv_scale, self.allow_fp16_gradients = self._one, True
        try:
            self.unscale_(optimizer)
        finally:
            self._inv_scale, self.allow_fp16_gradients = inv_scale, allow_fp16_gradients
        found_inf_per_device: dict[str, Any] = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        return found_inf_per_device

    def _remember_culprits_near_limit(self, index: int, found_inf: torch.Tensor | float) -> None:
        """Name the non-finite gradients of a skipped step that may end the streak, while they still exist.

        Only within two steps of ``max_consecutive_skips`` (the host may replay an iteration one step late), so
        that the flag and the gradients are read on a failing run only.
        """
        limit = self.max_consecutive_skips
        if limit is not None and self._streaks.get(index, 0) + 2 >= limit and bool(found_inf):
            self._last_culprits[index] = self._culprits([index])

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """End the iteration: move the scale once, by the rules, after every optimizer of the iteration stepped.

        Args:
            new_scale: set the scale to this value instead; it must lie in ``[floor, max_scale]`` (in static mode
                any normal float32, from ``2**-126``, whose inverse is finite, to float32's largest).

        Raises:
            LossScaleCollapseError: when an overflow would push the scale below its floor and
                ``on_min_scale="raise"`` (on an accelerator with a fused optimizer: one iteration later).
            NonFiniteStepsError: when one optimizer skipped ``max_consecutive_skips`` steps in a row.
            ValueError: for a ``new_scale`` outside the allowed range.

        .. warning:: A ``new_scale`` tensor is read on the host (one sync) to be validated.

        """
        record, self._iteration = self._iteration, _IterationRecord()
        self._parity ^= 1
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        if new_scale is not None:
            record.new_scale = self._checked_new_scale(new_scale)
        elif not record.checked:
            raise AssertionError("No inf checks were recorded prior to update.")
        if not record.on_host and record.new_scale is None and self.mode == "dynamic":
            self._update_on_device(list(record.device_flags.values()))
            record.device_ruled = True
        if not record.on_host:
            record.readers = {i: self._mirror.publish(i, f) for i, f in record.device_flags.items()}
            record.ready = self._mirror.end_iteration(next(iter(record.device_flags.values())).device)
        if record.ready is not None:
            # An accelerator: read the previous iteration now, this one at the next update.
            previous, self._pending = self._pending, record
            if previous is not None:
                self._replay(previous)
            return
        if self._pending is not None:
            previous, self._pending = self._pending, None
            self._replay(previous)
        self._replay(record)

    def _checked_new_scale(self, new_scale: float | torch.Tensor) -> float:
        owner = f"{type(self).__name__}.update"
        if not self.scales_loss:
            raise ValueError(f"{owner}(new_scale={new_scale!r}) is not allowed: check mode scales nothing.")
        static = (STATIC_SCALE_FLOOR, FLOAT32_MAX)
        low, high = (self.settings.floor, self.max_scale) if self.mode == "dynamic" else static
        value = check_number(owner, "new_scale", new_scale, at_least=low, at_most=high)
        return float32_within(value, low, high)

    def _update_on_device(self, device_flags: list[torch.Tensor]) -> None:
        """The rules of :func:`~lightning_mp._scale_rules.next_state`, as device ops on a device flag."""
        self._write_trackers()
        assert self._scale is not None and self._inv_scale is not None and self._hysteresis_tensor is not None
        assert self._growth_tracker is not None
        found_inf = device_flags[0] if len(device_flags) == 1 else torch.stack(device_flags).amax()
        update_scale_on_device(
            self._scale, self._growth_tracker, self._hysteresis_tensor, self._inv_scale, found_inf, self.settings
        )

    def _replay(self, record: _IterationRecord) -> None:
        """Apply the host rules and the per-optimizer counters to an iteration whose flags can be read now."""
        flags = record.read()
        for index, slots in record.flag_slots.items():
            if not flags.get(index, True):
                self._clean_flags.update(slots)
        found_inf = any(flags.values())
        skipped = [index for index in sorted(record.stepped) if flags.get(index)]
        self.optimizer_steps += len(record.stepped)
        self.skipped_steps += len(skipped)
        self.last_step_skipped = bool(skipped)
        for index in record.stepped:
            self._streaks[index] = self._streaks.get(index, 0) + 1 if index in skipped else 0
            if index not in skipped:
                self._last_culprits.pop(index, None)
        if record.new_scale is not None:
            self._state = replace(self._state, scale=record.new_scale)
            self._write_scale()
            return
        before = self._state
        transition = next_state(before, found_inf, self.settings)
        if transition.event == "collapsed":
            floor = self.settings.floor
            raise LossScaleCollapseError(
                step=self.optimizer_steps,
                scale=before.scale,
                floor=floor,
                nonfinite_parameters=self._culprits(sorted(flags)),
            )
        self._state = transition.state
        self.scale_backoffs += transition.state.scale < before.scale
        self.scale_growths += transition.state.scale > before.scale
        if transition.event == "held_at_floor":
            warnings.warn(
                f"The loss scale is at its floor {self.settings.floor:g} and gradients still overflow: steps keep"
                " being skipped. Try precision='bf16-mixed', keep_fp32=[...] for the overflowing layers, or a lower"
                " learning rate.",
                RuntimeWarning,
                stacklevel=3,
            )
        if not record.device_ruled:
            self._device_trackers_current = False
            if transition.state.scale != before.scale:
                self._write_scale()
        self._raise_on_streak()

    def _raise_on_streak(self) -> None:
        limit = self.max_consecutive_skips
        if limit is None:
            return
        for index, streak in self._streaks.items():
            if streak >= limit:
                optimizer = self._optimizer_at(index)
                optimizer = getattr(optimizer, "optimizer", optimizer)  # name the optimizer, not its wrapper
                raise NonFiniteStepsError(
                    step=self.optimizer_steps,
                    consecutive_skips=streak,
                    scale=self.get_scale(),
                    nonfinite_parameters=self._culprits([index]) or self._last_culprits.get(index, []),
                    optimizer=f"optimizer {index} ({type(optimizer).__name__})" if optimizer is not None else None,
                )

    def _culprits(self, indices: list[int]) -> list[tuple[str, tuple[int, ...]]]:
        named = (
            (self.param_names.get(id(p), f"optimizers[{index}].param_groups[{g}][{i}]"), p)
            for index in indices
            if (optimizer := self._optimizer_at(index)) is not None
            for g, group in enumerate(optimizer.param_groups)
            for i, p in enumerate(group["params"])
        )
        return nonfinite_gradients(named)

    def record_unchecked_step(self, skipped: bool = False) -> None:
        """End an iteration whose one step was checked outside this scaler (LBFGS evaluates its own closure).

        Args:
            skipped: whether the caller found a non-finite loss or gradient and undid the step; it counts as a
                skipped step (and towards ``max_consecutive_skips``) like any other.

        """
        self._iteration.stepped.add(_UNCHECKED)
        self._iteration.host_flags[_UNCHECKED] = float(skipped)
        self.update()

    # ------------------------------------------------------------------------------------------------ reading

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 in check mode). Never synchronises.

        Exact on the CPU. On an accelerator, after an iteration whose flag stayed on the device (fused
        optimizers), it is the scale as of the previous iteration until the next :meth:`update`.
        """
        return self._state.scale if self.scales_loss else 1.0

    def _get_growth_tracker(self) -> int:
        return self._state.growth_tracker

    @property
    def hysteresis_tracker(self) -> int:
        """Overflows still tolerated before the next backoff."""
        return self._state.hysteresis_left

    @property
    def consecutive_skips(self) -> int:
        """The longest current streak of skipped steps among the optimizers."""
        return max(self._streaks.values(), default=0)

    def stats(self) -> PrecisionStats:
        """A snapshot of the counters; see :class:`~lightning_mp.stats.PrecisionStats`. Never synchronises.

        As fresh as :meth:`get_scale`: exact on the CPU, at most one iteration old on an accelerator.
        """
        return PrecisionStats(
            loss_scale=self.get_scale(),
            optimizer_steps=self.optimizer_steps,
            skipped_steps=self.skipped_steps,
            last_step_skipped=self.last_step_skipped,
            scale_backoffs=self.scale_backoffs,
            scale_growths=self.scale_growths,
            consecutive_skips=self.consecutive_skips,
        )

    # ------------------------------------------------------------------------------------------------ state

    def __getstate__(self) -> dict[str, Any]:
        """Pickle the settings, the host state and the counters; device tensors and optimizers are rebuilt lazily."""
        if self._pending is not None:
            previous, self._pending = self._pending, None
            self._replay(previous)
        state = super().__getstate__()
        state.update(
            _init_scale=self._state.scale,
            _inv_scale=None,
            _one=None,
            _hysteresis_tensor=None,
            _flags={},
            _clean_flags=set(),
            _optimizers=[],
            _index_by_id={},
            _iteration=_IterationRecord(),
            _mirror=HostMirror(),
            _local_overflows=None,
            _device_trackers_current=False,
        )
        return state

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: torch's five keys, then trackers, bounds, mode and counters.

        A torch GradScaler can load this dict too: it reads the five keys it knows.

        .. warning:: On an accelerator, when the last iteration's flag is still on the device, this waits for it.
        """
        if self._pending is not None:
            previous, self._pending = self._pending, None
            self._replay(previous)
        return {
            "scale": self._state.scale,
            "growth_factor": self.settings.growth_factor,
            "backoff_factor": self.settings.backoff_factor,
            "growth_interval": self.settings.growth_interval,
            "_growth_tracker": self._state.growth_tracker,
            "hysteresis": self.settings.hysteresis,
            "hysteresis_tracker": self._state.hysteresis_left,
            "consecutive_hysteresis": self.settings.consecutive_hysteresis,
            "min_scale": self.settings.min_scale,
            "max_scale": self.settings.max_scale,
            "mode": self.mode,
            "last_step_skipped": self.last_step_skipped,
            "counters": {name: getattr(self, name) for name in _COUNTERS},
            "streaks": [self._streaks.get(i, 0) for i in range(max(len(self._optimizers), len(self._streaks)))],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scale, the trackers and the counters, validated and fitted to this run's settings.

        Accepts torch's five-key GradScaler dict as well (counters then start from zero). This run's settings win
        over the dict's (a difference is warned about); a positive scale outside ``[floor, max_scale]`` and trackers
        beyond this run's ``growth_interval``/``hysteresis`` are clamped with a warning naming the key and both
        values. A scale of 0, a negative one or a non-finite one cannot come from training and is refused.

        Raises:
            RuntimeError: if ``state_dict`` is empty.
            ValueError: if a field is malformed; the message names the key, the value and what was expected.

        """
        owner = f"{type(self).__name__}.load_state_dict"
        if not isinstance(state_dict, dict):
            raise ValueError(f"{owner}(state_dict={state_dict!r}) is not allowed: expected a dict.")
        if not state_dict:
            raise RuntimeError("The loss scaler state dict is empty: there is no scale to restore.")
        settings = self.settings
        knobs = {
            "growth_factor": settings.growth_factor,
            "backoff_factor": settings.backoff_factor,
            "growth_interval": settings.growth_interval,
            "hysteresis": settings.hysteresis,
        }
        changed = [f"{k}: {state_dict[k]} -> {v}" for k, v in knobs.items() if k in state_dict and state_dict[k] != v]
        if changed:
            warnings.warn(
                "The checkpoint's loss-scaler settings differ from this run's; this run's are used ("
                + ", ".join(changed)
                + ").",
                UserWarning,
                stacklevel=2,
            )
        counters = state_dict.get("counters", {})
        if not isinstance(counters, dict):
            raise ValueError(f"{owner}: key 'counters' holds {counters!r}; expected a dict of non-negative integers.")
        values = {name: self._count(owner, f"counters['{name}']", counters.get(name, 0)) for name in _COUNTERS}
        if values["skipped_steps"] > values["optimizer_steps"] or values["consecutive_skips"] > values["skipped_steps"]:
            raise ValueError(
                f"{owner}: counters {values} are inconsistent; expected consecutive_skips <= skipped_steps <="
                " optimizer_steps."
            )
        streaks = state_dict.get("streaks", [values["consecutive_skips"]] if values["consecutive_skips"] else [])
        if not isinstance(streaks, list):
            raise ValueError(f"{owner}: key 'streaks' holds {streaks!r}; expected a list of non-negative integers.")
        streaks = [self._count(owner, f"streaks[{i}]", s) for i, s in enumerate(streaks)]
        limit = self.max_consecutive_skips
        if limit is not None and any(s >= limit for s in streaks):
            warnings.warn(
                f"The checkpoint's skip streaks {streaks} reach this run's max_consecutive_skips={limit}; they are"
                f" clamped to {limit - 1}.",
                UserWarning,
                stacklevel=2,
            )
            streaks = [min(s, limit - 1) for s in streaks]
        last_step_skipped = state_dict.get("last_step_skipped", False)
        if not isinstance(last_step_skipped, bool):
            raise ValueError(f"{owner}: key 'last_step_skipped' holds {last_step_skipped!r}; expected a bool.")
        state = self._state
        if self.mode == "dynamic":
            state = self._loaded_state(owner, state_dict)
        for name in ("optimizer_steps", "skipped_steps", "scale_backoffs", "scale_growths"):
            setattr(self, name, values[name])
        self._streaks = dict(enumerate(streaks))
        self.last_step_skipped = last_step_skipped
        self._state = state
        self._device_trackers_current = False
        self._write_scale()
        self._write_trackers()

    @staticmethod
    def _count(owner: str, key: str, value: Any) -> int:
        try:
            return check_number(owner, key, value, at_least=0, integer=True)
        except ValueError:
            raise ValueError(f"{owner}: key {key!r} holds {value!r}; expected a non-negative integer.") from None

    def _loaded_state(self, owner: str, state_dict: dict[str, Any]) -> ScaleState:
        settings = self.settings
        if "scale" not in state_dict:
            raise ValueError(f"{owner}: the dict has no key 'scale'; expected the loss scale, a positive number.")
        raw_scale = state_dict["scale"]
        try:
            # Training never makes a scale of 0, a negative one or a non-finite one: such a value is damage.
            scale = check_number(owner, "scale", raw_scale, above=0)
        except ValueError:
            raise ValueError(
                f"{owner}: key 'scale' holds {raw_scale!r}; expected a finite positive number (the loss scale). No"
                " training writes such a scale, so the checkpoint is damaged: restore another one, or drop the"
                " scaler's state to start again from init_scale."
            ) from None
        low, high = settings.floor, settings.max_scale
        if not low <= scale <= high:
            warnings.warn(
                f"The checkpoint's key 'scale' holds {scale:g}, outside [{low:g}, {high:g}]; it is clamped to"
                f" {min(max(scale, low), high):g}.",
                UserWarning,
                stacklevel=3,
            )
        growth_tracker = self._count(owner, "_growth_tracker", state_dict.get("_growth_tracker", 0))
        saved_hysteresis = state_dict.get("hysteresis_tracker", settings.hysteresis)
        hysteresis_left = self._count(owner, "hysteresis_tracker", saved_hysteresis)
        fitted_growth = min(growth_tracker, settings.growth_interval - 1)
        fitted_hysteresis = min(hysteresis_left, settings.hysteresis)
        for key, saved, fitted in (
            ("_growth_tracker", growth_tracker, fitted_growth),
            ("hysteresis_tracker", hysteresis_left, fitted_hysteresis),
        ):
            if saved != fitted:
                warnings.warn(
                    f"The checkpoint's key {key!r} holds {saved}, beyond this run's settings; it is clamped to"
                    f" {fitted}.",
                    UserWarning,
                    stacklevel=3,
                )
        return ScaleState(float32_within(scale, low, high), fitted_growth, fitted_hysteresis)
