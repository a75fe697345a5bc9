"""Host copies of the scaler's small device flags, read without making the host wait.

The inf flag of a fused optimizer's step stays on the device: the fused kernel reads it there. The host still needs
it, one iteration late at most, to count skipped steps, keep its copy of the scale and raise the collapse and streak
errors. Reading the tensor (``.item()``, ``.tolist()``) would wait for the device every step, so the mirror keeps a
host buffer per flag and a numpy view of it, made once:

* on the CPU the flag tensor already lives in host memory and every op has finished when it returns, so the view of
  the flag itself is exact the moment the iteration ends;
* on an accelerator a non-blocking copy fills a pinned buffer (one of two, so that the copy in flight never
  overwrites the one being read) and an event marks when it is complete; the host reads it one iteration later.

.. warning:: On an accelerator, :meth:`FoundInfCopies.read` waits for the copy's event when the device is more than one
   iteration behind the host: that bounds how late an error can be raised to one iteration.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Reader = Callable[[], float]


class FoundInfCopies:
    """Publishes device tensors of one element to host buffers, and reads them back without a sync."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, int], tuple[torch.Tensor, Any]] = {}
        self._parity = 0

    def __getstate__(self) -> dict[str, Any]:
        """Host buffers and views of device memory are not pickled: an unpickled mirror makes them again."""
        return FoundInfCopies().__dict__

    def publish(self, key: Any, tensor: torch.Tensor) -> Reader:
        """Start copying ``tensor`` to the host; return a function that reads the copy once it is complete."""
        if tensor.device.type == "cpu":
            # The tensor's own memory: the numpy view is made once, and reading it is a plain memory read.
            source, view = self._buffers.get((key, 0), (None, None))
            if source is not tensor:
                view = tensor.detach().numpy()
                self._buffers[(key, 0)] = (tensor, view)
            host_view = view
            assert host_view is not None
            return lambda: float(host_view)
        slot = (key, self._parity)
        if slot not in self._buffers:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=torch.cuda.is_available())
            self._buffers[slot] = (host, host.numpy())
        host, view = self._buffers[slot]
        # Only CUDA gets an event to wait on; other accelerators copy synchronously.
        host.copy_(tensor, non_blocking=tensor.device.type == "cuda")
        return lambda: float(view)

    def end_iteration(self, device: torch.device) -> torch.cuda.Event | None:
        """Close the copies published since the last call; return the event to wait on (CUDA), if any."""
        self._parity ^= 1
        if device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event
