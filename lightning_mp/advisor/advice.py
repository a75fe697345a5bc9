"""The advisor's rules: fp16's limits, the per-layer report, and the recommendation drawn from it.

fp16 represents magnitudes from ``2**-24`` (its smallest subnormal) to ``65504``. Normal numbers start at ``2**-14``;
below that only a few mantissa bits are left, and below ``2**-24`` a value becomes zero. bf16 has fp32's range and
none of these limits, but three fewer mantissa bits than fp16. Whether a model trains in fp16 depends on where its
values fall, layer by layer (one :class:`LayerReport` each, measured by :func:`~lightning_mp.advisor.advise`).

From the table, :func:`recommend` draws the :class:`Advice`, with pure functions only:

- ``keep_fp32``: the layers whose activations come within a factor :data:`ACTIVATION_HEADROOM` of fp16's maximum,
  on their inputs or outputs (so that both the layer that produces a huge value and the one that consumes it stay
  fp32), or whose output activations underflow to zero more than :data:`UNDERFLOW_LIMIT` of the time
  (:func:`at_risk_in_fp16`). Loss scaling cannot help activations: it only scales gradients;
- ``init_scale``: the largest power of two that keeps the largest gradient outside the kept layers a factor
  :data:`GRADIENT_HEADROOM` below 65504, so the first steps neither overflow nor waste range;
- the precision, for the hardware (:func:`recommend_precision`, a pure function of the device's capabilities):
  bf16 where the device multiplies it natively (bf16 has fp32's range, so the layers at risk need nothing); fp16
  with the ``keep_fp32`` layers and ``init_scale`` above on a GPU without fast bf16; and fp32 on a CPU that emulates
  both half types, where either would be slower than fp32. It never recommends emulated bf16. The advice also says
  what it would recommend on a GPU (:attr:`Advice.on_gpu`), so that a measurement on a laptop serves the cluster.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lightning_mp.arguments.checks import arguments_of, check_choice
from lightning_mp.plugin.hardware import AMPERE, DeviceCapabilities
from lightning_mp.scaling.rules import SCALER_DEFAULTS

FP16_MAX = 65504.0
FP16_SMALLEST_SUBNORMAL = 2.0**-24
FP16_SMALLEST_NORMAL = 2.0**-14
ACTIVATION_HEADROOM = 4.0
"""A layer whose activations come within this factor of 65504 is kept in fp32: later batches can be larger."""
UNDERFLOW_LIMIT = 0.01
"""A layer whose output activations would flush to zero in fp16 more often than this is kept in fp32."""
GRADIENT_HEADROOM = 64.0
"""``init_scale`` keeps the largest gradient this factor below 65504."""
MIN_INIT_SCALE, MAX_INIT_SCALE = 2.0**-24, 2.0**24

RecommendedPrecision = Literal["bf16-mixed", "16-mixed", "32-true"]


@dataclass(frozen=True)
class LayerReport:
    """What one module's values would do in fp16, measured in fp32.

    Attributes:
        name: qualified module name (``""`` for the root module).
        type_name: the module's class name.
        max_activation: largest absolute value among its floating inputs and outputs.
        max_gradient: largest absolute gradient of its outputs and own parameters (0 without gradients).
        activation_zero_share: share of output activations that are nonzero and below ``2**-24``.
        activation_subnormal_share: share of output activations in ``[2**-24, 2**-14)``.
        gradient_zero_share: the same as ``activation_zero_share`` for its gradients.
        gradient_subnormal_share: the same as ``activation_subnormal_share`` for its gradients.
        overflows_fp16: whether an activation or a gradient is above 65504.
        keep_fp32: whether the advisor recommends keeping it in fp32.

    """

    name: str
    type_name: str
    max_activation: float
    max_gradient: float
    activation_zero_share: float
    activation_subnormal_share: float
    gradient_zero_share: float
    gradient_subnormal_share: float
    overflows_fp16: bool
    keep_fp32: bool


@dataclass(frozen=True)
class Advice:
    """The advisor's table and recommendation.

    Attributes:
        layers: one :class:`LayerReport` per recorded module, in the order they first ran.
        precision: the recommended ``MixedPrecision`` precision for the measured device.
        keep_fp32: qualified names of the modules to keep in fp32 when training in fp16.
        init_scale: the recommended first loss scale for fp16.
        batches: how many batches were measured.
        reason: why this precision.
        on_gpu: what the advisor would recommend on a GPU, with and without native bf16.

    """

    layers: tuple[LayerReport, ...]
    precision: RecommendedPrecision
    keep_fp32: tuple[str, ...]
    init_scale: float
    batches: int
    reason: str
    on_gpu: str = ""

    def plugin_kwargs(self, precision: RecommendedPrecision | None = None) -> dict[str, Any]:
        """Keyword arguments for :class:`~lightning_mp.MixedPrecision` that apply this advice.

        Args:
            precision: override the recommended precision, for example ``"16-mixed"`` on hardware without bf16.

        Example:
            >>> advice = Advice((), "bf16-mixed", ("blowup",), 256.0, 1, "")
            >>> advice.plugin_kwargs("16-mixed")
            {'precision': '16-mixed', 'keep_fp32': ['blowup'], 'init_scale': 256.0}

        """
        if precision is not None:
            with arguments_of("Advice.plugin_kwargs"):
                check_choice("precision", precision, ("bf16-mixed", "16-mixed", "32-true", None))
        chosen = self.precision if precision is None else precision
        if chosen == "32-true":
            return {"precision": "32-true"}
        kwargs: dict[str, Any] = {"precision": chosen, "keep_fp32": list(self.keep_fp32)}
        if chosen == "16-mixed":
            kwargs["init_scale"] = self.init_scale
        return kwargs

    def to_markdown(self) -> str:
        """The table and the recommendation as Markdown, as written to TensorBoard under ``precision/advice``."""
        header = (
            "| layer | type | max abs activation | max abs gradient | act. flushed to 0 | act. subnormal"
            " | grad. flushed to 0 | grad. subnormal | fp16 overflow | keep fp32 |"
        )
        rows = [header, "|" + "---|" * 10]
        for layer in self.layers:
            rows.append(
                f"| {layer.name or '(root)'} | {layer.type_name}"
                f" | {layer.max_activation:.3g} | {layer.max_gradient:.3g}"
                f" | {layer.activation_zero_share:.2%} | {layer.activation_subnormal_share:.2%}"
                f" | {layer.gradient_zero_share:.2%} | {layer.gradient_subnormal_share:.2%}"
                f" | {'yes' if layer.overflows_fp16 else 'no'} | {'**yes**' if layer.keep_fp32 else 'no'} |"
            )
        return "\n".join([*self._recommendation(), "", *rows])

    def _recommendation(self) -> list[str]:
        return [
            f"**Recommended precision:** `{self.precision}` ({self.reason}).",
            f"**For fp16:** `MixedPrecision('16-mixed', keep_fp32={list(self.keep_fp32)!r},"
            f" init_scale={self.init_scale:g})`.",
            *([f"**On a GPU:** {self.on_gpu}."] if self.on_gpu else []),
            f"Measured in fp32 over {self.batches} batch{'es' if self.batches != 1 else ''}.",
        ]

    def __str__(self) -> str:
        width = max([len(layer.name) for layer in self.layers] + [6])
        lines = [
            *(line.replace("**", "").replace("`", "") for line in self._recommendation()),
            "",
            f"{'layer':<{width}}  {'max |act|':>10}  {'max |grad|':>10}  {'act->0':>7}  {'grad->0':>7}  overflow  keep",
        ]
        for layer in self.layers:
            lines.append(
                f"{layer.name or '(root)':<{width}}  {layer.max_activation:>10.3g}  {layer.max_gradient:>10.3g}"
                f"  {layer.activation_zero_share:>7.2%}  {layer.gradient_zero_share:>7.2%}"
                f"  {'yes' if layer.overflows_fp16 else 'no':>8}  {'fp32' if layer.keep_fp32 else '-'}"
            )
        return "\n".join(lines)


def at_risk_in_fp16(max_activation: float, activation_zero_share: float) -> bool:
    """Whether a layer's activations come too close to fp16's maximum, or flush to zero too often, for fp16.

    Example:
        >>> at_risk_in_fp16(30_000.0, 0.0), at_risk_in_fp16(1.0, 0.5), at_risk_in_fp16(1.0, 0.0)
        (True, True, False)

    """
    return max_activation > FP16_MAX / ACTIVATION_HEADROOM or activation_zero_share > UNDERFLOW_LIMIT


def recommend_precision(
    capabilities: DeviceCapabilities, keep_fp32: Sequence[str], init_scale: float
) -> tuple[RecommendedPrecision, str, str]:
    """The precision to recommend on a device, why, and what a GPU would get: a pure function.

    Args:
        capabilities: the device's (see :meth:`~lightning_mp.plugin.hardware.DeviceCapabilities.detect`).
        keep_fp32: the layers at risk in fp16.
        init_scale: the recommended first fp16 loss scale.

    Returns:
        ``(precision, reason, on_gpu)``.

    Example:
        >>> recommend_precision(DeviceCapabilities("cpu", native_bf16=False), (), 1024.0)[0]
        '32-true'

    """
    device = capabilities.describe()
    at_risk = f"{len(keep_fp32)} layer(s) leave fp16's range" if keep_fp32 else "nothing leaves fp16's range"
    fp16 = f"'16-mixed' with keep_fp32={list(keep_fp32)!r}, init_scale={init_scale:g}"
    ampere = ".".join(map(str, AMPERE))
    on_gpu = f"'bf16-mixed' on a GPU of compute capability {ampere} or higher, {fp16} on an older one"
    precision: RecommendedPrecision
    if capabilities.native_bf16:
        precision, reason = "bf16-mixed", f"{at_risk}; {device} runs bf16 natively, and bf16 has fp32's range"
    elif capabilities.device_type in ("cuda", "mps"):
        precision, reason = "16-mixed", f"{at_risk}; {device} has no fast bf16, so fp16 with the settings below"
    else:
        precision = "32-true"
        reason = f"{at_risk}; {device} emulates bf16 and fp16, and both are slower than fp32 there"
    return precision, reason, on_gpu


def recommend(layers: tuple[LayerReport, ...], batches: int, capabilities: DeviceCapabilities) -> Advice:
    """The advice for a measured table: the layers to keep in fp32, the first loss scale and the precision.

    Args:
        layers: the reports of the modules that produced activations, in the order they first ran.
        batches: how many batches were measured.
        capabilities: the hardware to advise for.

    """
    keep = tuple(layer.name for layer in layers if layer.keep_fp32)
    largest_gradient = max((layer.max_gradient for layer in layers if not layer.keep_fp32), default=0.0)
    if largest_gradient > 0:
        exponent = math.floor(math.log2(FP16_MAX / GRADIENT_HEADROOM / largest_gradient))
        init_scale = min(max(2.0**exponent, MIN_INIT_SCALE), MAX_INIT_SCALE)
    else:
        init_scale = SCALER_DEFAULTS.init_scale
    precision, reason, on_gpu = recommend_precision(capabilities, keep, init_scale)
    return Advice(layers, precision, keep, init_scale, batches, reason, on_gpu)


__all__ = [
    "ACTIVATION_HEADROOM",
    "FP16_MAX",
    "FP16_SMALLEST_NORMAL",
    "FP16_SMALLEST_SUBNORMAL",
    "GRADIENT_HEADROOM",
    "MAX_INIT_SCALE",
    "MIN_INIT_SCALE",
    "UNDERFLOW_LIMIT",
    "Advice",
    "LayerReport",
    "RecommendedPrecision",
    "at_risk_in_fp16",
    "recommend",
    "recommend_precision",
]
