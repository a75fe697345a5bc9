"""Naming the parameters whose gradients were not finite, for the errors that stop a run.

When the scale collapses or one optimizer skips ``max_consecutive_skips`` steps in a row, the error names the
parameters to blame: each parameter of the optimizers involved whose gradient holds an inf or a NaN, by its qualified
name where the opt level told the scaler its names (``param_names``), else by its place in the optimizer
(``optimizers[0].param_groups[1][2]``). Reading every gradient synchronises with the device, so it is done on failing
runs only: when the error is raised, and at a skipped step within two steps of the streak limit, while the gradients
still exist (a manual loop may zero them right after ``step``; the :class:`~lightning_mp.scaling.counters.StepCounters`
keeps those names).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

import torch

from lightning_mp.errors import NonFiniteStepsError
from lightning_mp.scaling.counters import StepCounters
from lightning_mp.scaling.gradients import nonfinite_gradients

__all__ = ["NonfiniteParameters", "Optimizers", "nonfinite_parameters", "raise_on_streak"]

NonfiniteParameters = list[tuple[str, tuple[int, ...]]]
"""``(name, shape)`` of each parameter whose gradient is not finite."""


class Optimizers(Protocol):
    """The optimizers a scaler has seen, by index (:class:`~lightning_mp.scaling.steps.StepStates`)."""

    def at(self, index: int) -> torch.optim.Optimizer | None:
        """The optimizer of index ``index``, or None."""

    def step_parameters(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The tensors whose gradients its step applies."""
        ...


def nonfinite_parameters(
    optimizers: Optimizers, names: Mapping[int, str], indices: Iterable[int]
) -> NonfiniteParameters:
    """The parameters of the optimizers ``indices`` whose gradients (those their steps apply) hold an inf or a NaN.

    .. warning:: Reads every gradient of those optimizers on the host: one sync per gradient on an accelerator.
    """
    named = (
        (names.get(id(p), f"optimizers[{index}].param_groups[{g}][{i}]"), p)
        for index in indices
        if (optimizer := optimizers.at(index)) is not None
        for (g, i), p in zip(_positions(optimizer), optimizers.step_parameters(optimizer), strict=True)
    )
    return nonfinite_gradients(named)


def _positions(optimizer: torch.optim.Optimizer) -> list[tuple[int, int]]:
    """``(group, index)`` of each parameter of ``optimizer``, in the order of its groups."""
    return [(g, i) for g, group in enumerate(optimizer.param_groups) for i in range(len(group["params"]))]


def raise_on_streak(
    counters: StepCounters,
    limit: int | None,
    optimizers: Optimizers,
    nonfinite: Callable[[list[int]], NonfiniteParameters],
    scale: Callable[[], float],
) -> None:
    """Raise for the first optimizer whose streak of skipped steps reached ``limit``; nothing when none did.

    ``scale`` gives the loss scale for the message; it is asked only when raising.

    Raises:
        NonFiniteStepsError: naming the optimizer (not its wrapper) and the parameters to blame, those seen now or
            those remembered at a skipped step near the limit.

    """
    for index, streak in counters.streaks_reaching(limit):
        optimizer = optimizers.at(index)
        optimizer = getattr(optimizer, "optimizer", optimizer)  # name the optimizer, not its wrapper
        raise NonFiniteStepsError(
            step=counters.optimizer_steps,
            consecutive_skips=streak,
            scale=scale(),
            nonfinite_parameters=nonfinite([index]) or counters.last_nonfinite.get(index, []),
            optimizer=f"optimizer {index} ({type(optimizer).__name__})" if optimizer is not None else None,
        )
