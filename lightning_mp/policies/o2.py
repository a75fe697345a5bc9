"""O2: the model computes with persistent half weights; fp32 master weights take the optimizer steps.

Apex's O2 and DeepSpeed's fp16/bf16 optimizers keep the model's weights in half and an fp32 master copy of each
for the optimizer. This level does the same, with one difference that keeps Lightning's recipes working: the
masters are the model's original parameters, and between an optimizer step and the next forward the model shows
them, so that callbacks, checkpoints and ``load_state_dict`` read and write fp32 weights without knowing about O2.

1. ``convert_module`` (before the model moves and before DDP wraps it) gives each chosen parameter a half twin: a
   new ``nn.Parameter`` holding its value cast once to the half type, put in the parameter's slot in every module
   that holds it (a tied parameter gets one twin). The original fp32 parameter object becomes the master. Chosen are
   the fp32 parameters of every module except normalisation layers (BatchNorm, LayerNorm, GroupNorm,
   InstanceNorm, RMSNorm and any class whose name ends in ``Norm``), the subtrees that ``keep_fp32`` matches, and
   layers whose forward needs the fp32 parameter itself (they compute in fp32 under autocast, as in O1):

   - recurrent layers: their forward reads a cached list of their weights, not the module's slots;
   - reparametrized weights (``torch.nn.utils.parametrize``: ``parametrizations.spectral_norm``, ``weight_norm``,
     ``orthogonal``; and the older ``nn.utils.spectral_norm``/``weight_norm`` hooks): the parametrization runs on
     the original parameter and may keep fp32 state that it updates in place (spectral norm's power iteration);
   - sparse embeddings (``Embedding``/``EmbeddingBag`` with ``sparse=True``): their sparse gradients would need a
     sparse cast, and their optimizers (``SparseAdam``, SGD) are cheap on the rows a batch touches anyway.

   A tied weight is one tensor in one dtype: a module tied to one that ``keep_fp32`` matches is kept too, with a
   warning naming it (the rule O3 and lean follow, :func:`~lightning_mp.policies.casting.keep_tied_weights_together`),
   and a parameter that any module computing in fp32 holds gets no twin, in none of its modules (also with a
   warning). So a tie never splits into a master on one side and a twin on the other, and an optimizer built on
   the model's parameters never holds one master twice.

   Lazy parameters (``nn.LazyLinear``) compute in fp32 until their first forward materialises them and get their
   twin at the next forward. Parameters of other dtypes (fp64) and every buffer keep their dtype. In fp16 a weight
   beyond fp16's range (65504) is refused by name (:class:`HalfOverflowError`). DDP, wrapped after this, holds the
   half twins: it all-reduces half gradients, half the bytes of O1's.
2. The optimizer steps the masters. An optimizer built on the model's parameters after the conversion (the
   Trainer's ``configure_optimizers``) holds the twins: ``connect`` points its ``param_groups`` at their masters,
   as Apex's ``amp.initialize`` does, and moves any state it holds; one built before it (Fabric) holds the masters
   already. Under the Trainer, ``connect`` comes after the model was moved and wrapped, and ends by showing the
   masters: from there to the first training forward (``on_fit_start``, ``on_train_start``, the first
   ``on_train_epoch_start``) the model's parameters are the optimizer's, by identity, as after every step, so that
   callbacks that match the two (``BackboneFinetuning``'s bookkeeping and ``filter_on_optimizer``, the weight
   averaging callbacks) work whether or not an evaluation ran first. A group added later with twins (a model that
   shows them, inside a training step) is pointed at the masters at its first step.
3. Forward (``forward_context``, every training, validation, test and predict step and Fabric's forward): the outermost
   entry puts the twins into the slots (a dict write per slot: no cast, no op, no Python call). A forward without
   gradients (validation, test, predict) puts the masters back at its exit; a forward with gradients leaves the twins
   there for its backward, and the step shows the masters (point 4), so a training step swaps the weights twice (entry
   and step), not four times. Its exit shows them too where the forward failed, or where a backward ran inside it
   (manual optimization's ``training_step``, stepping or not): nothing waits for a backward there. Autocast stays on
   around it, as a safety net for what is not a chosen weight: fp32 inputs of matrix products, losses and softmax-like
   reductions in fp32, normalisation layers in fp32 (their fp32 weights with half inputs). Since embeddings are half,
   the residual stream and the activations saved for backward are half too. Backward (``backward_context``) flows into
   the twins, whose ``.grad`` is half, where autograd and DDP accumulate it (``no_sync`` gradient accumulation
   included); it puts the twins into the slots where they are not, so that from the training forward to the step the
   model shows them, with their gradients after backward (``on_before_backward``, ``on_after_backward``,
   ``clip_grad_norm_`` of ``self.parameters()`` after ``manual_backward``, Fabric code between the forward and the
   step).
4. Step (the engines call :meth:`O2Policy.prepare_step` once per optimizer step, before unscaling, clipping or stepping
   it, and before a user's own ``scaler.unscale_`` of it:
   :meth:`~lightning_mp.scaler.LossScaler.prepare_before_unscale`): in one pass the masters come back into the slots,
   and the twins' gradients move into their masters' ``.grad`` in fp32 (added where a master already holds one); the
   twins' are freed. Every waiting gradient moves, also of a parameter that another optimizer steps or none does, so
   that from the step on the model shows the gradients fp32 training shows there, dense and in fp32. A training step
   that returned None (no backward) is prepared too, so the masters are back after it as after any step. So the loss
   scaler unscales and checks fp32 master gradients (foreach, fused and the fused hand-off work unchanged), and
   ``on_before_optimizer_step`` hooks, ``grad_norm`` and gradient clipping see true fp32 gradients on
   ``model.parameters()``. Gradients move at the step, not after each backward: DDP reduces the accumulated ``.grad``
   once, at the last micro-batch, so an earlier move would keep earlier micro-batches out of the reduction. The cost is
   that micro-batches accumulate in half (in fp16 the scaled gradients, whose range fits); a step without accumulation
   loses nothing. After the optimizer step (:meth:`O2Policy.after_optimizer_step`) one foreach copy writes the stepped
   masters into their twins, the one cast per weight per optimizer step, and their fp32 gradients are freed. The
   stepped masters are named, not found by their version counters, which fused optimizer kernels do not move. A step the
   host saw skipped changed no master and writes nothing; one skipped on the device (fused kernels) writes the same
   values again.

   Discarded gradients. The optimizer holds the masters, so its ``zero_grad`` (Lightning's in every closure, the
   user's in manual optimization, Fabric's wrapper) reaches the masters' ``.grad``, not the twins' where the
   gradients wait. So each backward (``backward_context``) leaves in every master whose twin takes a gradient a
   ``.grad`` it can recognise: the gradient already there, or else an empty sparse tensor of the master's shape
   (no element, no memory; made once per pair). A ``zero_grad`` that removed it (``set_to_none=True``), zeroed it
   in place (``set_to_none=False``: its version moved) or replaced it discarded the gradient waiting on the twin:
   the next backward, or the step, drops it before anything is added to it, and a zeroed one leaves a zero fp32
   gradient, as torch does. ``model.zero_grad()`` clears whichever side the model shows, and the same check covers
   the masters. The step, finding the stand-in intact, puts the twin's gradient in its place. So a step uses the
   gradients of the backwards since the last discard, as in fp32, and an inf in a discarded backward skips no step.
   Between a backward and the step, an optimizer's parameters therefore show the empty stand-in, not None, as
   their ``.grad`` (so does the model where it shows the masters in between: after an evaluation forward, or a
   manual training step that did not step); the step and :meth:`O2Policy.teardown` remove it.
5. Edits are never lost. A master whose version counter moved since its twin was written (``load_state_dict``,
   StochasticWeightAveraging or an EMA callback writing fp32 weights between steps) is written into its twin at the
   next forward. A twin edited in place while it is in the slots (a weight changed inside ``training_step``) is
   copied into its master when the masters come back, or at the next forward's entry where that comes first, element
   by element: where the twin still equals the master rounded to half, the master keeps its extra bits, so swapping
   weights out and back in loses nothing.
   ``state_dict()`` gives the masters' fp32 values also while the twins are in the slots, and ``load_state_dict``
   writes fp32 values into the masters exactly. Writes through ``.data`` move no version counter; Lightning's
   ``WeightAveraging`` swaps the average in and out that way around validation, so the first forward without
   gradients (validation, test, predict) after one with them, and the reverse, write every master into its twin;
   except from a forward with gradients to the start of its backward, where that graph saved the twins (a write
   would fail the backward) and no master can have changed (nothing stepped them): a forward without gradients
   there (a metric or pseudo-label pass) computes with the twins as they are and writes only masters edited since.
   ``requires_grad`` set on either side since the last forward (``BackboneFinetuning`` freezes and unfreezes
   whichever the model shows) is mirrored at the outermost forward's entry and at an exit that puts the masters
   back; inside a step, where ``toggle_optimizer`` sets it on the masters the optimizer holds, the backward context
   keeps gradients from the twins whose masters do not require them.
6. The Trainer and Fabric move the model to its device after ``convert_module``, while it holds the twins: the
   masters follow at ``connect`` and at the first forward (same parameter objects, new storage). ``teardown``
   (after fit, and after a failed fit) puts the masters back for good, removes every hook and forgets the model: the
   model is the fp32 model it was, with the same parameter objects. The ``keep_fp32`` subtrees run in fp32 regions
   (:mod:`lightning_mp.overrides`) whose hooks are attached here once and removed there.

Memory with AdamW, per parameter: between steps 2 bytes of half weight, 4 of master and 8 of moments (fp32 and O1
keep 16, with their gradients); during backward 2 more of half gradient, at the step 4 of fp32 gradient. The host
work is a few Python calls per step, whatever the size of the model, and no more than O1's: the forward and
backward contexts are built once, and the step's pass over the pairs is written out in ``prepare_step``.

Under ``torch.compile`` of a whole model after ``fabric.setup`` the forward context is traced, and the slots cannot
change inside a graph: that model computes with its masters under autocast, as in O1.

.. warning:: The fp16 range check reads values back to the host (a synchronisation on CUDA): once at setup and once
    after each skipped step. Clean steps are not checked; a weight that outgrows fp16 makes its twin inf, the
    gradients non-finite and the step skipped, and that skip names it.

Private names: :mod:`lightning_mp._private_names` lists them, with the reason for each.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Collection, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mp.overrides import Fp32Overrides, Fp32Region, has_fp32_region, outermost
from lightning_mp.policies.base import PrecisionPolicy
from lightning_mp.policies.casting import check_half_dtype, is_normalization, keep_tied_weights_together


class HalfOverflowError(RuntimeError):
    """fp32 weights beyond the half type's range: their half twins would be inf, and every step would be skipped.

    Args:
        names: qualified names of the parameters.
        largest: the largest magnitude found in each.
        dtype: the half type.

    """

    def __init__(self, names: Sequence[str], largest: Sequence[float], dtype: torch.dtype) -> None:
        self.names = list(names)
        limit = torch.finfo(dtype).max
        shown = ", ".join(f"{name} (max |w| = {value:.4g})" for name, value in zip(names, largest, strict=True))
        super().__init__(
            f"lightning_mp O2: weights beyond {dtype}'s largest value {limit:g} cannot be copied to {dtype} without"
            f" becoming inf: {shown}. Train in bf16 (precision='bf16-mixed'), which has fp32's range, keep these"
            " modules in fp32 (keep_fp32=[...]), or bring the weights into range (weight decay, a smaller init)."
        )


def computes_weights_in_fp32(module: nn.Module) -> set[nn.Module]:
    """The modules under ``module`` whose forward needs their fp32 parameters themselves, not half twins.

    Reparametrized weights (their parametrization subtree, or a module with an older ``spectral_norm`` or
    ``weight_norm`` hook) and sparse embeddings: the module docstring, point 1, says why.
    """
    found: set[nn.Module] = set()
    for child in module.modules():
        parametrizations = getattr(child, "parametrizations", None) if parametrize.is_parametrized(child) else None
        if isinstance(parametrizations, nn.Module):
            found.update(parametrizations.modules())
        sparse_embedding = isinstance(child, (nn.Embedding, nn.EmbeddingBag)) and child.sparse
        if _has_legacy_norm_hook(child) or sparse_embedding:
            found.add(child)
    return found


def _has_legacy_norm_hook(module: nn.Module) -> bool:
    """Whether ``module`` has an older ``nn.utils.weight_norm`` or ``nn.utils.spectral_norm`` hook.

    Told by what the two leave on the module, in public view (nn.Module has no public way to list its hooks): the
    weight ``name`` turns into a plain tensor attribute, neither parameter nor buffer, which the hook recomputes at
    each forward from the parameters ``{name}_g`` and ``{name}_v`` (weight norm), or from the parameter
    ``{name}_orig`` and the buffers ``{name}_u`` and ``{name}_v`` (spectral norm).
    """
    parameters = {name for name, _ in module.named_parameters(recurse=False)}
    buffers = {name for name, _ in module.named_buffers(recurse=False)}
    for name, value in vars(module).items():
        if not isinstance(value, Tensor) or isinstance(value, nn.Parameter):
            continue
        g, v, orig, u = (f"{name}_{suffix}" for suffix in ("g", "v", "orig", "u"))
        if {g, v} <= parameters or (orig in parameters and {u, v} <= buffers):
            return True
    return False


def overflowing_weights(named: Sequence[tuple[str, Tensor]], dtype: torch.dtype) -> tuple[list[str], list[float]]:
    """The names and largest magnitudes of the tensors whose values exceed ``dtype``'s range.

    .. warning:: Reads one value per call back to the host (a synchronisation on CUDA). O2 calls it at setup and
        after a skipped step only.
    """
    if not named:
        return [], []
    largest = torch.stack([tensor.detach().abs().amax().float() for _, tensor in named]).tolist()
    limit = torch.finfo(dtype).max
    hits = [(name, value) for (name, _), value in zip(named, largest, strict=True) if value > limit]
    return [name for name, _ in hits], [value for _, value in hits]


class MasterWeights:
    """fp32 masters and the half twins that take their place in the model's slots while it computes.

    Each pair is a master (the model's original fp32 parameter) and its twin (a half ``nn.Parameter``), with every
    ``(module, name)`` slot that holds it and every qualified name it has in the model. The module docstring says
    when values, gradients and ``requires_grad`` move between the two.

    Args:
        dtype: the half type.

    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.names: list[str] = []
        self.masters: list[nn.Parameter] = []
        self.twins: list[nn.Parameter] = []
        self.slots: list[list[tuple[nn.Module, str]]] = []
        self.keys: list[list[str]] = []
        """Per pair, its qualified names in the converted model (a tied parameter has several)."""
        self.twins_in_slots = False
        self._no_grad = torch.no_grad()
        self.twin_versions: list[int] = []
        """The twins' versions when they were last written: a twin whose version moved was edited in the slots."""
        self._master_versions: list[int] = []
        """The masters' versions when their twins were last written: a master whose version moved has changed."""
        self._requires_grad: list[bool] = []
        self._aliases: list[Tensor] = []
        """A detached alias of each twin, made once: it shares the twin's storage and version counter, and writing
        through it needs no ``torch.no_grad()`` context (five Python calls at every step) and no op to make it."""
        self._index_of: dict[int, int] = {}
        """``id`` of a master or a twin -> its pair's index."""
        self.markers: list[Tensor] = []
        """Per pair, an empty sparse fp32 tensor of its master's shape: the master's ``.grad`` while its twin's
        gradient waits for the step, so that a ``zero_grad`` of the master is seen (module docstring, point 4)."""
        self.marks: list[Tensor | None] = []
        """Per pair, the master's ``.grad`` when the last backward began (a marker or a real gradient), or None."""
        self.mark_versions: list[int] = []
        """The version of each mark when it was taken: ``zero_grad(set_to_none=False)`` moves it."""

    def add(self, master: nn.Parameter, slots: list[tuple[nn.Module, str]], keys: list[str]) -> int:
        """Make a half twin of ``master`` (one cast) for the ``slots`` that hold it; return the pair's index."""
        with torch.no_grad():
            twin = nn.Parameter(master.detach().to(self.dtype), requires_grad=master.requires_grad)
        index = len(self.masters)
        self.names.append(keys[0])
        self.masters.append(master)
        self.twins.append(twin)
        self.slots.append(slots)
        self.keys.append(keys)
        self.twin_versions.append(twin._version)
        self._master_versions.append(master._version)
        self._requires_grad.append(master.requires_grad)
        self._aliases.append(twin.detach())
        self._index_of[id(master)] = self._index_of[id(twin)] = index
        self.markers.append(_empty_gradient(master))
        self.marks.append(None)
        self.mark_versions.append(0)
        if self.twins_in_slots:
            for module, name in slots:
                module._parameters[name] = twin
        return index

    def follow_devices(self) -> None:
        """Move each master (and its gradient) to its twin's device; the masters stay the same parameter objects.

        The Trainer and Fabric move the model after ``convert_module``, while it holds the twins.
        """
        with self._no_grad:
            for i, (master, twin) in enumerate(zip(self.masters, self.twins, strict=True)):
                if master.device != twin.device:
                    grad, mark = master.grad, self.marks[i]
                    intact = mark is not None and grad is mark and mark._version == self.mark_versions[i]
                    old_marker = self.markers[i]
                    master.data = master.data.to(twin.device)
                    self.markers[i] = _empty_gradient(master)
                    if grad is old_marker:
                        master.grad = self.markers[i]
                    elif grad is not None:
                        master.grad = grad.to(twin.device)
                    moved = master.grad
                    if intact and moved is not None:
                        self.marks[i] = moved
                        self.mark_versions[i] = moved._version

    def master_of(self, parameter: Tensor) -> Tensor:
        """The master of a twin; any other tensor (a master, a parameter without twin) as it is."""
        index = self._index_of.get(id(parameter))
        return parameter if index is None else self.masters[index]

    def indices(self, parameters: Sequence[Tensor]) -> list[int]:
        """The pair index of each of ``parameters`` that has one."""
        return [index for p in parameters if (index := self._index_of.get(id(p))) is not None]

    def take_edit(self, i: int) -> None:
        """Copy what was written into twin ``i`` since it was last written into its master, element by element.

        Where the twin still equals its master rounded to half, the master keeps its value: writing back what was
        there (an EMA swap, a ``load_state_dict`` of the same values) loses no precision.
        """
        master, twin = self.masters[i], self.twins[i]
        with self._no_grad:
            master.copy_(torch.where(twin == master.to(self.dtype), master, twin.to(master.dtype)))
        self.twin_versions[i] = twin._version
        self._master_versions[i] = master._version

    def show_masters(self, mirror: bool = True, show: bool = True) -> None:
        """Put the masters back into the slots, after taking the edits of the twins into them (:meth:`take_edit`).

        ``show=False`` only takes the edits (and mirrors ``requires_grad`` if asked). One method, not three, because
        it runs at the end of every evaluation forward (module docstring, point 3).
        """
        versions = self.twin_versions
        recorded = self._requires_grad
        for i, (master, twin) in enumerate(zip(self.masters, self.twins, strict=True)):
            if twin._version != versions[i]:
                self.take_edit(i)
            if mirror:
                if twin.requires_grad != recorded[i]:
                    master.requires_grad_(twin.requires_grad)
                elif master.requires_grad != recorded[i]:
                    twin.requires_grad_(master.requires_grad)
                recorded[i] = master.requires_grad
            if show:
                for module, name in self.slots[i]:
                    module._parameters[name] = master
        if show:
            self.twins_in_slots = False

    def push(self, stepped: Collection[int] = (), show: bool = False, mirror: bool = False) -> None:
        """Write the ``stepped`` masters, and every master whose version moved, into their twins: one foreach cast.

        The stepped ones are named because fused optimizer kernels write the parameters without moving their
        version counters.
        ``show`` also puts the twins into the slots, and ``mirror`` gives both sides of a pair the ``requires_grad``
        that one of them was set to since the last mirror (at the edges of a step, not inside it: module docstring).
        """
        written: list[int] = []
        targets: list[Tensor] = []
        sources: list[Tensor] = []
        versions = self._master_versions
        recorded = self._requires_grad
        aliases = self._aliases
        for i, (master, twin) in enumerate(zip(self.masters, self.twins, strict=True)):
            if master._version != versions[i] or i in stepped:
                written.append(i)
                alias = aliases[i]
                if alias.data_ptr() != twin.data_ptr():  # the model was moved: the twin has new storage
                    alias = aliases[i] = twin.detach()
                targets.append(alias)
                sources.append(master)
                versions[i] = master._version
            if mirror:
                if master.requires_grad != recorded[i]:
                    twin.requires_grad_(master.requires_grad)
                elif twin.requires_grad != recorded[i]:
                    master.requires_grad_(twin.requires_grad)
                recorded[i] = master.requires_grad
            if show:
                for module, name in self.slots[i]:
                    module._parameters[name] = twin
        if targets:
            torch._foreach_copy_(targets, sources)
            for i in written:
                self.twin_versions[i] = self.twins[i]._version
        if show:
            self.twins_in_slots = True

    def substitute_masters(self, state_dict: dict[str, Any], prefix: str, indices: Iterable[int]) -> None:
        """Put the fp32 values of the masters ``indices`` (one model's) in ``state_dict`` where their twins' are."""
        self.show_masters(mirror=False, show=False)
        for i in indices:
            master = self.masters[i]
            for key in self.keys[i]:
                value = state_dict.get(prefix + key)
                if isinstance(value, Tensor):
                    state_dict[prefix + key] = master if isinstance(value, nn.Parameter) else master.detach()

    def load_masters(self, state_dict: dict[str, Any], prefix: str, indices: Iterable[int]) -> None:
        """Write the fp32 values of ``state_dict`` into the masters ``indices``, which ``load_state_dict`` rounds."""
        with self._no_grad:
            for i in indices:
                master = self.masters[i]
                value = state_dict.get(prefix + self.keys[i][0])
                if isinstance(value, Tensor) and value.shape == master.shape:
                    master.copy_(value)


class _TwinsInSlots(AbstractContextManager):
    """The forward context: the twins into the slots at the outermost entry (module docstring, point 3).

    The outermost exit of a forward with gradients leaves them there for the backward, and the step shows the
    masters; an evaluation, a failed forward, and a training step that took its optimizer steps inside (manual
    optimization) show them at the exit.
    """

    def __init__(self, policy: O2Policy) -> None:
        self.policy = policy

    def __enter__(self) -> None:
        policy = self.policy
        weights = policy.weights
        if weights is None:
            return
        policy.forward_depth += 1
        if policy.forward_depth == 1:
            if policy.lazy:
                policy.adopt_materialized_lazy()
            if weights.masters and weights.masters[0].device != weights.twins[0].device:
                weights.follow_devices()
            if weights.twins_in_slots:
                # Left there by a forward with gradients that no step followed yet (gradient accumulation, a loss
                # dropped): what was written into them since is taken before any master is written over it.
                weights.show_masters(mirror=False, show=False)
            # Edits through ``.data`` move no version counter (Lightning's WeightAveraging swaps the average in and
            # out that way around validation): where evaluation starts or ends, every master is written. Not while
            # a training forward's graph waits for its backward: that graph saved the twins, a write would make its
            # backward fail, and no master can have changed since (nothing stepped them).
            evaluating = not torch.is_grad_enabled()
            boundary = evaluating != policy.evaluating and not policy.awaiting_backward
            everything = range(len(weights.masters)) if boundary else ()
            policy.evaluating = evaluating
            if not evaluating:
                policy.awaiting_backward = True
            weights.push(everything, show=True, mirror=True)

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        policy = self.policy
        if policy.forward_depth == 0:
            return
        policy.forward_depth -= 1
        if policy.forward_depth or policy.weights is None:
            return
        # A training step that ran its backward inside (manual optimization) leaves no graph for a later backward:
        # the masters come back whether or not it stepped, as after every step of automatic optimization.
        finished = policy.evaluating or policy.stepped_in_forward or not policy.awaiting_backward
        if finished or exc_type is not None:
            policy.stepped_in_forward = False
            policy.weights.show_masters()


class _HeldGradients(AbstractContextManager):
    """The backward context: the twins in the slots; those whose masters need no gradient get none."""

    def __init__(self, policy: O2Policy, weights: MasterWeights) -> None:
        self.policy = policy
        self.weights = weights
        self.held: list[nn.Parameter] = []

    def __enter__(self) -> None:
        weights = self.weights
        self.policy.awaiting_backward = False
        # The gradients land on the twins: the model shows them, with their gradients, until the step. Nothing is
        # written into them here: backward computes with what the forward saved.
        show = not weights.twins_in_slots
        held = self.held
        markers, marks, versions = weights.markers, weights.marks, weights.mark_versions
        for i, (master, twin, slots) in enumerate(zip(weights.masters, weights.twins, weights.slots, strict=True)):
            if twin.requires_grad and not master.requires_grad:
                twin.requires_grad_(False)
                held.append(twin)
            if show:
                for module, name in slots:
                    module._parameters[name] = twin
            # A zero_grad since the last backward (the master's .grad is not what that backward left, or was zeroed
            # in place) discards what waits on the twin, before this backward adds to it.
            mark, grad = marks[i], master.grad
            if mark is not None and (grad is not mark or mark._version != versions[i]):
                twin.grad = None
                if grad is markers[i]:  # zeroed in place: a zero gradient, as torch leaves it
                    master.grad = grad = torch.zeros_like(master)
                marks[i] = None
            if twin.requires_grad:
                if grad is None:
                    marker = markers[i]
                    if marker.device != master.device:  # the master was moved since (not by follow_devices)
                        marker = markers[i] = _empty_gradient(master)
                    grad = master.grad = marker
                marks[i] = grad
                versions[i] = grad._version
        weights.twins_in_slots = True

    def __exit__(self, *exc_info: object) -> None:
        for twin in self.held:
            twin.requires_grad_(True)
        self.held.clear()


def _upcast_state(state: dict[str, Any], master: Tensor) -> dict[str, Any]:
    """An optimizer state kept for a twin, made its master's: elementwise half states become fp32, with a warning.

    torch's ``Optimizer.load_state_dict`` casts states to the dtype of the parameter they are loaded for, so a state
    loaded while the optimizer held twins was rounded to half.
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


def _empty_gradient(master: Tensor) -> Tensor:
    """An empty sparse tensor of ``master``'s shape, dtype and device: a ``.grad`` that holds nothing.

    It stands in the master's ``.grad`` from a backward to the step while the gradient waits on the twin. torch's
    ``zero_grad`` then has something to clear: ``set_to_none=True`` removes it, ``set_to_none=False`` zeroes it in
    place (its version moves), and either says that the waiting gradient was discarded. No element, no memory.
    """
    indices = torch.empty((master.dim(), 0), dtype=torch.long, device=master.device)
    values = torch.empty((0,), dtype=master.dtype, device=master.device)
    return torch.sparse_coo_tensor(indices, values, master.shape, check_invariants=True, is_coalesced=True)


def _substitute_masters(
    weights: MasterWeights, indices: list[int], module: nn.Module, state_dict: dict[str, Any], prefix: str, _: Any
) -> None:
    weights.substitute_masters(state_dict, prefix, indices)


def _load_masters(
    weights: MasterWeights, indices: list[int], module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any
) -> None:
    weights.load_masters(state_dict, prefix, indices)


class O2Policy(PrecisionPolicy):
    """Half weights in the model, fp32 masters in the optimizer, fp32 gradients and optimizer states at the step.

    Args:
        half_dtype: ``torch.float16`` or ``torch.bfloat16``.
        keep_fp32: module types, qualified names or ``re:`` patterns whose modules compute in fp32.

    Raises:
        ValueError: if ``half_dtype`` is not a half type, or a ``keep_fp32`` entry is invalid.

    """

    opt_level = "O2"
    uses_autocast = True

    def __init__(self, half_dtype: torch.dtype | None, keep_fp32: Sequence[type | str] = ()) -> None:
        super().__init__(check_half_dtype(type(self).__name__, half_dtype), keep_fp32)
        self.overrides = Fp32Overrides(self.keep_fp32)
        self.weights: MasterWeights | None = None
        """The masters and their twins, from ``convert_module`` until ``teardown``."""
        self.lazy: list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]], list[int]]] = []
        """Lazy parameters waiting for their first forward: name, parameter, slots and their model's pair indices."""
        self._adopted: dict[int, int] = {}
        """Per optimizer (by ``id``), how many parameter groups ``connect`` has pointed at the masters."""
        self._stepped: dict[int, set[int]] = {}
        """Per optimizer (by ``id``), the pairs its coming step writes: their twins are rewritten after it."""
        self.forward_depth = 0
        self.evaluating = False
        """Whether the last outermost forward ran without gradients (validation, test, predict)."""
        self.stepped_in_forward = False
        """Whether an optimizer stepped inside the current forward context (manual optimization's training step)."""
        self.awaiting_backward = False
        """Whether a forward with gradients ran since the last backward began and the last step: its graph may hold
        the twins, saved for that backward."""
        # Built once: a forward and a backward then cost two Python calls each (the host overhead O2 must not add).
        self._twins_in_slots = _TwinsInSlots(self)
        self._held_gradients: _HeldGradients | None = None

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Give every chosen fp32 parameter a half twin and put the twins in the slots, before DDP wraps the model.

        Raises:
            HalfOverflowError: in fp16, if a chosen weight is beyond fp16's range.

        """
        assert self.half_dtype is not None
        overrides = keep_tied_weights_together(module, self.overrides)
        in_fp32 = overrides.kept_modules(module) | computes_weights_in_fp32(module)
        chosen: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str]], list[str]]] = {}
        held_in_fp32: dict[int, str] = {}  # id of each parameter a module computing in fp32 holds -> its name there
        for module_name, child in module.named_modules(remove_duplicate=False):
            prefix = f"{module_name}." if module_name else ""
            if child in in_fp32 or is_normalization(child) or isinstance(child, nn.RNNBase):
                for name, parameter in child._parameters.items():
                    if parameter is not None:
                        held_in_fp32.setdefault(id(parameter), prefix + name)
                continue
            for name, parameter in child._parameters.items():
                if parameter is None or parameter.dtype != torch.float32:
                    continue
                _, slots, keys = chosen.setdefault(id(parameter), (parameter, [], []))
                if (child, name) not in slots:
                    slots.append((child, name))
                keys.append(prefix + name)
        for tied in chosen.keys() & held_in_fp32.keys():
            _, _, keys = chosen.pop(tied)
            rank_zero_warn(
                f"lightning_mp O2: {', '.join(repr(key) for key in keys)} stays an fp32 weight without a half copy: it"
                f" is tied to {held_in_fp32[tied]!r}, whose module computes with its fp32 weight, and tied weights are"
                " one tensor, in one dtype. Its modules compute with it under autocast, as in O1."
            )
        materialized = [entry for entry in chosen.values() if not isinstance(entry[0], nn.UninitializedParameter)]
        self._check_range([(keys[0], master) for master, _, keys in materialized])
        # One MasterWeights for every model this run converts (Fabric sets up a GAN's two models one by one); each
        # model's state-dict hooks know its own pairs, whose names may repeat in another model.
        if self.weights is None:
            self.weights = MasterWeights(self.half_dtype)
            self._held_gradients = _HeldGradients(self, self.weights)
        weights = self.weights
        indices = [weights.add(master, slots, keys) for master, slots, keys in materialized]
        weights.push(show=True, mirror=True)
        self.lazy += [
            (keys[0], master, slots, indices)
            for master, slots, keys in chosen.values()
            if isinstance(master, nn.UninitializedParameter)
        ]
        # Partials, not bound methods: torch marks the hooks its public API registers with an attribute.
        substitute = functools.partial(_substitute_masters, weights, indices)
        self.hook_handles.append(module.register_state_dict_post_hook(substitute))
        self.hook_handles.append(
            module.register_load_state_dict_pre_hook(functools.partial(_load_masters, weights, indices))
        )
        for root in [module.get_submodule(name) for name in outermost(overrides.match(module))]:
            if not has_fp32_region(root):  # a region the user attached is the user's to keep
                self.hook_handles += Fp32Region().attach(root)
        return module

    @override
    def connect(self, module: nn.Module, optimizers: list[Optimizer]) -> list[Optimizer]:
        """Point each optimizer's ``param_groups`` (and any state it holds) at the masters instead of the twins.

        The masters move first to the device the model was moved to since ``convert_module``.
        """
        optimizers = super().connect(module, optimizers)
        weights = self.weights
        if weights is not None:
            weights.follow_devices()
        for optimizer in optimizers:
            self._adopt(optimizer)
        # The model was moved and wrapped (DDP holds the twins): from here to the first training forward it shows
        # the masters the optimizers hold, so that callbacks match the two by identity (module docstring, point 2).
        if weights is not None and self.forward_depth == 0 and not self.awaiting_backward:
            weights.show_masters()
        return optimizers

    @override
    def parameter_names(self, module: nn.Module) -> dict[int, str]:
        """``id -> name`` of the masters the optimizers step, and of every other parameter of ``module``."""
        names = super().parameter_names(module)
        if self.weights is not None:
            names.update(
                {id(master): name for master, name in zip(self.weights.masters, self.weights.names, strict=True)}
            )
        return names

    @override
    def forward_context(self) -> AbstractContextManager:
        """The twins in the model's slots for the duration of the (outermost) forward context."""
        return self._twins_in_slots

    @override
    def backward_context(self) -> AbstractContextManager:
        """Keep gradients from the twins whose masters do not require them (``toggle_optimizer`` inside the step)."""
        return self._held_gradients if self._held_gradients is not None else super().backward_context()

    @override
    def prepare_step(self, optimizer: Optimizer) -> None:
        """Show the masters in the model and move the twins' gradients into them, in fp32, before the scaler.

        One pass over the pairs takes the twins' edits, shows the masters and moves the gradients. It is written here
        rather than through :meth:`MasterWeights.show_masters` because it runs at every step, where each method
        call is a Python call more than O1's step makes (O2's budget is O1's); unlike that method it mirrors no
        ``requires_grad``, which ``toggle_optimizer`` may have set on the masters for this step only.
        """
        weights = self.weights
        if weights is None:
            return
        if self._adopted.get(id(optimizer)) != len(optimizer.param_groups):
            self._adopt(optimizer)
        if id(optimizer) not in self._stepped:
            self._stepped[id(optimizer)] = set(
                weights.indices([p for group in optimizer.param_groups for p in group["params"]])
            )
        show = weights.twins_in_slots
        versions = weights.twin_versions
        markers, marks, mark_versions = weights.markers, weights.marks, weights.mark_versions
        for i, (master, twin, slots) in enumerate(zip(weights.masters, weights.twins, weights.slots, strict=True)):
            if twin._version != versions[i]:
                weights.take_edit(i)
            if show:
                for module, name in slots:
                    module._parameters[name] = master
            # Every pair, not only those this optimizer steps: the model shows the masters from here on, with the
            # gradients in fp32, as in fp32 training (another optimizer's, a parameter no optimizer holds).
            gradient = twin.grad
            mark = marks[i]
            if mark is not None:
                marks[i] = None
                grad = master.grad
                if grad is not mark or mark._version != mark_versions[i]:
                    # A zero_grad since the last backward discarded what waits on the twin.
                    twin.grad = gradient = None
                    if grad is markers[i]:  # zeroed in place: a zero gradient, as torch leaves it
                        master.grad = torch.zeros_like(master)
                elif grad is markers[i]:
                    master.grad = None
            if gradient is None:
                continue
            # The twin's half gradient moves into its master's .grad in fp32, added to one already there.
            if master.grad is None:
                master.grad = gradient.to(master.dtype)
            else:
                master.grad.add_(gradient)
            twin.grad = None
        weights.twins_in_slots = False
        self.awaiting_backward = False

    @override
    def after_optimizer_step(self, optimizer: Optimizer, skipped: bool) -> None:
        """Write the stepped masters into their twins (one foreach cast) and free their fp32 gradients.

        The fp32 gradients live from :meth:`prepare_step` to here: between steps O2 keeps 2 bytes of half weight,
        4 of master and the optimizer's states per parameter, and no gradient. After a skip, weights beyond fp16's
        range are named. Inside a forward context (manual optimization's ``training_step``) the twins go back into
        the slots, so that a later forward in the same step computes in half with the new weights, and the masters
        come back at that context's exit.

        Raises:
            HalfOverflowError: if the step was skipped because a weight's fp16 twin was inf.

        """
        weights = self.weights
        if weights is None:
            return
        # A step the host saw skipped changed no master; one skipped on the device is written again, unchanged.
        stepped = () if skipped is True else self._stepped.get(id(optimizer), ())
        inside_forward = self.forward_depth > 0
        weights.push(stepped, show=inside_forward)
        self.stepped_in_forward |= inside_forward
        for i in stepped:
            weights.masters[i].grad = None
        if skipped:
            self._check_range([(name, master) for name, master in zip(weights.names, weights.masters, strict=True)])

    @override
    def teardown(self) -> None:
        """Put the masters back for good, remove the hooks and forget the model."""
        weights = self.weights
        if weights is not None:
            weights.show_masters()
            for master, marker in zip(weights.masters, weights.markers, strict=True):
                if master.grad is marker:
                    master.grad = None
        super().teardown()
        self.weights = None
        self._held_gradients = None
        self.lazy = []
        self._adopted = {}
        self._stepped = {}
        self.forward_depth = 0
        self.evaluating = False
        self.stepped_in_forward = False
        self.awaiting_backward = False

    def _adopt(self, optimizer: Optimizer) -> None:
        """Point ``optimizer``'s groups at the masters of the twins they hold; move the twins' state to them."""
        assert self.weights is not None
        master_of = self.weights.master_of
        entries: dict[int, int] = {}  # id of each master the groups hold -> id of the entry that holds it first
        for index, group in enumerate(optimizer.param_groups):
            for position, parameter in enumerate(group["params"]):
                master = master_of(parameter)
                if entries.setdefault(id(master), id(parameter)) != id(parameter):
                    name = self.weights.names[self.weights.indices([master])[0]]
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
        self._adopted[id(optimizer)] = len(optimizer.param_groups)
        self._stepped.pop(id(optimizer), None)

    def adopt_materialized_lazy(self) -> None:
        """Give the lazy parameters that their first forward materialised a twin."""
        assert self.weights is not None
        waiting: list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]], list[int]]] = []
        for name, parameter, slots, indices in self.lazy:
            if isinstance(parameter, nn.UninitializedParameter):
                waiting.append((name, parameter, slots, indices))
                continue
            self._check_range([(name, parameter)])
            indices.append(self.weights.add(parameter, slots, [name]))
            self._stepped.clear()
        self.lazy = waiting

    def _check_range(self, named: Sequence[tuple[str, Tensor]]) -> None:
        if self.half_dtype != torch.float16:
            return
        names, largest = overflowing_weights(named, torch.float16)
        if names:
            raise HalfOverflowError(names, largest, torch.float16)


__all__ = ["HalfOverflowError", "MasterWeights", "O2Policy"]
