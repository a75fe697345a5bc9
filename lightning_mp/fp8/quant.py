"""What an FP8 cast does to one tensor, measured on the device: amax, scale, underflow, saturation and SQNR.

torchao's float8 training casts each operand of a linear layer's matmuls (the input, the weight and the gradient of
the output) to an FP8 dtype with a scale computed from the tensor itself at every step ("dynamic scaling"):

1. ``amax = max |x|``, over the whole tensor (*tensorwise*) or over each row's last dimension (*rowwise*; torchao's
   "axiswise" scaling, reducing the dimension the matmul sums over: the input's and the gradient's features, the
   weight's inputs);
2. ``scale = fp8_max / max(amax, 1e-12)``, computed in float64 and stored in float32; the rowwise recipes then round
   it down to a power of two, so that the scaling itself adds no rounding;
3. ``q = cast(clamp(x * scale, -fp8_max, fp8_max))`` in float32, and the matmul reads ``q / scale`` back.

Which FP8 dtype each operand gets depends on the recipe (:data:`RECIPES`, read from torchao 0.18.0's
``Float8LinearConfig.from_recipe_name``): ``tensorwise`` casts the input and the weight to e4m3 (3 mantissa bits,
largest 448) and the output gradient to e5m2 (2 mantissa bits, largest 57344, a wider range); ``rowwise`` and
``rowwise_with_gw_hp`` cast all three to e4m3 with rowwise scales rounded to powers of two (``rowwise_with_gw_hp``
keeps the weight-gradient matmul in high precision, so the statistics here describe its other two matmuls).

:func:`cast_stats` replays those steps on a tensor and returns, as one float32 vector on the tensor's device
(:data:`STAT_NAMES`):

- ``amax``: the tensor's largest magnitude (over all rows);
- ``scale``: the scale the cast used; for rowwise scaling the smallest row scale (the row with the largest amax);
- ``underflow_share``: the share of the tensor's non-zero elements that become zero in FP8 (their scaled magnitude
  falls below half the smallest subnormal): information the matmul never sees;
- ``saturated_share``: the share of elements whose scaled magnitude exceeds the FP8 maximum and is clamped to it,
  which dynamic scaling only causes where the scale was capped (an amax below 1e-12) or rounded;
- ``sqnr_db``: the signal-to-quantisation-noise ratio ``10 log10(sum x^2 / sum (x - q/scale)^2)`` in dB, as torchao's
  ``compute_error`` defines it; capped at :data:`MAX_SQNR_DB` where the cast is exact. e4m3 keeps about 30 dB on
  well-scaled data, e5m2 about 25 dB.

Everything stays on the device: no value is read by the host, so a caller can stack the vectors of many tensors and
read them in one transfer. The functions need only torch; :func:`casts_of_config` reads a torchao config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

Granularity = Literal["tensorwise", "rowwise"]
Operand = Literal["input", "weight", "grad_output"]
OPERANDS: tuple[Operand, ...] = ("input", "weight", "grad_output")
STAT_NAMES = ("amax", "scale", "underflow_share", "saturated_share", "sqnr_db")
"""The order of the values :func:`cast_stats` returns."""
MAX_SQNR_DB = 150.0
"""The SQNR reported for an exact cast (no quantisation noise), in dB; far above anything FP8 reaches."""
SCALE_EPS = 1e-12
"""The smallest amax the scale divides by, as torchao's ``amax_to_scale`` clamps it."""


@dataclass(frozen=True)
class OperandCast:
    """How one matmul operand is cast to FP8: the scaling granularity, the FP8 dtype and power-of-two scales."""

    granularity: Granularity
    dtype: torch.dtype
    power_of_two_scale: bool = False

    def __post_init__(self) -> None:
        if self.granularity not in ("tensorwise", "rowwise"):
            raise ValueError(
                f"OperandCast(granularity={self.granularity!r}) is not allowed: use 'tensorwise' or 'rowwise'."
            )
        if self.dtype not in _FP8_DTYPES:
            raise ValueError(
                f"OperandCast(dtype={self.dtype}) is not allowed: use one of {', '.join(map(str, _FP8_DTYPES))}."
            )


@dataclass(frozen=True)
class RecipeCasts:
    """The casts of a linear layer's three operands under one recipe."""

    input: OperandCast
    weight: OperandCast
    grad_output: OperandCast

    def of(self, operand: Operand) -> OperandCast:
        """The cast of ``operand`` (``"input"``, ``"weight"`` or ``"grad_output"``)."""
        cast: OperandCast = getattr(self, operand)
        return cast


_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
_E4M3_TENSORWISE = OperandCast("tensorwise", torch.float8_e4m3fn)
_E4M3_ROWWISE = OperandCast("rowwise", torch.float8_e4m3fn, power_of_two_scale=True)
RECIPES: dict[str, RecipeCasts] = {
    "tensorwise": RecipeCasts(_E4M3_TENSORWISE, _E4M3_TENSORWISE, OperandCast("tensorwise", torch.float8_e5m2)),
    "rowwise": RecipeCasts(_E4M3_ROWWISE, _E4M3_ROWWISE, _E4M3_ROWWISE),
    "rowwise_with_gw_hp": RecipeCasts(_E4M3_ROWWISE, _E4M3_ROWWISE, _E4M3_ROWWISE),
}
"""The casts of each torchao recipe's forward and grad-input matmuls (torchao 0.18.0 on NVIDIA GPUs and the CPU)."""


def recipe_casts(recipe: str) -> RecipeCasts:
    """The casts of a recipe by name.

    Raises:
        ValueError: naming the recipe and the recipes allowed.

    """
    if recipe not in RECIPES:
        raise ValueError(f"recipe={recipe!r} is not allowed: use one of {', '.join(map(repr, RECIPES))}.")
    return RECIPES[recipe]


def casts_of_config(config: Any) -> RecipeCasts:
    """The casts a torchao ``Float8LinearConfig`` (a ``Float8Linear`` module's ``config``) applies.

    Those of its forward and grad-input matmuls; a disabled cast is described as tensorwise (those matmuls have none).
    """

    def cast(cast_config: Any) -> OperandCast:
        granularity: Granularity = (
            "rowwise" if getattr(cast_config.scaling_granularity, "value", "") == "axiswise" else "tensorwise"
        )
        return OperandCast(granularity, cast_config.target_dtype, bool(config.round_scales_to_power_of_2))

    return RecipeCasts(
        cast(config.cast_config_input), cast(config.cast_config_weight), cast(config.cast_config_grad_output)
    )


def fp8_scale(tensor: torch.Tensor, cast: OperandCast) -> tuple[torch.Tensor, torch.Tensor]:
    """``(amax, scale)`` of ``tensor`` as the dynamic cast computes them: 0-d for tensorwise, ``(..., 1)`` rowwise."""
    magnitude = tensor.detach().abs()
    amax = magnitude.amax() if cast.granularity == "tensorwise" else magnitude.amax(dim=-1, keepdim=True)
    largest = torch.finfo(cast.dtype).max
    scale = (largest / amax.double().clamp(min=SCALE_EPS)).float()
    if cast.power_of_two_scale:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return amax.float(), scale


def fp8_round_trip(tensor: torch.Tensor, cast: OperandCast) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(scaled, restored, scale)``: ``tensor * scale`` in float32, and its FP8 cast read back as ``q / scale``."""
    _, scale = fp8_scale(tensor, cast)
    largest = torch.finfo(cast.dtype).max
    scaled = tensor.detach().float() * scale
    restored = scaled.clamp(-largest, largest).to(cast.dtype).float() / scale
    return scaled, restored, scale


def cast_stats(tensor: torch.Tensor, cast: OperandCast) -> torch.Tensor:
    """The statistics of casting ``tensor`` to FP8 as ``cast`` says, as a float32 vector in :data:`STAT_NAMES` order.

    Runs about twenty ops on the tensor's device and synchronises nothing.

    Example:
        >>> x = torch.tensor([[1.0, 2.0, 448.0, 1e-9]])
        >>> stats = dict(zip(STAT_NAMES, cast_stats(x, RECIPES["tensorwise"].input).tolist()))
        >>> stats["amax"], stats["scale"], stats["underflow_share"]
        (448.0, 1.0, 0.25)

    """
    if tensor.numel() == 0:
        return torch.full((len(STAT_NAMES),), float("nan"), device=tensor.device)
    if cast.granularity == "rowwise" and tensor.dim() == 0:
        tensor = tensor.reshape(1)
    values = tensor.detach().float()
    amax, scale = fp8_scale(values, cast)
    scaled, restored, _ = fp8_round_trip(values, cast)
    nonzero = values != 0
    underflowed = (nonzero & (restored == 0)).sum()
    underflow_share = underflowed / nonzero.sum().clamp(min=1)
    saturated_share = (scaled.abs() > torch.finfo(cast.dtype).max).float().mean()
    signal = values.square().sum()
    noise = (values - restored).square().sum()
    sqnr_db = (10 * torch.log10(signal / noise)).nan_to_num(nan=MAX_SQNR_DB, posinf=MAX_SQNR_DB).clamp(max=MAX_SQNR_DB)
    return torch.stack([amax.max(), scale.min(), underflow_share.float(), saturated_share, sqnr_db.float()])


__all__ = [
    "MAX_SQNR_DB",
    "OPERANDS",
    "RECIPES",
    "STAT_NAMES",
    "OperandCast",
    "RecipeCasts",
    "cast_stats",
    "casts_of_config",
    "fp8_round_trip",
    "fp8_scale",
    "recipe_casts",
]
