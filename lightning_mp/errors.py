"""Exceptions of lightning_mp.

A collapsed loss scale, or gradients that are never finite, are the failures mixed precision cannot recover from by
itself: every step is skipped and the model silently stops learning. :class:`LossScaleCollapseError` and
:class:`NonFiniteStepsError` turn them into a loud, actionable stop that names the non-finite parameters.
"""

from __future__ import annotations

from collections.abc import Sequence


def _describe(nonfinite_parameters: Sequence[tuple[str, tuple[int, ...]]]) -> str:
    if not nonfinite_parameters:
        return (
            "The non-finite gradients could not be named: none was left in this process when this was raised (on"
            " another DDP rank, or clipped by value, zeroed or replaced after the check); GradientHealthMonitor names"
            " them as they happen."
        )
    shown = ", ".join(f"{name} {list(shape)}" for name, shape in nonfinite_parameters)
    return f"Parameters with non-finite gradients: {shown}."


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
        where = _describe(self.nonfinite_parameters)
        super().__init__(
            f"Loss scale collapse at optimizer step {step}: gradients are still non-finite at scale {scale:g}, and"
            f" backing off again would go below the floor {floor:g}. {where} Things to try: train in bf16"
            " (precision='bf16-mixed'), which needs no loss scaling; keep the layers above in fp32"
            " (keep_fp32=[...]); lower the learning rate; or check the data and the loss for inf/NaN."
        )


class NonFiniteStepsError(RuntimeError):
    """Too many optimizer steps in a row were skipped because gradients were inf or NaN.

    Raised in every precision once ``max_consecutive_skips`` is reached: bf16, fp32 and static scales have no scale
    to collapse, so without it a run whose gradients are always non-finite would skip forever.

    Args:
        step: the optimizer step (counted from 1, skipped steps included) at which the limit was reached.
        consecutive_skips: the skipped steps in a row.
        scale: the loss scale in force (1.0 where nothing is scaled).
        nonfinite_parameters: ``(name, shape)`` of parameters whose gradients were not finite at that step.
        optimizer: which optimizer kept skipping (``"optimizer 1 (Adam)"``), when several step in one iteration.

    """

    def __init__(
        self,
        step: int,
        consecutive_skips: int,
        scale: float,
        nonfinite_parameters: Sequence[tuple[str, tuple[int, ...]]] = (),
        optimizer: str | None = None,
    ) -> None:
        self.step = step
        self.consecutive_skips = consecutive_skips
        self.scale = scale
        self.nonfinite_parameters = list(nonfinite_parameters)
        self.optimizer = optimizer
        whose = f" of {optimizer}" if optimizer else ""
        super().__init__(
            f"{consecutive_skips} optimizer steps in a row{whose} were skipped for inf/NaN gradients (step {step}, loss"
            f" scale {scale:g}): the model has stopped learning. {_describe(self.nonfinite_parameters)} Things to"
            " try: check the data and the loss for inf/NaN; keep the layers above in fp32 (keep_fp32=[...]); lower"
            " the learning rate; raise max_consecutive_skips, or set it to None, if such streaks are expected."
        )
