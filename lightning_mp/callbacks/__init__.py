"""Telemetry callbacks: loss scale, gradient health, per-layer dtypes, a precision sentinel and FP8, for TensorBoard.

:class:`FP8Monitor` lives with the FP8 mode (:mod:`lightning_mp.fp8.telemetry`) and is offered here beside the others;
importing it needs no torchao.
"""

from lightning_mp.callbacks.advisor import AdvisorCallback
from lightning_mp.callbacks.gradient_health_monitor import GradientHealthMonitor
from lightning_mp.callbacks.layer_dtype_monitor import LayerDtypeMonitor
from lightning_mp.callbacks.loss_scale_monitor import LossScaleMonitor
from lightning_mp.callbacks.precision_sentinel import PrecisionSentinel
from lightning_mp.fp8.telemetry import FP8Monitor

__all__ = [
    "AdvisorCallback",
    "FP8Monitor",
    "GradientHealthMonitor",
    "LayerDtypeMonitor",
    "LossScaleMonitor",
    "PrecisionSentinel",
]
