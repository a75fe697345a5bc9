"""The scale rules of :func:`~lightning_mp.scaling.rules.next_state`, as a few in-place device ops.

Where the inf flag never reaches the host (a fused optimizer skipped on the device), the scale must still move by
the same rules without a sync. torch's ``_amp_update_scale_`` kernel implements ``hysteresis=1``: back off on an
overflow, grow after ``growth_interval`` clean iterations. Around it:

* the growth factor is capped at ``float32_max / max_scale``, so a growth never overflows float32 (the kernel keeps
  the old scale when it would) and still reaches the ceiling;
* a clamp keeps the scale in ``[floor, max_scale]``; the host's update from the same rules raises the collapse error;
* with ``hysteresis > 1`` a float tracker counts overflows down, only the overflow that empties it reaches the kernel
  as a backoff, an absorbed one still restarts the growth window (the tracker is set to -1, which the kernel's clean
  branch turns into 0), and the tracker refills after a growth (or after every clean iteration with
  ``consecutive_hysteresis``);
* ``1/scale`` is recomputed in place for the next unscale.

:class:`DeviceScale` holds those tensors: allocated on the gradients' device at first use from the host's
:class:`~lightning_mp.scaling.rules.ScaleState`, rewritten from it (an asynchronous ``fill_``, no sync) when the host
rules moved the scale, and never pickled (an unpickled scaler allocates them again).

Private names: :mod:`lightning_mp._private_names` lists them, with the reason for each.

The property tests drive a fused optimizer through these ops and the pure rules side by side: they agree exactly.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_mp.scaling.rules import FLOAT32_MAX, ScalerSettings, ScaleState


def update_scale_on_device(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    hysteresis_left: torch.Tensor,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    settings: ScalerSettings,
) -> None:
    """Move ``scale`` and its trackers in place after one iteration whose inf flag is ``found_inf`` (0. or 1.).

    Args:
        scale: the float32 scale, 0-d.
        growth_tracker: the int32 count of clean iterations since the last growth or overflow, 0-d.
        hysteresis_left: the float32 count of overflows still tolerated, 0-d (unused with ``hysteresis=1``).
        inv_scale: the float32 ``1/scale``, 0-d, rewritten.
        found_inf: the iteration's float32 inf flag, 0-d.
        settings: the settings.

    """
    growth_factor = min(settings.growth_factor, FLOAT32_MAX / settings.max_scale)
    if settings.hysteresis == 1:
        backs_off = found_inf
    else:
        hysteresis_left.sub_(found_inf).clamp_(min=0)
        backs_off = found_inf * (hysteresis_left == 0)
        growth_tracker.masked_fill_(found_inf > 0, -1)
    torch._amp_update_scale_(
        scale, growth_tracker, backs_off, growth_factor, settings.backoff_factor, settings.growth_interval
    )
    if settings.hysteresis > 1:
        refill = found_inf == 0
        if not settings.consecutive_hysteresis:
            refill &= growth_tracker == 0
        hysteresis_left.masked_fill_(refill, float(settings.hysteresis))
    scale.clamp_(settings.floor_float32, settings.ceiling_float32)
    torch.reciprocal(scale, out=inv_scale)


class DeviceScale:
    """The scale, ``1/scale``, a one and the two trackers as 0-d tensors on the device of the gradients."""

    def __init__(self) -> None:
        self.scale: torch.Tensor | None = None
        """The float32 scale (1.0 in check mode); None until the first use."""
        self.inv_scale: torch.Tensor | None = None
        """The float32 ``1/scale`` the unscale kernel multiplies by."""
        self.one: torch.Tensor | None = None
        """A float32 one: the multiplier of a check that does not unscale."""
        self.growth_tracker: torch.Tensor | None = None
        self.hysteresis_left: torch.Tensor | None = None
        self.trackers_current = True
        """Whether the device trackers equal the host's (False after the host rules moved them)."""

    def __getstate__(self) -> dict[str, Any]:
        """Device tensors are not pickled: an unpickled scaler allocates them again from the host state."""
        return {**DeviceScale().__dict__, "trackers_current": False}

    def allocate(self, state: ScaleState, device: torch.device, scales_loss: bool) -> None:
        """Allocate the tensors on ``device`` from the host's ``state``."""
        self.scale = torch.full((), state.scale, dtype=torch.float32, device=device)
        self.growth_tracker = torch.full((), state.growth_tracker, dtype=torch.int32, device=device)
        self.inv_scale = torch.full((), 1.0 / state.scale if scales_loss else 1.0, dtype=torch.float32, device=device)
        self.one = torch.ones((), dtype=torch.float32, device=device)
        self.hysteresis_left = torch.full((), float(state.hysteresis_left), device=device)

    def write_scale(self, state: ScaleState, scales_loss: bool) -> None:
        """Write the host's scale and its inverse, if allocated (``fill_`` from a float: a launch, no sync)."""
        if self.scale is None or self.inv_scale is None:
            return
        self.scale.fill_(state.scale)
        self.inv_scale.fill_(1.0 / state.scale if scales_loss else 1.0)

    def write_trackers(self, state: ScaleState) -> None:
        """Write the host's trackers where the device copies are stale."""
        if self.growth_tracker is not None and self.hysteresis_left is not None and not self.trackers_current:
            self.growth_tracker.fill_(state.growth_tracker)
            self.hysteresis_left.fill_(float(state.hysteresis_left))
        self.trackers_current = True

    def update(self, state: ScaleState, device_flags: list[torch.Tensor], settings: ScalerSettings) -> None:
        """Move the scale by the rules on the device, after an iteration whose flags are ``device_flags``."""
        self.write_trackers(state)
        assert self.scale is not None and self.growth_tracker is not None
        assert self.hysteresis_left is not None and self.inv_scale is not None
        found_inf = device_flags[0] if len(device_flags) == 1 else torch.stack(device_flags).amax()
        update_scale_on_device(
            self.scale, self.growth_tracker, self.hysteresis_left, self.inv_scale, found_inf, settings
        )
