"""The one place where the telemetry callbacks read the loss scaler beyond its public surface.

The callbacks need three facts that :attr:`MixedPrecision.stats` does not carry, and they must read them without
synchronising the host with the device:

- ``local_overflows``: this rank's own overflow count, as a device tensor where the scaler keeps one (under DDP),
  so that the DDP reduction can gather it with the other counters in one collective instead of calling
  :meth:`MixedPrecision.local_overflows`, which reads it with ``.item()``;
- ``max_scale``: the ceiling of the dynamic scale, to tell "the scale is as high as it goes" apart from "the scale
  is still growing" (the underflow rule of :class:`~lightning_mp.callbacks.PrecisionSentinel`);
- ``scales_loss``: whether the scaler multiplies the loss at all (False in bf16 and fp32, where it only checks for
  inf and NaN).

Private names read here (re-point this function when the scaler changes): ``MixedPrecision._loss_scaler``, to see
the scaler in its checking mode too, where :attr:`MixedPrecision.scaler` is None; ``LossScaler._local_overflows``,
the device counter behind :meth:`LossScaler.local_overflows`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_mp.plugin import MixedPrecision


@dataclass(frozen=True)
class ScalerView:
    """What the telemetry callbacks read from the loss scaler, without a device synchronisation.

    Attributes:
        local_overflows: this rank's overflow count: a 0-d device tensor where the scaler counts on the device,
            else a host integer.
        max_scale: the dynamic scale's ceiling; None where the scale does not move.
        scales_loss: whether the loss is multiplied by a scale (fp16 with a dynamic or static scale).

    """

    local_overflows: torch.Tensor | int
    max_scale: float | None
    scales_loss: bool


def scaler_view(plugin: MixedPrecision) -> ScalerView:
    """Read the loss scaler's counters and settings for telemetry; never synchronises with the device."""
    scaler = plugin._loss_scaler
    if scaler is None:
        return ScalerView(local_overflows=0, max_scale=None, scales_loss=False)
    device_counter = getattr(scaler, "_local_overflows", None)
    local = device_counter if isinstance(device_counter, torch.Tensor) else scaler.skipped_steps
    max_scale = scaler.max_scale if scaler.mode == "dynamic" else None
    return ScalerView(local_overflows=local, max_scale=max_scale, scales_loss=scaler.scales_loss)
