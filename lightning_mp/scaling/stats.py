"""Read-only snapshots of the loss scaler: its counters (:class:`PrecisionStats`), and :class:`ScalerView`.

The scaler builds a :class:`PrecisionStats` from host-side counters, so reading it never synchronises with the
device. How fresh they are: where a step read the inf flag to decide the skip (optimizers that are not fused), or
on the CPU, exact after every ``update``; where the flag stayed on the device (fused optimizers on a GPU), as of
the previous iteration, since the host reads a non-blocking copy of the flag one iteration later.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrecisionStats:
    """Loss-scaling counters at the end of the last optimizer step.

    Attributes:
        loss_scale: the scale the next backward will use; 1.0 where nothing is scaled (bf16, fp32).
        optimizer_steps: optimizer steps attempted, skipped ones included.
        skipped_steps: steps skipped because a gradient was inf or NaN (cumulative). Identical on every DDP rank.
        last_step_skipped: whether the most recent step was skipped.
        scale_backoffs: how many times the scale was reduced.
        scale_growths: how many times the scale was increased.
        consecutive_skips: skipped steps in a row up to now (0 after a clean step).
        loss_scales: with ``scale_per_optimizer=True``, each optimizer's scale, by optimizer number
            (:mod:`lightning_mp.scaling.per_optimizer`); empty where one scale serves every optimizer.

    """

    loss_scale: float = 1.0
    optimizer_steps: int = 0
    skipped_steps: int = 0
    last_step_skipped: bool = False
    scale_backoffs: int = 0
    scale_growths: int = 0
    consecutive_skips: int = 0
    loss_scales: tuple[float, ...] = ()

    @classmethod
    def from_counters(cls, loss_scale: float, last_step_skipped: bool, counters: Mapping[str, int]) -> PrecisionStats:
        """The statistics of one scaler: its scale, whether its last step was skipped, and its counters."""
        return cls(
            loss_scale=loss_scale,
            optimizer_steps=counters["optimizer_steps"],
            skipped_steps=counters["skipped_steps"],
            last_step_skipped=last_step_skipped,
            scale_backoffs=counters["scale_backoffs"],
            scale_growths=counters["scale_growths"],
            consecutive_skips=counters["consecutive_skips"],
        )

    @property
    def skip_rate(self) -> float:
        """Skipped steps over attempted steps since the start of training (0.0 before the first step)."""
        return self.skipped_steps / self.optimizer_steps if self.optimizer_steps else 0.0

    def as_dict(self, prefix: str = "precision/") -> dict[str, float]:
        """Every counter and the skip rate as a float under ``prefix``: ready for ``fabric.log_dict`` or any logger.

        With a scale per optimizer, each one's is ``loss_scale/optimizer_<number>`` too.

        Example:
            >>> PrecisionStats(loss_scale=1024.0, optimizer_steps=4, skipped_steps=1).as_dict()["precision/skip_rate"]
            0.25

        """
        values = {
            field.name: float(getattr(self, field.name))
            for field in dataclasses.fields(self)
            if field.name != "loss_scales"
        }
        values["skip_rate"] = self.skip_rate
        values.update({f"loss_scale/optimizer_{number}": scale for number, scale in enumerate(self.loss_scales)})
        return {prefix + name: value for name, value in values.items()}


@dataclass(frozen=True)
class ScalerView:
    """What telemetry reads from the loss scaler beyond :class:`PrecisionStats`, without a device synchronisation.

    Attributes:
        local_overflows: this rank's overflow count: a 0-d device tensor where the scaler counts on the device
            (under DDP, so that a reduction gathers it with other counters in one collective), else a host integer.
        max_scale: the dynamic scale's ceiling, which tells "as high as it goes" from "still growing"; None where
            the scale does not move.
        scales_loss: whether the loss is multiplied by a scale (fp16 with a dynamic or static scale); False where the
            scaler only checks for inf and NaN (bf16, fp32) and before setup.

    """

    local_overflows: torch.Tensor | int = 0
    max_scale: float | None = None
    scales_loss: bool = False
