"""Count what a training step costs the host, in numbers that do not depend on the machine's load.

Wall time on a shared CPU says little about a GPU, but three counts carry over exactly:

* **Host syncs**: every point where the host must wait for the device to read a value. On CUDA each one stops the
  host from queueing work ahead of the GPU, and rules out CUDA graphs. They are counted where torch turns a tensor
  into a Python value: ``aten::_local_scalar_dense`` (what ``.item()``, ``float()``, ``int()`` and ``bool()`` of a
  tensor dispatch), ``Tensor.tolist()`` and ``Tensor.numpy()`` (which read memory directly on the CPU and dispatch
  nothing, so they are caught one level up, as torch functions), and blocking device-to-host copies (on CUDA). A
  read counts once, even where it passes through several of those levels.
* **Dispatched ops**: every ATen operator call that reaches the dispatcher, seen by a ``TorchDispatchMode``. On a
  GPU each compute op is at least one kernel launch; for small models launches decide the speed. ``compute_ops``
  leaves out views (metadata only) and the syncs themselves.
* **Python calls**: Python function calls counted by ``sys.setprofile``: the host's own overhead per step.
* **Weight casts**: copies that change the dtype of a weight, or write another dtype into one: a dispatched
  ``aten._to_copy`` whose source, or a ``copy_``/``_foreach_copy_`` whose source or destination, lies in the storage of
  a weight (``untyped_storage().data_ptr()``, so that views of a weight, a transposed one included, count as the
  weight). Which storages are weights is asked again at each phase (:meth:`WeightCastCounter.start_phase`): an opt
  level may keep its weights in the model, in the optimizer's ``param_groups`` (fp32 masters), or swap them between
  phases. On a GPU each cast is one kernel that reads the whole weight, so casts per weight carry over exactly.

Use the counters around one steady-state step::

    with count_syncs_and_ops() as counts:
        scaler.step(optimizer)
    assert counts.syncs == 1          # torch's GradScaler with a foreach optimizer: the skip decision

    with count_python_calls() as calls:
        trainer_step()
    print(calls.python_calls)

    with WeightCastCounter(model.parameters) as casts:
        loss = model(inputs).sum()          # under autocast: each weight cast once, its cached copy reused
        casts.start_phase("backward")
        loss.backward()
    assert casts.by_phase["backward"] == 0

The method was checked on known cases (``tests/bench/test_counting.py``): torch's ``GradScaler.step`` makes 1 sync
with a foreach optimizer and 0 with a fused one, ``.item()`` and ``.tolist()`` each count 1, and a pure compute region
counts 0. Counting Python calls and dispatched ops at the same time would count the dispatch mode's own Python
frames, so the two are separate context managers.

Private names: :mod:`lightning_mp._private_names` lists them, with the reason for each.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from collections import Counter
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from typing_extensions import override

_SCALAR_READ = torch.ops.aten._local_scalar_dense.default
_COPIES = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)
_FOREACH_COPY = torch.ops.aten._foreach_copy_.default
_HOST_READ_METHODS = ("tolist", "numpy")
"""Tensor methods that read device memory into Python without dispatching ``_local_scalar_dense`` on the CPU."""


@dataclass
class StepCounts:
    """What a region dispatched and how often it made the host wait.

    Attributes:
        syncs: host reads of device values (``.item()``, ``bool()``, ``.tolist()``, blocking device-to-host copies).
        ops: every dispatched ATen op, views and syncs included.
        compute_ops: dispatched ops that are neither views nor host reads.
        host_to_device_copies: copies from a CPU tensor to another device (blocking on CUDA unless pinned).
        ops_by_name: dispatched ops per overload name, for finding where the ops go.
        sync_ops: the op or method behind each sync, in order.

    """

    syncs: int = 0
    ops: int = 0
    compute_ops: int = 0
    host_to_device_copies: int = 0
    ops_by_name: Counter[str] = field(default_factory=Counter)
    sync_ops: list[str] = field(default_factory=list)


def _device_of(value: Any) -> torch.device | None:
    return value.device if isinstance(value, torch.Tensor) else None


def _is_device_to_host_copy(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if func is torch.ops.aten._to_copy.default:
        source, target = _device_of(args[0]), kwargs.get("device")
        blocking = not kwargs.get("non_blocking", False)
        return blocking and source is not None and source.type != "cpu" and torch.device(target or source).type == "cpu"
    if func is torch.ops.aten.copy_.default:
        target, source = _device_of(args[0]), _device_of(args[1])
        blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        return blocking and source is not None and target is not None and source.type != "cpu" and target.type == "cpu"
    return False


def _is_host_to_device_copy(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if func is torch.ops.aten._to_copy.default:
        source, target = _device_of(args[0]), kwargs.get("device")
        return source is not None and source.type == "cpu" and target is not None and torch.device(target).type != "cpu"
    if func is torch.ops.aten.copy_.default:
        target, source = _device_of(args[0]), _device_of(args[1])
        return source is not None and target is not None and source.type == "cpu" and target.type != "cpu"
    return False


class _OpCounter(TorchDispatchMode):
    def __init__(self, counts: StepCounts, inside_host_read: Callable[[], bool]) -> None:
        super().__init__()
        self.counts = counts
        self.inside_host_read = inside_host_read

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        counts = self.counts
        counts.ops += 1
        counts.ops_by_name[str(func)] += 1
        is_sync = func is _SCALAR_READ or (func in _COPIES and _is_device_to_host_copy(func, args, kwargs))
        if is_sync:
            if not self.inside_host_read():
                counts.syncs += 1
                counts.sync_ops.append(str(func))
        elif not func.is_view:
            counts.compute_ops += 1
        if func in _COPIES and _is_host_to_device_copy(func, args, kwargs):
            counts.host_to_device_copies += 1
        return func(*args, **kwargs)


class _HostReadCounter(TorchFunctionMode):
    """Counts ``tolist()`` and ``numpy()``, which dispatch no scalar read on the CPU."""

    def __init__(self, counts: StepCounts) -> None:
        super().__init__()
        self.counts = counts
        self.depth = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name not in _HOST_READ_METHODS:
            return func(*args, **(kwargs or {}))
        if self.depth == 0:
            self.counts.syncs += 1
            self.counts.sync_ops.append(f"Tensor.{name}")
        self.depth += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.depth -= 1


@contextlib.contextmanager
def count_syncs_and_ops() -> Generator[StepCounts, None, None]:
    """Count host syncs and dispatched ops in the ``with`` block; the yielded counts fill in as it runs."""
    counts = StepCounts()
    host_reads = _HostReadCounter(counts)
    with host_reads, _OpCounter(counts, lambda: host_reads.depth > 0):
        yield counts


@dataclass
class PythonCalls:
    """Python function calls made in a region (C functions are not counted)."""

    python_calls: int = 0


class count_python_calls:  # a class, so that its own frames can be left out; used like a function
    """Count Python function calls in the ``with`` block, through ``sys.setprofile``; restores the previous hook.

    The counter's own ``__exit__`` is not counted, nor calls of the functions in ``excluding`` (the hooks of a tool
    that starts and stops the counter, say). The garbage collector is off in the block: the callbacks a collection
    runs (weak-reference callbacks, finalizers) come whenever garbage has piled up, so counting them would make the
    count depend on what ran before.

    Args:
        excluding: code objects (``function.__code__``) whose calls are not counted.

    """

    def __init__(self, excluding: Iterable[CodeType] = ()) -> None:
        self.calls = PythonCalls()
        self._excluded = {_EXIT_CODE, *excluding}
        self._previous: Any = None
        self._collector_was_on = False

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code not in self._excluded:
            self.calls.python_calls += 1

    def __enter__(self) -> PythonCalls:
        self._collector_was_on = gc.isenabled()
        gc.disable()
        self._previous = sys.getprofile()
        sys.setprofile(self._profile)
        return self.calls

    def __exit__(self, *exc_info: object) -> None:
        sys.setprofile(self._previous)
        if self._collector_was_on:
            gc.enable()


_EXIT_CODE = count_python_calls.__exit__.__code__


def _storage_of(tensor: Any) -> int | None:
    if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
        return None
    return tensor.untyped_storage().data_ptr() or None


class WeightCastCounter(TorchDispatchMode):
    """Count the casts of weights in the ``with`` block, per phase of a training step.

    A cast of a weight is a dispatched ``aten._to_copy`` that changes the dtype of a weight (or a view of one), or a
    ``copy_``/``_foreach_copy_`` between tensors of different dtypes whose source or destination is a weight. Casts
    of gradients, activations and optimizer states are not counted.

    Args:
        weights: returns the tensors that are weights (a model's ``parameters``, an optimizer's ``param_groups``);
            asked on entering the block and at each :meth:`start_phase`.
        phase: the name of the first phase.

    Attributes:
        by_phase: casts counted in each phase, by the phase's name.

    """

    def __init__(self, weights: Callable[[], Iterable[torch.Tensor]], phase: str = "forward") -> None:
        super().__init__()
        self.by_phase: Counter[str] = Counter()
        self._weights = weights
        self._phase = phase
        self._storages: set[int] = set()

    def start_phase(self, phase: str) -> None:
        """Count the casts from here on under ``phase``, and look up again which storages hold weights."""
        self._phase = phase
        self._storages = {storage for tensor in self._weights() if (storage := _storage_of(tensor)) is not None}

    @override
    def __enter__(self) -> WeightCastCounter:
        self.start_phase(self._phase)
        return super().__enter__()

    def _touches_weight(self, *tensors: Any) -> bool:
        return any(_storage_of(tensor) in self._storages for tensor in tensors)

    def _casts_in(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        if func is torch.ops.aten._to_copy.default:
            dtype = kwargs.get("dtype")
            return int(dtype is not None and dtype != args[0].dtype and self._touches_weight(args[0]))
        if func is torch.ops.aten.copy_.default:
            target, source = args[0], args[1]
            return int(target.dtype != source.dtype and self._touches_weight(target, source))
        if func is _FOREACH_COPY:
            pairs = zip(args[0], args[1], strict=True)
            return sum(t.dtype != s.dtype and self._touches_weight(t, s) for t, s in pairs)
        return 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if casts := self._casts_in(func, args, kwargs):
            self.by_phase[self._phase] += casts
        return func(*args, **kwargs)


__all__ = ["PythonCalls", "StepCounts", "WeightCastCounter", "count_python_calls", "count_syncs_and_ops"]
