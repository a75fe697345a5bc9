"""Inference export: a half-precision copy of a trained model, and a parity report against the fp32 original.

Deploying in fp16 or bf16 halves the memory of the weights and, on hardware with fast half matrix units, can double
the throughput. ``module.half()`` is the usual way, but it also casts normalisation layers (whose variance is the
first thing to lose precision) and makes the model reject fp32 inputs. :func:`to_inference` instead:

1. deep-copies the model, so the original is untouched, and puts the copy in eval mode without gradients;
2. casts weights and floating buffers to the half type, keeping normalisation layers and ``keep_fp32`` modules in
   fp32 (:func:`~lightning_mp.policies.o3.convert_to_half`, with the normalisation layers O3 would cast kept fp32);
3. gives every module with half weights a pre-hook that casts its floating inputs to the half type, so the copy takes
   fp32 or half inputs alike. Its outputs are in the half type (fp32 from a ``keep_fp32`` last layer).

:func:`compare` runs both models on one batch and reports, with torchmetrics:

- the largest absolute difference between the outputs;
- the largest relative difference, ``max |converted - fp32| / max |fp32|`` (relative to the output's scale, so that
  outputs near zero do not make it meaningless);
- for classifiers, the share of samples whose top-1 class is the same in both (``MulticlassAccuracy`` with the fp32
  model's argmax as the target).

Example:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))
    >>> fast = to_inference(model, dtype=torch.bfloat16)
    >>> fast[0].weight.dtype, fast[1].weight.dtype, model[0].weight.dtype
    (torch.bfloat16, torch.float32, torch.float32)
    >>> report = compare(model, fast, torch.randn(32, 8), verbose=False)
    >>> report.max_rel_error < 0.05
    True

"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torchmetrics import MaxMetric
from torchmetrics.classification import MulticlassAccuracy

from lightning_mp.overrides import Fp32Overrides, KeepFp32Pattern, cast_low_precision
from lightning_mp.policies.o2 import HALF_DTYPES
from lightning_mp.policies.o3 import convert_to_half


def to_inference(
    model: nn.Module,
    dtype: torch.dtype = torch.bfloat16,
    keep_fp32: Sequence[KeepFp32Pattern] = (),
    keep_normalization_fp32: bool = True,
) -> nn.Module:
    """Return a half-precision copy of ``model`` for inference; the original is left untouched.

    Args:
        model: the trained model (an ``nn.Module`` or a ``LightningModule``).
        dtype: ``torch.bfloat16`` or ``torch.float16``.
        keep_fp32: module types, qualified names or ``re:`` patterns that stay fp32 (see
            :mod:`lightning_mp.overrides`).
        keep_normalization_fp32: keep normalisation layers in fp32, as opt level O2 does.

    Returns:
        The converted copy, in eval mode, with ``requires_grad`` off. Its forward takes fp32 or half inputs.

    Raises:
        ValueError: if ``model`` is not a module, ``dtype`` is not a half type, or a ``keep_fp32`` entry is invalid.

    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"to_inference(model={type(model).__name__}) is not allowed: model must be an nn.Module.")
    if dtype not in HALF_DTYPES:
        raise ValueError(
            f"to_inference(dtype={dtype!r}) is not allowed: dtype must be torch.bfloat16 or torch.float16."
        )
    overrides = Fp32Overrides(keep_fp32)
    converted = copy.deepcopy(model)
    converted.eval()
    converted.requires_grad_(False)
    convert_to_half(converted, dtype, overrides, keep_normalization_fp32=keep_normalization_fp32, float_outputs=False)
    return converted


@dataclass(frozen=True)
class ParityReport:
    """How far a converted model's outputs are from the fp32 model's, on one batch.

    Attributes:
        dtype: the converted model's half type.
        samples: the batch size (first dimension of the output).
        max_abs_error: ``max |converted - fp32|`` over every output element.
        max_rel_error: ``max_abs_error / max |fp32|``.
        top1_agreement: share of predictions whose argmax over the last dimension agrees; None for non-classifiers.

    """

    dtype: torch.dtype
    samples: int
    max_abs_error: float
    max_rel_error: float
    top1_agreement: float | None

    def __str__(self) -> str:
        name = str(self.dtype).removeprefix("torch.")
        lines = [
            f"Parity of the {name} model against fp32 on {self.samples} samples:",
            f"  max absolute error   {self.max_abs_error:.3e}",
            f"  max relative error   {self.max_rel_error:.3e}  (to the largest fp32 output)",
        ]
        if self.top1_agreement is not None:
            lines.append(f"  top-1 agreement      {self.top1_agreement:.2%}")
        return "\n".join(lines)


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
            fp32 model gets it with half tensors cast to fp32; the converted model gets it as it is.
        classifier: whether the output holds class scores over its last dimension; None decides from the output:
            a single tensor, at least 2-D, with a last dimension of at least 2.
        verbose: print the report.

    Returns:
        The :class:`ParityReport`.

    Raises:
        ValueError: if a model is not a module, the batch is of another type, or the outputs do not match in shape.

    """
    for argument, value in (("fp32_model", fp32_model), ("converted", converted)):
        if not isinstance(value, nn.Module):
            raise ValueError(f"compare({argument}={type(value).__name__}) is not allowed: it must be an nn.Module.")
    if not isinstance(batch, (Tensor, Sequence, Mapping)) or isinstance(batch, str):
        raise ValueError(
            f"compare(batch={type(batch).__name__}) is not allowed: batch must be a tensor, a tuple or list of"
            " positional inputs, or a dict of keyword inputs."
        )
    raw_reference = _run(fp32_model, cast_low_precision(batch, torch.float32))
    reference, output = _flat_output(raw_reference), _flat_output(_run(converted, batch))
    if reference.shape != output.shape:
        raise ValueError(
            f"compare(...) needs outputs of the same shape, got {tuple(reference.shape)} from fp32_model and"
            f" {tuple(output.shape)} from converted."
        )
    reference, output = reference.float(), output.float()
    absolute_error = MaxMetric().to(reference.device)
    reference_scale = MaxMetric().to(reference.device)
    absolute_error.update((output - reference).abs())
    reference_scale.update(reference.abs())
    max_abs_error = float(absolute_error.compute())
    scale = float(reference_scale.compute())
    if classifier is None:
        classifier = isinstance(raw_reference, Tensor) and reference.ndim >= 2 and reference.shape[-1] >= 2
    agreement = None
    if classifier:
        accuracy = MulticlassAccuracy(num_classes=reference.shape[-1], average="micro").to(reference.device)
        accuracy.update(output.argmax(-1).flatten(), reference.argmax(-1).flatten())
        agreement = float(accuracy.compute())
    report = ParityReport(
        dtype=_half_dtype_of(converted),
        samples=int(reference.shape[0]) if reference.ndim else 1,
        max_abs_error=max_abs_error,
        max_rel_error=max_abs_error / scale if scale > 0 else float(max_abs_error > 0),
        top1_agreement=agreement,
    )
    if verbose:
        print(report)
    return report


def _run(model: nn.Module, batch: Any) -> Any:
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


__all__ = ["ParityReport", "compare", "to_inference"]
