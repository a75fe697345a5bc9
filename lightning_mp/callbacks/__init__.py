"""Telemetry callbacks: the loss scale, gradient health and per-layer dtypes, logged for TensorBoard."""

from lightning_mp.callbacks.advisor import AdvisorCallback
from lightning_mp.callbacks.gradient_health_monitor import GradientHealthMonitor
from lightning_mp.callbacks.layer_dtype_monitor import LayerDtypeMonitor
from lightning_mp.callbacks.loss_scale_monitor import LossScaleMonitor

__all__ = [
    "AdvisorCallback",
    "GradientHealthMonitor",
    "LayerDtypeMonitor",
    "LossScaleMonitor",
]
