"""The precision advisor: find the layers that fp16 would break before a run does, and say what to do about it.

:func:`advise` measures a few training batches in fp32 on a copy of the model, layer by layer
(:mod:`~lightning_mp.advisor.measure`), and pure rules turn the table into an :class:`Advice`: a precision for the
hardware, the layers to keep in fp32 and a first loss scale (:mod:`~lightning_mp.advisor.advice`).
"""

from lightning_mp.advisor.advice import (
    ACTIVATION_HEADROOM,
    GRADIENT_HEADROOM,
    UNDERFLOW_LIMIT,
    Advice,
    LayerReport,
    recommend_precision,
)
from lightning_mp.advisor.advice import FP16_MAX as FP16_MAX
from lightning_mp.advisor.advice import FP16_SMALLEST_NORMAL as FP16_SMALLEST_NORMAL
from lightning_mp.advisor.advice import FP16_SMALLEST_SUBNORMAL as FP16_SMALLEST_SUBNORMAL
from lightning_mp.advisor.advice import MAX_INIT_SCALE as MAX_INIT_SCALE
from lightning_mp.advisor.advice import MIN_INIT_SCALE as MIN_INIT_SCALE
from lightning_mp.advisor.advice import RecommendedPrecision as RecommendedPrecision
from lightning_mp.advisor.measure import advise
from lightning_mp.measuring.trial_batches import LossFunction as LossFunction
from lightning_mp.plugin.hardware import DeviceCapabilities

__all__ = [
    "ACTIVATION_HEADROOM",
    "GRADIENT_HEADROOM",
    "UNDERFLOW_LIMIT",
    "Advice",
    "DeviceCapabilities",
    "LayerReport",
    "advise",
    "recommend_precision",
]
