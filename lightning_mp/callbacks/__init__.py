"""Telemetry callbacks: the loss scale, gradient health, per-layer dtypes and a precision sentinel, for TensorBoard."""

from lightning_mp.callbacks.advisor import AdvisorCallback
from lightning_mp.callbacks.gradient_health_monitor import GradientHealthMonitor
from lightning_mp.callbacks.layer_dtype_monitor import LayerDtypeMonitor
from lightning_mp.callbacks.loss_scale_monitor import LossScaleMonitor
from lightning_mp.callbacks.precision_sentinel import PrecisionSentinel

__all__ = [
    "AdvisorCallback",
    "GradientHealthMonitor",
    "LayerDtypeMonitor",
    "LossScaleMonitor",
    "PrecisionSentinel",
]
