"""The fp32 workspace of a bf16 step: chunks of parameters, their optimizer states, and torch's own update rule.

The bf16 parameters of a parameter group are updated in chunks (:func:`chunk_limit` elements at most, unless a
parameter is larger). Each chunk costs about a dozen kernel launches, so a large model's chunks are larger rather
than more numerous: at most :data:`MAX_CHUNKS` per parameter group and device. A chunk's weights, optimizer states
(:class:`ChunkStates`, created in bf16 as torch would create them) and gradients are copied into the rows of one
fp32 workspace (:func:`row_views` gives each parameter's view of a row), and **torch's own update rule**
(:func:`update_rule`: ``torch.optim.adam.adam`` or ``torch.optim.sgd.sgd``) steps the workspace. The rule is torch's
fused kernel wherever torch has one for the device, CPU and CUDA included, whatever the optimizer was built with,
since it is one op per chunk and reads no step count on the host; foreach elsewhere. Handed an inf flag
(``found_inf``), the fused rule skips the step on the device.

Persistent memory per bf16 parameter with AdamW: 2 bytes of weight, 2 of gradient, 4 of moment estimates, plus 2
with Kahan compensation. The workspace is transient and bounded by the chunk size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim import SGD, Adam, Optimizer
from torch.optim.adam import adam as adam_rule_of_torch
from torch.optim.sgd import sgd as sgd_rule_of_torch

from lightning_mp.stochastic_rounding.state import COMPENSATION_KEY

SUPPORTED_OPTIMIZERS: tuple[type[Optimizer], ...] = (Adam, SGD)
"""``torch.optim.Adam`` and its subclass ``AdamW``, and ``torch.optim.SGD``."""
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


@dataclass(frozen=True)
class Chunk:
    """Parameters updated together in one fp32 workspace, with their gradients and sizes."""

    params: list[Tensor]
    grads: list[Tensor]
    sizes: list[int]


UpdateRule = Callable[
    [list[Tensor], list[Tensor], dict[str, list[Tensor]], list[Tensor], Optimizer, Tensor | None], None
]
"""Steps the workspace: weights, gradients, states by name, step counts, the optimizer, and the inf flag to skip on."""
FUSED_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia")
"""Device types with torch's fused Adam/AdamW/SGD kernels (``torch.utils._foreach_utils``'s list, kept here)."""


class ChunkStates:
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


def row_views(workspace: Tensor, params: list[Tensor], sizes: list[int]) -> list[list[Tensor]]:
    """Per row of ``workspace``, one view per parameter, shaped like it, side by side along the row."""
    views: list[list[Tensor]] = [[] for _ in range(workspace.shape[0])]
    for piece, parameter in zip(workspace.split_with_sizes(sizes, dim=1), params, strict=True):
        for row, piece_of_row in zip(views, piece.unbind(), strict=True):
            row.append(piece_of_row.view(parameter.shape))
    return views


def update_rule(optimizer: Optimizer, group: dict[str, Any], fused: bool) -> tuple[list[str], UpdateRule]:
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


__all__ = [
    "FUSED_DEVICE_TYPES",
    "MAX_CHUNKS",
    "MIN_CHUNK_NUMEL",
    "SUPPORTED_OPTIMIZERS",
    "Chunk",
    "ChunkStates",
    "UpdateRule",
    "chunk_limit",
    "row_views",
    "update_rule",
]
