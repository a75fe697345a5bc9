"""O2's master parameters: an fp32 copy kept beside each half model parameter, which the optimizer's math steps.

Apex's O2 and DeepSpeed's fp16/bf16 optimizers keep two copies of each weight: a half *model parameter*, which the
forward and backward use, and an fp32 *master parameter*, which the optimizer steps. Here the model parameter is the
user's own ``nn.Parameter``, cast to half in place (its ``.data``), so it is one object from before setup to after
teardown: the model, the optimizer's ``param_groups`` and every hook registered on it (gradient hooks,
post-accumulate hooks, ``requires_grad``) see the same parameter, and its dtype stays half for the whole run, so DDP's
hooks on it keep working. The master is an fp32 ``nn.Parameter`` that nothing else holds: :class:`MasterParams`
keeps it beside its model parameter, found by the model parameter's identity.

Values. The master takes over the parameter's original fp32 storage, so a conversion copies nothing in fp32.
:meth:`MasterParams.master_params_to_model_params` writes the stepped masters into their model parameters (the one
weight cast per step): in fp16 in one foreach copy, to nearest even; in bf16 to nearest with ties away from zero
(:func:`~lightning_mp.policies.o2.split.write_rounded`, a fixed few ops per chunk of weights), the rounding whose 16
dropped bits ``lean-exact`` keeps, so that both levels compute with the same weights. The other way, a model
parameter edited in place since it was last written (``load_state_dict``, a weight changed in a callback, DDP's
broadcast of rank 0's weights at wrap time) is merged into its master element by element
(:meth:`MasterParams.merge_edits`): where the model parameter still equals its master rounded to half (either way a
tie can round), the master keeps its extra bits, so writing the same values back loses nothing.
``state_dict()`` gives the masters' fp32 values, merged first, and ``load_state_dict`` writes fp32 values into the
masters exactly (:meth:`MasterParams.register_state_dict_hooks`).

Gradients. Backward gives the model parameters half gradients (scaled in fp16), where autograd, the user's hooks and
DDP see them. For a step, :meth:`MasterParams.model_grads_to_master_grads` gives each master an fp32 copy, which the
loss scaler unscales and checks exactly (fp16's unscaled gradients would lose their smallest values in fp16);
:meth:`MasterParams.master_grads_to_model_grads` writes the unscaled values back into the half gradients, so that a
hook reading ``.grad`` before the step reads true gradients, as torch documents for fp16 after ``unscale_``. A half
gradient the user changed since (clipping ``model.parameters()`` by hand) wins over its master's:
:meth:`MasterParams.take_model_grad_edits` copies it up before the step.

Memory per parameter with AdamW: 2 bytes of half model parameter, 4 of master and 8 of fp32 moment estimates, 2 of half
gradient from a backward to the step, and 4 of fp32 gradient in the step only: 14 bytes between steps.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_mp.policies.o2.split import round_into, round_to_bf16, write_rounded


class MasterParams:
    """The half model parameters the opt level converted, each with its fp32 master, by index.

    Entry ``i`` is ``model_params[i]`` (the user's parameter, half), ``master_params[i]`` (fp32, held only here) and
    ``keys[i]`` (every qualified name it has in its model; a tied parameter has several).

    Args:
        dtype: the half type.

    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.model_params: list[nn.Parameter] = []
        self.master_params: list[nn.Parameter] = []
        self.keys: list[list[str]] = []
        self.index_of: dict[int, int] = {}
        """``id`` of a model or a master parameter -> its entry."""
        self._written_versions: list[int] = []
        """Each model parameter's version when it last equalled its master rounded; -1: never checked since the
        conversion (DDP may have broadcast other values into it since)."""
        self._model_grads: list[Tensor | None] = []
        """Each model parameter's ``.grad`` as the last copy between it and its master's left it, and its version."""
        self._aliases: list[Tensor] = []
        """A detached alias of each model parameter (its storage and version counter), written without no_grad."""
        self._model_grad_versions: list[int] = []
        self._loaded: set[int] = set()
        """Entries whose masters a ``load_state_dict`` wrote, until its post-hook rounds them into the model."""

    def __len__(self) -> int:
        return len(self.model_params)

    @property
    def names(self) -> list[str]:
        """Each entry's first qualified name, for messages."""
        return [keys[0] for keys in self.keys]

    def add(self, param: nn.Parameter, keys: list[str]) -> int:
        """Make ``param`` half in place and keep its fp32 values as its master; return the entry's index."""
        with torch.no_grad():
            master = nn.Parameter(param.data, requires_grad=param.requires_grad)
            param.data = self.to_half(master.data)
        index = len(self.model_params)
        self.model_params.append(param)
        self.master_params.append(master)
        self.keys.append(keys)
        self.index_of[id(param)] = self.index_of[id(master)] = index
        self._written_versions.append(-1)
        self._aliases.append(param.detach())
        self._model_grads.append(None)
        self._model_grad_versions.append(0)
        return index

    def to_half(self, master: Tensor) -> Tensor:
        """``master`` rounded to the half type as the model computes with it (bf16: ties away from zero)."""
        return round_to_bf16(master) if self.dtype == torch.bfloat16 else master.to(self.dtype)

    def unchanged(self, param: Tensor, master: Tensor) -> Tensor:
        """Where ``param`` still holds ``master`` rounded.

        By this rounding, or to nearest even (torch's copy, which ``load_state_dict`` makes).
        """
        same = param == self.to_half(master)
        return same.logical_or_(param == master.to(self.dtype)) if self.dtype == torch.bfloat16 else same

    def follow_devices(self, indices: Iterable[int]) -> None:
        """Move each master to its model parameter's device (the Trainer and Fabric move the model after setup)."""
        for i in indices:
            master, param = self.master_params[i], self.model_params[i]
            if master.device != param.device:
                with torch.no_grad():
                    master.data = master.data.to(param.device)

    def merge_edits(self, indices: Iterable[int], force: bool = False) -> None:
        """Merge what was written into each model parameter since it was last written into its master.

        Element by element: where the model parameter still equals its master rounded to half, the master keeps its
        value. ``force`` merges whatever the version counters say (writes through ``.data`` move none).
        """
        versions = self._written_versions
        with torch.no_grad():
            for i in indices:
                param = self.model_params[i]
                if force or param._version != versions[i]:
                    master = self.master_params[i]
                    if master.device != param.device:
                        master.data = master.data.to(param.device)
                    master.copy_(torch.where(self.unchanged(param, master), master, param.to(master.dtype)))
                    versions[i] = param._version

    def master_params_to_model_params(self, indices: Sequence[int], consume: bool = False) -> None:
        """Write the masters ``indices`` into their model parameters.

        In fp16 in one foreach copy, in bf16 rounded ties away from zero in a fixed few ops per chunk of weights;
        with ``consume`` (bf16) the masters' lowest bits are set in place instead of in a copy, which leaves them
        unfit for anything but freeing (:func:`~lightning_mp.policies.o2.split.round_into`). Through detached aliases
        of the model parameters, which share their storage and version counter: the write needs no
        ``torch.no_grad()``, and a graph that saved a model parameter sees it changed, as after an fp32 step.
        """
        if not indices:
            return
        model_params, master_params, aliases = self.model_params, self.master_params, self._aliases
        targets: list[Tensor] = []
        sources: list[Tensor] = []
        for i in indices:
            alias, param = aliases[i], model_params[i]
            if alias.data_ptr() != param.data_ptr():  # the model was moved since: new storage
                alias = aliases[i] = param.detach()
            targets.append(alias)
            sources.append(master_params[i].detach())  # no autograd record of the rounding's views
        if self.dtype == torch.bfloat16:
            (round_into if consume else write_rounded)(targets, sources)
        else:
            torch._foreach_copy_(targets, sources)
        versions = self._written_versions
        for i in indices:
            versions[i] = model_params[i]._version

    def model_grads_to_master_grads(self, indices: Iterable[int]) -> None:
        """Give each master ``indices`` an fp32 copy of its model parameter's gradient (None where it has none)."""
        model_params, master_params = self.model_params, self.master_params
        seen, seen_versions = self._model_grads, self._model_grad_versions
        for i in indices:
            grad = model_params[i].grad
            master_params[i].grad = None if grad is None else grad.to(torch.float32)
            seen[i] = grad
            seen_versions[i] = 0 if grad is None else grad._version

    def master_grads_to_model_grads(self, indices: Sequence[int]) -> None:
        """Write the gradients of the masters ``indices`` (unscaled, clipped) into the half model gradients."""
        model_grads: list[Tensor] = []
        master_grads: list[Tensor] = []
        written: list[int] = []
        for i in indices:
            model_grad, master_grad = self.model_params[i].grad, self.master_params[i].grad
            if model_grad is not None and master_grad is not None:
                model_grads.append(model_grad)
                master_grads.append(master_grad)
                written.append(i)
        if not written:
            return
        torch._foreach_copy_(model_grads, master_grads)
        seen, seen_versions = self._model_grads, self._model_grad_versions
        for model_grad, i in zip(model_grads, written, strict=True):
            seen[i] = model_grad
            seen_versions[i] = model_grad._version

    def ready_for_step(self, indices: Iterable[int]) -> None:
        """Before an optimizer step of ``indices``: merge edits into the masters, and fresh gradients.

        A model parameter edited since it was last written is merged into its master; a model gradient changed or
        replaced since the last copy (or with none made in this step) replaces its master's.
        """
        model_params, master_params = self.model_params, self.master_params
        versions, seen, seen_versions = self._written_versions, self._model_grads, self._model_grad_versions
        for i in indices:
            param = model_params[i]
            if param._version != versions[i] or master_params[i].device != param.device:
                self.merge_edits((i,), force=True)
            grad = param.grad
            if grad is not seen[i] or (grad is not None and grad._version != seen_versions[i]):
                master_params[i].grad = None if grad is None else grad.to(torch.float32)
                seen[i] = grad
                seen_versions[i] = 0 if grad is None else grad._version

    def finish_step(self, indices: Sequence[int]) -> None:
        """After an optimizer step of ``indices``: write the masters into the model parameters, free the gradients.

        The masters' fp32 gradients are freed with the step, so an O2 parameter's ``.grad`` is None after a step, as
        after ``zero_grad()``.
        """
        self.master_params_to_model_params(indices)
        self.free_step_gradients(indices)

    def free_step_gradients(self, indices: Sequence[int]) -> None:
        """Free the gradients of the stepped entries ``indices``, half and fp32."""
        model_params, master_params, seen = self.model_params, self.master_params, self._model_grads
        for i in indices:
            master_params[i].grad = None
            model_params[i].grad = None
            seen[i] = None

    def free_master_grads(self) -> None:
        """Free every master's fp32 gradient (kept after a skipped step, for the scaler's report)."""
        for master in self.master_params:
            master.grad = None

    def restore_fp32(self) -> None:
        """Give every model parameter its master's fp32 values back as its own data (the end of a run).

        Every edit is merged first, also one written through ``.data`` (an averaging callback's final copy).
        """
        self.merge_edits(range(len(self)), force=True)
        with torch.no_grad():
            for param, master in zip(self.model_params, self.master_params, strict=True):
                param.data = master.data.to(param.device)
                if param.grad is not None:
                    param.grad = param.grad.to(master.dtype)
                master.grad = None

    def register_state_dict_hooks(self, module: nn.Module, indices: list[int]) -> list[RemovableHandle]:
        """Hooks through which ``module``'s ``state_dict`` gives, and ``load_state_dict`` sets, the fp32 masters.

        ``indices`` are the entries of this one model: their names may repeat in another model.
        """
        # Partials, not bound methods: torch marks the hooks its public API registers with an attribute.
        return [
            module.register_state_dict_post_hook(functools.partial(_substitute_master_params, self, indices)),
            module.register_load_state_dict_pre_hook(functools.partial(_load_master_params, self, indices)),
            module.register_load_state_dict_post_hook(functools.partial(_round_loaded_masters, self, indices)),
        ]

    def substitute_master_params(self, state_dict: dict[str, Any], prefix: str, indices: Sequence[int]) -> None:
        """Put the fp32 values of the masters ``indices`` in ``state_dict`` where their model parameters' are."""
        self.merge_edits(indices, force=True)
        for i in indices:
            master = self.master_params[i]
            for key in self.keys[i]:
                value = state_dict.get(prefix + key)
                if isinstance(value, Tensor):
                    state_dict[prefix + key] = master if isinstance(value, nn.Parameter) else master.detach()

    def load_master_params(self, state_dict: dict[str, Any], prefix: str, indices: Iterable[int]) -> None:
        """Write the fp32 values of ``state_dict`` into the masters ``indices``; ``load_state_dict`` rounds them."""
        with torch.no_grad():
            for i in indices:
                master = self.master_params[i]
                value = state_dict.get(prefix + self.keys[i][0])
                if isinstance(value, Tensor) and value.shape == master.shape:
                    master.copy_(value)
                    # load_state_dict writes the same values rounded to nearest even into the model parameter; the
                    # post-hook rounds them as a step would (round_loaded_masters).
                    self._written_versions[i] = -1
                    self._loaded.add(i)

    def round_loaded_masters(self, indices: Iterable[int]) -> None:
        """Write the masters a ``load_state_dict`` set into their model parameters, rounded as a step writes them.

        torch's load rounds to nearest even; a resumed run must compute with the weights the uninterrupted one had.
        """
        loaded = [i for i in indices if i in self._loaded]
        self._loaded.difference_update(loaded)
        self.master_params_to_model_params(loaded)


def _substitute_master_params(
    masters: MasterParams, indices: list[int], module: nn.Module, state_dict: dict[str, Any], prefix: str, _: Any
) -> None:
    masters.substitute_master_params(state_dict, prefix, indices)


def _round_loaded_masters(masters: MasterParams, indices: list[int], module: nn.Module, incompatible: Any) -> None:
    masters.round_loaded_masters(indices)


def _load_master_params(
    masters: MasterParams, indices: list[int], module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any
) -> None:
    masters.load_master_params(state_dict, prefix, indices)
