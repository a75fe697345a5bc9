"""Dynamic loss scaling with hysteresis, bounds, a static mode and counters, on torch's GradScaler kernels.

Why scale at all: fp16 keeps 5 exponent bits, so gradients smaller than 2**-24 flush to zero and the model stops
learning from them. Multiplying the loss by a large factor ``S`` before ``backward`` shifts every gradient up by
``S`` into fp16's range; dividing the fp32 gradients by ``S`` before the optimizer step undoes it exactly.

How the scale moves (dynamic mode), once per optimizer step:

* ``unscale_`` multiplies every gradient by ``1/S`` and sets a flag if any of them is inf or NaN. This is torch's
  fused ``_amp_foreach_non_finite_check_and_unscale_`` kernel, one pass over the gradients. Under DDP the flag is
  all-reduced (max) so that every rank takes the same decision.
* ``step`` reads the flag (the one host-device synchronisation of the whole algorithm, which torch already makes)
  and skips ``optimizer.step()`` entirely when it is set: no parameter, moment or step count changes.
* ``update`` applies the rules below on the host, where the flag already is, and writes the new scale to the
  device only when it changed:

  - overflow: the growth tracker resets to 0 and the hysteresis tracker drops by one. When it reaches 0 the scale
    is multiplied by ``backoff_factor``. With ``hysteresis=1`` (the default) this is exactly torch's rule; with
    ``hysteresis=2`` one isolated overflow is skipped without losing half the scale, as in DeepSpeed and Megatron.
  - clean step: the growth tracker counts up; after ``growth_interval`` clean steps in a row the scale is
    multiplied by ``growth_factor`` (never above ``max_scale``) and the hysteresis tracker refills. With
    ``consecutive_hysteresis=True`` it refills after every clean step instead.
  - floor: an overflow that would push the scale below ``min_scale`` (or below ``2**-24`` when ``min_scale`` is
    None, a scale at which no fp16 gradient is distinguishable from zero anyway) raises
    :class:`~lightning_mp.errors.LossScaleCollapseError`, or with ``on_min_scale="warn"`` warns and stays at the
    floor. A collapse never skips silently forever.
  - streak: ``max_consecutive_skips`` skipped steps in a row (100 by default) raise
    :class:`~lightning_mp.errors.NonFiniteStepsError` in every mode, since bf16, fp32 and static scales have no
    scale to collapse and would otherwise skip forever.

Other modes: ``"static"`` keeps the scale fixed (Apex's static loss scale) but still skips non-finite steps;
``"check"`` multiplies nothing (bf16 and fp32 need no scaling) and only skips non-finite steps, so no mode ever
writes a NaN into the weights.

Because the scale is mirrored on the host, :meth:`LossScaler.get_scale` is free: it never synchronises.
"""

from __future__ import annotations

import math
import struct
import warnings
from collections import defaultdict
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state

from lightning_mp._gradients import nonfinite_gradients
from lightning_mp._validation import check_choice, check_number
from lightning_mp.errors import LossScaleCollapseError, NonFiniteStepsError
from lightning_mp.stats import PrecisionStats

ScalingMode = Literal["dynamic", "static", "check"]
OnMinScale = Literal["raise", "warn"]

COLLAPSE_FLOOR = 2.0**-24
"""The floor used when ``min_scale`` is None."""

_COUNTERS = ("optimizer_steps", "skipped_steps", "scale_backoffs", "scale_growths", "consecutive_skips")


def _to_float32(value: float) -> float:
    """Round a Python float to the nearest float32, as the device-side scale tensor stores it."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _float32_within(value: float, low: float, high: float) -> float:
    """``value`` rounded to float32, moved one float32 step back inside ``[low, high]`` where rounding left it.

    The scale lives in a float32 tensor, and a bound such as ``min_scale=1e-6`` is not a float32: rounding to the
    nearest float32 can land just outside the range the user asked for.
    """
    rounded = _to_float32(value)
    if rounded < low or rounded > high:
        bits = struct.unpack("<I", struct.pack("<f", rounded))[0]
        # For positive floats, the next larger float32 is the next integer bit pattern.
        rounded = struct.unpack("<f", struct.pack("<I", bits + (1 if rounded < low else -1)))[0]
    return rounded


def validate_scaler_arguments(
    owner: str,
    *,
    init_scale: float,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float | None,
    max_scale: float,
    on_min_scale: str,
    check_init_range: bool = True,
    max_consecutive_skips: int | None = None,
) -> None:
    """Check the scaler's knobs; raise ValueError naming the argument, the value and what is allowed.

    ``check_init_range=False`` skips the check that ``init_scale`` lies in ``[min_scale, max_scale]``: a static
    scale is not bound by the dynamic range.
    """
    check_number(owner, "init_scale", init_scale, above=0)
    check_number(owner, "growth_factor", growth_factor, above=1)
    check_number(owner, "backoff_factor", backoff_factor, above=0, below=1)
    check_number(owner, "growth_interval", growth_interval, at_least=1, integer=True)
    check_number(owner, "hysteresis", hysteresis, at_least=1, integer=True)
    check_number(owner, "max_scale", max_scale, above=0)
    if min_scale is not None:
        check_number(owner, "min_scale", min_scale, above=0)
        if min_scale > max_scale:
            raise ValueError(
                f"{owner}(min_scale={min_scale!r}, max_scale={max_scale!r}) is not allowed: min_scale must be"
                " <= max_scale."
            )
    low = min_scale if min_scale is not None else 0.0
    if check_init_range and not low <= init_scale <= max_scale:
        raise ValueError(
            f"{owner}(init_scale={init_scale!r}) is not allowed: init_scale must lie in"
            f" [min_scale, max_scale] = [{low:g}, {max_scale:g}]."
        )
    check_choice(owner, "on_min_scale", on_min_scale, ("raise", "warn"))
    if max_consecutive_skips is not None:
        check_number(owner, "max_consecutive_skips", max_consecutive_skips, at_least=1, integer=True)


class LossScaler(torch.amp.GradScaler):
    """A ``torch.amp.GradScaler`` with hysteresis, scale bounds, a static and a check-only mode, and counters.

    The module docstring describes the algorithm. Use it through :class:`~lightning_mp.MixedPrecision`, or by hand
    exactly like a GradScaler::

        scaler = LossScaler("cpu", growth_interval=1000, hysteresis=2)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)          # optional: clip here, gradients are true
        scaler.step(optimizer)              # skipped when a gradient is inf/NaN
        scaler.update()

    Args:
        device: the device type of the gradients (``"cpu"``, ``"cuda"``, ...).
        init_scale: the scale of the first step.
        growth_factor: multiplier applied after ``growth_interval`` clean steps; > 1.
        backoff_factor: multiplier applied on an overflow that exhausts the hysteresis; in (0, 1).
        growth_interval: clean steps in a row before the scale grows; >= 1.
        hysteresis: overflows tolerated before the scale backs off; 1 is torch's behaviour.
        consecutive_hysteresis: refill the hysteresis tracker after every clean step, not only after a growth.
        min_scale: the floor; None means the collapse floor ``2**-24``.
        max_scale: the ceiling the scale never grows past.
        on_min_scale: ``"raise"`` a :class:`~lightning_mp.errors.LossScaleCollapseError` or ``"warn"`` and stay at
            the floor when an overflow would push the scale below it.
        mode: ``"dynamic"``, ``"static"`` (fixed ``init_scale``) or ``"check"`` (no scaling, skip non-finite steps).
        max_consecutive_skips: raise :class:`~lightning_mp.errors.NonFiniteStepsError` after this many skipped
            steps in a row, in every mode (without it a bf16, fp32 or static run whose gradients are always inf
            would skip forever); None disables the guard.

    Raises:
        ValueError: for any argument outside its allowed range.

    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        consecutive_hysteresis: bool = False,
        min_scale: float | None = None,
        max_scale: float = 2.0**24,
        on_min_scale: OnMinScale = "raise",
        mode: ScalingMode = "dynamic",
        max_consecutive_skips: int | None = 100,
    ) -> None:
        owner = type(self).__name__
        check_choice(owner, "mode", mode, ("dynamic", "static", "check"))
        if mode == "check":
            init_scale = 1.0
        validate_scaler_arguments(
            owner,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            min_scale=min_scale,
            max_scale=max_scale,
            on_min_scale=on_min_scale,
            check_init_range=mode == "dynamic",
            max_consecutive_skips=max_consecutive_skips,
        )
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=True,
        )
        self.mode: ScalingMode = mode
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = min_scale
        self.max_scale = max_scale
        self.on_min_scale: OnMinScale = on_min_scale
        self.max_consecutive_skips = max_consecutive_skips
        self.allow_fp16_gradients = False
        """Set by opt levels whose gradients are fp16 themselves (O3): torch refuses to unscale those by default."""
        self.param_names: dict[int, str] = {}
        """``id(parameter) -> qualified name``, so that errors can name the parameters that overflowed."""

        low = min_scale if min_scale is not None else COLLAPSE_FLOOR
        in_range = mode == "dynamic" and low <= init_scale <= max_scale
        self._host_scale = _float32_within(init_scale, low, max_scale) if in_range else _to_float32(init_scale)
        self._host_growth_tracker = 0
        self._hysteresis_left = hysteresis
        self.optimizer_steps = 0
        self.skipped_steps = 0
        self.scale_backoffs = 0
        self.scale_growths = 0
        self.consecutive_skips = 0
        self.last_step_skipped = False
        self._found_inf_this_iteration: bool | None = None
        self._stepped_optimizers: list[torch.optim.Optimizer] = []
        self._local_overflows: torch.Tensor | None = None
        self._write_scale()

    @property
    def scales_loss(self) -> bool:
        """Whether the loss is multiplied at all (dynamic or static mode)."""
        return self.mode != "check"

    def scale(self, outputs: Any) -> Any:
        """Multiply the loss by the current scale; in check mode return it unchanged."""
        if not self.scales_loss:
            return outputs
        return super().scale(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place and record whether any is inf or NaN.

        Runs at most once per optimizer step, like torch's. Under DDP the inf flag is all-reduced with ``max``, so a
        rank whose gradients overflowed makes every rank skip: the parameters never diverge across ranks.
        """
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        scale = self._scale_tensor_for(optimizer)
        inv_scale = scale.double().reciprocal().float()
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=scale.device)
        per_device = self._unscale_grads_(optimizer, inv_scale, found_inf, self.allow_fp16_gradients)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            for flag in per_device.values():
                self._count_local_overflow(flag)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        state["found_inf_per_device"] = per_device
        state["stage"] = OptState.UNSCALED

    def _scale_tensor_for(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        if self._scale is None:
            device = next(
                (p.device for group in optimizer.param_groups for p in group["params"] if p.grad is not None),
                torch.device(self._device),
            )
            self._lazy_init_scale_growth_tracker(device)
        assert self._scale is not None
        return self._scale

    def _count_local_overflow(self, flag: torch.Tensor) -> None:
        # Kept on the device (no sync); read only when telemetry asks for it.
        if self._local_overflows is None:
            self._local_overflows = torch.zeros((), dtype=torch.float32, device=flag.device)
        self._local_overflows += (flag > 0).float()

    def local_overflows(self) -> int:
        """Steps on which this rank's own gradients overflowed, before the DDP all-reduce.

        .. warning:: Under DDP this reads a device counter and synchronises; call it on logging steps only.
        """
        if self._local_overflows is None:
            return self.skipped_steps
        return int(self._local_overflows.item())

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale if needed, then run ``optimizer.step()`` unless a gradient is inf or NaN."""
        if self._scale is None:
            self._scale_tensor_for(optimizer)
        self._stepped_optimizers.append(optimizer)
        return super().step(optimizer, *args, **kwargs)

    def _maybe_opt_step(
        self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any], *args: Any, **kwargs: Any
    ) -> Any:
        # The one host-device synchronisation of the step (torch makes the same one). The flag is kept on the host
        # so that update() and the telemetry need no further sync.
        found_inf = bool(sum(v.item() for v in optimizer_state["found_inf_per_device"].values()))
        self._found_inf_this_iteration = bool(self._found_inf_this_iteration) or found_inf
        if found_inf:
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Move the scale after the step(s) of this iteration, by the rules in the module docstring.

        Args:
            new_scale: set the scale to this value instead (the trackers are left alone).

        Raises:
            LossScaleCollapseError: when an overflow would push the scale below its floor and
                ``on_min_scale="raise"``.

        """
        if new_scale is not None:
            value = float(new_scale.item()) if isinstance(new_scale, torch.Tensor) else float(new_scale)
            self._host_scale = _to_float32(value)
            self._write_scale()
            self._end_iteration()
            return
        found_inf = self._found_inf_this_iteration
        if found_inf is None:
            flags = [f for s in self._per_optimizer_states.values() for f in s["found_inf_per_device"].values()]
            if not flags:
                raise AssertionError("No inf checks were recorded prior to update.")
            # Optimizers that unscale inside their own step (fused Adam) never pass through _maybe_opt_step.
            found_inf = any(bool(f.item()) for f in flags)
        try:
            self._record_outcome(found_inf)
        finally:
            self._end_iteration()

    def _end_iteration(self) -> None:
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        self._found_inf_this_iteration = None
        self._stepped_optimizers = []

    def _record_outcome(self, found_inf: bool) -> None:
        self.optimizer_steps += 1
        self.last_step_skipped = found_inf
        if found_inf:
            self.skipped_steps += 1
            self.consecutive_skips += 1
        else:
            self.consecutive_skips = 0
        if self.mode == "dynamic" and found_inf:
            self._host_growth_tracker = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self._back_off()
        if (
            found_inf
            and self.max_consecutive_skips is not None
            and self.consecutive_skips >= self.max_consecutive_skips
        ):
            raise NonFiniteStepsError(
                step=self.optimizer_steps,
                consecutive_skips=self.consecutive_skips,
                scale=self.get_scale(),
                nonfinite_parameters=self._culprits(),
            )
        if self.mode == "dynamic" and not found_inf:
            if self.consecutive_hysteresis:
                self._hysteresis_left = self.hysteresis
            self._host_growth_tracker += 1
            if self._host_growth_tracker == self._growth_interval:
                self._host_growth_tracker = 0
                self._grow()

    def _back_off(self) -> None:
        candidate = _to_float32(self._host_scale * self._backoff_factor)
        floor = self.min_scale if self.min_scale is not None else COLLAPSE_FLOOR
        if candidate < floor:
            if self.on_min_scale == "raise":
                raise LossScaleCollapseError(
                    step=self.optimizer_steps,
                    scale=self._host_scale,
                    floor=floor,
                    nonfinite_parameters=self._culprits(),
                )
            warnings.warn(
                f"The loss scale is at its floor {floor:g} and gradients still overflow: steps keep being skipped."
                " Try precision='bf16-mixed', keep_fp32=[...] for the overflowing layers, or a lower learning rate.",
                RuntimeWarning,
                stacklevel=2,
            )
            candidate = _float32_within(floor, floor, math.inf)
        if candidate < self._host_scale:
            self.scale_backoffs += 1
            self._host_scale = candidate
            self._write_scale()

    def _grow(self) -> None:
        candidate = _to_float32(self._host_scale * self._growth_factor)
        if not math.isfinite(candidate):
            candidate = self._host_scale
        candidate = min(candidate, _float32_within(self.max_scale, 0.0, self.max_scale))
        if not self.consecutive_hysteresis:
            self._hysteresis_left = self.hysteresis
        if candidate > self._host_scale:
            self.scale_growths += 1
            self._host_scale = candidate
            self._write_scale()

    def _write_scale(self) -> None:
        # fill_ from a Python float is an asynchronous kernel launch: no synchronisation.
        if self._scale is not None:
            self._scale.fill_(self._host_scale)
        else:
            self._init_scale = self._host_scale

    def _culprits(self) -> list[tuple[str, tuple[int, ...]]]:
        named = (
            (self.param_names.get(id(p), f"param_groups[{g}][{i}]"), p)
            for optimizer in self._stepped_optimizers
            for g, group in enumerate(optimizer.param_groups)
            for i, p in enumerate(group["params"])
        )
        return nonfinite_gradients(named)

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 in check mode). Free: read from the host mirror, no sync."""
        return self._host_scale if self.scales_loss else 1.0

    def _get_growth_tracker(self) -> int:
        return self._host_growth_tracker

    @property
    def hysteresis_tracker(self) -> int:
        """Overflows still tolerated before the next backoff."""
        return self._hysteresis_left

    def stats(self) -> PrecisionStats:
        """A snapshot of the counters; see :class:`~lightning_mp.stats.PrecisionStats`. Never synchronises."""
        return PrecisionStats(
            loss_scale=self.get_scale(),
            optimizer_steps=self.optimizer_steps,
            skipped_steps=self.skipped_steps,
            last_step_skipped=self.last_step_skipped,
            scale_backoffs=self.scale_backoffs,
            scale_growths=self.scale_growths,
            consecutive_skips=self.consecutive_skips,
        )

    def record_unchecked_step(self) -> None:
        """Count a step taken without the inf check (an optimizer that needs a closure, such as LBFGS)."""
        self._record_outcome(False)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: torch's five keys, then trackers, bounds, mode and counters.

        A torch GradScaler can load this dict too: it reads the five keys it knows.
        """
        return {
            "scale": self._host_scale,
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._host_growth_tracker,
            "hysteresis": self.hysteresis,
            "hysteresis_tracker": self._hysteresis_left,
            "consecutive_hysteresis": self.consecutive_hysteresis,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "mode": self.mode,
            "last_step_skipped": self.last_step_skipped,
            "counters": {name: getattr(self, name) for name in _COUNTERS},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scale, the trackers and the counters.

        Accepts torch's five-key GradScaler dict as well (trackers and counters then start from zero). The knobs
        given to the constructor win over those in the dict; a difference is warned about.

        Raises:
            RuntimeError: if ``state_dict`` is empty.

        """
        if not state_dict:
            raise RuntimeError("The loss scaler state dict is empty: there is no scale to restore.")
        knobs = {"growth_factor": self._growth_factor, "backoff_factor": self._backoff_factor}
        knobs.update(growth_interval=self._growth_interval, hysteresis=self.hysteresis)
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
        for name in _COUNTERS:
            setattr(self, name, int(counters.get(name, 0)))
        self.last_step_skipped = bool(state_dict.get("last_step_skipped", False))
        if self.mode != "dynamic":
            # A static scale is fixed by the constructor, and check mode has no scale at all.
            return
        scale = float(state_dict["scale"])
        low = self.min_scale if self.min_scale is not None else 0.0
        if not low <= scale <= self.max_scale:
            warnings.warn(
                f"The checkpoint's loss scale {scale:g} lies outside [{low:g}, {self.max_scale:g}]; it is clamped.",
                UserWarning,
                stacklevel=2,
            )
            scale = min(max(scale, low), self.max_scale)
        self._host_scale = _float32_within(scale, low, self.max_scale)
        self._host_growth_tracker = int(state_dict.get("_growth_tracker", 0))
        self._hysteresis_left = int(state_dict.get("hysteresis_tracker", self.hysteresis))
        self._write_scale()
