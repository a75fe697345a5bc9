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
2. The step post-hook updates the bf16 parameters in chunks of at most ``chunk_numel`` elements. For each chunk it
   copies weights, moment estimates and gradients into one fp32 workspace (one ``_foreach_copy_`` per quantity),
   runs **torch's own update rule** on it (``torch.optim.adam.adam`` or ``torch.optim.sgd.sgd``: the fused kernel
   wherever torch has one for the device, CPU and CUDA included, whatever the optimizer was built with, since it
   is one op per chunk and reads no step count on the host; foreach elsewhere), then writes weights and states back
   to bf16 with stochastic rounding, and puts the gradients back in place.
3. The random numbers come from a ``torch.Generator`` per device, seeded from ``torch.initial_seed()`` (rank 0's
   under ``torch.distributed``, so that every rank rounds alike). Its state is saved in the optimizer's own
   ``state_dict`` under :data:`STATE_KEY`, so a resumed run draws the same numbers as an uninterrupted one.

Persistent memory per bf16 parameter with AdamW: 2 bytes of weight, 2 of gradient, 4 of moment estimates, plus 2
with Kahan compensation. The workspace is transient and bounded by the chunk size.

Why not torchao: torchao 0.18's low-precision optimizers (``torchao.optim._AdamW(bf16_stochastic_round=True)``)
offer Adam and AdamW only (no SGD), compile each parameter's update with ``torch.compile`` (a C++ tool chain and a
compile per shape on the CPU), draw from the global random generator (a resume cannot restore the rounding's numbers
from the optimizer state alone), and replace the user's optimizer rather than fit around it. Writing the rounding
as three tensor ops on top of torch's own update rules keeps every torch option (fused, foreach, ``amsgrad``,
``nesterov``, ``maximize``) and adds no dependency.

Private names: :mod:`lightning_mp._private_names` lists them, with the reason for each.
"""

from __future__ import annotations

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
    """Parameters updated together in one fp32 workspace, with their gradients and state tensors."""

    params: list[Tensor]
    grads: list[Tensor]
    numel: int


class StochasticRoundingStep:
    """Make an ``Adam``, ``AdamW`` or ``SGD`` optimizer step its bf16 parameters with stochastic rounding.

    Attaches torch's public step and state-dict hooks to ``optimizer``; :meth:`detach` removes them. fp32
    parameters are stepped by the optimizer as usual. See the module docstring for the algorithm.

    Args:
        optimizer: a ``torch.optim.Adam``, ``AdamW`` or ``SGD``; its bf16 states are created in bf16.
        kahan: also keep a bf16 Kahan compensation buffer per bf16 parameter.
        seed: seed of the rounding's generators; None takes ``torch.initial_seed()`` (rank 0's under DDP).
        chunk_numel: the most elements per fp32 workspace (a larger parameter gets a chunk of its own); bounds the
            step's transient memory to about ``4 * (3 + 2 * states + kahan) * chunk_numel`` bytes, with ``states``
            the optimizer's tensors per parameter (2 for Adam and AdamW): 14 MiB for AdamW by default.

    .. warning:: With ``seed=None`` under ``torch.distributed``, the constructor broadcasts rank 0's seed and reads
        it on the host: one synchronisation, once.

    Raises:
        TypeError: if ``optimizer`` is not one of the supported types.
        ValueError: if the optimizer uses ``differentiable=True`` or sparse gradients, or ``chunk_numel < 1``.

    """

    def __init__(
        self, optimizer: Optimizer, kahan: bool = False, seed: int | None = None, chunk_numel: int = 1 << 19
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
        if chunk_numel < 1:
            raise ValueError(f"StochasticRoundingStep(chunk_numel={chunk_numel!r}) is not allowed: it must be >= 1.")
        self.optimizer = optimizer
        self.kahan = kahan
        self.chunk_numel = chunk_numel
        self.seed = _shared_seed() if seed is None else seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self._pending_generator_states: dict[str, Tensor] = {}
        self._set_aside: dict[Tensor, Tensor] = {}
        self._handles: list[RemovableHandle] = [
            optimizer.register_step_pre_hook(self._take_bf16_gradients),
            optimizer.register_step_post_hook(self._step_bf16_parameters),
            optimizer.register_state_dict_post_hook(self._add_rounding_state),
            optimizer.register_load_state_dict_pre_hook(self._load_rounding_state),
        ]

    def detach(self) -> None:
        """Remove the hooks: the optimizer steps as torch's own again."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

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
        self._set_aside.clear()
        bf16 = [p for group in optimizer.param_groups for p in group["params"] if p.dtype is torch.bfloat16]
        if any(parameter.grad is not None and parameter.grad.is_sparse for parameter in bf16):
            raise ValueError("StochasticRoundingStep does not support sparse gradients: use a dense embedding.")
        for parameter in bf16:
            if parameter.grad is not None:
                self._set_aside[parameter] = parameter.grad
                parameter.grad = None

    def _step_bf16_parameters(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        grads, self._set_aside = self._set_aside, {}
        try:
            if grads and not _found_inf(optimizer):
                with torch.no_grad():
                    for group in optimizer.param_groups:
                        for chunk in self._chunks(group, grads):
                            self._step_chunk(optimizer, group, chunk)
        finally:
            for parameter, grad in grads.items():
                parameter.grad = grad

    def _chunks(self, group: dict[str, Any], grads: dict[Tensor, Tensor]) -> list[_Chunk]:
        by_device: dict[torch.device, list[Tensor]] = {}
        for parameter in group["params"]:
            if parameter in grads:
                by_device.setdefault(parameter.device, []).append(parameter)
        chunks: list[_Chunk] = []
        for parameters in by_device.values():
            current: list[Tensor] = []
            size = 0
            for parameter in parameters:
                if current and size + parameter.numel() > self.chunk_numel:
                    chunks.append(_Chunk(current, [grads[p] for p in current], size))
                    current, size = [], 0
                current.append(parameter)
                size += parameter.numel()
            if current:
                chunks.append(_Chunk(current, [grads[p] for p in current], size))
        return chunks

    def _step_chunk(self, optimizer: Optimizer, group: dict[str, Any], chunk: _Chunk) -> None:
        device = chunk.params[0].device
        state_names, update = _update_rule(optimizer, group, device)
        states = [self._state_of(optimizer, parameter, state_names, self.kahan) for parameter in chunk.params]
        # Workspace rows: the weights and states (rounded back to bf16 together), the gradients, the compensation.
        rounded_rows = 1 + len(state_names)
        rows = rounded_rows + 1 + (1 if self.kahan else 0)
        workspace = torch.empty(rows, chunk.numel, dtype=torch.float32, device=device)
        sizes = [parameter.numel() for parameter in chunk.params]
        shapes = [parameter.shape for parameter in chunk.params]

        def views(row: int) -> list[Tensor]:
            return [piece.view(shape) for piece, shape in zip(workspace[row].split(sizes), shapes, strict=True)]

        weights, grads = views(0), views(rounded_rows)
        state_views = {name: views(1 + index) for index, name in enumerate(state_names)}
        torch._foreach_copy_(weights, chunk.params)
        torch._foreach_copy_(grads, chunk.grads)
        if self.kahan:
            compensation = [state[COMPENSATION_KEY] for state in states]
            torch._foreach_copy_(views(rows - 1), compensation)
            workspace[0].add_(workspace[rows - 1])
        for name in state_names:
            saved = [state[name] for state in states]
            fresh = [index for index, tensor in enumerate(saved) if tensor is None]
            if fresh:
                self._first_momentum(
                    group, [state_views[name][i] for i in fresh], [grads[i] for i in fresh], [weights[i] for i in fresh]
                )
            if len(fresh) < len(saved):
                present = [index for index, tensor in enumerate(saved) if tensor is not None]
                torch._foreach_copy_([state_views[name][i] for i in present], [saved[i] for i in present])
        update(weights, grads, state_views, [state["step"] for state in states if "step" in state], optimizer)
        if self.kahan:
            workspace[rows - 1].copy_(workspace[0])
        stochastic_round_(workspace[:rounded_rows], self.generator(device))
        torch._foreach_copy_(chunk.params, weights)
        for name in state_names:
            for index, state in enumerate(states):
                if state[name] is None:
                    state[name] = torch.empty_like(chunk.params[index], memory_format=torch.preserve_format)
            torch._foreach_copy_([state[name] for state in states], state_views[name])
        if self.kahan:
            workspace[rows - 1].sub_(workspace[0])
            torch._foreach_copy_(compensation, views(rows - 1))

    @staticmethod
    def _first_momentum(
        group: dict[str, Any], buffers: list[Tensor], grads: list[Tensor], weights: list[Tensor]
    ) -> None:
        """Start SGD momentum buffers so that torch's rule makes them its first-step value, ``d_p``.

        The rule computes ``buffer = momentum * buffer + (1 - dampening) * d_p`` with ``d_p = ±grad + weight_decay *
        weight``; starting from ``d_p * dampening / momentum`` gives ``d_p``, as torch's first step does, while other
        parameters of the chunk are past theirs.
        """
        if group["dampening"] == 0:
            torch._foreach_zero_(buffers)
            return
        torch._foreach_copy_(buffers, grads)
        if group["maximize"]:
            torch._foreach_neg_(buffers)
        if group["weight_decay"] != 0:
            torch._foreach_add_(buffers, weights, alpha=group["weight_decay"])
        torch._foreach_mul_(buffers, group["dampening"] / group["momentum"])

    @staticmethod
    def _state_of(optimizer: Optimizer, parameter: Tensor, state_names: Sequence[str], kahan: bool) -> dict[str, Any]:
        state = optimizer.state[parameter]
        if isinstance(optimizer, Adam):
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=parameter.device)
                for name in state_names:
                    state[name] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
            elif state["step"].device != parameter.device:
                # torch loads a non-fused optimizer's step count onto the CPU; the fused rule needs it on the device.
                state["step"] = state["step"].to(parameter.device)
        for name in state_names:
            state.setdefault(name, None)
        if kahan and COMPENSATION_KEY not in state:
            state[COMPENSATION_KEY] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
        return state

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


UpdateRule = Callable[[list[Tensor], list[Tensor], dict[str, list[Tensor]], list[Tensor], Optimizer], None]
_FUSED_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia")
"""Device types with torch's fused Adam/AdamW/SGD kernels (``torch.utils._foreach_utils``'s list, kept here)."""


def _update_rule(optimizer: Optimizer, group: dict[str, Any], device: torch.device) -> tuple[list[str], UpdateRule]:
    """The state tensors the optimizer keeps per parameter, and torch's update rule for the fp32 workspace.

    torch's fused kernel where it has one for the device (one op for the whole chunk, no host sync), else foreach.
    """
    fused = device.type in _FUSED_DEVICE_TYPES
    kernel: dict[str, Any] = {"fused": True} if fused else {"foreach": True}
    if isinstance(optimizer, Adam):
        names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
        beta1, beta2 = group["betas"]

        def adam_rule(
            weights: list[Tensor], grads: list[Tensor], states: dict[str, list[Tensor]], steps: list[Tensor], opt: Any
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
        weights: list[Tensor], grads: list[Tensor], states: dict[str, list[Tensor]], steps: list[Tensor], opt: Any
    ) -> None:
        sgd_rule_of_torch(
            weights,
            grads,
            # torch's rule takes list[Tensor | None]; mypy's invariant lists reject both list[Tensor] and list[None].
            states.get("momentum_buffer", [None] * len(weights)),  # type: ignore[arg-type]
            grad_scale=getattr(opt, "grad_scale", None) if fused else None,
            weight_decay=group["weight_decay"],
            momentum=momentum,
            lr=group["lr"],
            dampening=group["dampening"],
            nesterov=group["nesterov"],
            maximize=group["maximize"],
            **kernel,
        )

    return names, sgd_rule


def _found_inf(optimizer: Optimizer) -> bool:
    """Whether a GradScaler handed the optimizer a non-finite gradient flag for this step.

    .. warning:: Reads the flag on the host: one synchronisation per step, where a flag was handed over (fused
        optimizers; in bf16 also Adam, AdamW and SGD, which :class:`~lightning_mp.LossScaler` steps through their
        fused kernel).
    """
    found_inf = getattr(optimizer, "found_inf", None)
    return isinstance(found_inf, Tensor) and bool(found_inf.item())


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
    "STATE_KEY",
    "SUPPORTED_OPTIMIZERS",
    "StochasticRoundingStep",
    "stale_update_share",
    "stochastic_round_",
]
