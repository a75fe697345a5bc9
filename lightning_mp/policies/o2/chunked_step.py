"""An optimizer step over packed masters, one chunk of parameters at a time: ``lean-exact``'s bounded step.

``lean-exact`` keeps each fp32 master packed (its bf16 weight plus an int16 remainder) between steps. Rebuilding every
master for the step would make the step's memory O2's, the whole model's masters at once. Instead the step runs the
user's own optimizer on one chunk of parameters at a time, so at most one chunk's masters exist:

1. The opt level's step pre-hook puts a :class:`ChunkedStep` in place of the optimizer's ``param_groups`` list: a
   list of the same group dicts, which anything may index and iterate as usual.
2. torch's own step walks ``for group in self.param_groups`` once and steps each group's parameters there. To that
   loop alone (told by its code object, the caller of ``iter()``) a :class:`ChunkedStep` readies the masters (edits
   merged, fresh fp32 gradients), keys the optimizer's state by the masters, and then, per group, yields the group
   dict once per chunk of its parameters that have a gradient (at most ``chunk_numel`` elements, or one larger
   parameter), with ``group["params"]`` holding that chunk's masters (and the fp32 parameters among them as they
   are), rebuilt just before. Each chunk is packed again (its remainders taken, its masters rounded into their
   weights and freed) when the loop asks for the next one. At the end the groups hold the user's parameters, the
   state is keyed by them, and the optimizer's own list is back.
3. The step post-hook checks that the loop ran and frees the step's gradients; after a step that raised, the opt
   level puts the list back (:meth:`ChunkedStep.restore`).

Why this is the same step, bit for bit. Each parameter is stepped exactly once, by the same code, with its own group's
hyperparameters, state and gradient; torch's per-parameter optimizers (:data:`INDEPENDENT_STEPS`) compute each
parameter's update from those alone, in their single-tensor, foreach and fused forms, so cutting a group into chunks
changes which list a tensor is in, never its numbers. The step is still one call of the optimizer's ``step``: its pre-
and post-hooks fire once, ``state["step"]`` counts once per parameter, and schedulers see one step. An optimizer
outside that set (LBFGS, whose update couples every parameter; an optimizer whose own ``step`` is not torch's) steps
whole, as at O2.

What everyone else sees. Any other iteration of ``param_groups`` (step hooks, torch's CUDA-graph check inside the
step, Lightning, the plugin's own reads) gets the groups as they are, holding the user's parameters: before the loop
with bf16 gradients, after it with stepped bf16 weights and a state keyed by those parameters.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mp.policies.o2.split import chunks

INDEPENDENT_STEPS = frozenset(
    inspect.unwrap(optimizer_type.step)
    for optimizer_type in (
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.SGD,
        torch.optim.Adagrad,
        torch.optim.RMSprop,
        torch.optim.Adamax,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.Adadelta,
        torch.optim.ASGD,
        torch.optim.Rprop,
        torch.optim.Adafactor,
    )
)
"""The ``step`` functions of torch's optimizers that walk ``param_groups`` once, in their own body, and update each
parameter from its own gradient, state and group alone (torch's wrappers around them unwrapped)."""


def steps_each_parameter_alone(optimizer: Optimizer) -> bool:
    """Whether ``optimizer``'s ``step`` is one of torch's per-parameter steps (:data:`INDEPENDENT_STEPS`).

    A subclass that overrides ``step`` does not qualify, whatever it inherits from.
    """
    step = inspect.unwrap(type(optimizer).step)
    return step in INDEPENDENT_STEPS and "param_groups" in step.__code__.co_names


class PackedMasters(Protocol):
    """What a chunked step needs of the masters: found by parameter, readied whole, rebuilt and packed by entry."""

    index_of: dict[int, int]
    master_params: list[nn.Parameter]

    def prepare_chunked_step(self, indices: list[int]) -> None:
        """Merge edits and give fresh fp32 gradients to the masters ``indices``, leaving them packed."""

    def unpack(self, indices: list[int]) -> None:
        """Rebuild the packed masters ``indices``."""

    def repack(self, indices: list[int]) -> None:
        """Round the rebuilt masters ``indices`` into their weights and pack them."""


class ChunkedStep(list[dict[str, Any]]):
    """``optimizer.param_groups`` for the length of one step: the same groups; chunks of masters to torch's loop.

    Args:
        optimizer: the optimizer about to step, one :func:`steps_each_parameter_alone` accepts; its ``param_groups``
            list is replaced until torch's loop ends (or :meth:`restore`).
        masters: the packed masters of its half parameters.
        chunk_numel: the most parameter elements one chunk holds (a larger parameter is a chunk of its own).
        key_state_by_masters: keys the optimizer's state by the masters, for torch's loop.
        key_state_by_params: keys it by the user's parameters again.

    """

    def __init__(
        self,
        optimizer: Optimizer,
        masters: PackedMasters,
        chunk_numel: int,
        key_state_by_masters: Callable[[Optimizer], None],
        key_state_by_params: Callable[[Optimizer], object],
    ) -> None:
        super().__init__(optimizer.param_groups)
        self.optimizer = optimizer
        self.groups = optimizer.param_groups
        """The optimizer's own list, put back when torch's loop ends."""
        self.masters = masters
        self.chunk_numel = chunk_numel
        self.walked = False
        """Whether torch's loop walked the chunks to their end."""
        self._step_code = inspect.unwrap(type(optimizer).step).__code__
        self._key_state_by_masters = key_state_by_masters
        self._key_state_by_params = key_state_by_params
        optimizer.param_groups = self

    def __iter__(self) -> Iterator[dict[str, Any]]:
        frame = inspect.currentframe()
        from_step = frame is not None and frame.f_back is not None and frame.f_back.f_code is self._step_code
        del frame  # a frame held here would keep its caller's locals alive
        return self._walk() if from_step else list.__iter__(self)

    def _walk(self) -> Iterator[dict[str, Any]]:
        """The groups, once per chunk of masters, rebuilt before and packed after (module docstring)."""
        masters, optimizer = self.masters, self.optimizer
        index_of, master_params = masters.index_of, masters.master_params
        masters.prepare_chunked_step(self.entries())
        self._key_state_by_masters(optimizer)
        try:
            for group in self.groups:
                params = group["params"]
                stepped: list[Tensor] = []
                entries: list[int | None] = []
                for param in params:  # inline: this runs for every parameter at every step
                    i = index_of.get(id(param))
                    tensor = param if i is None else master_params[i]
                    if tensor.grad is not None:
                        stepped.append(tensor)
                        entries.append(i)
                sizes = [tensor.numel() for tensor in stepped]
                try:
                    for start, end in chunks(sizes, self.chunk_numel):
                        indices = [i for i in entries[start:end] if i is not None]
                        masters.unpack(indices)
                        group["params"] = stepped[start:end]
                        yield group
                        # Only once the loop asks for the next chunk: a step that raised leaves this one rebuilt,
                        # which is a master's value as valid as a packed one, and the next step packs it.
                        masters.repack(indices)
                finally:
                    group["params"] = params
        finally:
            self._key_state_by_params(optimizer)
        self.walked = True
        self.restore()

    def entries(self) -> list[int]:
        """The entries of the optimizer's half parameters, in its groups' order."""
        index_of = self.masters.index_of
        return [i for group in self.groups for param in group["params"] if (i := index_of.get(id(param))) is not None]

    def restore(self) -> None:
        """Put the optimizer's own ``param_groups`` list back."""
        if self.optimizer.param_groups is self:
            self.optimizer.param_groups = self.groups


__all__ = ["INDEPENDENT_STEPS", "ChunkedStep", "PackedMasters", "steps_each_parameter_alone"]
