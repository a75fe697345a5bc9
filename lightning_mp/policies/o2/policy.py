"""O2: the model computes with half model parameters; the optimizer steps fp32 master parameters.

Apex's O2 and DeepSpeed's fp16/bf16 optimizers keep two copies of each weight: a half *model parameter*, which the
forward and backward use, and an fp32 *master parameter*, which the optimizer steps. This level does the same, with
one difference that keeps Lightning's recipes working: the masters are the model's original parameter objects, and
between an optimizer step and the next forward the model shows them, so that callbacks, checkpoints and
``load_state_dict`` read and write fp32 weights without knowing about O2.

1. ``convert_module`` (before the model moves and before DDP wraps it) pairs each chosen fp32 parameter
   (:mod:`~lightning_mp.policies.o2.selection`) with a half model parameter, cast once
   (:mod:`~lightning_mp.policies.o2.parameters`), and shows the model parameters: DDP, wrapped after this,
   all-reduces half gradients. Lazy parameters (``nn.LazyLinear``) compute in fp32 until their first forward
   materialises them, and are paired at the next forward. The ``keep_fp32`` subtrees run in fp32 regions
   (:mod:`lightning_mp.overrides`) from here to teardown.
2. ``connect`` points the optimizer's ``param_groups`` at the masters, as Apex's ``amp.initialize`` does, and moves
   any state it holds; an optimizer built on the model before the conversion (Fabric) holds them already. Under the
   Trainer, ``connect`` ends by showing the masters, so that from setup to the first training forward the model's
   parameters are the optimizer's, by identity, as after every step (``BackboneFinetuning`` and the weight averaging
   callbacks match the two). A group added later with model parameters is pointed at their masters at its first step.
3. Forward and backward run in O2's contexts (:mod:`~lightning_mp.policies.o2.contexts`): the model shows the half
   model parameters, and the gradients land on them, in half.
4. ``prepare_step`` (once per optimizer step, before unscaling, clipping or stepping it) shows the masters and moves
   every waiting half gradient into its master's ``.grad`` in fp32. From there on the model shows what fp32 training
   shows: the loss scaler, ``on_before_optimizer_step``, ``grad_norm`` and clipping see fp32 gradients on
   ``model.parameters()``. Gradients move at the step, not after each backward, because DDP reduces the accumulated
   ``.grad`` at the last micro-batch; so micro-batches accumulate in half (in fp16 the scaled gradients, whose range
   fits).
5. ``after_optimizer_step`` writes the stepped masters into their model parameters in one foreach copy, the one cast
   per weight per optimizer step, and frees their fp32 gradients. A step the host saw skipped writes nothing; in
   fp16 it names the masters beyond fp16's range (:mod:`~lightning_mp.policies.o2.overflow`), which setup refuses too.
6. ``teardown`` (after fit, and after a failed fit) shows the masters for good and removes every hook: the model is
   the fp32 model it was, with the same parameter objects.

Memory with AdamW, per parameter: between steps 2 bytes of half model parameter, 4 of master and 8 of moments (fp32
and O1 keep 16, with their gradients); during backward 2 more of half gradient, at the step 4 of fp32 gradient.

Under ``torch.compile`` of a whole model after ``fabric.setup`` the forward context is traced, and a graph cannot
change which parameters the model holds: that model computes with its masters under autocast, as in O1.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mp.overrides import Fp32Overrides, Fp32Region, has_fp32_region, outermost
from lightning_mp.policies.base import PrecisionPolicy
from lightning_mp.policies.casting import check_half_dtype, keep_tied_weights_together
from lightning_mp.policies.o2.contexts import O2BackwardContext, O2ForwardContext
from lightning_mp.policies.o2.overflow import check_range
from lightning_mp.policies.o2.parameters import ParameterPairs
from lightning_mp.policies.o2.selection import Holders, choose_parameters

LazyParameter = tuple[str, nn.Parameter, Holders, list[int]]
"""A lazy parameter waiting for its first forward: its name, itself, its holders and its model's pair indices."""


class O2Policy(PrecisionPolicy):
    """Half model parameters in the model, fp32 master parameters in the optimizer, fp32 gradients at the step.

    Args:
        half_dtype: ``torch.float16`` or ``torch.bfloat16``.
        keep_fp32: module types, qualified names or ``re:`` patterns whose modules compute in fp32.

    Raises:
        ValueError: if ``half_dtype`` is not a half type, or a ``keep_fp32`` entry is invalid.

    """

    opt_level = "O2"
    uses_autocast = True
    computes_with_half_weights = True

    def __init__(self, half_dtype: torch.dtype | None, keep_fp32: Sequence[type | str] = ()) -> None:
        super().__init__(check_half_dtype(type(self).__name__, half_dtype), keep_fp32)
        self.overrides = Fp32Overrides(self.keep_fp32)
        self.pairs: ParameterPairs | None = None
        """The master and model parameters, from ``convert_module`` until ``teardown``."""
        self.lazy_params: list[LazyParameter] = []
        self._groups_pointed_at_masters: dict[int, int] = {}
        """Per optimizer (by ``id``), how many parameter groups ``connect`` has pointed at the masters."""
        self._stepped: dict[int, set[int]] = {}
        """Per optimizer (by ``id``), the pairs its coming step writes: their model parameters are written after it."""
        self.forward_depth = 0
        self.evaluating = False
        """Whether the last outermost forward ran without gradients (validation, test, predict)."""
        self.stepped_in_forward = False
        """Whether an optimizer stepped inside the current forward context (manual optimization's training step)."""
        self.awaiting_backward = False
        """Whether a forward with gradients ran since the last backward began and the last step: its graph may hold
        the model parameters, saved for that backward."""
        self._forward_context = O2ForwardContext(self)
        self._backward_context: O2BackwardContext | None = None

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Give every chosen fp32 parameter a half model parameter and show those, before DDP wraps the model.

        Raises:
            HalfOverflowError: in fp16, if a chosen weight is beyond fp16's range.

        """
        assert self.half_dtype is not None
        overrides = keep_tied_weights_together(module, self.overrides)
        chosen = choose_parameters(module, overrides.kept_modules(module))
        materialized = [entry for entry in chosen.values() if not isinstance(entry[0], nn.UninitializedParameter)]
        check_range([(keys[0], master) for master, _, keys in materialized], self.half_dtype)
        # One ParameterPairs for every model this run converts (Fabric sets up a GAN's two models one by one); each
        # model's state-dict hooks know its own pairs, whose names may repeat in another model.
        if self.pairs is None:
            self.pairs = ParameterPairs(self.half_dtype)
            self._backward_context = O2BackwardContext(self, self.pairs)
        pairs = self.pairs
        indices = [pairs.add(master, holders, keys) for master, holders, keys in materialized]
        pairs.master_params_to_model_params(show=True, mirror=True)
        self.lazy_params += [
            (keys[0], master, holders, indices)
            for master, holders, keys in chosen.values()
            if isinstance(master, nn.UninitializedParameter)
        ]
        self.hook_handles += pairs.register_state_dict_hooks(module, indices)
        for root in [module.get_submodule(name) for name in outermost(overrides.match(module))]:
            if not has_fp32_region(root):  # a region the user attached is the user's to keep
                self.hook_handles += Fp32Region().attach(root)
        return module

    @override
    def connect(self, module: nn.Module, optimizers: list[Optimizer]) -> list[Optimizer]:
        """Point each optimizer's ``param_groups`` (and any state it holds) at the masters, not the model parameters.

        The masters move first to the device the model was moved to since ``convert_module``.
        """
        optimizers = super().connect(module, optimizers)
        pairs = self.pairs
        if pairs is not None:
            pairs.follow_devices()
        for optimizer in optimizers:
            self._point_at_masters(optimizer)
        # The model was moved and wrapped (DDP holds the model parameters): from here to the first training forward
        # it shows the masters the optimizers hold, so that callbacks match the two by identity (module docstring).
        if pairs is not None and self.forward_depth == 0 and not self.awaiting_backward:
            pairs.show_master_params()
        return optimizers

    @override
    def parameter_names(self, module: nn.Module) -> dict[int, str]:
        """``id -> name`` of the masters the optimizers step, and of every other parameter of ``module``."""
        names = super().parameter_names(module)
        if self.pairs is not None:
            names.update(
                {id(master): name for master, name in zip(self.pairs.master_params, self.pairs.names, strict=True)}
            )
        return names

    @override
    def forward_context(self) -> AbstractContextManager:
        """The half model parameters shown for the duration of the (outermost) forward context."""
        return self._forward_context

    @override
    def backward_context(self) -> AbstractContextManager:
        """Keep gradients from the model parameters whose masters do not require them (``toggle_optimizer``)."""
        return self._backward_context if self._backward_context is not None else super().backward_context()

    @override
    def prepare_step(self, optimizer: Optimizer) -> None:
        """Show the masters and move the model parameters' gradients into them, in fp32, before the scaler.

        One pass over the pairs copies the model parameters' edits, shows the masters and moves the gradients. Unlike
        :meth:`ParameterPairs.show_master_params` it mirrors no ``requires_grad``, which ``toggle_optimizer`` may
        have set on the masters for this step only.
        """
        pairs = self.pairs
        if pairs is None:
            return
        if self._groups_pointed_at_masters.get(id(optimizer)) != len(optimizer.param_groups):
            self._point_at_masters(optimizer)
        if id(optimizer) not in self._stepped:
            self._stepped[id(optimizer)] = set(
                pairs.indices([p for group in optimizer.param_groups for p in group["params"]])
            )
        show = pairs.model_params_shown
        versions = pairs.model_param_versions
        markers, marks, mark_versions = pairs.markers, pairs.marks, pairs.mark_versions
        for i, (master, model_param, holders) in enumerate(
            zip(pairs.master_params, pairs.model_params, pairs.holders, strict=True)
        ):
            if model_param._version != versions[i]:
                pairs.copy_model_param_edit(i)
            if show:
                for module, name in holders:
                    module._parameters[name] = master
            # Every pair, not only those this optimizer steps: the model shows the masters from here on, with the
            # gradients in fp32, as in fp32 training (another optimizer's, a parameter no optimizer holds).
            gradient = model_param.grad
            mark = marks[i]
            if mark is not None:
                marks[i] = None
                grad = master.grad
                if grad is not mark or mark._version != mark_versions[i]:
                    # A zero_grad since the last backward discarded what waits on the model parameter.
                    model_param.grad = gradient = None
                    if grad is markers[i]:  # zeroed in place: a zero gradient, as torch leaves it
                        master.grad = torch.zeros_like(master)
                elif grad is markers[i]:
                    master.grad = None
            if gradient is None:
                continue
            # The half gradient moves into its master's .grad in fp32, added to one already there.
            if master.grad is None:
                master.grad = gradient.to(master.dtype)
            else:
                master.grad.add_(gradient)
            model_param.grad = None
        pairs.model_params_shown = False
        self.awaiting_backward = False

    @override
    def after_optimizer_step(self, optimizer: Optimizer, skipped: bool) -> None:
        """Write the stepped masters into their model parameters (one foreach cast) and free their fp32 gradients.

        The fp32 gradients live from :meth:`prepare_step` to here: between steps O2 keeps 2 bytes of half model
        parameter, 4 of master and the optimizer's states per parameter, and no gradient. After a skip, weights
        beyond fp16's range are named. Inside a forward context (manual optimization's ``training_step``) the model
        parameters are shown again, so that a later forward in the same step computes in half with the new weights,
        and the masters come back at that context's exit.

        Raises:
            HalfOverflowError: if the step was skipped because a weight's fp16 model parameter was inf.

        """
        pairs = self.pairs
        if pairs is None:
            return
        # A step the host saw skipped changed no master; one skipped on the device is written again, unchanged.
        stepped = () if skipped is True else self._stepped.get(id(optimizer), ())
        inside_forward = self.forward_depth > 0
        pairs.master_params_to_model_params(stepped, show=inside_forward)
        self.stepped_in_forward |= inside_forward
        for i in stepped:
            pairs.master_params[i].grad = None
        if skipped:
            check_range(list(zip(pairs.names, pairs.master_params, strict=True)), self.half_dtype)

    @override
    def teardown(self) -> None:
        """Show the masters for good, remove the hooks and forget the model."""
        pairs = self.pairs
        if pairs is not None:
            pairs.show_master_params()
            for master, marker in zip(pairs.master_params, pairs.markers, strict=True):
                if master.grad is marker:
                    master.grad = None
        super().teardown()
        self.pairs = None
        self._backward_context = None
        self.lazy_params = []
        self._groups_pointed_at_masters = {}
        self._stepped = {}
        self.forward_depth = 0
        self.evaluating = False
        self.stepped_in_forward = False
        self.awaiting_backward = False

    def pair_materialized_lazy_params(self) -> None:
        """Give the lazy parameters that their first forward materialised a half model parameter."""
        assert self.pairs is not None
        waiting: list[LazyParameter] = []
        for name, parameter, holders, indices in self.lazy_params:
            if isinstance(parameter, nn.UninitializedParameter):
                waiting.append((name, parameter, holders, indices))
                continue
            check_range([(name, parameter)], self.half_dtype)
            indices.append(self.pairs.add(parameter, holders, [name]))
            self._stepped.clear()
        self.lazy_params = waiting

    def _point_at_masters(self, optimizer: Optimizer) -> None:
        """Point ``optimizer``'s groups at the masters of the model parameters they hold, with their state."""
        assert self.pairs is not None
        master_of = self.pairs.master_of
        entries: dict[int, int] = {}  # id of each master the groups hold -> id of the entry that holds it first
        for index, group in enumerate(optimizer.param_groups):
            for position, parameter in enumerate(group["params"]):
                master = master_of(parameter)
                if entries.setdefault(id(master), id(parameter)) != id(parameter):
                    name = self.pairs.names[self.pairs.indices([master])[0]]
                    raise ValueError(
                        f"lightning_mp O2: {type(optimizer).__name__} param group {index} holds {name!r}, which the"
                        " optimizer holds already: once as the model's half weight and once as its fp32 master, one"
                        " parameter that would be stepped twice. torch refuses a parameter in two groups; add each"
                        " parameter to the optimizer once (filter out those it holds before add_param_group)."
                    )
                if master is parameter:
                    continue
                group["params"][position] = master
                if parameter in optimizer.state:
                    optimizer.state[master] = _upcast_state(optimizer.state.pop(parameter), master)
        self._groups_pointed_at_masters[id(optimizer)] = len(optimizer.param_groups)
        self._stepped.pop(id(optimizer), None)


def _upcast_state(state: dict[str, Any], master: Tensor) -> dict[str, Any]:
    """An optimizer state kept for a model parameter, made its master's: half elementwise states become fp32, warned.

    torch's ``Optimizer.load_state_dict`` casts states to the dtype of the parameter they are loaded for, so a state
    loaded while the optimizer held model parameters was rounded to half.
    """
    rounded = [key for key, value in state.items() if _is_half_elementwise(value, master)]
    if rounded:
        warnings.warn(
            f"lightning_mp O2: an optimizer state ({', '.join(rounded)}) was loaded while the optimizer held O2's half"
            " weights, so torch rounded it to half; it continues in fp32 from the rounded values. Build the optimizer"
            " on the model's parameters before fabric.setup (or let the Trainer connect it) before loading its state.",
            UserWarning,
            stacklevel=2,
        )
    return {key: value.to(master.dtype) if key in rounded else value for key, value in state.items()}


def _is_half_elementwise(value: Any, master: Tensor) -> bool:
    return isinstance(value, Tensor) and value.shape == master.shape and value.dtype in (torch.float16, torch.bfloat16)
