"""The optimizers a loss scaler has seen, each under a stable index, held by weak references.

The scaler counts skips and streaks per optimizer, and names the optimizer and its parameters in its errors; it knows
an optimizer by the index it got at its first ``unscale_`` or ``step``. The key is the optimizer's ``param_groups``
list, which a wrapper (Lightning's ``LightningOptimizer``) shares with the optimizer it wraps: an ``unscale_`` through
the wrapper and a ``step`` of the optimizer are the same optimizer here. An optimizer that no longer exists (a plugin
reused for another model) keeps its index, and nothing keeps it, or its model, alive.

Weak references cannot be pickled: a pickled scaler starts with an empty registry, and a new optimizer gets the next
free index as before.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch


class OptimizerRegistry:
    """Optimizer -> index, by its ``param_groups``; index -> the optimizer, while it exists."""

    def __init__(self) -> None:
        self._optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        self._index_by_groups: dict[int, int] = {}

    def __len__(self) -> int:
        """The number of indices given out."""
        return len(self._optimizers)

    def __getstate__(self) -> dict[str, Any]:
        """Weak references are not pickled: an unpickled registry is empty."""
        return OptimizerRegistry().__dict__

    def index(self, optimizer: torch.optim.Optimizer) -> int:
        """``optimizer``'s index, given out now if it has none (or its param_groups belong to a dead optimizer)."""
        key = id(optimizer.param_groups)
        index = self._index_by_groups.get(key)
        known = self.at(index) if index is not None else None
        if index is not None and known is not None and known.param_groups is optimizer.param_groups:
            return index
        index = len(self._optimizers)
        self._optimizers.append(weakref.ref(optimizer))
        self._index_by_groups[key] = index
        return index

    def known_index(self, optimizer: torch.optim.Optimizer) -> int | None:
        """``optimizer``'s index if one was given out for its ``param_groups``; gives out none."""
        return self._index_by_groups.get(id(optimizer.param_groups))

    def at(self, index: int) -> torch.optim.Optimizer | None:
        """The optimizer under ``index``, or None when there is none or it no longer exists."""
        return self._optimizers[index]() if 0 <= index < len(self._optimizers) else None
