"""The running statistics of normalisation layers, kept safe across a step that may be skipped.

BatchNorm and InstanceNorm with ``track_running_stats`` update their running mean and variance in the forward, before
anyone knows whether the step will be taken. :class:`RunningStats` copies them before the first forward after a step
and, once the step's verdict is known, drops the copies or puts them back: a copy where the host knows the verdict,
else a ``torch.where`` on the device flag, so a skip decided on the device costs no synchronisation.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from lightning_mp.scaling.verdict import StepVerdict

RUNNING_STAT_NAMES = ("running_mean", "running_var", "num_batches_tracked")


def normalization_layers(module: nn.Module) -> list[nn.Module]:
    """The layers of ``module`` that track running statistics (BatchNorm, InstanceNorm with track_running_stats)."""
    return [
        layer
        for layer in module.modules()
        if getattr(layer, "track_running_stats", False) and getattr(layer, "running_mean", None) is not None
    ]


def _running_stats(layer: nn.Module) -> list[Tensor]:
    buffers = []
    for name in RUNNING_STAT_NAMES:
        buffer = getattr(layer, name, None)
        if buffer is not None:
            buffers.append(buffer)
    return buffers


class RunningStats:
    """The running statistics of the models a run steps: copied before a step's forward, put back if it is skipped.

    Example:
        >>> model = nn.BatchNorm1d(2)
        >>> stats = RunningStats()
        >>> stats.track(model)
        >>> stats.save()
        >>> _ = model(torch.randn(4, 2))
        >>> stats.restore_if_skipped(StepVerdict(skipped=True))
        >>> model.running_mean.tolist()
        [0.0, 0.0]

    """

    def __init__(self) -> None:
        self._layers: dict[int, list[nn.Module]] = {}
        """Per model (by id), its layers with running statistics."""
        self._saved: dict[int, list[Tensor]] = {}
        """Per layer (by id), its running statistics as they were before the first forward since its last step."""

    def track(self, model: nn.Module) -> None:
        """Copy and restore the running statistics of ``model`` too (once per model)."""
        self._layers.setdefault(id(model), normalization_layers(model))

    @property
    def saved(self) -> bool:
        """Whether a copy waits for its step's verdict."""
        return bool(self._saved)

    def save(self) -> None:
        """Copy the running statistics not yet copied since their model's last step."""
        for layers in self._layers.values():
            for layer in layers:
                if id(layer) not in self._saved:
                    self._saved[id(layer)] = [buffer.detach().clone() for buffer in _running_stats(layer)]

    def restore_if_skipped(self, verdict: StepVerdict, models: Iterable[nn.Module] | None = None) -> None:
        """After a step: drop the copies, and put them back first if the step was skipped.

        Args:
            verdict: the step's verdict; where the device decided it, the copies go back with a ``torch.where`` on
                its flag, without a sync.
            models: the models the step changed; None means every tracked model.

        """
        chosen = self._layers.values() if models is None else [self._layers.get(id(model), []) for model in models]
        skipped, flag = verdict.skipped, verdict.flag
        with torch.no_grad():
            for layers in chosen:
                for layer in layers:
                    saved = self._saved.pop(id(layer), None)
                    if saved is None or not (skipped or flag is not None):
                        continue
                    for buffer, before in zip(_running_stats(layer), saved, strict=True):
                        if flag is None:
                            buffer.copy_(before)
                        else:
                            on_device = flag.to(buffer.device)
                            condition = on_device if on_device.dtype == torch.bool else on_device > 0
                            buffer.copy_(torch.where(condition, before, buffer))

    def clear(self) -> None:
        """Forget the models (at teardown), so that a reused plugin keeps no previous model alive."""
        self._layers.clear()
        self._saved.clear()
