"""bf16 optimizer steps with stochastic rounding, and optional Kahan compensation, on top of torch's own optimizers.

Why rounding matters. A bf16 number has 8 significant bits: next to a weight of 1.0, the smallest change that a
round-to-nearest cast keeps is ``2**-8``. An Adam step of ``lr=1e-3`` on such a weight rounds back to the old value,
every time: the update is lost, and training in pure bf16 (Lightning's ``bf16-true``) stalls where fp32 keeps
learning. **Stochastic rounding** rounds ``x`` up with probability equal to its distance from the lower neighbour,
measured in units of the gap: ``E[round(x)] = x``. A tiny update then moves the weight by one bf16 step once in a
while, and on average by exactly the update, so nothing is lost in expectation.

The rounding in bits. Viewed as an int32, an fp32 number is its bf16 truncation in the high 16 bits and the
remainder in the low 16. Adding a uniform random integer in ``[0, 2**16)`` to the int32 view carries into the high
bits with probability ``remainder / 2**16``; masking the low 16 bits then leaves exactly a bf16 value, which a cast
keeps unchanged. Negative numbers work the same on their magnitude, zero stays zero, and a carry into the exponent
is the correct next representable number. That is three tensor ops (``randint``, ``add_``, ``bitwise_and_``) for
any number of values::

    bits = fp32.view(torch.int32); bits.add_(noise_0_to_65535); bits.bitwise_and_(-65536); bf16.copy_(fp32)

**Kahan compensation** keeps, per weight, the part of the last update that the rounding dropped, in a bf16 buffer
``c``, and adds it back before the next update: the optimizer steps ``w + c`` in fp32, the result ``w'`` is rounded
to bf16, and ``c = w' - round(w')``. With both on, rounding errors neither bias the weights nor accumulate.

How a step runs (:class:`StochasticRoundingStep`, attached to the user's own ``Adam``, ``AdamW`` or ``SGD`` through
torch's public optimizer hooks, so schedulers, ``param_groups`` and checkpoints keep seeing that optimizer):

1. A step pre-hook takes the gradients of the bf16 parameters aside, so that torch's step only updates the fp32
   parameters (normalisation layers, ``keep_fp32`` modules) with their fp32 states, exactly as without this mode.
2. The step post-hook updates the bf16 parameters in chunks (:func:`chunk_limit` elements at most, unless a
   parameter is larger). Each chunk costs about a dozen kernel launches, so a large model's chunks are larger
   rather than more numerous: at most :data:`MAX_CHUNKS` per parameter group and device. For each chunk it
   copies weights, moment estimates and gradients into one fp32 workspace (one ``_foreach_copy_`` per quantity),
   runs **torch's own update rule** on it (``torch.optim.adam.adam`` or ``torch.optim.sgd.sgd``: the fused kernel
   wherever torch has one for the device, CPU and CUDA included, whatever the optimizer was built with, since it
   is one op per chunk and reads no step count on the host; foreach elsewhere), then writes weights and states back
   to bf16 with stochastic rounding, and puts the gradients back in place.
3. The random numbers come from a ``torch.Generator`` per device, seeded from ``torch.initial_seed()`` (rank 0's
   under ``torch.distributed``, so that every rank rounds alike). Its state is saved in the optimizer's own
   ``state_dict`` under :data:`STATE_KEY`, so a resumed run draws the same numbers as an uninterrupted one.
4. A step with non-finite gradients is skipped **on the device**, without a host sync. The loss scaler hands the
   optimizer its inf flag (``found_inf``, torch's fused-step protocol), and the post-hook passes it on to torch's
   fused rule, which then leaves the workspace as it was filled. Those values round back to themselves exactly
   (their low 16 bits are zero, so no random carry reaches the kept bits). Kahan's addition and new compensation
   are weighted by the flag (exactly 1 or 0, so a clean step's numbers are unchanged, bit for bit). The generator
   draws as on a clean step, so later steps draw the same numbers whether or not one was skipped. Only two cases
   read the flag on the host: a device without torch's fused kernels, and an SGD step that would start momentum
   buffers, since a skipped one must leave them unstarted.

Persistent memory per bf16 parameter with AdamW: 2 bytes of weight, 2 of gradient, 4 of moment estimates, plus 2
with Kahan compensation. The workspace is transient and bounded by the chunk size.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import SGD, Adam, Optimizer
from torch.optim.adam import adam as adam_rule_of_torch
from torch.optim.sgd import sgd as sgd_rule_of_torch
from torch.utils.hooks import RemovableHandle

STATE_KEY = "stochastic_rounding"
"""Key of the rounding's state (generator states, seed, settings) in the optimizer's ``state_dict``."""
COMPENSATION_KEY = "kahan_compensation"
"""Key of the Kahan compensation buffer in a parameter's optimizer state."""
SUPPORTED_OPTIMIZERS: tuple[type[Optimizer], ...] = (Adam, SGD)
"""``torch.optim.Adam`` and its subclass ``AdamW``, and ``torch.optim.SGD``."""
_LOW_BITS_MASK = -(1 << 16)
MIN_CHUNK_NUMEL = 1 << 19
"""The fewest elements :func:`chunk_limit` lets a chunk hold: 14 MiB of transient memory for AdamW."""
MAX_CHUNKS = 32
"""The most chunks :func:`chunk_limit` cuts a parameter group into on one device (more only for larger parameters)."""


def chunk_limit(numel: int) -> int:
    """The most elements per chunk for a parameter group of ``numel`` bf16 elements on one device.

    The larger of :data:`MIN_CHUNK_NUMEL` and a :data:`MAX_CHUNKS`-th of the group: a small model's step needs
    little transient memory, and a large one's about a dozen kernel launches per chunk, which a fixed chunk size would
    multiply (a 219M-parameter model would take 420 chunks of ``2**19``, over 5,000 launches per step).

    Example:
        >>> chunk_limit(1_000), chunk_limit(219_000_000)
        (524288, 6843750)

    """
    return max(MIN_CHUNK_NUMEL, -(-numel // MAX_CHUNKS))


def stochastic_round_(values: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Round fp32 ``values`` in place to bf16-representable values, up with probability of the distance below.

    Afterwards ``values.to(torch.bfloat16)`` is exact, and ``E[values]`` equals the values before the call.

    Args:
        values: a contiguous fp32 tensor; finite values.
        generator: the random generator to draw from; None uses torch's default generator.

    Returns:
        ``values``, rounded.

    Raises:
        TypeError: if ``values`` is not fp32.

    Example:
        >>> x = torch.full((100_000,), 1.0 + 2.0**-10)
        >>> _ = stochastic_round_(x, torch.Generator().manual_seed(0))
        >>> sorted(set(x.tolist())) == [1.0, 1.0 + 2.0**-7]
        True
        >>> abs(x.mean().item() - (1.0 + 2.0**-10)) < 1e-4
        True

    """
    if values.dtype is not torch.float32:
        raise TypeError(f"stochastic_round_(values) needs an fp32 tensor, got dtype={values.dtype}.")
    bits = values.view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device, generator=generator)
    return bits.add_(noise).bitwise_and_(_LOW_BITS_MASK).view(torch.float32)


def stale_update_share(before: Tensor, after: Tensor, intended: Tensor) -> float:
    """The share of elements that an update meant to change but that kept their stored value.

    Round-to-nearest loses every update smaller than half a bf16 gap, so its share is high; stochastic rounding
    keeps the updates' expected value, and its share falls as the updates grow relative to the gap.

    Args:
        before: the stored values before the update.
        after: the stored values after the update; same shape.
        intended: the update that was meant (``after - before`` in exact arithmetic); same shape.

    Returns:
        ``#(intended != 0 and after == before) / #(intended != 0)``; 0.0 when no element was meant to change.

    .. warning:: Returns a Python float: on an accelerator this synchronises with the device.

    Example:
        >>> before = torch.ones(4, dtype=torch.bfloat16)
        >>> stale_update_share(before, before + torch.tensor([1.0, 0, 0, 0]), torch.full((4,), 1e-3))
        0.75

    """
    meant = intended != 0
    total = int(meant.sum())
    if total == 0:
        return 0.0
    return int((meant & (after == before)).sum()) / total


@dataclass(frozen=True)
class _Chunk:
    """Parameters updated together in one fp32 workspace, with their gradients and sizes."""

    params: list[Tensor]
    grads: list[Tensor]
    sizes: list[int]


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
        self.seed = _shared_seed() if seed is None else seed
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

    def _chunks(self, group: dict[str, Any], set_aside: dict[int, tuple[Tensor, Tensor]]) -> list[_Chunk]:
        by_device: dict[torch.device, list[tuple[Tensor, Tensor]]] = {}
        numel_by_device: dict[torch.device, int] = {}
        for parameter in group["params"]:
            pair = set_aside.get(id(parameter))
            if pair is not None:
                by_device.setdefault(parameter.device, []).append(pair)
                numel_by_device[parameter.device] = numel_by_device.get(parameter.device, 0) + parameter.numel()
        chunks: list[_Chunk] = []
        for device, pairs in by_device.items():
            limit = self.chunk_numel or chunk_limit(numel_by_device[device])
            params: list[Tensor] = []
            grads: list[Tensor] = []
            sizes: list[int] = []
            total = 0
            for parameter, grad in pairs:
                size = parameter.numel()
                if params and total + size > limit:
                    chunks.append(_Chunk(params, grads, sizes))
                    params, grads, sizes, total = [], [], [], 0
                params.append(parameter)
                grads.append(grad)
                sizes.append(size)
                total += size
            if params:
                chunks.append(_Chunk(params, grads, sizes))
        return chunks

    def _step_chunk(self, optimizer: Optimizer, group: dict[str, Any], chunk: _Chunk, found_inf: Tensor | None) -> None:
        device = chunk.params[0].device
        fused = device.type in _FUSED_DEVICE_TYPES
        state_names, update = _update_rule(optimizer, group, fused)
        states = _ChunkStates(optimizer, chunk.params, state_names, self.kahan)
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
        views = _row_views(workspace, chunk.params, chunk.sizes)
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


def check_rounding_state(field: str, state: Any) -> dict[str, Any]:
    """Check a saved rounding state (what :meth:`StochasticRoundingStep.rounding_state` returns) at load time.

    A generator saved for the CPU is tried on a scratch generator, so that a damaged one fails here, not at the
    first step.

    Args:
        field: where ``state`` was found, for the error message.
        state: the saved rounding state.

    Returns:
        the state, with the seed as a Python ``int``.

    Raises:
        ValueError: naming the field, its value and what is allowed.

    """
    expected = "a dict with 'seed' (an integer in [0, 2**64)), 'kahan' (a bool) and 'generators' (a dict)"
    if not isinstance(state, dict) or not {"seed", "generators"} <= state.keys():
        raise ValueError(f"The checkpoint's {field} holds {state!r}; expected {expected}.")
    seed = state["seed"]
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 64:
        raise ValueError(f"The checkpoint's {field}['seed'] holds {seed!r}; expected an integer in [0, 2**64).")
    kahan = state.get("kahan", False)
    if not isinstance(kahan, bool):
        raise ValueError(f"The checkpoint's {field}['kahan'] holds {kahan!r}; expected True or False.")
    generators = state["generators"]
    if not isinstance(generators, dict):
        raise ValueError(
            f"The checkpoint's {field}['generators'] holds {generators!r}; expected a dict from a device name to"
            " the generator's state (a uint8 tensor)."
        )
    for name, value in generators.items():
        where = f"{field}['generators'][{name!r}]"
        try:
            device = torch.device(name)
        except (RuntimeError, TypeError):
            raise ValueError(f"The checkpoint's {where} names no device; expected a name such as 'cpu'.") from None
        if not isinstance(value, Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
            raise ValueError(
                f"The checkpoint's {where} holds {value!r}; expected a generator state (a 1-d uint8 tensor)."
            )
        if device.type == "cpu":
            try:
                torch.Generator().set_state(value)
            except RuntimeError as error:
                raise ValueError(
                    f"The checkpoint's {where} is not a CPU generator state ({value.numel()} bytes): {error}"
                ) from None
    return {**state, "seed": seed, "kahan": kahan}


UpdateRule = Callable[
    [list[Tensor], list[Tensor], dict[str, list[Tensor]], list[Tensor], Optimizer, Tensor | None], None
]
"""Steps the workspace: weights, gradients, states by name, step counts, the optimizer, and the inf flag to skip on."""
_FUSED_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia")
"""Device types with torch's fused Adam/AdamW/SGD kernels (``torch.utils._foreach_utils``'s list, kept here)."""


class _ChunkStates:
    """The optimizer states of a chunk's parameters, created as torch would (bf16 moments), gathered in one pass.

    Attributes:
        tensors: per state name, each parameter's tensor; None for an SGD momentum buffer not started yet.
        present: per state name, the tensors that exist, in order.
        fresh: the indices of the parameters whose SGD momentum buffer is not started yet.
        steps: the step counts (Adam, AdamW).
        compensation: the Kahan compensation buffers, with ``kahan``.

    """

    def __init__(self, optimizer: Optimizer, params: list[Tensor], state_names: Sequence[str], kahan: bool) -> None:
        self.states: list[dict[str, Any]] = []
        self.tensors: dict[str, list[Tensor | None]] = {name: [] for name in state_names}
        self.present: dict[str, list[Tensor]] = {name: [] for name in state_names}
        self.fresh: list[int] = []
        self.steps: list[Tensor] = []
        self.compensation: list[Tensor] = []
        adam = isinstance(optimizer, Adam)
        for index, parameter in enumerate(params):
            state = optimizer.state[parameter]
            if adam:
                if "step" not in state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=parameter.device)
                elif state["step"].device != parameter.device:
                    # torch loads a non-fused optimizer's step count onto the CPU; the fused rule needs it there.
                    state["step"] = state["step"].to(parameter.device)
                self.steps.append(state["step"])
            for name in state_names:
                tensor = state.get(name)
                if tensor is None and adam:
                    tensor = state[name] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
                if tensor is None:
                    self.fresh.append(index)
                else:
                    self.present[name].append(tensor)
                self.tensors[name].append(tensor)
            if kahan:
                if COMPENSATION_KEY not in state:
                    state[COMPENSATION_KEY] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
                self.compensation.append(state[COMPENSATION_KEY])
            self.states.append(state)

    def created(self, name: str, params: list[Tensor]) -> list[Tensor]:
        """Every parameter's state tensor ``name``, in order; the buffers not started yet are created (empty) now."""
        if not self.fresh:
            return self.present[name]
        for index in self.fresh:
            self.states[index][name] = torch.empty_like(params[index], memory_format=torch.preserve_format)
        return [state[name] for state in self.states]


def _row_views(workspace: Tensor, params: list[Tensor], sizes: list[int]) -> list[list[Tensor]]:
    """Per row of ``workspace``, one view per parameter, shaped like it, side by side along the row."""
    views: list[list[Tensor]] = [[] for _ in range(workspace.shape[0])]
    for piece, parameter in zip(workspace.split_with_sizes(sizes, dim=1), params, strict=True):
        for row, piece_of_row in zip(views, piece.unbind(), strict=True):
            row.append(piece_of_row.view(parameter.shape))
    return views


def _update_rule(optimizer: Optimizer, group: dict[str, Any], fused: bool) -> tuple[list[str], UpdateRule]:
    """The state tensors the optimizer keeps per parameter, and torch's update rule for the fp32 workspace.

    torch's fused kernel where the device has one (one op for the whole chunk, no host sync, skipped on the device
    when handed an inf flag), else foreach.
    """
    kernel: dict[str, Any] = {"fused": True} if fused else {"foreach": True}
    if isinstance(optimizer, Adam):
        names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
        beta1, beta2 = group["betas"]

        def adam_rule(
            weights: list[Tensor],
            grads: list[Tensor],
            states: dict[str, list[Tensor]],
            steps: list[Tensor],
            opt: Any,
            found_inf: Tensor | None,
        ) -> None:
            adam_rule_of_torch(
                weights,
                grads,
                states["exp_avg"],
                states["exp_avg_sq"],
                states.get("max_exp_avg_sq", []),
                steps,
                capturable=group.get("capturable", False) and not fused,
                grad_scale=getattr(opt, "grad_scale", None) if fused else None,
                found_inf=found_inf,
                decoupled_weight_decay=group.get("decoupled_weight_decay", False),
                amsgrad=group["amsgrad"],
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=group["maximize"],
                **kernel,
            )

        return names, adam_rule

    momentum = group["momentum"]
    names = ["momentum_buffer"] if momentum != 0 else []

    def sgd_rule(
        weights: list[Tensor],
        grads: list[Tensor],
        states: dict[str, list[Tensor]],
        steps: list[Tensor],
        opt: Any,
        found_inf: Tensor | None,
    ) -> None:
        sgd_rule_of_torch(
            weights,
            grads,
            # torch's rule takes list[Tensor | None]; mypy's invariant lists reject both list[Tensor] and list[None].
            states.get("momentum_buffer", [None] * len(weights)),  # type: ignore[arg-type]
            grad_scale=getattr(opt, "grad_scale", None) if fused else None,
            found_inf=found_inf,
            weight_decay=group["weight_decay"],
            momentum=momentum,
            lr=group["lr"],
            dampening=group["dampening"],
            nesterov=group["nesterov"],
            maximize=group["maximize"],
            **kernel,
        )

    return names, sgd_rule


def _shared_seed() -> int:
    seed = torch.initial_seed() % (1 << 63)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        backend_device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        shared = torch.tensor([seed], dtype=torch.int64, device=backend_device)
        dist.broadcast(shared, src=0)
        seed = int(shared.item())
    return seed


__all__ = [
    "COMPENSATION_KEY",
    "MAX_CHUNKS",
    "MIN_CHUNK_NUMEL",
    "STATE_KEY",
    "SUPPORTED_OPTIMIZERS",
    "StochasticRoundingStep",
    "chunk_limit",
    "stale_update_share",
    "stochastic_round_",
]
