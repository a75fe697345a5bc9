"""Parity measurement: run a converted model and its fp32 original on one batch and measure how far apart they are.

:func:`compare` runs both models on one batch and reports, in a :class:`~lightning_mp.inference.ParityReport`:

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

:func:`layer_errors` measures each layer's *own* error, free of its predecessors': the fp32 model runs on the batch
once, with forward hooks recording every layer's inputs and output (a layer is a module with parameters of its own;
only its first call is recorded); then each half layer of the converted copy runs alone on the recorded fp32 inputs
(its pre-hook casts them to the half type), and its output is compared with the fp32 one.

.. warning::
    Both read results back to the host (``float(tensor)``), which synchronises with the device once per measured
    quantity.

"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn

from lightning_mp.arguments.checks import arguments_of, caller
from lightning_mp.inference.reports import LayerParity, ParityReport
from lightning_mp.overrides import cast_low_precision
from lightning_mp.policies.casting import HALF_DTYPES


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{caller()}({name}={value!r}) is not allowed: {name} must be True or False.")


def check_batch(batch: Any) -> None:
    tensors: list[Tensor] = []
    if isinstance(batch, (Tensor, Sequence, Mapping)) and not isinstance(batch, (str, bytes, bytearray)):
        apply_to_collection(batch, Tensor, tensors.append)
    if not tensors:
        shown = f"{batch!r}"[:60] if isinstance(batch, (str, bytes, bytearray)) else type(batch).__name__
        raise TypeError(
            f"{caller()}(batch={shown}) is not allowed: batch must be a tensor, a tuple or list of positional inputs,"
            " or a dict of keyword inputs, holding at least one tensor."
        )


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
    with arguments_of("compare"):
        check_batch(batch)
        if classifier is not None:
            check_bool("classifier", classifier)
        check_bool("verbose", verbose)
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


def _recorded_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (name, module)
        for name, module in model.named_modules()
        if name and any(parameter.is_floating_point() for parameter in module.parameters(recurse=False))
    ]


def layer_errors(fp32_model: nn.Module, converted: nn.Module, batch: Any) -> dict[str, LayerParity]:
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


__all__ = ["compare"]
