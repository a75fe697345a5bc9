"""Inference export: a half-precision copy of a trained model, optionally kept within an error budget.

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

**An error budget.** ``to_inference(model, dtype, batch=x, max_rel_error=1e-2)`` also measures each layer, and keeps
in fp32 the layers that would break the budget:

1. each layer's *own* error is measured (:func:`~lightning_mp.inference.parity.layer_errors`): the layer alone, in
   the half type, on the inputs the fp32 model gave it on ``batch``;
2. the layers whose own relative error exceeds the budget, or whose output is not finite, are kept in fp32;
3. the whole converted model is compared end to end (:func:`~lightning_mp.inference.compare`). While that error
   still exceeds the budget (errors add up over layers), the half layer with the largest own error is kept in fp32
   too, and the model converted again.

The result is the converted copy with a :class:`~lightning_mp.inference.ParityTable` as its ``parity`` attribute: the
per-layer errors, the layers kept and why, and the end-to-end :class:`~lightning_mp.inference.ParityReport`. Without
``batch`` nothing is measured and ``parity`` is None.

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
    The error budget reads results back to the host (``float(tensor)``), which synchronises with the device once per
    measured quantity.

"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_mp.arguments.checks import arguments_of, check_number
from lightning_mp.inference.parity import check_batch, check_bool, compare, layer_errors
from lightning_mp.inference.reports import ParityTable
from lightning_mp.overrides import Fp32Overrides, KeepFp32Pattern, deepcopy_with_hooks
from lightning_mp.policies.casting import HALF_DTYPES, convert_to_half


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
    with arguments_of("to_inference"):
        check_bool("keep_normalization_fp32", keep_normalization_fp32)
        check_bool("verbose", verbose)
        if batch is not None:
            check_batch(batch)
    if max_rel_error is not None:
        try:
            max_rel_error = check_number("max_rel_error", max_rel_error, above=0)
        except ValueError:
            raise ValueError(
                f"to_inference(max_rel_error={max_rel_error!r}) is not allowed: max_rel_error must be None or a"
                " finite number > 0, relative to the largest fp32 output."
            ) from None
    if batch is None and max_rel_error is not None:
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
    errors_by_layer = layer_errors(model, converted, batch)
    kept: dict[str, str] = {}
    if max_rel_error is not None:
        for name, error in errors_by_layer.items():
            if error.max_rel_error > max_rel_error:
                kept[name] = "own error over the budget" if error.finite else "non-finite output"
        if kept:
            converted = _convert(model, dtype, [*patterns, *kept], keep_normalization_fp32)
    output = compare(model, converted, batch, verbose=False)
    while max_rel_error is not None and not output.max_rel_error <= max_rel_error:
        remaining = [name for name in errors_by_layer if name not in kept]
        if not remaining:
            break
        worst = max(remaining, key=lambda name: errors_by_layer[name].max_rel_error)
        kept[worst] = "largest own error left while the whole output was over the budget"
        converted = _convert(model, dtype, [*patterns, *kept], keep_normalization_fp32)
        output = compare(model, converted, batch, verbose=False)
    rows = tuple(
        dataclasses.replace(error, kept_fp32=name in kept, why_kept=kept.get(name, ""))
        for name, error in errors_by_layer.items()
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


__all__ = ["to_inference"]
