"""lean-exact: O2's results bit for bit, with each fp32 master kept as its bf16 weight plus a 16-bit remainder.

Select it with ``MixedPrecision("bf16-mixed", opt_level="lean-exact")``.

O2 keeps, per chosen weight, a bf16 model parameter (2 bytes) and an fp32 master (4 bytes). But the bf16 parameter
*is* the top half of the master, rounded: :mod:`lightning_mp.policies.o2.split` shows that the master is exactly the
bf16 weight plus the 16 bits the rounding dropped, kept as an int16 remainder, when the rounding goes to nearest with
ties away from zero (the rounding O2 in bf16 uses too). So this level is O2 with each master stored as its
remainder between optimizer steps: 4 bytes of weight and master per parameter instead of 6, and the same numbers.

How a step runs (everything else is O2's, :mod:`lightning_mp.policies.o2.policy`):

1. Between steps each master is *packed*: its remainder is kept, and the master (the same ``nn.Parameter`` object
   the optimizer's state is keyed by) holds one zero expanded to its shape, so that it still takes the fp32 gradient
   the loss scaler unscales and checks, as at O2.
2. The optimizer's ``step`` runs once, over one chunk of parameters at a time
   (:mod:`~lightning_mp.policies.o2.chunked_step`: at most ``master_chunk_numel`` elements, :data:`MASTER_CHUNK_NUMEL`
   by default, or one larger parameter). Each chunk's masters are rebuilt exactly from weight and remainder
   (:func:`~lightning_mp.policies.o2.split.unpack`: a fixed few ops per chunk, whatever the number of weights in it,
   and no temporary) and the remainders freed; torch's own step updates the masters in fp32 with their fp32
   gradients and states, as at O2.
3. Before the next chunk, each stepped master's remainder is taken (its low 16 bits, one strided copy), the master
   is rounded into its weight (its lowest bit set in place, then one foreach cast: no temporary), and the master is
   freed. A step skipped on the host never unpacks; one skipped on the device (torch's fused kernels with the
   scaler's inf flag) leaves the master as it was, so it packs back to the same bits.

torch's per-parameter optimizers (Adam, AdamW, SGD, Adagrad, RMSprop and the others of
:data:`~lightning_mp.policies.o2.chunked_step.INDEPENDENT_STEPS`, in their fused, foreach and single-tensor forms) step
in chunks; any other optimizer (LBFGS, whose update couples every parameter, or one with a ``step`` of its own) steps
whole, every master rebuilt at once, as at O2.

Memory per chosen parameter with AdamW: 2 bytes of bf16 weight and 2 of remainder, 8 of fp32 moment estimates, 2 of
bf16 gradient from a backward to the step: 12 between steps, O2's 14 less the 2 bytes of the master's top half. In
the step the fp32 gradients exist whole, as at O2 (the loss scaler checks them and clipping scales them before it),
and the step adds one chunk: its rebuilt masters, 4 bytes per element, and the optimizer's temporaries for it (none
for fused AdamW, 4 bytes per element for foreach AdamW). O2's step holds every master, and every temporary, at once.

What differs from O2. A weight written by hand between steps (a callback editing ``weight`` in place) keeps its
master's 16 low bits under the new top half; O2 would take the new value exactly where it differs from the rounded
master. ``load_state_dict``, DDP's start-up broadcast and the plugin's checkpoints go through the masters and are
exact. The optimizer's step hooks find the user's parameters in its groups, wherever they were registered, where at
O2 a pre-hook registered after the plugin's finds the masters. Under FSDP and FSDP2 the fp32 shards are the exact
masters already (4 bytes per parameter, stored once across the ranks), so this level runs there as O2 does, with
nothing to pack (:mod:`lightning_mp.policies.sharded`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mp.policies.o2.chunked_step import ChunkedStep, steps_each_parameter_alone
from lightning_mp.policies.o2.masters import MasterParams
from lightning_mp.policies.o2.policy import O2Policy
from lightning_mp.policies.o2.split import dense_flat, take_remainders, unpack

MASTER_CHUNK_NUMEL = 1 << 24
"""The most parameter elements whose fp32 masters a step rebuilds at once unless ``master_chunk_numel`` says
otherwise: 64 MiB of masters. Each chunk costs the same on the host whatever its size (the optimizer's Python for a
group, some 70 calls, and about 14 kernel launches on the CPU counter), so a chunk this size keeps a GPU's work on it
longer than that, at a memory no GPU notices."""


class RemainderMasters(MasterParams):
    """:class:`~lightning_mp.policies.o2.masters.MasterParams` whose masters are packed into int16 remainders.

    Entry ``i`` is packed when ``remainders[i]`` holds its remainder (and its master no storage), unpacked in a step.

    Args:
        dtype: must be ``torch.bfloat16``.
        chunk_numel: the most elements one rebuild or packing holds at once (a larger tensor is one of its own).

    """

    def __init__(self, dtype: torch.dtype, chunk_numel: int = MASTER_CHUNK_NUMEL) -> None:
        super().__init__(dtype)
        self.chunk_numel = chunk_numel
        self.remainders: list[Tensor | None] = []
        self._zeros: dict[torch.device, Tensor] = {}
        """Per device, the one fp32 zero every packed master there is a view of."""

    def pack(self, indices: Iterable[int]) -> None:
        """Keep the remainder of each unpacked master ``indices`` and free the master.

        Its weight already holds it rounded. A fixed few ops per chunk of weights, per device
        (:func:`~lightning_mp.policies.o2.split.take_remainders`).
        """
        for device_indices in self._by_device(i for i in indices if self.remainders[i] is None):
            remainders = take_remainders([self.master_params[i].data for i in device_indices], self.chunk_numel)
            self._keep(device_indices, remainders)

    def _keep(self, indices: list[int], remainders: list[Tensor]) -> None:
        for i, remainder in zip(indices, remainders, strict=True):
            self.remainders[i] = remainder
            self._free_master(i, self.master_params[i].device)

    def _free_master(self, i: int, device: torch.device) -> None:
        """Let entry ``i``'s master hold one fp32 zero on ``device``, expanded to its shape.

        Its gradient can still be assigned (the scaler unscales the masters' gradients before the step), and an
        in-place write into it fails loudly.
        """
        zero = self._zeros.get(device)
        if zero is None:
            zero = self._zeros[device] = torch.zeros((), dtype=torch.float32, device=device)
        master = self.master_params[i]
        master.data = zero.expand(master.shape)

    @override
    def finish_step(self, indices: Sequence[int]) -> None:
        """Free the step's gradients, and pack the masters ``indices`` the step left rebuilt (:meth:`repack`)."""
        self.free_step_gradients(indices)
        self.repack(indices)

    def repack(self, indices: Iterable[int]) -> None:
        """Take each rebuilt master's remainder, round the master into its weight, and free it.

        A fixed few ops per chunk of weights, per device, and no temporary beyond the remainders themselves
        (:func:`~lightning_mp.policies.o2.split.round_into`). Like :meth:`pack` and :meth:`unpack`, it runs once per
        chunk of a step and needs no ``torch.no_grad()``: it reads and writes ``.data`` and detached tensors only.
        """
        for device_indices in self._by_device(i for i in indices if self.remainders[i] is None):
            remainders = take_remainders([self.master_params[i].data for i in device_indices], self.chunk_numel)
            self.master_params_to_model_params(device_indices, consume=True)
            self._keep(device_indices, remainders)

    def unpack(self, indices: Iterable[int]) -> None:
        """Rebuild each packed master ``indices`` from its model parameter and remainder, exactly; free the remainder.

        A fixed few ops per chunk of weights (:func:`~lightning_mp.policies.o2.split.unpack`), per device; the masters
        are laid out as their parameters.
        """
        for device_indices in self._by_device(i for i in indices if self.remainders[i] is not None):
            weights = [self.model_params[i].detach() for i in device_indices]
            device = weights[0].device
            held = [self.remainders[i] for i in device_indices]
            remainders = [r if r.device == device else r.to(device) for r in held if r is not None]
            masters = unpack(weights, remainders, self.chunk_numel)
            for i, master in zip(device_indices, masters, strict=True):
                self.master_params[i].data = master
                self.remainders[i] = None

    def value(self, i: int) -> Tensor:
        """Entry ``i``'s fp32 master value: the master itself in a step, else a new tensor rebuilt from it."""
        if self.remainders[i] is None:
            return self.master_params[i]
        weight = self.model_params[i].detach()
        return unpack([weight], [self._remainder_on(i, weight.device)])[0]

    def _remainder_on(self, i: int, device: torch.device) -> Tensor:
        remainder = self.remainders[i]
        assert remainder is not None
        return remainder if remainder.device == device else remainder.to(device)

    def _by_device(self, indices: Iterable[int]) -> list[list[int]]:
        groups: dict[torch.device, list[int]] = {}
        for i in indices:
            groups.setdefault(self.model_params[i].device, []).append(i)
        return list(groups.values())

    @override
    def add(self, param: nn.Parameter, keys: list[str]) -> int:
        """Make ``param`` bf16 in place and keep its fp32 values' remainder; return the entry's index.

        A parameter whose elements do not fill their span (a strided slice, not a layout) is made contiguous first.
        """
        if dense_flat(param) is None:
            param.data = param.data.contiguous()
        self.remainders.append(None)
        index = MasterParams.add(self, param, keys)
        self.pack((index,))
        return index

    @override
    def follow_devices(self, indices: Iterable[int]) -> None:
        """Move each remainder to its parameter's device; a packed master gets its placeholder there, not a copy.

        Moving the placeholder itself (an expanded zero) would copy it at its full size.
        """
        unpacked: list[int] = []
        with torch.no_grad():
            for i in indices:
                remainder, param = self.remainders[i], self.model_params[i]
                if remainder is None:
                    unpacked.append(i)
                elif remainder.device != param.device:
                    self.remainders[i] = remainder.to(param.device)
                    self._free_master(i, param.device)
        super().follow_devices(unpacked)

    @override
    def merge_edits(self, indices: Iterable[int], force: bool = False) -> None:
        """A packed entry's edited weight keeps its remainder under the new top half: only the versions move."""
        unpacked: list[int] = []
        for i in indices:
            if self.remainders[i] is None:
                unpacked.append(i)
            else:
                self._written_versions[i] = self.model_params[i]._version
        super().merge_edits(unpacked, force)

    @override
    def ready_for_step(self, indices: Iterable[int]) -> None:
        """Before a whole step: every master ``indices`` rebuilt, with edits merged and fresh fp32 gradients."""
        indices = list(indices)
        self.follow_devices(indices)
        self.unpack(indices)
        super().ready_for_step(indices)

    def prepare_chunked_step(self, indices: list[int]) -> None:
        """Before a chunked step: edits merged and fresh fp32 gradients, the masters still packed.

        Each chunk is rebuilt when the step reaches it (:meth:`unpack`).
        """
        self.follow_devices(indices)
        super().ready_for_step(indices)

    @override
    def restore_fp32(self) -> None:
        self.unpack(range(len(self)))
        super().restore_fp32()

    @override
    def substitute_master_params(self, state_dict: dict[str, Any], prefix: str, indices: Sequence[int]) -> None:
        """Put each master's fp32 value, rebuilt exactly, in ``state_dict`` where its model parameter's is."""
        self.merge_edits(indices, force=True)
        for i in indices:
            value = self.value(i).detach()
            for key in self.keys[i]:
                if isinstance(state_dict.get(prefix + key), Tensor):
                    state_dict[prefix + key] = value

    @override
    def load_master_params(self, state_dict: dict[str, Any], prefix: str, indices: Iterable[int]) -> None:
        """Unpack the masters ``state_dict`` holds values for, and write them; the post-hook packs them again."""
        with torch.no_grad():
            for i in indices:
                value = state_dict.get(prefix + self.keys[i][0])
                if isinstance(value, Tensor) and value.shape == self.model_params[i].shape:
                    param = self.model_params[i]
                    self.remainders[i] = None
                    self.master_params[i].data = value.detach().to(device=param.device, dtype=torch.float32, copy=True)
                    self._written_versions[i] = -1
                    self._loaded.add(i)

    @override
    def round_loaded_masters(self, indices: Iterable[int]) -> None:
        loaded = [i for i in indices if i in self._loaded]
        super().round_loaded_masters(loaded)
        self.pack(loaded)


class LeanExactPolicy(O2Policy):
    """O2 in bf16 with each fp32 master packed as an int16 remainder beside its bf16 weight between steps.

    Args:
        half_dtype: must be ``torch.bfloat16``.
        keep_fp32: module types, qualified names or ``re:`` patterns whose modules compute in fp32.
        master_chunk_numel: the most parameter elements whose masters exist at once in an optimizer step (a larger
            parameter is a chunk of its own); None takes :data:`MASTER_CHUNK_NUMEL`.

    Raises:
        ValueError: if ``half_dtype`` is not bf16, or a ``keep_fp32`` entry is invalid.

    """

    opt_level = "lean-exact"
    packs_masters = True
    masters_type: ClassVar[type[MasterParams]] = RemainderMasters

    def __init__(
        self,
        half_dtype: torch.dtype | None,
        keep_fp32: Sequence[type | str] = (),
        master_chunk_numel: int | None = None,
    ) -> None:
        if half_dtype is not torch.bfloat16:
            raise ValueError(
                f"{type(self).__name__}(half_dtype={half_dtype!r}) is not allowed: opt_level='lean-exact' keeps each"
                " fp32 master as its bf16 weight plus the 16 bits rounding dropped, and only bf16 is the top half of"
                " an fp32 (fp16's exponent is narrower). Use MixedPrecision('bf16-mixed', opt_level='lean-exact'),"
                " or opt_level='O2' for fp16."
            )
        if sys.byteorder != "little":
            raise RuntimeError(
                "opt_level='lean-exact' reads an fp32 master's low 16 bits as the first half of each 32-bit word,"
                f" which needs a little-endian machine; this one is {sys.byteorder}-endian. Use opt_level='O2'."
            )
        super().__init__(half_dtype, keep_fp32)
        self.master_chunk_numel = MASTER_CHUNK_NUMEL if master_chunk_numel is None else master_chunk_numel
        self._chunked_steps: dict[int, ChunkedStep] = {}
        """Per optimizer (by ``id``) stepping a chunk at a time: its groups for the length of the step."""

    @override
    def new_masters(self) -> MasterParams:
        return RemainderMasters(torch.bfloat16, self.master_chunk_numel)

    @override
    def after_optimizer_step(self, optimizer: Optimizer, skipped: bool) -> None:
        """Put back the groups of a chunked step that raised after the pre-hook; then as O2."""
        self._restore_groups(optimizer)
        super().after_optimizer_step(optimizer, skipped)

    @override
    def step_raised(self, optimizer: Optimizer) -> None:
        """Put back the groups of a chunked step (its loop packed each chunk it stepped); a whole step as O2."""
        self._restore_groups(optimizer)
        super().step_raised(optimizer)

    def _restore_groups(self, optimizer: Optimizer) -> None:
        """Forget ``optimizer``'s chunked step, if one is left, and put its own ``param_groups`` list back."""
        chunked = self._chunked_steps.pop(id(optimizer), None)
        if chunked is not None:
            chunked.restore()

    @override
    def teardown(self) -> None:
        for chunked in self._chunked_steps.values():
            chunked.restore()
        self._chunked_steps = {}
        super().teardown()

    @override
    def _before_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        """Step torch's per-parameter optimizers a chunk of masters at a time; any other whole, as O2."""
        masters = self.masters
        if not isinstance(masters, RemainderMasters) or not steps_each_parameter_alone(optimizer):
            super()._before_step(optimizer, args, kwargs)
            return
        self._restore_groups(optimizer)  # a step that raised where nothing put its list back
        self._chunked_steps[id(optimizer)] = ChunkedStep(
            optimizer,
            masters,
            self.master_chunk_numel,
            # No group entry swapped: only the state is keyed by the masters, for the length of each walk.
            key_state_by_masters=lambda stepping: self._hold_masters(stepping, []),
            key_state_by_params=self._hold_model_params,
        )

    @override
    def _after_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        """Free the gradients of a chunked step, whose masters its loop packed; after a whole step as O2.

        Raises:
            RuntimeError: if the optimizer's ``step`` returned without walking its groups as torch's loop does.

        """
        chunked = self._chunked_steps.pop(id(optimizer), None)
        if chunked is None:
            super()._after_step(optimizer, args, kwargs)
            return
        chunked.restore()
        if not chunked.walked:
            raise RuntimeError(
                f"lean-exact expected {type(optimizer).__name__}.step to walk optimizer.param_groups in its own loop,"
                " as torch's step does, to hand it the fp32 masters a chunk at a time; it returned without, so it"
                " stepped the bf16 weights directly. A wrapped or compiled step cannot be chunked: use"
                " opt_level='O2', or call the optimizer's own step."
            )
        if self.masters is not None:
            self.masters.finish_step(chunked.entries())

    @override
    def master_param(self, parameter: Tensor) -> Tensor:
        """The fp32 master of a parameter this level made bf16 (rebuilt between steps); any other parameter itself."""
        masters = self.masters
        i = None if masters is None else masters.index_of.get(id(parameter))
        if i is None or not isinstance(masters, RemainderMasters):
            return parameter
        return masters.value(i)


__all__ = ["LeanExactPolicy", "RemainderMasters"]
