"""O2's parameter pairs: each fp32 master parameter with the half model parameter that stands in for it.

The master parameter is the model's original fp32 ``nn.Parameter``, which the optimizer steps; the model parameter
is a new half ``nn.Parameter`` holding its value cast once. Either can be shown: put into every ``(module, name)``
that holds the parameter (a dict write per holder, no cast). :class:`ParameterPairs` keeps the pairs and moves
values, gradients and ``requires_grad`` between the two sides; the forward and backward contexts
(:mod:`lightning_mp.policies.o2.contexts`) and the policy decide when.

Values. :meth:`~ParameterPairs.master_params_to_model_params` writes masters into their model parameters in one
foreach copy: those an optimizer stepped (named, since fused kernels move no version counter) and every master whose
version counter moved since it was last written (``load_state_dict``, StochasticWeightAveraging or an EMA callback
writing fp32 weights). The other way, a model parameter edited in place while the model shows it (a weight changed
inside ``training_step``) is copied into its master element by element: where it still equals the master rounded to
half, the master keeps its extra bits, so swapping weights out and back in loses nothing. ``state_dict()`` gives the
masters' fp32 values whichever side the model shows, and ``load_state_dict`` writes fp32 values into the masters
exactly.

Gradients. Backward gives the model parameters half gradients, which wait there until the step moves them into the
masters. The optimizer holds the masters, so its ``zero_grad`` reaches the masters' ``.grad``, not the model
parameters' where the gradients wait. So each backward leaves in every master whose model parameter takes a
gradient a ``.grad`` it can recognise: the gradient already there, or else an empty sparse tensor of the master's
shape (:func:`empty_gradient`, the pair's marker). A ``zero_grad`` that removed it, zeroed it in place (its version
moved) or replaced it discarded the gradient waiting on the model parameter: the next backward, or the step, drops
it, and a zeroed one leaves a zero fp32 gradient, as torch does. So a step uses the gradients of the backwards since
the last discard, as in fp32, and an inf in a discarded backward skips no step.

``requires_grad`` set on either side (``BackboneFinetuning`` freezes and unfreezes whichever the model shows) is
mirrored onto the other side where a context asks for it.

The Trainer and Fabric move the model to its device while it shows the model parameters: the masters follow
(:meth:`~ParameterPairs.follow_devices`), the same parameter objects with new storage.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_mp.policies.o2.selection import Holders


class ParameterPairs:
    """fp32 master parameters and the half model parameters that take their place while the model computes.

    Pair ``i`` is ``master_params[i]`` and ``model_params[i]``, with ``holders[i]`` (every ``(module, name)`` that
    holds the parameter) and ``keys[i]`` (every qualified name it has in its model).

    Args:
        dtype: the half type.

    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.names: list[str] = []
        """Per pair, its first qualified name, for messages."""
        self.master_params: list[nn.Parameter] = []
        self.model_params: list[nn.Parameter] = []
        self.holders: list[Holders] = []
        self.keys: list[list[str]] = []
        """Per pair, its qualified names in the converted model (a tied parameter has several)."""
        self.model_params_shown = False
        """Whether the model holds the model parameters (else the masters)."""
        self._no_grad = torch.no_grad()
        self.model_param_versions: list[int] = []
        """The model parameters' versions when they were last written: one whose version moved was edited."""
        self._master_param_versions: list[int] = []
        """The masters' versions when their model parameters were last written: one whose version moved changed."""
        self._requires_grad: list[bool] = []
        """Per pair, the ``requires_grad`` both sides had at the last mirror."""
        self._model_param_aliases: list[Tensor] = []
        """A detached alias of each model parameter: it shares its storage and version counter, and writing through
        it needs no ``torch.no_grad()`` context."""
        self._index_of: dict[int, int] = {}
        """``id`` of a master or a model parameter -> its pair's index."""
        self.markers: list[Tensor] = []
        """Per pair, an empty sparse fp32 tensor of its master's shape: the master's ``.grad`` while its model
        parameter's gradient waits for the step, so that a ``zero_grad`` of the master is seen."""
        self.marks: list[Tensor | None] = []
        """Per pair, the master's ``.grad`` when the last backward began (a marker or a real gradient), or None."""
        self.mark_versions: list[int] = []
        """The version of each mark when it was taken: ``zero_grad(set_to_none=False)`` moves it."""

    def add(self, master_param: nn.Parameter, holders: Holders, keys: list[str]) -> int:
        """Make a half model parameter of ``master_param`` (one cast) for its ``holders``; return the pair's index."""
        with torch.no_grad():
            model_param = nn.Parameter(master_param.detach().to(self.dtype), requires_grad=master_param.requires_grad)
        index = len(self.master_params)
        self.names.append(keys[0])
        self.master_params.append(master_param)
        self.model_params.append(model_param)
        self.holders.append(holders)
        self.keys.append(keys)
        self.model_param_versions.append(model_param._version)
        self._master_param_versions.append(master_param._version)
        self._requires_grad.append(master_param.requires_grad)
        self._model_param_aliases.append(model_param.detach())
        self._index_of[id(master_param)] = self._index_of[id(model_param)] = index
        self.markers.append(empty_gradient(master_param))
        self.marks.append(None)
        self.mark_versions.append(0)
        if self.model_params_shown:
            for module, name in holders:
                module._parameters[name] = model_param
        return index

    def follow_devices(self) -> None:
        """Move each master (and its gradient) to its model parameter's device; the masters stay the same objects."""
        with self._no_grad:
            for i, (master, model_param) in enumerate(zip(self.master_params, self.model_params, strict=True)):
                if master.device != model_param.device:
                    grad, mark = master.grad, self.marks[i]
                    intact = mark is not None and grad is mark and mark._version == self.mark_versions[i]
                    old_marker = self.markers[i]
                    master.data = master.data.to(model_param.device)
                    self.markers[i] = empty_gradient(master)
                    if grad is old_marker:
                        master.grad = self.markers[i]
                    elif grad is not None:
                        master.grad = grad.to(model_param.device)
                    moved = master.grad
                    if intact and moved is not None:
                        self.marks[i] = moved
                        self.mark_versions[i] = moved._version

    def master_of(self, parameter: Tensor) -> Tensor:
        """The master of a model parameter; any other tensor (a master, a parameter without a pair) as it is."""
        index = self._index_of.get(id(parameter))
        return parameter if index is None else self.master_params[index]

    def indices(self, parameters: Sequence[Tensor]) -> list[int]:
        """The pair index of each of ``parameters`` that has one."""
        return [index for p in parameters if (index := self._index_of.get(id(p))) is not None]

    def copy_model_param_edit(self, i: int) -> None:
        """Copy what was written into model parameter ``i`` since it was last written into its master.

        Element by element: where the model parameter still equals its master rounded to half, the master keeps its
        value.
        """
        master, model_param = self.master_params[i], self.model_params[i]
        with self._no_grad:
            master.copy_(torch.where(model_param == master.to(self.dtype), master, model_param.to(master.dtype)))
        self.model_param_versions[i] = model_param._version
        self._master_param_versions[i] = master._version

    def copy_model_param_edits(self) -> None:
        """Copy into its master each model parameter edited since it was written (:meth:`copy_model_param_edit`)."""
        versions = self.model_param_versions
        for i, model_param in enumerate(self.model_params):
            if model_param._version != versions[i]:
                self.copy_model_param_edit(i)

    def show_master_params(self) -> None:
        """Put the masters into the model, after copying the model parameters' edits into them.

        Both sides of each pair get the ``requires_grad`` that either side was set to since the last mirror.
        """
        versions = self.model_param_versions
        recorded = self._requires_grad
        for i, (master, model_param) in enumerate(zip(self.master_params, self.model_params, strict=True)):
            if model_param._version != versions[i]:
                self.copy_model_param_edit(i)
            if model_param.requires_grad != recorded[i]:
                master.requires_grad_(model_param.requires_grad)
            elif master.requires_grad != recorded[i]:
                model_param.requires_grad_(master.requires_grad)
            recorded[i] = master.requires_grad
            for module, name in self.holders[i]:
                module._parameters[name] = master
        self.model_params_shown = False

    def master_params_to_model_params(
        self, stepped: Collection[int] = (), *, show: bool = False, mirror: bool = False
    ) -> None:
        """Write the ``stepped`` masters, and every master whose version moved, into their model parameters.

        One foreach copy writes them all.

        Args:
            stepped: the pairs an optimizer stepped, written whatever their version counters say.
            show: also put the model parameters into the model.
            mirror: also give both sides of each pair the ``requires_grad`` one of them was set to since the last
                mirror.

        """
        written: list[int] = []
        targets: list[Tensor] = []
        sources: list[Tensor] = []
        versions = self._master_param_versions
        recorded = self._requires_grad
        aliases = self._model_param_aliases
        for i, (master, model_param) in enumerate(zip(self.master_params, self.model_params, strict=True)):
            if master._version != versions[i] or i in stepped:
                written.append(i)
                alias = aliases[i]
                if alias.data_ptr() != model_param.data_ptr():  # the model was moved: new storage
                    alias = aliases[i] = model_param.detach()
                targets.append(alias)
                sources.append(master)
                versions[i] = master._version
            if mirror:
                if master.requires_grad != recorded[i]:
                    model_param.requires_grad_(master.requires_grad)
                elif model_param.requires_grad != recorded[i]:
                    master.requires_grad_(model_param.requires_grad)
                recorded[i] = master.requires_grad
            if show:
                for module, name in self.holders[i]:
                    module._parameters[name] = model_param
        if targets:
            torch._foreach_copy_(targets, sources)
            for i in written:
                self.model_param_versions[i] = self.model_params[i]._version
        if show:
            self.model_params_shown = True

    def register_state_dict_hooks(self, module: nn.Module, indices: list[int]) -> list[RemovableHandle]:
        """Hooks through which ``module``'s ``state_dict`` gives, and ``load_state_dict`` sets, the fp32 masters.

        ``indices`` are the pairs of this one model: their names may repeat in another model.
        """
        # Partials, not bound methods: torch marks the hooks its public API registers with an attribute.
        return [
            module.register_state_dict_post_hook(functools.partial(_substitute_master_params, self, indices)),
            module.register_load_state_dict_pre_hook(functools.partial(_load_master_params, self, indices)),
        ]

    def substitute_master_params(self, state_dict: dict[str, Any], prefix: str, indices: Iterable[int]) -> None:
        """Put the fp32 values of the masters ``indices`` in ``state_dict`` where their model parameters' are."""
        self.copy_model_param_edits()
        for i in indices:
            master = self.master_params[i]
            for key in self.keys[i]:
                value = state_dict.get(prefix + key)
                if isinstance(value, Tensor):
                    state_dict[prefix + key] = master if isinstance(value, nn.Parameter) else master.detach()

    def load_master_params(self, state_dict: dict[str, Any], prefix: str, indices: Iterable[int]) -> None:
        """Write the fp32 values of ``state_dict`` into the masters ``indices``, which ``load_state_dict`` rounds."""
        with self._no_grad:
            for i in indices:
                master = self.master_params[i]
                value = state_dict.get(prefix + self.keys[i][0])
                if isinstance(value, Tensor) and value.shape == master.shape:
                    master.copy_(value)


def empty_gradient(master: Tensor) -> Tensor:
    """An empty sparse tensor of ``master``'s shape, dtype and device: a ``.grad`` that holds nothing.

    It stands in the master's ``.grad`` from a backward to the step while the gradient waits on the model parameter.
    torch's ``zero_grad`` then has something to clear: ``set_to_none=True`` removes it, ``set_to_none=False`` zeroes
    it in place (its version moves), and either says that the waiting gradient was discarded. No element, no memory.
    """
    indices = torch.empty((master.dim(), 0), dtype=torch.long, device=master.device)
    values = torch.empty((0,), dtype=master.dtype, device=master.device)
    return torch.sparse_coo_tensor(indices, values, master.shape, check_invariants=True, is_coalesced=True)


def _substitute_master_params(
    pairs: ParameterPairs, indices: list[int], module: nn.Module, state_dict: dict[str, Any], prefix: str, _: Any
) -> None:
    pairs.substitute_master_params(state_dict, prefix, indices)


def _load_master_params(
    pairs: ParameterPairs, indices: list[int], module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any
) -> None:
    pairs.load_master_params(state_dict, prefix, indices)
