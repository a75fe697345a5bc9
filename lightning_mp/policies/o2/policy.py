"""O2: the model computes with half parameters; the optimizer's math steps fp32 master parameters kept beside them.

Apex's O2 and DeepSpeed's fp16/bf16 optimizers keep a half *model parameter*, which the forward and backward use, and
an fp32 *master parameter*, which the optimizer steps. This level keeps both without giving the user a second object:
the user's parameters become half in place and stay the very objects the model, the optimizer and every hook hold,
and each master is kept out of sight beside its parameter (:mod:`~lightning_mp.policies.o2.masters`).

1. ``convert_module`` (before the model moves and before DDP wraps it) casts each chosen parameter
   (:mod:`~lightning_mp.policies.o2.selection`) to half in place and keeps its fp32 values as its master. DDP, wrapped
   after this, all-reduces half gradients. Lazy parameters (``nn.LazyLinear``) compute in fp32 until their first
   forward materialises them and are converted at the next forward. The ``keep_fp32`` subtrees run in fp32 regions
   (:mod:`lightning_mp.overrides`) from here to teardown.
2. ``connect`` registers four hooks on each optimizer, through torch's public optimizer API: around ``step`` and
   around ``load_state_dict``, the optimizer's ``param_groups`` hold the masters instead of the model parameters, and
   its state is keyed by them. So any optimizer (fused, foreach, LBFGS, a third-party one) computes its update in fp32
   on fp32 weights, gradients and states, and a loaded state is cast to fp32, not rounded to half. Everywhere else
   the groups hold the model parameters, and the state dict keeps torch's format with fp32 states. The post-hook is
   put first among the optimizer's (:func:`run_first`): every other post-hook, registered before or after, reads the
   model parameters with the step written into them.
3. Forward and backward need nothing: the model computes with its half parameters under autocast (fp32 for what is
   not a chosen weight: normalisation layers, losses, softmax-like reductions), and the half gradients land on the
   parameters, where the user's hooks and DDP see them.
4. ``prepare_step`` (once per optimizer step, before unscaling, clipping or stepping) gives each master an fp32 copy
   of its parameter's gradient; the loss scaler unscales and checks those (:meth:`O2Policy.step_parameters`), and
   ``gradients_changed`` writes the true values back into the half gradients, so hooks before the step read true
   gradients on the model's parameters (fp16's after ``unscale_``, as in torch's recipe). Clipping through the plugin
   clips the masters' fp32 gradients; a half gradient changed by hand since wins at the step.
5. After the step the stepped masters are written into their parameters in one foreach copy, the one cast per
   weight per step, and both gradients, half and fp32, are freed: after a step an O2 parameter's ``.grad`` is None,
   as after ``zero_grad()``, and O2 keeps 14 bytes per parameter between steps with AdamW. A step skipped on the host
   writes nothing and keeps the gradients until the next backward (the scaler's report reads them); in fp16
   it names the masters beyond fp16's range (:mod:`~lightning_mp.policies.o2.overflow`), which setup refuses too.
6. ``teardown`` (after fit, and after a failed fit) writes every master back into its parameter as fp32 data and
   removes every hook: the model is the fp32 model it was, with the same parameter objects.

Fabric loads an optimizer's state before the plugin first sees the optimizer (at its first step), when torch would
round fp32 states to the half parameters' dtype. So under Fabric the policy's state (saved with the plugin's) refers
to each connected optimizer's fp32 states of the O2 parameters: the very tensors of the optimizer's own state dict,
which ``torch.save`` stores once. A state loaded before its optimizer connects is then put back in fp32 exactly; one
loaded without the plugin's state continues from its half values, with a warning.
"""

from __future__ import annotations

import warnings
import weakref
from collections import defaultdict
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_mp.arguments.checks import arguments_of
from lightning_mp.overrides import Fp32Overrides, Fp32Region, has_fp32_region, outermost
from lightning_mp.policies.base import PrecisionPolicy
from lightning_mp.policies.casting import check_half_dtype, keep_tied_weights_together
from lightning_mp.policies.o2.masters import MasterParams
from lightning_mp.policies.o2.overflow import check_range
from lightning_mp.policies.o2.selection import choose_parameters

Swapped = list[tuple[list[Any], int, int]]
"""Where an optimizer's groups hold masters in a step: each ``(group["params"], position, entry)``."""


class StateViews:
    """An optimizer's state keyed by its parameters (its own dict, between steps) and by their masters (in a step).

    Both dicts hold the very same per-parameter state dicts, so torch's step, which reads ``optimizer.state[master]``
    while the groups hold the masters, updates what the optimizer's own dict holds. Swapping which dict the optimizer
    holds costs nothing per parameter; the master-keyed dict is rebuilt only when the optimizer's own changed since
    (a first step, a load, Lightning moving the states to a device), told by the identities of its values, which are
    read without hashing a tensor.

    Args:
        by_param: the optimizer's state dict.
        masters: the model parameters and their masters.

    """

    def __init__(self, by_param: defaultdict[Any, Any], masters: MasterParams) -> None:
        self.masters = masters
        self.by_param = by_param
        index_of, master_params = masters.index_of, masters.master_params
        self.by_master: defaultdict[Any, Any] = defaultdict(dict)
        for key, value in by_param.items():
            i = index_of.get(id(key))
            self.by_master[key if i is None else master_params[i]] = value
        self.values = tuple(map(id, by_param.values()))

    def by_param_after(self, state: defaultdict[Any, Any]) -> defaultdict[Any, Any]:
        """The optimizer's own dict, holding what ``state`` (the dict it held in a step or a load) holds now.

        After a step that added states (a first step) they are added to it; after a load, which replaced the dict, a
        new one keyed by the parameters is made.
        """
        index_of, model_params = self.masters.index_of, self.masters.model_params
        own: defaultdict[Any, Any] = self.by_param if state is self.by_master else defaultdict(dict)
        own.clear()
        for key, value in state.items():
            i = index_of.get(id(key))
            own[key if i is None else model_params[i]] = value
        if state is self.by_master:
            self.values = tuple(map(id, own.values()))
        return own


class O2Policy(PrecisionPolicy):
    """Half model parameters (the user's own, cast in place), fp32 masters beside them for the optimizer's math.

    Args:
        half_dtype: ``torch.float16`` or ``torch.bfloat16``.
        keep_fp32: module types, qualified names or ``re:`` patterns whose modules compute in fp32.

    Raises:
        ValueError: if ``half_dtype`` is not a half type, or a ``keep_fp32`` entry is invalid.

    """

    opt_level = "O2"
    uses_autocast = True
    computes_with_half_weights = True
    masters_type: ClassVar[type[MasterParams]] = MasterParams
    """What keeps the masters: fp32 tensors here, packed remainders at ``lean-exact``."""

    def __init__(self, half_dtype: torch.dtype | None, keep_fp32: Sequence[type | str] = ()) -> None:
        with arguments_of(type(self).__name__):
            half_dtype = check_half_dtype(half_dtype)
        super().__init__(half_dtype, keep_fp32)
        self.overrides = Fp32Overrides(self.keep_fp32)
        self.masters: MasterParams | None = None
        """The model parameters and their masters, from ``convert_module`` until ``teardown``."""
        self.lazy_params: list[tuple[str, nn.Parameter, list[int], nn.Module]] = []
        """Lazy parameters waiting for their first forward: name, parameter, its model's entries, its model."""
        self._connected: list[weakref.ReferenceType[Optimizer]] = []
        """The optimizers whose hooks are registered, in connection order."""
        self._in_step: dict[int, Swapped] = {}
        """Per optimizer (by ``id``) in its ``step`` or ``load_state_dict``: where its groups hold masters."""
        self._state_views: dict[int, StateViews] = {}
        """Per optimizer (by ``id``), its state keyed by its parameters and by their masters (:class:`StateViews`)."""
        self._saved_states: list[dict[str, dict[str, Tensor]]] = []
        """The fp32 optimizer states of a loaded policy state, per optimizer in connection order (Fabric)."""
        self._master_grads_kept = False
        """Whether a skipped step left fp32 gradients on masters, to free at the next backward."""

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Cast every chosen parameter to half in place, keeping its fp32 values as its master, before DDP wraps it.

        Raises:
            HalfOverflowError: in fp16, if a chosen weight is beyond fp16's range.

        """
        assert self.half_dtype is not None
        overrides = keep_tied_weights_together(module, self.overrides)
        chosen = choose_parameters(module, overrides.kept_modules(module))
        materialized = [entry for entry in chosen.values() if not isinstance(entry[0], nn.UninitializedParameter)]
        check_range([(keys[0], param) for param, keys in materialized], self.half_dtype)
        # One MasterParams for every model this run converts (Fabric sets up a GAN's two models one by one); each
        # model's state-dict hooks know its own entries, whose names may repeat in another model.
        if self.masters is None:
            self.masters = self.new_masters()
        masters = self.masters
        indices = [masters.add(param, keys) for param, keys in materialized]
        self.lazy_params += [
            (keys[0], param, indices, module)
            for param, keys in chosen.values()
            if isinstance(param, nn.UninitializedParameter)
        ]
        self.hook_handles += masters.register_state_dict_hooks(module, indices)
        for root in [module.get_submodule(name) for name in outermost(overrides.match(module))]:
            if not has_fp32_region(root):  # a region the user attached is the user's to keep
                self.hook_handles += Fp32Region().attach(root)
        return module

    def new_masters(self) -> MasterParams:
        """An empty :attr:`masters_type` for this level's half type, which ``convert_module`` fills."""
        assert self.half_dtype is not None
        return self.masters_type(self.half_dtype)

    @override
    def connect(self, module: nn.Module, optimizers: list[Optimizer]) -> list[Optimizer]:
        """Register the step and load hooks on each optimizer; put back the fp32 states a Fabric load rounded.

        Connecting an optimizer again is a no-op, and optimizers may be connected one at a time (Fabric does).
        """
        optimizers = super().connect(module, optimizers)
        self._connected = [reference for reference in self._connected if reference() is not None]
        for optimizer in optimizers:
            if any(reference() is optimizer for reference in self._connected):
                continue
            position = len(self._connected)
            self._connected.append(weakref.ref(optimizer))
            finishing = optimizer.register_step_post_hook(self._after_step)
            run_first(finishing)
            self.hook_handles += [
                optimizer.register_step_pre_hook(self._before_step),
                finishing,
                optimizer.register_load_state_dict_pre_hook(self._before_load),
                optimizer.register_load_state_dict_post_hook(self._after_load),
            ]
            saved = self._saved_states[position] if position < len(self._saved_states) else None
            self._repair_rounded_states(optimizer, saved)
        return optimizers

    @override
    def parameter_names(self, module: nn.Module) -> dict[int, str]:
        """``id -> name`` of every parameter of ``module`` and of the masters beside them."""
        names = super().parameter_names(module)
        if self.masters is not None:
            masters = self.masters
            names.update({id(master): name for master, name in zip(masters.master_params, masters.names, strict=True)})
        return names

    @override
    def backward_context(self) -> AbstractContextManager:
        """Free the masters' fp32 gradients a skipped step kept: the scaler has reported them by now."""
        if self._master_grads_kept and self.masters is not None:
            self._master_grads_kept = False
            self.masters.free_master_grads()
        return super().backward_context()

    @override
    def master_dtype(self, parameter: Tensor) -> torch.dtype | None:
        """fp32 for a parameter this level made half, whose master it keeps; None for any other."""
        masters = self.masters
        return torch.float32 if masters is not None and id(parameter) in masters.index_of else None

    @override
    def master_param(self, parameter: Tensor) -> Tensor:
        """The fp32 master of a parameter this level made half; any other parameter itself."""
        masters = self.masters
        i = None if masters is None else masters.index_of.get(id(parameter))
        return parameter if masters is None or i is None else masters.master_params[i]

    @override
    def forward_context(self) -> AbstractContextManager:
        """Convert the lazy parameters that a forward materialised since; nothing else surrounds a forward."""
        if self.lazy_params:
            self._convert_materialized_lazy_params()
        return super().forward_context()

    @override
    def step_parameters(self, optimizer: Optimizer) -> list[Tensor]:
        """``optimizer``'s parameters, each O2 parameter by its master, whose fp32 gradient the step applies."""
        masters = self.masters
        if masters is None:
            return super().step_parameters(optimizer)
        index_of, master_params = masters.index_of, masters.master_params
        tensors: list[Tensor] = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                i = index_of.get(id(p))
                tensors.append(p if i is None else master_params[i])
        return tensors

    @override
    def prepare_step(self, optimizer: Optimizer) -> None:
        """Give each master of ``optimizer``'s parameters an fp32 copy of its parameter's gradient."""
        if self.masters is not None:
            self.masters.model_grads_to_master_grads(self._entries(optimizer)[1])

    @override
    def gradients_changed(self, optimizer: Optimizer) -> None:
        """Write the unscaled (or clipped) fp32 gradients into the half model gradients, where hooks read them."""
        if self.masters is not None:
            self.masters.master_grads_to_model_grads(self._entries(optimizer)[1])

    @override
    def before_closure(self, optimizer: Optimizer) -> None:
        """An optimizer re-evaluates its closure in its step (LBFGS): the model computes with the masters it moved."""
        swapped = self._in_step.get(id(optimizer))
        if swapped and self.masters is not None:
            self.masters.master_params_to_model_params([i for _, _, i in swapped])

    @override
    def after_optimizer_step(self, optimizer: Optimizer, skipped: bool) -> None:
        """After a skip, name the weights beyond fp16's range; a taken step was finished by the step hook.

        Raises:
            HalfOverflowError: if the step was skipped because a weight's fp16 model parameter was inf.

        """
        masters = self.masters
        if masters is None:
            return
        if id(optimizer) in self._in_step:  # a step that raised after the pre-hook
            self._hold_model_params(optimizer)
        self._master_grads_kept |= skipped
        if skipped and self.half_dtype == torch.float16:
            masters.merge_edits(range(len(masters)))  # a weight written since (an inf in fp16) is named too
            check_range(list(zip(masters.names, masters.master_params, strict=True)), self.half_dtype)

    @override
    def step_raised(self, optimizer: Optimizer) -> None:
        """Put the parameters back in the groups with the masters written into them, wherever the step raised.

        The masters are still in the groups where the optimizer itself raised (part of a step may be taken) or a
        user's pre-hook that runs after the plugin's did (none is). Written here, the model computes with what the
        optimizer holds, as after any taken step; where no step ran, the masters are what the weights were made
        from, and the write changes nothing. (A post-hook that raises runs after the plugin's, which finished the
        step: :func:`run_first`.)
        """
        masters = self.masters
        if masters is None or id(optimizer) not in self._in_step:
            return
        masters.master_params_to_model_params(self._hold_model_params(optimizer))

    @override
    def state_dict(self) -> dict[str, Any]:
        """Under Fabric, the connected optimizers' fp32 states of the O2 parameters (the same tensors); else empty."""
        if not self.optimizers_connect_late or self.masters is None:
            return {}
        states = []
        for reference in self._connected:
            optimizer = reference()
            if optimizer is not None:
                states.append(self._fp32_states(optimizer))
        return {"optimizer_states": states}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep the fp32 optimizer states of a Fabric checkpoint for the optimizers that connect later.

        Raises:
            ValueError: if ``optimizer_states`` is not a list of dicts of tensors, naming it.

        """
        states = state_dict.get("optimizer_states", [])
        if not isinstance(states, list) or not all(_is_states(entry) for entry in states):
            raise ValueError(
                f"The checkpoint's ['policy']['optimizer_states'] holds {type(states).__name__}; expected a list with"
                " one dict per optimizer, from parameter positions to dicts of fp32 state tensors."
            )
        self._saved_states = states
        connected = [optimizer for reference in self._connected if (optimizer := reference()) is not None]
        for optimizer, saved in zip(connected, states, strict=False):
            self._repair_rounded_states(optimizer, saved)

    @override
    def teardown(self) -> None:
        """Put every master back into its parameter as fp32 data, remove the hooks and forget the model."""
        for reference in self._connected:
            optimizer = reference()
            if optimizer is not None:
                self._hold_model_params(optimizer)
        if self.masters is not None:
            self.masters.restore_fp32()
        super().teardown()
        self.masters = None
        self.lazy_params = []
        self._connected = []
        self._in_step = {}
        self._state_views = {}
        self._saved_states = []
        self._master_grads_kept = False

    # ------------------------------------------------------------------------------------------------ optimizer hooks

    def _entries(self, optimizer: Optimizer) -> tuple[Swapped, list[int]]:
        """Where ``optimizer``'s groups hold O2 parameters: each ``(group["params"], position, entry)``; the entries."""
        assert self.masters is not None
        index_of = self.masters.index_of
        entries: Swapped = []
        indices: list[int] = []
        for group in optimizer.param_groups:
            params = group["params"]
            for position, param in enumerate(params):
                i = index_of.get(id(param))
                if i is not None:
                    entries.append((params, position, i))
                    indices.append(i)
        return entries, indices

    def _hold_masters(self, optimizer: Optimizer, entries: Swapped) -> None:
        """Put the masters in ``optimizer``'s groups in place of their parameters, with its state keyed by them."""
        masters = self.masters
        assert masters is not None
        master_params = masters.master_params
        views = self._state_views.get(id(optimizer))
        state = optimizer.state
        if views is None or state is not views.by_param or tuple(map(id, state.values())) != views.values:
            views = self._state_views[id(optimizer)] = StateViews(state, masters)
        optimizer.state = views.by_master
        for params, position, i in entries:
            params[position] = master_params[i]
        self._in_step[id(optimizer)] = entries

    def _hold_model_params(self, optimizer: Optimizer) -> list[int]:
        """Put the parameters back in ``optimizer``'s groups and key its state by them; return the entries."""
        swapped = self._in_step.pop(id(optimizer), None)
        masters = self.masters
        if swapped is None or masters is None:
            return []
        views = self._state_views[id(optimizer)]
        state = optimizer.state
        if state is views.by_master and tuple(map(id, state.values())) == views.values:
            optimizer.state = views.by_param
        else:
            optimizer.state = views.by_param_after(state)
        model_params = masters.model_params
        indices: list[int] = []
        for params, position, i in swapped:
            params[position] = model_params[i]
            indices.append(i)
        return indices

    def _before_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if self.masters is None or id(optimizer) in self._in_step:
            return
        entries, indices = self._entries(optimizer)
        self.masters.ready_for_step(indices)
        self._hold_masters(optimizer, entries)

    def _after_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        indices = self._hold_model_params(optimizer)
        if indices and self.masters is not None:
            self.masters.finish_step(indices)

    def _before_load(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
        if self.masters is not None:
            entries, indices = self._entries(optimizer)
            self.masters.follow_devices(indices)
            self._hold_masters(optimizer, entries)

    def _after_load(self, optimizer: Optimizer) -> None:
        self._hold_model_params(optimizer)

    # ------------------------------------------------------------------------------------------------ states

    def _fp32_states(self, optimizer: Optimizer) -> dict[str, dict[str, Tensor]]:
        """Position in ``optimizer``'s state dict -> the fp32 state tensors of each O2 parameter (no copies)."""
        masters = self.masters
        assert masters is not None
        params = [p for group in optimizer.param_groups for p in group["params"]]
        found: dict[str, dict[str, Tensor]] = {}
        for position, param in enumerate(params):
            if id(param) not in masters.index_of or param not in optimizer.state:
                continue
            tensors = {
                key: value
                for key, value in optimizer.state[param].items()
                if isinstance(value, Tensor) and value.dtype == torch.float32 and value.shape == param.shape
            }
            if tensors:
                found[str(position)] = tensors
        return found

    def _repair_rounded_states(self, optimizer: Optimizer, saved: dict[str, dict[str, Tensor]] | None) -> None:
        """Put fp32 states back where torch rounded a loaded state to an O2 parameter's half dtype.

        ``saved`` are the fp32 states of the plugin's checkpoint for this optimizer; without them the rounded values
        continue in fp32, with a warning.
        """
        masters = self.masters
        if masters is None or not optimizer.state:
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        rounded: list[str] = []
        for position, param in enumerate(params):
            if id(param) not in masters.index_of or param not in optimizer.state:
                continue
            state = optimizer.state[param]
            exact = (saved or {}).get(str(position), {})
            for key, value in list(state.items()):
                if not (isinstance(value, Tensor) and value.dtype == param.dtype and value.shape == param.shape):
                    continue
                fp32 = exact.get(key)
                if isinstance(fp32, Tensor) and fp32.shape == value.shape:
                    state[key] = fp32.to(device=value.device, dtype=torch.float32)
                else:
                    state[key] = value.to(torch.float32)
                    rounded.append(key)
        if rounded:
            warnings.warn(
                f"lightning_mp O2: {type(optimizer).__name__}'s state ({', '.join(sorted(set(rounded)))}) was loaded"
                " before the plugin connected the optimizer, and without the plugin's state, so torch rounded it to"
                " the half parameters' dtype; it continues in fp32 from the rounded values. Save and load the plugin"
                ' in the state too: {"model": model, "optimizer": optimizer, "precision": plugin}.',
                UserWarning,
                stacklevel=3,
            )

    def _convert_materialized_lazy_params(self) -> None:
        """Convert the lazy parameters that their first forward materialised."""
        masters = self.masters
        assert masters is not None
        waiting: list[tuple[str, nn.Parameter, list[int], nn.Module]] = []
        for name, param, indices, module in self.lazy_params:
            if isinstance(param, nn.UninitializedParameter):
                waiting.append((name, param, indices, module))
                continue
            check_range([(name, param)], self.half_dtype)
            indices.append(masters.add(param, [name]))
        self.lazy_params = waiting


def run_first(handle: RemovableHandle) -> None:
    """Move the hook behind ``handle`` to the front of the hooks it was registered with.

    torch runs an optimizer's step post-hooks in the order they were registered, and offers no way to register one
    ahead of the others. The opt level's post-hook finishes the step (the masters written into the weights, the
    user's parameters back in the groups), so it must run before any other reads them, also one registered before
    the opt level connected (under Fabric, at the optimizer's first step). The handle's public ``hooks_dict_ref`` and
    ``id`` name the ordered dict and the entry.
    """
    hooks = handle.hooks_dict_ref()
    if hooks is None or handle.id not in hooks:
        return
    others = [(key, hook) for key, hook in hooks.items() if key != handle.id]
    first = hooks[handle.id]
    hooks.clear()
    hooks[handle.id] = first
    hooks.update(others)


def _is_states(entry: Any) -> bool:
    return isinstance(entry, dict) and all(
        isinstance(states, dict) and all(isinstance(value, Tensor) for value in states.values())
        for states in entry.values()
    )
