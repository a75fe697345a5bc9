"""Exceptions of lightning_mp.

A collapsed loss scale is the one failure mixed precision cannot recover from by itself: every step is skipped
and the model silently stops learning. :class:`LossScaleCollapseError` turns that into a loud, actionable stop.
"""

from __future__ import annotations

from collections.abc import Sequence


class LossScaleCollapseError(RuntimeError):
    """The dynamic loss scale would fall below its floor: gradients overflow at every scale tried.

    Args:
        step: the optimizer step (counted from 1, skipped steps included) at which the collapse happened.
        scale: the loss scale in force when the last overflow was seen.
        floor: the smallest scale allowed (``min_scale``, or the collapse floor when ``min_scale`` is None).
        nonfinite_parameters: ``(name, shape)`` of parameters whose gradients were not finite at that step.

    """

    def __init__(
        self,
        step: int,
        scale: float,
        floor: float,
        nonfinite_parameters: Sequence[tuple[str, tuple[int, ...]]] = (),
    ) -> None:
        self.step = step
        self.scale = scale
        self.floor = floor
        self.nonfinite_parameters = list(nonfinite_parameters)
        if self.nonfinite_parameters:
            shown = ", ".join(f"{name} {list(shape)}" for name, shape in self.nonfinite_parameters)
            where = f"Parameters with non-finite gradients: {shown}."
        else:
            where = "No parameter names were available for this optimizer."
        super().__init__(
            f"Loss scale collapse at optimizer step {step}: gradients are still non-finite at scale {scale:g}, and"
            f" backing off again would go below the floor {floor:g}. {where} Things to try: train in bf16"
            " (precision='bf16-mixed'), which needs no loss scaling; keep the layers above in fp32"
            " (keep_fp32=[...]); lower the learning rate; or check the data and the loss for inf/NaN."
        )
