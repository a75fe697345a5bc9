"""The bf16 optimizer step with stochastic rounding and optional Kahan compensation, on torch's own optimizers.

**Kahan compensation** keeps, per weight, the part of the last update that the rounding dropped, in a bf16 buffer
``c``, and adds it back before the next update: the optimizer steps ``w + c`` in fp32, the result ``w'`` is rounded
to bf16, and ``c = w' - round(w')``. With both on, rounding errors neither bias the weights nor accumulate.

How a step runs (:class:`StochasticRoundingStep`, attached to the user's own ``Adam``, ``AdamW`` or ``SGD`` through
torch's public optimizer hooks, so schedulers, ``param_groups`` and checkpoints keep seeing that optimizer):

1. A step pre-hook takes the gradients of the bf16 parameters aside, so that torch's step only updates the fp32
   parameters (normalisation layers, ``keep_fp32`` modules) with their fp32 states, exactly as without this mode.
2. The step post-hook updates the bf16 parameters in chunks, each in one fp32 workspace stepped by torch's own update
   rule (:mod:`~lightning_mp.stochastic_rounding.workspace`), then writes weights and states back to bf16 with
   stochastic rounding (:func:`~lightning_mp.stochastic_rounding.rounding.stochastic_round_`), and puts the
   gradients back in place.
3. The random numbers come from a generator per device, whose state the optimizer's ``state_dict`` carries
   (:mod:`~lightning_mp.stochastic_rounding.state`), so a resumed run draws the same numbers as an uninterrupted one.
4. A step with non-finite gradients is skipped **on the device**, without a host sync. The loss scaler hands the
   optimizer its inf flag (``found_inf``, torch's fused-step protocol), and the post-hook passes it on to torch's
   fused rule, which then leaves the workspace as it was filled. Those values round back to themselves exactly
   (their low 16 bits are zero, so no random carry reaches the kept bits). Kahan's addition and new compensation
   are weighted by the flag (exactly 1 or 0, so a clean step's numbers are unchanged, bit for bit). The generator
   draws as on a clean step, so later steps draw the same numbers whether or not one was skipped. Only two cases
   read the flag on the host: a device without torch's fused kernels, and an SGD step that would start momentum
   buffers, since a skipped one must leave them unstarted.

Casts of weights per optimizer step: two per bf16 weight, one into the fp32 workspace and one of the rounded result
back (moment estimates and Kahan buffers go in and out once each too); fp32 parameters none. Both are needed: the
update must be computed in fp32, since a bf16 update would lose the small changes that stochastic rounding keeps,
and the weight is stored in bf16. Fewer would take a kernel of its own that reads bf16, updates and rounds in one
pass.

Why not torchao: torchao 0.18's low-precision optimizers (``torchao.optim._AdamW(bf16_stochastic_round=True)``)
offer Adam and AdamW only (no SGD), compile each parameter's update with ``torch.compile`` (a C++ tool chain and a
compile per shape on the CPU), draw from the global random generator (a resume cannot restore the rounding's numbers
from the optimizer state alone), and replace the user's optimizer rather than fit around it. Writing the rounding
as three tensor ops on top of torch's own update rules keeps every torch option (fused, foreach, ``amsgrad``,
``nesterov``, ``maximize``) and adds no dependency.

Private names: :mod:`lightning_mp._private_names` lists them, with the reason for each.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_mp.stochastic_rounding.rounding import stochastic_round_
from lightning_mp.stochastic_rounding.state import STATE_KEY, check_rounding_state, shared_seed
from lightning_mp.stochastic_rounding.workspace import (
    FUSED_DEVICE_TYPES,
    SUPPORTED_OPTIMIZERS,
    Chunk,
    ChunkStates,
    chunk_limit,
    row_views,
    update_rule,
)

_ROUNDING_OPTIMIZERS: weakref.WeakSet[Optimizer] = weakref.WeakSet()
"""The optimizers a :class:`StochasticRoundingStep` is attached to (held weakly)."""


def steps_bf16_parameters_itself(optimizer: Optimizer) -> bool:
    """Whether a :class:`StochasticRoundingStep` steps ``optimizer``'s bf16 parameters, in fp32 workspaces.

    torch's own step of such an optimizer (its fused kernel included) then never sees a bf16 parameter.
    """
    return optimizer in _ROUNDING_OPTIMIZERS


class StochasticRoundingStep:
    """Make an ``Adam``, ``AdamW`` or ``SGD`` optimizer step its bf16 parameters with stochastic rounding.

    Attaches torch's public step and state-dict hooks to ``optimizer``; :meth:`detach` removes them. fp32
    parameters are stepped by the optimizer as usual. See the module docstring for the algorithm.

    Args:
        optimizer: a ``torch.optim.Adam``, ``AdamW`` or ``SGD``; its bf16 states are created in bf16.
        kahan: also keep a bf16 Kahan compensation buffer per bf16 parameter.
        seed: seed of the rounding's generators; None takes ``torch.initial_seed()`` (rank 0's under DDP).
        chunk_numel: the most elements per fp32 workspace (a larger parameter gets a chunk of its own); None takes
            :func:`chunk_limit` of each parameter group's bf16 elements on a device. Bounds the step's transient
            memory to about ``4 * (3 + 2 * states + kahan) * chunk_numel`` bytes, with ``states`` the optimizer's
            tensors per parameter (2 for Adam and AdamW): by default 14 MiB for AdamW, or under 1 byte per
            parameter for a model of more than ``MAX_CHUNKS * 2**19`` elements.

    .. warning:: With ``seed=None`` under ``torch.distributed``, the constructor broadcasts rank 0's seed and reads
        it on the host: one synchronisation, once.

    .. warning:: An inf flag handed to a step on a device without torch's fused kernels, or to an SGD step that
        starts momentum buffers, is read on the host: one synchronisation there. Other steps make none.

    Raises:
        TypeError: if ``optimizer`` is not one of the supported types.
        ValueError: if the optimizer uses ``differentiable=True`` or sparse gradients, or ``chunk_numel < 1``.

    """

    def __init__(
        self, optimizer: Optimizer, kahan: bool = False, seed: int | None = None, chunk_numel: int | None = None
    ) -> None:
        if not isinstance(optimizer, SUPPORTED_OPTIMIZERS):
            raise TypeError(
                f"StochasticRoundingStep(optimizer={type(optimizer).__qualname__}) is not supported: bf16 steps with"
                " stochastic rounding support torch.optim.Adam, AdamW and SGD."
            )
        for group in optimizer.param_groups:
            if group.get("differentiable", False):
                raise ValueError(
                    "StochasticRoundingStep(optimizer) with differentiable=True is not supported: the bf16 update is"
                    " written back outside autograd. Build the optimizer with differentiable=False."
                )
        if chunk_numel is not None and chunk_numel < 1:
            raise ValueError(f"StochasticRoundingStep(chunk_numel={chunk_numel!r}) is not allowed: it must be >= 1.")
        self.optimizer = optimizer
        self.kahan = kahan
        self.chunk_numel = chunk_numel
        self.seed = shared_seed() if seed is None else seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self._pending_generator_states: dict[str, Tensor] = {}
        self._set_aside: dict[int, tuple[Tensor, Tensor]] = {}
        """The bf16 parameters whose gradients the pre-hook took aside, with those gradients, by ``id``."""
        self._handles: list[RemovableHandle] = [
            optimizer.register_step_pre_hook(self._take_bf16_gradients),
            optimizer.register_step_post_hook(self._step_bf16_parameters),
            optimizer.register_state_dict_post_hook(self._add_rounding_state),
            optimizer.register_load_state_dict_pre_hook(self._load_rounding_state),
        ]
        _ROUNDING_OPTIMIZERS.add(optimizer)

    def detach(self) -> None:
        """Remove the hooks: the optimizer steps as torch's own again."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        _ROUNDING_OPTIMIZERS.discard(self.optimizer)

    def generator(self, device: torch.device) -> torch.Generator:
        """The rounding's random generator for ``device``, created from the seed on first use."""
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(self.seed)
            saved = self._pending_generator_states.pop(str(device), None)
            if saved is not None:
                generator.set_state(saved)
            self._generators[device] = generator
        return generator

    # ------------------------------------------------------------------------------------------------ step hooks

    def _take_bf16_gradients(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        # Keyed by id: a tensor's own __hash__ is a Python call, and this runs for every parameter at every step.
        set_aside: dict[int, tuple[Tensor, Tensor]] = {}
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                grad = parameter.grad
                if grad is None or parameter.dtype is not torch.bfloat16:
                    continue
                if grad.is_sparse:
                    raise ValueError("StochasticRoundingStep does not support sparse gradients: use a dense embedding.")
                set_aside[id(parameter)] = (parameter, grad)
        for parameter, _ in set_aside.values():
            parameter.grad = None
        self._set_aside = set_aside

    def _step_bf16_parameters(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        set_aside, self._set_aside = self._set_aside, {}
        try:
            if set_aside:
                flag = getattr(optimizer, "found_inf", None)
                found_inf = flag if isinstance(flag, Tensor) else None
                with torch.no_grad():
                    for group in optimizer.param_groups:
                        for chunk in self._chunks(group, set_aside):
                            self._step_chunk(optimizer, group, chunk, found_inf)
        finally:
            for parameter, grad in set_aside.values():
                parameter.grad = grad

    def _chunks(self, group: dict[str, Any], set_aside: dict[int, tuple[Tensor, Tensor]]) -> list[Chunk]:
        by_device: dict[torch.device, list[tuple[Tensor, Tensor]]] = {}
        numel_by_device: dict[torch.device, int] = {}
        for parameter in group["params"]:
            pair = set_aside.get(id(parameter))
            if pair is not None:
                by_device.setdefault(parameter.device, []).append(pair)
                numel_by_device[parameter.device] = numel_by_device.get(parameter.device, 0) + parameter.numel()
        chunks: list[Chunk] = []
        for device, pairs in by_device.items():
            limit = self.chunk_numel or chunk_limit(numel_by_device[device])
            params: list[Tensor] = []
            grads: list[Tensor] = []
            sizes: list[int] = []
            total = 0
            for parameter, grad in pairs:
                size = parameter.numel()
                if params and total + size > limit:
                    chunks.append(Chunk(params, grads, sizes))
                    params, grads, sizes, total = [], [], [], 0
                params.append(parameter)
                grads.append(grad)
                sizes.append(size)
                total += size
            if params:
                chunks.append(Chunk(params, grads, sizes))
        return chunks

    def _step_chunk(self, optimizer: Optimizer, group: dict[str, Any], chunk: Chunk, found_inf: Tensor | None) -> None:
        device = chunk.params[0].device
        fused = device.type in FUSED_DEVICE_TYPES
        state_names, update = update_rule(optimizer, group, fused)
        states = ChunkStates(optimizer, chunk.params, state_names, self.kahan)
        if found_inf is not None and (not fused or states.fresh):
            # Only torch's fused kernels skip on the device, and a first SGD momentum step skipped there would leave
            # its buffers started from non-finite gradients.
            if found_inf.item():
                return
            found_inf = None
        # Workspace rows: the weights and states (rounded back to bf16 together), the gradients, the compensation.
        rounded_rows = 1 + len(state_names)
        rows = rounded_rows + 1 + (1 if self.kahan else 0)
        workspace = torch.empty(rows, sum(chunk.sizes), dtype=torch.float32, device=device)
        views = row_views(workspace, chunk.params, chunk.sizes)
        weights, grads = views[0], views[rounded_rows]
        torch._foreach_copy_(weights, chunk.params)
        torch._foreach_copy_(grads, chunk.grads)
        if self.kahan:
            compensation_row = workspace[rows - 1]
            torch._foreach_copy_(views[rows - 1], states.compensation)
            # 1.0 where the step is taken, 0.0 where the device skips it: a skip must leave weight and compensation
            # as they were, and multiplying by exactly 1 or 0 changes nothing else, bit for bit.
            taken = torch.ones((), device=device) if found_inf is None else (found_inf.to(device) == 0).float()
            workspace[0].addcmul_(compensation_row, taken)
        state_views = {name: views[1 + index] for index, name in enumerate(state_names)}
        for name, row in state_views.items():
            if not states.fresh:
                torch._foreach_copy_(row, states.present[name])
                continue
            self._first_momentum(group, states.fresh, row, grads, weights)
            if states.present[name]:
                targets = [view for view, saved in zip(row, states.tensors[name], strict=True) if saved is not None]
                torch._foreach_copy_(targets, states.present[name])
        update(weights, grads, state_views, states.steps, optimizer, found_inf)
        if self.kahan:
            compensation_row.mul_(1 - taken).addcmul_(workspace[0], taken)
        stochastic_round_(workspace[:rounded_rows], self.generator(device))
        torch._foreach_copy_(chunk.params, weights)
        for name in state_names:
            torch._foreach_copy_(states.created(name, chunk.params), state_views[name])
        if self.kahan:
            compensation_row.addcmul_(workspace[0], taken, value=-1)
            torch._foreach_copy_(states.compensation, views[rows - 1])

    @staticmethod
    def _first_momentum(
        group: dict[str, Any], fresh: list[int], buffers: list[Tensor], grads: list[Tensor], weights: list[Tensor]
    ) -> None:
        """Start the SGD momentum buffers ``fresh`` so that torch's rule makes them its first-step value, ``d_p``.

        The rule computes ``buffer = momentum * buffer + (1 - dampening) * d_p`` with ``d_p = ±grad + weight_decay *
        weight``; starting from ``d_p * dampening / momentum`` gives ``d_p``, as torch's first step does, while other
        parameters of the chunk are past theirs.
        """
        buffers, grads, weights = [buffers[i] for i in fresh], [grads[i] for i in fresh], [weights[i] for i in fresh]
        # Once per parameter (its first step): one op per tensor costs nothing that matters here.
        if group["dampening"] == 0:
            for buffer in buffers:
                buffer.zero_()
            return
        torch._foreach_copy_(buffers, grads)
        if group["maximize"]:
            torch._foreach_mul_(buffers, -1.0)  # negation, exact
        if group["weight_decay"] != 0:
            for buffer, weight in zip(buffers, weights, strict=True):
                buffer.add_(weight, alpha=group["weight_decay"])
        torch._foreach_mul_(buffers, group["dampening"] / group["momentum"])

    # ------------------------------------------------------------------------------------------------ state dict

    def rounding_state(self) -> dict[str, Any]:
        """The seed and the generators' states: what a resumed run needs to draw the same random numbers."""
        generators = {str(device): generator.get_state() for device, generator in self._generators.items()}
        return {"seed": self.seed, "kahan": self.kahan, "generators": {**self._pending_generator_states, **generators}}

    def load_rounding_state(self, state: dict[str, Any], field: str = STATE_KEY) -> None:
        """Restore what :meth:`rounding_state` returned; each generator resumes at its saved position.

        Args:
            state: the saved rounding state.
            field: where ``state`` was found, for the error message.

        Raises:
            ValueError: if ``state`` is malformed (:func:`check_rounding_state`), before anything changes.

        """
        state = check_rounding_state(field, state)
        self.seed = state["seed"]
        self._generators.clear()
        self._pending_generator_states = {name: value.clone() for name, value in state["generators"].items()}

    def _add_rounding_state(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict[STATE_KEY] = self.rounding_state()
        return state_dict

    def _load_rounding_state(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict = dict(state_dict)
        saved = state_dict.pop(STATE_KEY, None)
        if saved is not None:
            self.load_rounding_state(saved, f"optimizer.state_dict()[{STATE_KEY!r}]")
        return state_dict


__all__ = ["StochasticRoundingStep", "steps_bf16_parameters_itself"]
