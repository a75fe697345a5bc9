"""O2: the model keeps its fp32 weights; half copies of them exist only for the forward and backward pass.

The module's own parameters stay fp32 and are the master weights: the optimizer, ``param_groups``,
``add_param_group``, callbacks (BackboneFinetuning, StochasticWeightAveraging, EMA), ``grad_norm``,
``load_state_dict`` and checkpoints all see the real fp32 parameters, at any time. What changes is what the forward
computes with, as in FSDP's mixed precision without sharding:

1. ``convert_module`` only records which parameters compute in half: the fp32 parameters of every module except
   normalisation layers (BatchNorm, LayerNorm, GroupNorm, InstanceNorm, RMSNorm and any class whose name ends in
   ``Norm``), the subtrees that ``keep_fp32`` matches, and layers whose forward needs the fp32 parameter itself
   (autocast casts their weights per use instead, as in O1):

   - recurrent layers: their forward reads a cached list of their weights, not the module's slots;
   - reparametrized weights (``torch.nn.utils.parametrize``: ``parametrizations.spectral_norm``, ``weight_norm``,
     ``orthogonal``; and the older ``nn.utils.spectral_norm``/``weight_norm`` hooks): the parametrization runs on
     the original parameter and may keep fp32 state that it updates in place (spectral norm's power-iteration
     vectors), so it computes in fp32 and autocast casts the weight it produces;
   - sparse embeddings (``Embedding``/``EmbeddingBag`` with ``sparse=True``): the backward of a cast cannot carry a
     sparse gradient, and a half copy of a whole table would read every row for the few a batch looks up.

   Lazy parameters (``nn.LazyLinear``) are recorded too, and compute in fp32 until their first forward
   materialises them; every later forward uses half copies. Nothing is cast; the only hooks attached are the
   ``keep_fp32`` fp32 regions (point 5). Parameters of other dtypes (fp64) and every buffer keep their dtype. In
   fp16 a weight beyond fp16's range (65504) is refused by name here already (a lazy one after its first skip).
2. On entering the forward context (training, validation, test and predict steps, and Fabric's module forward),
   one pass over those parameters casts each to the half type (a tied parameter once for all its uses), and the
   half copy takes the parameter's place in its module (``module._parameters[name]``). The cast is differentiable:
   in backward, autograd carries each half gradient through the cast and accumulates it, in fp32, into the real
   parameter's ``.grad``. DDP's reducer hooks on the fp32 parameters therefore fire as usual. The pass costs one
   ``_to_copy`` per parameter forward and one backward, the casts autocast makes per use in O1, and no Python call
   per parameter. A single flat cast (concatenate, cast, split) would dispatch more ops, briefly need an fp32 copy
   of every weight, and tie all copies to one storage, so that none is freed before the last.
3. On leaving the context, also on an exception, the real parameters go back in place, and the half copies are
   freed: autograd does not keep them for backward. While the context is open, a saved-tensor hook
   (``torch.autograd.graph.saved_tensors_hooks``) replaces every half copy that an op saves for backward (a
   matrix product saves its weight, or a transposed view of it) by a note of its fp32 parameter, the parameter's
   version and the view's geometry; backward casts the parameter again when it needs the weight. The copies
   therefore exist only while the forward runs, and backward holds one weight copy at a time, not all of them:
   at the start of backward, where training's memory peaks, that is 2 bytes per parameter less, for one extra
   cast per weight in backward (the forward made the same cast once). Activations, and a copy the forward edited
   in place (it no longer equals a recast), are saved as usual. A
   parameter changed in place between the forward and its backward (an optimizer step, a weight edit) would make
   the recast differ from what the forward computed with; the backward then raises, naming the parameter, as torch
   raises in fp32 for a saved tensor modified in place.
4. ``torch.autocast`` stays on in the half type around the forward, as a safety net for what is not a parameter:
   fp32 inputs of matrix products are cast to half, losses and softmax-like reductions run in fp32 (so the scaled
   loss is fp32), and normalisation layers compute in fp32 (CUDA autocast upcasts them; on the CPU their kernels
   take half inputs with fp32 weights and accumulate in fp32), handing half outputs on. Because the weights are
   already half, autocast casts no weight; because embeddings are half, the residual stream and the activations
   saved for backward are half too, which is where O2 saves memory over O1.
5. ``keep_fp32`` subtrees keep fp32 weights and run in fp32 regions (:mod:`lightning_mp.overrides`), whose hooks
   ``convert_module`` attaches once and ``teardown`` removes: after fit, or after a failed fit (the Trainer tears
   the plugin down either way), the model is exactly the fp32 model it was, with no hook left behind. Attaching
   them per forward instead would put ``register_forward_pre_hook`` inside the forward context, which a model
   compiled after ``fabric.setup`` traces: dynamo cannot trace registering a hook and breaks the graph there.
   Between forwards the hooks change nothing that matters: the fp32 subtree gets fp32 inputs with autocast off, as
   it would in the context.

A fresh half copy is made for every forward, gradient-accumulation micro-batches included: the cast is one read of
the weights against a forward that reads them once per token, and reusing copies across backward passes would need
the autograd graph of the cast kept alive and the copies invalidated whenever a callback edits a weight. In manual
optimization the fp32 parameters go back in place after each ``manual_backward``, so that ``on_after_backward``
and the rest of ``training_step`` read their ``.grad`` (``clip_grad_norm_(self.parameters())``, gradient logging);
later forwards in the same step then compute as in O1, autocast casting each weight per use. Where a step comes
before any backward, it recasts the copies of the parameters it stepped, so a second forward sees the new weights;
the other copies keep their autograd edges, so that ``toggle_optimizer`` around the step leaves the next
optimizer's parameters trainable.

Loss scaling and skipping are O1's: the gradients the scaler unscales and checks are the fp32 parameters' own, so
foreach and fused optimizers work unchanged. A skipped fp16 step is also checked for weights beyond fp16's range
(whose half copies are inf), and :class:`HalfOverflowError` names them. The optimizer holds 4 bytes of weight, 4 of
gradient and its states per parameter, as in fp32; the half copies (2 bytes per parameter) exist only during the
step.

.. warning:: The fp16 range check reads values back to the host (a synchronisation on CUDA): once at setup and once
    after each skipped step. Clean steps are not checked and make no extra synchronisation; a weight that outgrows
    fp16 makes its copy inf, the gradients non-finite and the step skipped, and that skip names it.

Private names: :mod:`lightning_mp._private_names` lists them, with the reason for each.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from types import TracebackType

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mp.overrides import Fp32Overrides, Fp32Region, has_fp32_region, outermost
from lightning_mp.policies.base import PrecisionPolicy
from lightning_mp.policies.casting import check_half_dtype, is_normalization

_LEGACY_REPARAMETRIZATIONS = (SpectralNorm, WeightNorm)


class HalfOverflowError(RuntimeError):
    """fp32 weights beyond the half type's range: their half copies would be inf, and every step would be skipped.

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
    """The modules under ``module`` whose forward needs their fp32 parameters themselves, not half copies.

    Reparametrized weights (their parametrization subtree, or a module with an older ``spectral_norm`` or
    ``weight_norm`` hook) and sparse embeddings: the module docstring, point 1, says why.
    """
    found: set[nn.Module] = set()
    for child in module.modules():
        parametrizations = getattr(child, "parametrizations", None) if parametrize.is_parametrized(child) else None
        if isinstance(parametrizations, nn.Module):
            found.update(parametrizations.modules())
        legacy_hook = any(isinstance(hook, _LEGACY_REPARAMETRIZATIONS) for hook in child._forward_pre_hooks.values())
        sparse_embedding = isinstance(child, (nn.Embedding, nn.EmbeddingBag)) and child.sparse
        if legacy_hook or sparse_embedding:
            found.add(child)
    return found


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


class SavedWeight:
    """A half copy that an op saved for backward, kept as its fp32 parameter and recast when backward needs it.

    Args:
        parameter: the fp32 parameter the copy was cast from.
        name: its qualified name, for the error message.
        dtype: the half type.
        view: ``(size, stride, storage_offset)`` of the saved tensor within the copy (a transposed weight, say).

    """

    __slots__ = ("dtype", "name", "parameter", "version", "view")

    def __init__(self, parameter: Tensor, name: str, dtype: torch.dtype, view: tuple[torch.Size, tuple[int, ...], int]):
        self.parameter = parameter
        self.name = name
        self.dtype = dtype
        self.view = view
        self.version = parameter._version

    def recast(self) -> Tensor:
        """The saved tensor again: the parameter cast to half, viewed as the op saw it.

        Raises:
            RuntimeError: if the parameter was changed in place since the forward.

        """
        if self.parameter._version != self.version:
            raise RuntimeError(
                f"lightning_mp O2: the fp32 weight {self.name!r} was modified in place (an optimizer step or an"
                " in-place edit) after the forward that computed with it and before that forward's backward. The"
                " gradients would be computed with weights the forward did not use; torch raises the same error in"
                " fp32 for a saved tensor modified in place. Run backward before stepping or editing the weights."
            )
        copy = self.parameter.to(self.dtype)
        size, stride, offset = self.view
        if copy.size() == size and copy.stride() == stride and offset == 0:
            return copy
        return copy.as_strided(size, stride, offset)


def _swappable(parameter: Tensor) -> bool:
    """An fp32 parameter with values: a lazy one stays in place until its module's first forward materialises it."""
    # isinstance, not torch's is_lazy: dynamo traces it in a model compiled after fabric.setup, without a graph break.
    return parameter.dtype == torch.float32 and not isinstance(parameter, nn.UninitializedParameter)


def _unpack(saved: Tensor | SavedWeight) -> Tensor:
    return saved.recast() if isinstance(saved, SavedWeight) else saved


class HalfWeights(AbstractContextManager):
    """Context manager that puts differentiable half copies in place of chosen fp32 parameters, then restores them.

    While it is open, the copies that ops save for backward are saved as their fp32 parameters instead and recast in
    backward (:class:`SavedWeight`), so that no copy outlives the forward. Re-entrant: a nested ``with`` (a forward
    context inside another) changes nothing. :meth:`refresh` recasts the copies while the context is open, after
    the weights changed.

    Args:
        slots: ``(module, parameter name)`` of every parameter to replace; a parameter shared by several slots is
            cast once.
        dtype: the half type.
        names: qualified name of each parameter by ``id``, for error messages.
        recast_in_backward: save the parameter, not its copy, for backward (the default); ``False`` keeps the
            copies saved until backward frees them, as autocast does.

    """

    def __init__(
        self,
        slots: Sequence[tuple[nn.Module, str]],
        dtype: torch.dtype,
        names: Mapping[int, str] | None = None,
        recast_in_backward: bool = True,
    ):
        self.slots = list(slots)
        self.dtype = dtype
        self.names = dict(names or {})
        self.recast_in_backward = recast_in_backward
        self._depth = 0
        self._originals: list[nn.Parameter | None] = []
        self._copies: dict[int, tuple[Tensor, nn.Parameter]] = {}
        """Storage address of each live copy -> the copy and its parameter (the copies are alive: slots hold them)."""
        self._saved_hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._recasting = False

    def __enter__(self) -> HalfWeights:
        self._depth += 1
        if self._depth == 1:
            # Inside a compiled region the compiler decides what the graph saves; a hook there would break the graph.
            self._recasting = self.recast_in_backward and not torch.compiler.is_compiling()
            self._swap_in()
            if self._recasting:
                self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
                self._saved_hooks.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._depth -= 1
        if self._depth == 0:
            hooks, self._saved_hooks = self._saved_hooks, None
            if hooks is not None:
                hooks.__exit__(None, None, None)
            if self._originals:
                self._restore()
            if hooks is not None and isinstance(exc, RuntimeError) and "saved tensor hooks" in str(exc):
                raise RuntimeError(
                    "lightning_mp O2 recasts the half weight copies in backward through a saved-tensor hook, and"
                    " torch.func transforms (grad, vjp, jacrev, hessian) refuse to run under one. Pass"
                    " MixedPrecision(..., opt_level='O2', recast_in_backward=False) to keep the copies saved instead."
                ) from exc

    def step_out(self) -> None:
        """Put the fp32 parameters back in place for the rest of the open context (a no-op when closed).

        Later forwards in the context compute as in O1: autocast casts the fp32 weights per use.
        """
        if self._depth > 0 and self._originals:
            self._restore()

    def refresh(self, stepped: Iterable[Tensor]) -> None:
        """Recast the copies of the ``stepped`` parameters from their new fp32 values, if the context is open.

        The other copies, and their autograd edges, stay: a copy is differentiable only if its parameter required
        gradients when it was cast, and ``toggle_optimizer`` switches the other optimizers' parameters off around a
        step; recast then, their copies would keep them out of the next optimizer's backward for good.
        """
        if self._depth == 0 or not self._originals:
            return
        stepped_ids = {id(parameter) for parameter in stepped}
        copies: dict[int, Tensor] = {}
        for (module, name), parameter in zip(self.slots, self._originals, strict=True):
            if parameter is None or id(parameter) not in stepped_ids or not _swappable(parameter):
                continue
            copy = copies.get(id(parameter))
            if copy is None:
                copy = copies[id(parameter)] = self._cast(parameter)
            # The slot holds a plain tensor for the forward: that is the point of the swap (module docstring).
            module._parameters[name] = copy  # type: ignore[assignment]
        live = {id(module._parameters[name]) for module, name in self.slots}
        self._copies = {address: entry for address, entry in self._copies.items() if id(entry[0]) in live}

    def _cast(self, parameter: nn.Parameter) -> Tensor:
        copy = parameter.to(self.dtype)
        if self._recasting and copy.numel():  # an empty tensor has no storage address of its own
            self._copies[copy.untyped_storage().data_ptr()] = (copy, parameter)
        return copy

    def _pack(self, tensor: Tensor) -> Tensor | SavedWeight:
        """What autograd keeps for backward: a copy (or a view of one) becomes a :class:`SavedWeight`."""
        if tensor.dtype != self.dtype or type(tensor) is not Tensor or not self._copies:
            return tensor
        if tensor.layout != torch.strided or tensor.numel() == 0:
            return tensor
        entry = self._copies.get(tensor.untyped_storage().data_ptr())
        if entry is None or tensor._version != 0:  # a copy edited in place no longer equals a recast: keep it
            return tensor
        _, parameter = entry
        view = (tensor.size(), tensor.stride(), int(tensor.storage_offset()))
        return SavedWeight(parameter, self.names.get(id(parameter), "<unnamed>"), self.dtype, view)

    def _swap_in(self) -> None:
        copies: dict[int, Tensor] = {}
        originals = self._originals
        for module, name in self.slots:
            parameter = module._parameters[name]
            originals.append(parameter)
            if parameter is None or not _swappable(parameter):
                continue
            copy = copies.get(id(parameter))
            if copy is None:
                copy = copies[id(parameter)] = self._cast(parameter)
            # A plain tensor in a parameter's slot is the point of the swap (module docstring).
            module._parameters[name] = copy  # type: ignore[assignment]

    def _restore(self) -> None:
        for (module, name), parameter in zip(self.slots, self._originals, strict=True):
            module._parameters[name] = parameter
        self._originals = []
        self._copies = {}


class O2Policy(PrecisionPolicy):
    """fp32 weights, gradients and optimizer states; half copies of the weights for the forward and backward pass.

    Args:
        half_dtype: ``torch.float16`` or ``torch.bfloat16``.
        keep_fp32: module types, qualified names or ``re:`` patterns whose modules compute in fp32.
        recast_in_backward: save the fp32 parameters for backward and recast them there, instead of their half
            copies (module docstring, point 3).

    Raises:
        ValueError: if ``half_dtype`` is not a half type, or a ``keep_fp32`` entry is invalid.

    """

    opt_level = "O2"
    uses_autocast = True

    def __init__(
        self, half_dtype: torch.dtype | None, keep_fp32: Sequence[type | str] = (), recast_in_backward: bool = True
    ) -> None:
        super().__init__(check_half_dtype(type(self).__name__, half_dtype), keep_fp32)
        self.recast_in_backward = recast_in_backward
        self.overrides = Fp32Overrides(self.keep_fp32)
        self._half_weights: HalfWeights | None = None
        self._half_parameters: list[tuple[str, nn.Parameter]] = []

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Choose the parameters that compute in half and attach the ``keep_fp32`` fp32 regions until teardown.

        Raises:
            HalfOverflowError: in fp16, if a chosen weight is beyond fp16's range.

        """
        assert self.half_dtype is not None
        in_fp32 = self.overrides.kept_modules(module) | computes_weights_in_fp32(module)
        slots: list[tuple[nn.Module, str]] = []
        named: dict[int, tuple[str, nn.Parameter]] = {}
        for module_name, child in module.named_modules():
            if child in in_fp32 or is_normalization(child) or isinstance(child, nn.RNNBase):
                continue
            prefix = f"{module_name}." if module_name else ""
            for name, parameter in child.named_parameters(recurse=False):
                if parameter.dtype == torch.float32:
                    slots.append((child, name))
                    named.setdefault(id(parameter), (prefix + name, parameter))
        self._half_parameters = list(named.values())
        self._check_range()
        roots = [module.get_submodule(name) for name in outermost(self.overrides.match(module))]
        for root in roots:
            if not has_fp32_region(root):  # a region the user attached is the user's to keep
                self.hook_handles += Fp32Region().attach(root)
        names = {id(parameter): name for name, parameter in self._half_parameters}
        self._half_weights = HalfWeights(slots, self.half_dtype, names, self.recast_in_backward)
        return module

    @override
    def forward_context(self) -> AbstractContextManager:
        """Half copies of the weights in place for the duration of the forward."""
        return self._half_weights if self._half_weights is not None else super().forward_context()

    @override
    def after_backward(self) -> None:
        """In manual optimization, put the fp32 parameters back, so that their ``.grad`` is what the user reads."""
        if self._half_weights is not None:
            self._half_weights.step_out()

    @override
    def after_optimizer_step(self, optimizer: Optimizer, skipped: bool) -> None:
        """After a skipped fp16 step, name weights beyond fp16's range; after a step inside a forward, recast.

        Raises:
            HalfOverflowError: if the step was skipped because a weight's fp16 copy was inf.

        """
        if skipped:
            self._check_range()
        elif self._half_weights is not None:
            # Manual optimization: a step inside training_step.
            self._half_weights.refresh(p for group in optimizer.param_groups for p in group["params"])

    @override
    def teardown(self) -> None:
        """Remove the fp32 regions' hooks and drop every reference to the model, so that none stays alive."""
        super().teardown()
        self._half_weights = None
        self._half_parameters = []

    def _check_range(self) -> None:
        if self.half_dtype != torch.float16:
            return
        materialized = [
            (name, parameter)
            for name, parameter in self._half_parameters
            if not isinstance(parameter, nn.UninitializedParameter)
        ]
        names, largest = overflowing_weights(materialized, torch.float16)
        if names:
            raise HalfOverflowError(names, largest, torch.float16)


__all__ = ["HalfOverflowError", "HalfWeights", "O2Policy", "SavedWeight"]
