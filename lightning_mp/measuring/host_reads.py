"""One device-to-host transfer per batch, shared by every telemetry callback on a trainer.

Each monitor that needs device values on a logging step (the gradient summary, the DDP-gathered counters, the
sentinel's samples) computes them on the device and *submits* the tensor, with a function that consumes the host
values, in its ``on_train_batch_end``. The monitors that take part join in ``setup``. When the last of them has
submitted for the batch, every submitted tensor is flattened, concatenated and read back with a single
``.tolist()``: one host synchronisation for all the monitors together, however many are attached. A monitor with
nothing to read submits ``None``, and a batch where nobody submitted a tensor reads nothing at all.

Submissions carry the batch they belong to (``trainer.fit_loop.total_batch_idx``); one left over from a batch that
raised is dropped rather than read with the next batch.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import lightning.pytorch as pl
import torch

Consumer = Callable[[list[float]], None]


@dataclass
class HostReads:
    """The monitors of one trainer, and what they have submitted for the current batch."""

    participants: set[int] = field(default_factory=set)
    batch: int | None = None
    submitted: dict[int, tuple[torch.Tensor | None, Consumer | None]] = field(default_factory=dict)

    def join(self, callback: pl.Callback) -> None:
        """Take part: from now on the transfer waits for ``callback``'s submission."""
        self.participants.add(id(callback))

    def leave(self, callback: pl.Callback) -> None:
        """Stop taking part (at teardown): the transfer no longer waits for ``callback``."""
        self.participants.discard(id(callback))
        self.submitted.pop(id(callback), None)

    def submit(
        self,
        trainer: pl.Trainer,
        callback: pl.Callback,
        values: torch.Tensor | None = None,
        consume: Consumer | None = None,
    ) -> None:
        """Hand in ``values`` for this batch; ``consume`` gets them as floats once every participant has submitted.

        Call it in every ``on_train_batch_end``, without values when there is nothing to read.

        .. warning:: The last submission of a batch synchronises the host, once, if any participant submitted a
            tensor.
        """
        batch = trainer.fit_loop.total_batch_idx
        if batch != self.batch:
            self.batch, self.submitted = batch, {}
        self.submitted[id(callback)] = (values, consume)
        if self.participants <= set(self.submitted):
            self._read_all()

    def _read_all(self) -> None:
        pending, self.submitted = list(self.submitted.values()), {}
        tensors = [values for values, _ in pending if values is not None]
        host: list[float] = []
        if tensors:
            device = tensors[0].device
            flat = [values.detach().reshape(-1).to(device, torch.float64) for values in tensors]
            host = torch.cat(flat).tolist() if len(flat) > 1 else flat[0].tolist()
        offset = 0
        for values, consume in pending:
            size = 0 if values is None else values.numel()
            if values is not None and consume is not None:
                consume(host[offset : offset + size])
            offset += size


_READS: weakref.WeakKeyDictionary[pl.Trainer, HostReads] = weakref.WeakKeyDictionary()


def host_reads(trainer: pl.Trainer) -> HostReads:
    """The shared reader of ``trainer``, created on first use."""
    reads = _READS.get(trainer)
    if reads is None:
        reads = _READS[trainer] = HostReads()
    return reads
