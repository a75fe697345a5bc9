"""lightning_mp: mixed-precision training for PyTorch Lightning that you can see into.

``Trainer(plugins=[MixedPrecision(...)])`` runs the step under ``torch.autocast`` and a dynamic loss scaler with
hysteresis, bounds and counters; the callbacks put the loss scale, skipped steps, gradient health and per-layer
dtypes into TensorBoard, and the precision sentinel warns about silent precision failures. Under Lightning's
``FSDPStrategy`` pass ``FSDPMixedPrecision``, built from the same arguments (:mod:`lightning_mp.fsdp`), and under
``DeepSpeedStrategy`` ``DeepSpeedMixedPrecision``, which maps them onto DeepSpeed's engines
(:mod:`lightning_mp.deepspeed`).
"""

from lightning_mp.advisor import Advice, advise
from lightning_mp.callbacks import (
    AdvisorCallback,
    FP8Monitor,
    GradientHealthMonitor,
    LayerDtypeMonitor,
    LossScaleMonitor,
    PrecisionSentinel,
)
from lightning_mp.deepspeed import DeepSpeedMixedPrecision
from lightning_mp.errors import LossScaleCollapseError, NonFiniteStepsError
from lightning_mp.fp8.settings import FP8Settings
from lightning_mp.fsdp import FSDPMixedPrecision
from lightning_mp.inference import ParityReport, compare, to_inference
from lightning_mp.plugin import MixedPrecision
from lightning_mp.scaler import LossScaler
from lightning_mp.scaling.stats import PrecisionStats, ScalerView

__version__ = "0.1.0"

__all__ = [
    "Advice",
    "AdvisorCallback",
    "DeepSpeedMixedPrecision",
    "FP8Monitor",
    "FP8Settings",
    "FSDPMixedPrecision",
    "GradientHealthMonitor",
    "LayerDtypeMonitor",
    "LossScaleCollapseError",
    "LossScaleMonitor",
    "LossScaler",
    "MixedPrecision",
    "NonFiniteStepsError",
    "ParityReport",
    "PrecisionSentinel",
    "PrecisionStats",
    "ScalerView",
    "__version__",
    "advise",
    "compare",
    "to_inference",
]
