"""The parity reports: how far a half-precision copy's outputs are from the fp32 model's, as data and as text.

:class:`ParityReport` is what :func:`~lightning_mp.inference.compare` measures end to end on one batch: the largest
absolute and relative errors, the non-finite outputs of either model and, for classifiers, the top-1 agreement.
:class:`LayerParity` is one layer's own error, measured alone on the fp32 model's inputs to it, and whether the error
budget of :func:`~lightning_mp.inference.to_inference` kept it in fp32. :class:`ParityTable` gathers one
:class:`LayerParity` per layer with the end-to-end report and the budget. Each prints as the table a user reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


__all__ = ["LayerParity", "ParityReport", "ParityTable"]
