"""Inference export: a half-precision copy of a trained model, and a parity report against the fp32 original.

Deploying in fp16 or bf16 halves the memory of the weights and, on hardware with fast half matrix units, can double
the throughput. ``module.half()`` is the usual way, but it also casts normalisation layers (whose variance is the
first thing to lose precision) and makes the model reject fp32 inputs. :func:`to_inference` instead:

1. deep-copies the model, so the original is untouched, and puts the copy in eval mode without gradients;
2. casts weights and floating buffers to the half type, keeping normalisation layers and ``keep_fp32`` modules in
   fp32 (:func:`~lightning_mp.policies.casting.convert_to_half`, with the normalisation layers O3 would cast kept fp32).
   Tied weights are one tensor with one dtype, so a module tied to a kept one is kept too (with a warning): keeping
   only one side would make the first forward mix fp32 and half;
3. gives every module with half weights a pre-hook that casts its floating inputs to the half type, so the copy takes
   fp32 or half inputs alike. Its outputs are in the half type (fp32 from a ``keep_fp32`` last layer).

:func:`compare` runs both models on one batch and reports:

- the number of non-finite (NaN or inf) outputs of the converted model: any is a parity failure, and makes both
  errors below ``inf`` (a NaN must never look like a small error: ``max`` and torchmetrics' ``MaxMetric`` skip NaN);
- the largest absolute difference between the outputs;
- the largest relative difference, ``max |converted - fp32| / max |fp32|`` (relative to the output's scale, so that
  outputs near zero do not make it meaningless);
- for classifiers, the share of predictions (score vectors over the last dimension: one per sample, or per token)
  whose top-1 class is the same in both. A prediction whose scores hold a NaN or an inf, in either model,
  disagrees: ``argmax`` of a NaN row is meaningless (a broken model that always says class 0 would otherwise agree
  with a classifier that predicts class 0).

Each model runs on its own copy of the batch, so a model that writes into its input (``nn.ELU(inplace=True)`` as the
first layer) changes neither the caller's batch nor what the other model sees.

**An error budget.** ``to_inference(model, dtype, batch=x, max_rel_error=1e-2)`` also measures each layer, and keeps
in fp32 the layers that would break the budget:

1. the fp32 model runs on ``batch`` once, with forward hooks recording every layer's inputs and output (a layer is
   a module with parameters of its own; only its first call is recorded);
2. each layer of the converted copy runs alone on the recorded fp32 inputs (its pre-hook casts them to the half
   type), and its output is compared with the fp32 one: the layer's *own* error, free of its predecessors';
3. the layers whose own relative error exceeds the budget, or whose output is not finite, are kept in fp32;
4. the whole converted model is compared end to end. While that error still exceeds the budget (errors add up over
   layers), the half layer with the largest own error is kept in fp32 too, and the model converted again.

The result is the converted copy with a :class:`ParityTable` as its ``parity`` attribute: the per-layer errors, the
layers kept and why, and the end-to-end :class:`ParityReport`. Without ``batch`` nothing is measured and ``parity``
is None.

Example:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))
    >>> fast = to_inference(model, dtype=torch.bfloat16)
    >>> fast[0].weight.dtype, fast[1].weight.dtype, model[0].weight.dtype
    (torch.bfloat16, torch.float32, torch.float32)
    >>> report = compare(model, fast, torch.randn(32, 8), verbose=False)
    >>> report.max_rel_error < 0.05
    True
    >>> budgeted = to_inference(model, torch.float16, batch=torch.randn(32, 8), max_rel_error=1e-2, verbose=False)
    >>> budgeted.parity.output.max_rel_error <= 1e-2
    True

.. warning::
    :func:`compare` and the error budget read results back to the host (``float(tensor)``), which synchronises with
    the device once per measured quantity.

"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn

from lightning_mp.arguments.checks import check_number
from lightning_mp.overrides import Fp32Overrides, KeepFp32Pattern, cast_low_precision, deepcopy_with_hooks
from lightning_mp.policies.casting import HALF_DTYPES, convert_to_half


def _check_bool(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}({name}={value!r}) is not allowed: {name} must be True or False.")


def _check_batch(owner: str, batch: Any) -> None:
    tensors: list[Tensor] = []
    if isinstance(batch, (Tensor, Sequence, Mapping)) and not isinstance(batch, (str, bytes, bytearray)):
        apply_to_collection(batch, Tensor, tensors.append)
    if not tensors:
        shown = f"{batch!r}"[:60] if isinstance(batch, (str, bytes, bytearray)) else type(batch).__name__
        raise TypeError(
            f"{owner}(batch={shown}) is not allowed: batch must be a tensor, a tuple or list of positional inputs,"
            " or a dict of keyword inputs, holding at least one tensor."
        )


def to_inference(
    model: nn.Module,
    dtype: torch.dtype = torch.bfloat16,
    keep_fp32: Sequence[KeepFp32Pattern] = (),
    keep_normalization_fp32: bool = True,
    batch: Tensor | Sequence[Any] | Mapping[str, Any] | None = None,
    max_rel_error: float | None = None,
    verbose: bool = True,
) -> nn.Module:
    """Return a half-precision copy of ``model`` for inference; the original is left untouched.

    Args:
        model: the trained model (an ``nn.Module`` or a ``LightningModule``).
        dtype: ``torch.bfloat16`` or ``torch.float16``.
        keep_fp32: module types, qualified names or ``re:`` patterns that stay fp32 (see
            :mod:`lightning_mp.overrides`). A module whose weights are tied to a kept one's stays fp32 too, with a
            warning: the shared tensor has one dtype.
        keep_normalization_fp32: keep normalisation layers in fp32, as opt level O2 does.
        batch: a representative input (as :func:`compare` takes it). With it, the copy's ``parity`` attribute holds
            the per-layer :class:`ParityTable`.
        max_rel_error: the error budget, relative to the largest fp32 output (needs ``batch``): layers are kept in
            fp32 until the copy's outputs on ``batch`` are within it (see the module docstring).
        verbose: print the parity table when ``batch`` is given.

    Returns:
        The converted copy, in eval mode, with ``requires_grad`` off. Its forward takes fp32 or half inputs. Its
        ``parity`` attribute is the :class:`ParityTable` when ``batch`` was given, else None.

    Raises:
        TypeError: if ``keep_normalization_fp32`` or ``verbose`` is not a bool, or ``batch`` holds no tensor.
        ValueError: if ``model`` is not a module, ``dtype`` is not a half type, a ``keep_fp32`` entry is invalid, or
            ``max_rel_error`` is not a positive finite number or comes without ``batch``.

    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"to_inference(model={type(model).__name__}) is not allowed: model must be an nn.Module.")
    if not (isinstance(dtype, torch.dtype) and dtype in HALF_DTYPES):
        raise ValueError(
            f"to_inference(dtype={dtype!r}) is not allowed: dtype must be torch.bfloat16 or torch.float16."
        )
    _check_bool("to_inference", "keep_normalization_fp32", keep_normalization_fp32)
    _check_bool("to_inference", "verbose", verbose)
    if max_rel_error is not None:
        try:
            max_rel_error = check_number("to_inference", "max_rel_error", max_rel_error, above=0)
        except ValueError:
            raise ValueError(
                f"to_inference(max_rel_error={max_rel_error!r}) is not allowed: max_rel_error must be None or a"
                " finite number > 0, relative to the largest fp32 output."
            ) from None
    if batch is not None:
        _check_batch("to_inference", batch)
    elif max_rel_error is not None:
        raise ValueError(
            f"to_inference(max_rel_error={max_rel_error!r}, batch=None) is not allowed: an error budget needs a"
            " representative batch to measure it on."
        )
    patterns = Fp32Overrides(keep_fp32).patterns
    converted = _convert(model, dtype, patterns, keep_normalization_fp32)
    if batch is None:
        # nn.Module types __setattr__ for tensors and submodules; any other value becomes a plain attribute.
        converted.parity = None  # type: ignore[assignment]
        return converted
    layer_errors = _layer_errors(model, converted, batch)
    kept: dict[str, str] = {}
    if max_rel_error is not None:
        for name, error in layer_errors.items():
            if error.max_rel_error > max_rel_error:
                kept[name] = "own error over the budget" if error.finite else "non-finite output"
        if kept:
            converted = _convert(model, dtype, [*patterns, *kept], keep_normalization_fp32)
    output = compare(model, converted, batch, verbose=False)
    while max_rel_error is not None and not output.max_rel_error <= max_rel_error:
        remaining = [name for name in layer_errors if name not in kept]
        if not remaining:
            break
        worst = max(remaining, key=lambda name: layer_errors[name].max_rel_error)
        kept[worst] = "largest own error left while the whole output was over the budget"
        converted = _convert(model, dtype, [*patterns, *kept], keep_normalization_fp32)
        output = compare(model, converted, batch, verbose=False)
    rows = tuple(
        dataclasses.replace(error, kept_fp32=name in kept, why_kept=kept.get(name, ""))
        for name, error in layer_errors.items()
    )
    converted.parity = ParityTable(rows, output, max_rel_error)  # type: ignore[assignment]  # as above
    if verbose:
        print(converted.parity)
    return converted


def _convert(
    model: nn.Module, dtype: torch.dtype, keep_fp32: Sequence[KeepFp32Pattern], keep_normalization_fp32: bool
) -> nn.Module:
    converted = deepcopy_with_hooks(model)
    converted.eval()
    converted.requires_grad_(False)
    overrides = Fp32Overrides(keep_fp32)
    convert_to_half(converted, dtype, overrides, keep_normalization_fp32=keep_normalization_fp32, float_outputs=False)
    return converted


@dataclass(frozen=True)
class LayerParity:
    """One layer's own error in the half type: the layer alone, on the fp32 model's inputs to it.

    Attributes:
        name: qualified module name.
        type_name: the module's class name.
        max_abs_error: ``max |half output - fp32 output|`` (``inf`` when the half output is not finite).
        max_rel_error: ``max_abs_error / max |fp32 output|``.
        finite: whether every half output was finite.
        kept_fp32: whether :func:`to_inference` kept the layer in fp32 to meet the budget.
        why_kept: the reason it was kept ("" when it was not).

    """

    name: str
    type_name: str
    max_abs_error: float
    max_rel_error: float
    finite: bool
    kept_fp32: bool = False
    why_kept: str = ""


@dataclass(frozen=True)
class ParityReport:
    """How far a converted model's outputs are from the fp32 model's, on one batch.

    Attributes:
        dtype: the converted model's half type.
        samples: the batch size (first dimension of the output).
        max_abs_error: ``max |converted - fp32|`` over every output element; ``inf`` if an output is not finite.
        max_rel_error: ``max_abs_error / max |fp32|``; ``inf`` if an output is not finite.
        top1_agreement: share of predictions (score vectors over the last dimension) whose argmax agrees, one with a
            NaN or inf score disagreeing; None for non-classifiers.
        nonfinite_outputs: how many output elements of the converted model are NaN or inf.
        nonfinite_reference: how many output elements of the fp32 model are NaN or inf.
        nonfinite_predictions: for classifiers, how many predictions hold a NaN or inf score in either model; each
            counts as a disagreement in ``top1_agreement``.

    """

    dtype: torch.dtype
    samples: int
    max_abs_error: float
    max_rel_error: float
    top1_agreement: float | None
    nonfinite_outputs: int = 0
    nonfinite_reference: int = 0
    nonfinite_predictions: int = 0

    @property
    def finite(self) -> bool:
        """Whether both models' outputs are all finite; parity fails otherwise."""
        return self.nonfinite_outputs == 0 and self.nonfinite_reference == 0

    def __str__(self) -> str:
        name = str(self.dtype).removeprefix("torch.")
        lines = [
            f"Parity of the {name} model against fp32 on {self.samples} samples:",
            f"  max absolute error   {self.max_abs_error:.3e}",
            f"  max relative error   {self.max_rel_error:.3e}  (to the largest fp32 output)",
        ]
        if self.top1_agreement is not None:
            lines.append(f"  top-1 agreement      {self.top1_agreement:.2%}")
            if self.nonfinite_predictions:
                count = self.nonfinite_predictions
                lines[-1] += f"  ({count} prediction(s) with NaN or inf scores count as disagreeing)"
        if self.nonfinite_outputs:
            lines.append(f"  FAILED: {self.nonfinite_outputs} output value(s) of the {name} model are NaN or inf")
        if self.nonfinite_reference:
            lines.append(f"  FAILED: {self.nonfinite_reference} output value(s) of the fp32 model are NaN or inf")
        return "\n".join(lines)


@dataclass(frozen=True)
class ParityTable:
    """What :func:`to_inference` measured on the batch: each layer's own error, and the whole model's.

    Attributes:
        layers: one :class:`LayerParity` per layer with parameters of its own, in the order they first ran.
        output: the converted model against fp32, end to end.
        max_rel_error: the budget (None when none was given).

    """

    layers: tuple[LayerParity, ...]
    output: ParityReport
    max_rel_error: float | None

    @property
    def kept_fp32(self) -> tuple[str, ...]:
        """The layers kept in fp32 to meet the budget."""
        return tuple(layer.name for layer in self.layers if layer.kept_fp32)

    @property
    def within_budget(self) -> bool:
        """Whether the end-to-end relative error is within the budget (True without a budget if finite)."""
        if self.max_rel_error is None:
            return self.output.finite
        return self.output.max_rel_error <= self.max_rel_error

    def __str__(self) -> str:
        width = max([len(layer.name) for layer in self.layers] + [5])
        budget = "no budget" if self.max_rel_error is None else f"budget max_rel_error={self.max_rel_error:.3g}"
        lines = [
            f"Per-layer parity ({budget}); each layer alone, on the fp32 model's inputs to it:",
            f"  {'layer':<{width}}  {'type':<18}  {'max abs err':>11}  {'max rel err':>11}  dtype",
        ]
        for layer in self.layers:
            dtype = f"fp32 ({layer.why_kept})" if layer.kept_fp32 else str(self.output.dtype).removeprefix("torch.")
            lines.append(
                f"  {layer.name:<{width}}  {layer.type_name:<18}  {layer.max_abs_error:>11.3e}"
                f"  {layer.max_rel_error:>11.3e}  {dtype}"
            )
        kept = list(self.kept_fp32)
        lines.append(f"Kept in fp32 for the budget: {kept if kept else 'none'}")
        if not self.within_budget:
            lines.append("The whole model is still over the budget, with every measured layer kept in fp32.")
        return "\n".join([*lines, str(self.output)])


def _recorded_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (name, module)
        for name, module in model.named_modules()
        if name and any(parameter.is_floating_point() for parameter in module.parameters(recurse=False))
    ]


def _layer_errors(fp32_model: nn.Module, converted: nn.Module, batch: Any) -> dict[str, LayerParity]:
    """Each half layer's own error: run alone on the inputs the fp32 model gave it (see the module docstring)."""
    calls: dict[str, tuple[tuple[Any, ...], dict[str, Any], Tensor]] = {}
    handles = []
    for name, module in _recorded_layers(fp32_model):

        def record(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, name: str = name
        ) -> None:
            reference = _floating_output(output)
            if name in calls or reference is None:
                return
            # Copies: a later in-place op (ReLU(inplace=True), say) would otherwise change what was recorded.
            calls[name] = (_detached_copy(args), _detached_copy(kwargs), reference.detach().float().clone())

        handles.append(module.register_forward_hook(record, with_kwargs=True))
    try:
        _run(fp32_model, cast_low_precision(batch, torch.float32))
    finally:
        for handle in handles:
            handle.remove()
    converted_modules = dict(converted.named_modules())
    errors: dict[str, LayerParity] = {}
    for name, (args, kwargs, reference) in calls.items():
        layer = converted_modules[name]
        if not any(parameter.dtype in HALF_DTYPES for parameter in layer.parameters(recurse=False)):
            continue  # kept in fp32 already (keep_fp32, normalisation): it has no half error of its own
        with torch.no_grad():
            output = _floating_output(layer(*args, **kwargs))
        if output is None or output.shape != reference.shape:
            continue  # nothing comparable came out: the end-to-end comparison still covers the layer
        absolute, relative, nonfinite = _errors(reference, output.float())
        errors[name] = LayerParity(name, type(layer).__name__, absolute, relative, finite=nonfinite == 0)
    return errors


def _detached_copy(data: Any) -> Any:
    return apply_to_collection(data, Tensor, lambda tensor: tensor.detach().clone())


def _floating_output(output: Any) -> Tensor | None:
    """The floating tensors of a layer's output flattened into one, or None if it has none."""
    tensors: list[Tensor] = []
    apply_to_collection(output, Tensor, lambda t: tensors.append(t.flatten()) if t.is_floating_point() else None)
    return torch.cat([t.float() for t in tensors]) if tensors else None


def _errors(reference: Tensor, output: Tensor) -> tuple[float, float, int]:
    """``(max absolute error, max relative error, non-finite outputs)``; any non-finite output makes both inf.

    .. warning:: Reads three numbers back to the host.
    """
    nonfinite = int((~torch.isfinite(output)).sum())
    if nonfinite or reference.numel() == 0:
        return (math.inf, math.inf, nonfinite) if nonfinite else (0.0, 0.0, 0)
    finite_reference = reference[torch.isfinite(reference)]
    absolute = float((output - reference).abs().max())
    scale = float(finite_reference.abs().max()) if finite_reference.numel() else 0.0
    if math.isnan(absolute):
        absolute = math.inf  # the reference itself was not finite there
    relative = absolute / scale if scale > 0 else (math.inf if absolute > 0 else 0.0)
    return absolute, relative, 0


def compare(
    fp32_model: nn.Module,
    converted: nn.Module,
    batch: Tensor | Sequence[Any] | Mapping[str, Any],
    classifier: bool | None = None,
    verbose: bool = True,
) -> ParityReport:
    """Run both models on ``batch`` and report how far the converted outputs are from the fp32 ones.

    Both models run in eval mode without gradients; their train/eval modes are restored afterwards.

    Args:
        fp32_model: the reference model, in fp32.
        converted: the half-precision model, for example from :func:`to_inference`.
        batch: the model's input: a tensor, a tuple or list of positional inputs, or a dict of keyword inputs. The
            fp32 model gets it with half tensors cast to fp32; the converted model gets it as it is. Each model runs on
            its own copy, so neither the caller's batch nor the other model's input is changed by a model that writes
            into its input.
        classifier: whether the output holds class scores over its last dimension; None decides from the output:
            a single tensor, at least 2-D, with a last dimension of at least 2.
        verbose: print the report.

    Returns:
        The :class:`ParityReport`.

    Raises:
        TypeError: if ``batch`` holds no tensor (a string or bytes, say), or ``classifier`` or ``verbose`` is of
            another type.
        ValueError: if a model is not a module, or the outputs do not match in shape.

    .. warning:: Reads the errors back to the host, which synchronises with the device.

    """
    for argument, value in (("fp32_model", fp32_model), ("converted", converted)):
        if not isinstance(value, nn.Module):
            raise ValueError(f"compare({argument}={type(value).__name__}) is not allowed: it must be an nn.Module.")
    _check_batch("compare", batch)
    if classifier is not None:
        _check_bool("compare", "classifier", classifier)
    _check_bool("compare", "verbose", verbose)
    raw_reference = _run(fp32_model, cast_low_precision(batch, torch.float32))
    reference, output = _flat_output(raw_reference), _flat_output(_run(converted, batch))
    if reference.shape != output.shape:
        raise ValueError(
            f"compare(...) needs outputs of the same shape, got {tuple(reference.shape)} from fp32_model and"
            f" {tuple(output.shape)} from converted."
        )
    reference, output = reference.float(), output.float()
    max_abs_error, max_rel_error, nonfinite_outputs = _errors(reference, output)
    nonfinite_reference = int((~torch.isfinite(reference)).sum())
    if nonfinite_reference:
        max_abs_error = max_rel_error = math.inf
    if classifier is None:
        classifier = isinstance(raw_reference, Tensor) and reference.ndim >= 2 and reference.shape[-1] >= 2
    agreement = None
    nonfinite_predictions = 0
    if classifier:
        agreement, nonfinite_predictions = _top1_agreement(reference, output)
    report = ParityReport(
        dtype=_half_dtype_of(converted),
        samples=int(reference.shape[0]) if reference.ndim else 1,
        max_abs_error=max_abs_error,
        max_rel_error=max_rel_error,
        top1_agreement=agreement,
        nonfinite_outputs=nonfinite_outputs,
        nonfinite_reference=nonfinite_reference,
        nonfinite_predictions=nonfinite_predictions,
    )
    if verbose:
        print(report)
    return report


def _top1_agreement(reference: Tensor, output: Tensor) -> tuple[float, int]:
    """The share of predictions whose argmax agrees, and how many hold a NaN or inf score in either model.

    A prediction is a score vector over the last dimension; one with a non-finite score disagrees, whatever its argmax.

    .. warning:: Reads two numbers back to the host.
    """
    scores, reference_scores = output.reshape(-1, output.shape[-1]), reference.reshape(-1, reference.shape[-1])
    finite = torch.isfinite(scores).all(-1) & torch.isfinite(reference_scores).all(-1)
    agrees = (scores.argmax(-1) == reference_scores.argmax(-1)) & finite
    return float(agrees.double().mean()), int((~finite).sum())


def _run(model: nn.Module, batch: Any) -> Any:
    """Run ``model`` in eval mode without gradients on a copy of ``batch``, which it may change in place."""
    batch = _detached_copy(batch)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            if isinstance(batch, Tensor):
                return model(batch)
            if isinstance(batch, Mapping):
                return model(**batch)
            return model(*batch)
    finally:
        model.train(was_training)


def _flat_output(output: Any) -> Tensor:
    """The model's output as one tensor: itself, or its floating tensors flattened and joined."""
    if isinstance(output, Tensor):
        return output
    tensors: list[Tensor] = []
    apply_to_collection(output, Tensor, lambda t: tensors.append(t.flatten()) if t.is_floating_point() else None)
    if not tensors:
        raise ValueError(f"compare(...) found no floating tensor in the model's output of type {type(output)}.")
    return torch.cat([t.float() for t in tensors]).unsqueeze(0)


def _half_dtype_of(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.dtype in HALF_DTYPES), torch.float32)


__all__ = ["LayerParity", "ParityReport", "ParityTable", "compare", "to_inference"]
