"""Per-layer precision overrides: keep chosen modules in fp32 under any opt level.

``MixedPrecision(keep_fp32=[nn.LayerNorm, "head", "re:.*attn.*"])`` names modules three ways:

- a module **type** matches every instance of it or of a subclass;
- a plain **string** is a qualified name, as ``named_modules()`` gives it (``"encoder.layers.0.norm1"``), matched
  exactly;
- a string that starts with ``re:`` is a regular expression that must match the **whole** qualified name.

How a matched module runs in fp32:

1. A forward pre-hook switches autocast off (``torch.set_autocast_enabled(device, False)``) for every device type
   on which it is on. ``torch.autocast("cuda", enabled=False)`` alone does nothing under CPU autocast, so the hook
   asks each device type, not one.
2. The same hook casts the floating inputs below fp32 (fp16, bf16) to fp32; fp64 and integer inputs are untouched.
3. A forward hook, registered with ``always_call=True`` so that it runs even when the forward raises, switches
   autocast back on where the pre-hook switched it off. The output is left as the module computed it: fp32.

Under ``torch.compile`` the flag toggles are traced like any other call, so a compiled model or a compiled submodule
keeps its fp32 regions in one graph (entering a ``torch.autocast`` context in one hook and leaving it in another is
what torch.compile cannot trace). Before torch 2.12 each region splits the graph instead (:mod:`lightning_mp._compat`).

Only the outermost matched module of a subtree gets the hooks: everything below it already runs with autocast off
on fp32 inputs. Under O2 and O3 the weights of every module in a matched subtree also stay fp32 (see
:meth:`Fp32Overrides.kept_modules`).

The hooks are instances of small module-level classes, so a converted model can still be pickled (``ddp_spawn``)
and deep-copied; the plugin attaches them in ``convert_module``, in the worker, and removes them at teardown.
Applying twice attaches nothing new: nn.Module has no public way to list its hooks, so the package remembers the
handles of the hooks it attached to each module (:func:`remember_hooks`), and a handle tells whether its hook is still
attached (:func:`has_hooks`): one removed at teardown or by the user reads as gone, and the next conversion attaches
it again. :func:`deepcopy_with_hooks` copies a module with that memory (``to_inference`` copies so); a plain deep
copy or an unpickled copy of a hooked module carries the hooks but not the memory.

Example:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    >>> Fp32Overrides([nn.LayerNorm, "2"]).apply(model)
    ['1', '2']
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     model(torch.randn(3, 4)).dtype
    torch.float32

"""

from __future__ import annotations

import copy
import difflib
import functools
import re
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_mp._compat import note_autocast_flag_toggle

KeepFp32Pattern = type[nn.Module] | str
"""One ``keep_fp32`` entry: a module type, a qualified name, or ``"re:<regex>"``."""

REGEX_PREFIX = "re:"

BATCH_NORMS = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.LazyBatchNorm1d,
    nn.LazyBatchNorm2d,
    nn.LazyBatchNorm3d,
)
"""The batch norms that ``sync_batchnorm=True`` replaces by ``SyncBatchNorm``."""
# Every device type torch's autocast knows; only those on which autocast is enabled at call time are switched off.
_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "mtia", "maia", "ipu")


def _autocast_device_types() -> tuple[str, ...]:
    # An out-of-tree backend renames torch's "privateuseone" device type; a device of that type reports the new name.
    custom = torch.device("privateuseone").type
    return (*_AUTOCAST_DEVICE_TYPES, custom) if custom not in _AUTOCAST_DEVICE_TYPES else _AUTOCAST_DEVICE_TYPES


def is_low_precision(tensor: Tensor) -> bool:
    """Whether ``tensor`` is floating point with fewer than 32 bits (fp16, bf16, fp8)."""
    return tensor.is_floating_point() and tensor.dtype.itemsize < 4


def cast_low_precision(data: Any, dtype: torch.dtype) -> Any:
    """Cast every floating tensor below 32 bits in a nested collection to ``dtype``; leave the rest alone."""
    if isinstance(data, Tensor):
        return data.to(dtype) if data.dtype in _castable_dtypes(dtype, low_precision_only=True) else data
    return apply_to_collection(data, Tensor, lambda t: t.to(dtype) if is_low_precision(t) else t)


_PLAIN_TYPES = frozenset({type(None), bool, int, float, complex, str, torch.dtype, torch.device})
"""Types of arguments that hold no tensor: a hook need not look inside them."""
_FLOATING_DTYPES = frozenset(
    value for value in vars(torch).values() if isinstance(value, torch.dtype) and value.is_floating_point
)


@functools.cache
def _castable_dtypes(dtype: torch.dtype, low_precision_only: bool) -> frozenset[torch.dtype]:
    """The floating dtypes :func:`cast_arguments` casts to ``dtype``: a set, so that a hook tests one membership."""
    return frozenset(
        floating
        for floating in _FLOATING_DTYPES
        if floating != dtype and (not low_precision_only or floating.itemsize < 4)
    )


def cast_arguments(
    args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype, low_precision_only: bool = False
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """A forward pre-hook's arguments with their floating tensors cast to ``dtype``; None when none needs a cast.

    Runs at every forward of every hooked module, so arguments that are tensors or plain values are handled here,
    without a Python call each; collections go through Lightning's ``apply_to_collection``.

    Args:
        args: the positional arguments.
        kwargs: the keyword arguments.
        dtype: the floating dtype the tensors should have.
        low_precision_only: cast only tensors below 32 bits (fp16, bf16, fp8); else every floating tensor.

    """
    castable = _castable_dtypes(dtype, low_precision_only)
    cast: dict[Any, Tensor] = {}
    # One loop over both: positions of args are ints, names of kwargs are strings.
    for key, value in (*enumerate(args), *kwargs.items()):
        if isinstance(value, Tensor):
            if value.dtype in castable:
                cast[key] = value.to(dtype)
        elif type(value) not in _PLAIN_TYPES:
            return _cast_collection((args, kwargs), dtype, low_precision_only)
    if not cast:
        return None
    cast_args, cast_kwargs = list(args), dict(kwargs)
    for key, value in cast.items():
        if isinstance(key, int):
            cast_args[key] = value
        else:
            cast_kwargs[key] = value
    return tuple(cast_args), cast_kwargs


def _cast_collection(data: Any, dtype: torch.dtype, low_precision_only: bool) -> Any:
    if low_precision_only:
        return apply_to_collection(data, Tensor, lambda t: t.to(dtype) if is_low_precision(t) else t)
    return apply_to_collection(data, Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)


def first_low_precision_dtype(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.dtype | None:
    """The dtype of the first floating tensor below 32 bits among a hook's arguments, in order; None if none."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, Tensor):
            if value.is_floating_point() and value.dtype.itemsize < 4:
                return value.dtype
        elif type(value) not in _PLAIN_TYPES and (dtypes := _low_precision_dtypes(value)):
            return dtypes[0]
    return None


def _low_precision_dtypes(data: Any) -> list[torch.dtype]:
    dtypes: list[torch.dtype] = []
    apply_to_collection(data, Tensor, lambda t: dtypes.append(t.dtype) if is_low_precision(t) else None)
    return dtypes


class Fp32Region:
    """Forward hooks that run one module with autocast off and its low-precision inputs cast to fp32.

    The pre-hook switches autocast off with ``torch.set_autocast_enabled(device, False)`` for each device type on
    which it is on, and the always-called forward hook switches those back on. Unlike entering a ``torch.autocast``
    context in one hook and leaving it in another, toggling the flag is a plain call that torch.compile traces: a
    compiled model, or a compiled submodule, keeps its fp32 regions without a graph break.

    Args:
        restore_output_dtype: cast floating outputs back to the dtype of the first low-precision input. Off for
            ``keep_fp32`` modules (their output stays fp32); on for normalisation layers that O2 keeps in fp32
            inside an otherwise half-precision model, so that the next layer gets the half type it expects.

    """

    def __init__(self, restore_output_dtype: bool = False) -> None:
        self.restore_output_dtype = restore_output_dtype
        # Read once, outside any compiled region: the backend name is a C call that torch.compile does not trace.
        self._device_types = _autocast_device_types()
        # One entry per forward in flight, so that a module called inside its own forward still unwinds correctly.
        self._open: list[tuple[list[str], torch.dtype | None]] = []

    def attach(self, module: nn.Module) -> list[RemovableHandle]:
        """Register the pre-hook and the always-called forward hook on ``module``; return their handles."""
        handles = [
            module.register_forward_pre_hook(self.enter, with_kwargs=True),
            module.register_forward_hook(self.exit, with_kwargs=True, always_call=True),
        ]
        return remember_hooks(module, Fp32Region, handles)

    def enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
        """Switch autocast off and cast the inputs; the forward hook undoes the first."""
        incoming = first_low_precision_dtype(args, kwargs)
        switched_off = [device for device in self._device_types if torch.is_autocast_enabled(device)]
        if switched_off:
            note_autocast_flag_toggle()
        for device in switched_off:
            torch.set_autocast_enabled(device, False)
        self._open.append((switched_off, incoming))
        return cast_arguments(args, kwargs, torch.float32, low_precision_only=True)

    def exit(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        """Restore autocast; optionally cast the output back to the incoming half type."""
        switched_off, incoming = self._open.pop()
        for device in switched_off:
            torch.set_autocast_enabled(device, True)
        if not self.restore_output_dtype or incoming is None:
            return None
        if isinstance(output, Tensor):
            return output.to(incoming) if output.is_floating_point() else output
        return apply_to_collection(output, Tensor, lambda t: t.to(incoming) if t.is_floating_point() else t)


def has_fp32_region(module: nn.Module) -> bool:
    """Whether :class:`Fp32Region` hooks are already attached to ``module``."""
    return has_hooks(module, Fp32Region)


_ATTACHED_HOOKS: weakref.WeakKeyDictionary[nn.Module, dict[type, list[RemovableHandle]]] = weakref.WeakKeyDictionary()
"""The handles of the package's hooks on each module, by kind of hook; a module's entry goes with the module."""


def remember_hooks(module: nn.Module, kind: type, handles: list[RemovableHandle]) -> list[RemovableHandle]:
    """Note that ``handles`` attach hooks of ``kind`` to ``module``, for :func:`has_hooks`; return ``handles``."""
    _ATTACHED_HOOKS.setdefault(module, {}).setdefault(kind, []).extend(handles)
    return handles


def has_hooks(module: nn.Module, kind: type) -> bool:
    """Whether a hook of ``kind`` that :func:`remember_hooks` noted is still attached to ``module``.

    A handle's hook is attached while its id is in the hooks dict the handle refers to: the test torch's
    ``RemovableHandle.remove`` makes, on the handle's public attributes.
    """
    handles = _ATTACHED_HOOKS.get(module, {}).get(kind)
    if not handles:
        return False
    handles[:] = [handle for handle in handles if _is_attached(handle)]
    return bool(handles)


def deepcopy_with_hooks(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose hooks from this package read as attached, as the original's do.

    The remembered handles are deep-copied in the same pass as the module, so each copy refers to the copied
    module's hooks dict (``RemovableHandle`` pickles and copies the dict it refers to).
    """
    remembered = {id(child): _ATTACHED_HOOKS[child] for child in module.modules() if child in _ATTACHED_HOOKS}
    copies: dict[int, Any] = {}
    copied = copy.deepcopy(module, copies)
    for original, by_kind in remembered.items():
        for kind, handles in by_kind.items():
            remember_hooks(copies[original], kind, copy.deepcopy(handles, copies))
    return copied


def _is_attached(handle: RemovableHandle) -> bool:
    hooks = handle.hooks_dict_ref()
    return hooks is not None and handle.id in hooks


def outermost(names: Iterable[str]) -> list[str]:
    """The names in ``names`` that are not inside another one (``""`` is the root and contains everything)."""
    names = list(dict.fromkeys(names))
    return [
        name
        for name in names
        if not any(other != name and (other == "" or name.startswith(other + ".")) for other in names)
    ]


class Fp32Overrides:
    """The parsed ``keep_fp32`` patterns: which modules they match, and the hooks that keep those in fp32.

    Args:
        patterns: module types, qualified names, or ``"re:"``-prefixed regular expressions.

    Raises:
        ValueError: if ``patterns`` is a single string or type instead of a sequence, or an entry is neither a
            module type nor a non-empty string, or a ``re:`` entry is not a valid regular expression.

    """

    def __init__(self, patterns: Sequence[KeepFp32Pattern] | None = ()) -> None:
        if patterns is None:  # a config's ``keep_fp32: null``: nothing is kept in fp32
            patterns = ()
        if isinstance(patterns, (str, type)) or not isinstance(patterns, Iterable):
            # A single valid entry is shown wrapped in a list; anything else gets a generic example.
            if isinstance(patterns, str):
                example = f"[{patterns!r}]"
            elif isinstance(patterns, type):
                example = f"[{patterns.__name__}]"
            else:
                example = "[nn.LayerNorm, 'head', 're:.*norm']"
            raise ValueError(
                f"keep_fp32={patterns!r} is not allowed: keep_fp32 must be a list of module types, qualified names"
                f" or 're:' patterns, for example keep_fp32={example} (or [] or None for none)."
            )
        self.patterns: list[KeepFp32Pattern] = list(patterns)
        self._regexes: dict[str, re.Pattern[str]] = {}
        for pattern in self.patterns:
            if isinstance(pattern, type) and issubclass(pattern, nn.Module):
                continue
            if not isinstance(pattern, str) or not pattern or pattern == REGEX_PREFIX:
                raise ValueError(
                    f"keep_fp32 entry {pattern!r} is not allowed: each entry must be an nn.Module subclass"
                    " (nn.LayerNorm), a qualified module name ('encoder.head') or a regular expression prefixed with"
                    " 're:' ('re:.*attn.*')."
                )
            if pattern.startswith(REGEX_PREFIX):
                try:
                    self._regexes[pattern] = re.compile(pattern[len(REGEX_PREFIX) :])
                except re.error as error:
                    raise ValueError(
                        f"keep_fp32 entry {pattern!r} is not allowed: {pattern[len(REGEX_PREFIX) :]!r} is not a"
                        f" valid regular expression ({error}). Entries prefixed with 're:' must be Python regular"
                        " expressions."
                    ) from error

    def __bool__(self) -> bool:
        return bool(self.patterns)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.patterns!r})"

    def _matches(self, pattern: KeepFp32Pattern, name: str, module: nn.Module) -> bool:
        if isinstance(pattern, type):
            # sync_batchnorm=True replaces BatchNorm1d/2d/3d by SyncBatchNorm, which subclasses none of them.
            converted_batch_norm = isinstance(module, nn.SyncBatchNorm) and issubclass(pattern, BATCH_NORMS)
            return isinstance(module, pattern) or converted_batch_norm
        if pattern.startswith(REGEX_PREFIX):
            return self._regexes[pattern].fullmatch(name) is not None
        return name == pattern

    def match(self, module: nn.Module, warn: bool = True) -> list[str]:
        """Qualified names of every module under ``module`` (itself included) that a pattern matches.

        Args:
            module: the root; names are relative to it.
            warn: warn, once per pattern, about patterns that match nothing, suggesting close names.

        """
        named = list(module.named_modules())
        matched: list[str] = []
        for pattern in self.patterns:
            hits = [name for name, child in named if self._matches(pattern, name, child)]
            matched.extend(hit for hit in hits if hit not in matched)
            if warn and not hits:
                close = difflib.get_close_matches(str(pattern), [name for name, _ in named if name], n=3)
                hint = f" Close names: {close}." if close else ""
                rank_zero_warn(
                    f"keep_fp32 pattern {pattern!r} matches no module of {type(module).__name__}, so it keeps"
                    " nothing in fp32. Names are qualified as in named_modules(); 're:' patterns must match a whole"
                    f" name.{hint}"
                )
        return matched

    def kept_modules(self, module: nn.Module) -> set[nn.Module]:
        """Every module inside a matched subtree: under O2 and O3 their weights stay fp32."""
        roots = self.match(module, warn=False)
        return {child for name in roots for child in module.get_submodule(name).modules()}

    def apply(self, module: nn.Module, handles: list[RemovableHandle] | None = None) -> list[str]:
        """Attach :class:`Fp32Region` hooks to the outermost matched modules, in place.

        Args:
            module: the root; names are relative to it.
            handles: if given, the handles of the hooks attached now are appended to it, for the caller to remove
                them (the opt levels remove theirs at teardown).

        Returns:
            The qualified names of the modules that run in fp32 regions (already-hooked ones included).

        """
        names = outermost(self.match(module))
        for name in names:
            target = module.get_submodule(name)
            if not has_fp32_region(target):
                attached = Fp32Region().attach(target)
                if handles is not None:
                    handles.extend(attached)
        return names


__all__ = [
    "Fp32Overrides",
    "Fp32Region",
    "KeepFp32Pattern",
    "cast_arguments",
    "cast_low_precision",
    "first_low_precision_dtype",
    "is_low_precision",
]
