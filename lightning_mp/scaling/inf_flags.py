"""The loss scaler's inf flags: one preallocated float32 per optimizer and device, and the record of an iteration.

A flag is a 0-d float32 tensor that the unscale kernel sets to 1.0 when a gradient holds an inf or a NaN. Allocating
one per step would cost an allocation and a fill; zeroing one would cost an op. The pool avoids both:

* a flag is allocated once per ``(optimizer index, device, parity)`` and reused every iteration;
* a flag whose value the host read as 0 is known to be clean and is handed out again without a ``zero_``;
  any other flag is zeroed before use;
* on an accelerator the host reads a flag one iteration late (a non-blocking copy), so two flags alternate by
  iteration parity: the one being copied is never the one being written. On the CPU one flag suffices.

:class:`IterationRecord` keeps what one iteration decided until the host can read it: each optimizer's device flag,
the verdicts the steps already read on the host, the gradient norms of a check-mode step that decides on the host,
the flags it used, and whether the scale already moved on the device. The scaler's ``update`` closes the record and
the host applies it (:mod:`lightning_mp.scaler`).

Under DDP the pool also counts this rank's own overflows, before the all-reduce, on the device: the telemetry reads
that count on logging steps only. The pool holds device tensors only, so a pickled scaler starts with an empty one.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lightning_mp.scaling import kernels
from lightning_mp.scaling.found_inf_copies import Reader

FlagSlot = tuple[int, torch.device, int]
"""``(optimizer index, device, parity)``: where a flag lives in the pool."""


class IterationRecord:
    """The inf flags of one iteration, kept until the host can read them without a sync."""

    def __getstate__(self) -> dict[str, Any]:
        """An iteration in progress is not pickled: an unpickled scaler starts a new one."""
        return IterationRecord().__dict__

    def __init__(self) -> None:
        self.device_flags: dict[int, torch.Tensor] = {}
        """Optimizer index -> its inf flag on the device (or a host copy in flight)."""
        self.host_flags: dict[int, float] = {}
        """Optimizer index -> its inf flag, where the step already read it."""
        self.stepped: set[int] = set()
        """The optimizer indices that stepped (or skipped) in this iteration."""
        self.flag_slots: dict[int, list[FlagSlot]] = {}
        """Optimizer index -> the preallocated flags it used."""
        self.readers: dict[int, Reader] = {}
        """Optimizer index -> a reader of its flag's host copy, once published."""
        self.norms: dict[int, torch.Tensor] = {}
        """Optimizer index -> the inf-norms of its gradients, where its step reads them on the host (check mode)."""
        self.skip_on_device: set[int] = set()
        """The optimizer indices whose check handed their step to torch's fused kernel, which skips on the device."""
        self.new_scale: float | None = None
        """A scale the user set in ``update(new_scale)``, which replaces the rules for this iteration."""
        self.device_ruled = False
        """Whether the scale already moved on the device (the host only applies the rules to stay in step)."""
        self.ready: torch.cuda.Event | None = None
        """On CUDA, the event after which the flags' host copies are complete."""

    @property
    def checked(self) -> bool:
        """Whether any optimizer's gradients were checked (or declared clean) in this iteration."""
        return bool(self.device_flags or self.host_flags or self.norms)

    def verdict_from_norms(self, index: int) -> float:
        """Optimizer ``index``'s verdict on the host (1.0: skip); from its gradient norms, read once (one sync)."""
        found_inf = self.host_flags.get(index)
        if found_inf is None:
            found_inf = self.host_flags[index] = float(not all(map(math.isfinite, self.norms[index].tolist())))
        return found_inf

    def recheck(self, index: int, parameters: list[torch.Tensor]) -> None:
        """Fold a new check of optimizer ``index``'s gradients (of ``parameters``) into its verdict, before its step.

        Where the verdict is a device flag, it is raised on the device (no sync); where the step reads norms on the
        host, the new norms join them (a skip already decided stays one). Nothing happens after the step, nor for an
        optimizer whose gradients were not checked.
        """
        if index in self.stepped or not (index in self.norms or index in self.device_flags):
            return
        home = self.device_flags[index].device if index in self.device_flags else None
        norms = kernels.recheck_norms(parameters, home)
        if not norms:
            return
        if index in self.norms:
            if not self.host_flags.get(index):  # a skip already decided stays one; else read again at the step
                self.host_flags.pop(index, None)
                self.norms[index] = torch.cat([self.norms[index], *norms])
            return
        flag = self.device_flags[index]
        nonfinite = (~torch.isfinite(torch.cat(norms))).any()
        flag.copy_(torch.maximum(flag, nonfinite.to(flag.dtype)))

    @property
    def on_host(self) -> bool:
        """Whether every flag was already read by a step (so the rules can run on the host)."""
        return set(self.device_flags) <= set(self.host_flags)

    def peek(self) -> dict[int, bool] | None:
        """Every optimizer's verdict where the host can read it without waiting for an accelerator; else None.

        Changes nothing: a flag still on an accelerator is left for :meth:`read` at the update.
        """
        flags: dict[int, bool] = {}
        for index, norms in self.norms.items():
            if index not in self.host_flags:
                if norms.device.type != "cpu":
                    return None
                flags[index] = not all(map(math.isfinite, norms.tolist()))
        for index, flag in self.device_flags.items():
            if index not in self.host_flags:
                if flag.device.type != "cpu":
                    return None
                flags[index] = bool(flag)
        flags.update((index, bool(flag)) for index, flag in self.host_flags.items())
        return flags

    def read(self) -> dict[int, bool]:
        """Every optimizer's verdict (True: skipped), waiting for the flags' host copies if they are in flight."""
        for index in self.norms:  # an unscale_ whose step never came
            self.verdict_from_norms(index)
        if self.ready is not None:
            self.ready.synchronize()
        flags = {index: bool(read()) for index, read in self.readers.items()}
        flags.update((index, bool(flag)) for index, flag in self.host_flags.items())
        return flags


class InfFlagPool:
    """Preallocated inf flags, reused across iterations and zeroed only when they may hold a 1."""

    def __init__(self) -> None:
        self._flags: dict[FlagSlot, torch.Tensor] = {}
        self._clean: set[FlagSlot] = set()
        self._parity = 0
        self.local_overflows: torch.Tensor | None = None
        """This rank's overflows before the all-reduce, on the device; None until the first one is counted."""

    def __len__(self) -> int:
        """The number of flags allocated."""
        return len(self._flags)

    def __getstate__(self) -> dict[str, Any]:
        """Device tensors are not pickled: an unpickled pool allocates its flags again."""
        return {**InfFlagPool().__dict__, "_parity": self._parity}

    def zeroed_flag(self, index: int, device: torch.device, record: IterationRecord) -> torch.Tensor:
        """Optimizer ``index``'s flag on ``device``, holding 0, recorded in ``record`` as used by that optimizer."""
        slot = (index, device, self._parity if device.type != "cpu" else 0)
        flag = self._flags.get(slot)
        if flag is None:
            flag = self._flags[slot] = torch.zeros((), dtype=torch.float32, device=device)
        elif slot in self._clean:
            self._clean.discard(slot)
        else:
            flag.zero_()
        record.flag_slots.setdefault(index, []).append(slot)
        return flag

    def mark_clean(self, record: IterationRecord, verdicts: dict[int, bool]) -> None:
        """Remember the flags of ``record`` that the host read as 0: the next use needs no ``zero_``."""
        for index, slots in record.flag_slots.items():
            if not verdicts.get(index, True):
                self._clean.update(slots)

    def next_iteration(self) -> None:
        """Switch to the other set of accelerator flags, while the host copies this iteration's."""
        self._parity ^= 1

    def count_local_overflow(self, flag: torch.Tensor) -> None:
        """Add this rank's own ``flag`` (before the all-reduce) to :attr:`local_overflows`, on the device: no sync."""
        if self.local_overflows is None:
            self.local_overflows = torch.zeros((), dtype=torch.float32, device=flag.device)
        self.local_overflows.add_(flag)
