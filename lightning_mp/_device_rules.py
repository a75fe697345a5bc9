"""The scale rules of :func:`~lightning_mp._scale_rules.next_state`, as a few in-place device ops.

Where the inf flag never reaches the host (a fused optimizer skipped on the device), the scale must still move by
the same rules without a sync. torch's ``_amp_update_scale_`` kernel implements ``hysteresis=1``: back off on an
overflow, grow after ``growth_interval`` clean iterations. Around it:

* the growth factor is capped at ``float32_max / max_scale``, so a growth never overflows float32 (the kernel keeps
  the old scale when it would) and still reaches the ceiling;
* a clamp keeps the scale in ``[floor, max_scale]``; the host's replay of the same rules raises the collapse error;
* with ``hysteresis > 1`` a float tracker counts overflows down, only the overflow that empties it reaches the kernel
  as a backoff, an absorbed one still restarts the growth window (the tracker is set to -1, which the kernel's clean
  branch turns into 0), and the tracker refills after a growth (or after every clean iteration with
  ``consecutive_hysteresis``);
* ``1/scale`` is recomputed in place for the next unscale.

The property tests drive a fused optimizer through these ops and the pure rules side by side: they agree exactly.
"""

from __future__ import annotations

import torch

from lightning_mp._scale_rules import FLOAT32_MAX, ScalerSettings


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
        settings: the knobs.

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
