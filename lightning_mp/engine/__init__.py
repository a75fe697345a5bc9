"""The step engines: one contract (:mod:`~lightning_mp.engine.base`), one engine per front end."""

from lightning_mp.engine.base import StepEngine
from lightning_mp.engine.fabric import FabricEngine
from lightning_mp.engine.running_stats import RunningStats
from lightning_mp.engine.trainer import TrainerEngine
from lightning_mp.scaling.verdict import StepVerdict

__all__ = ["FabricEngine", "RunningStats", "StepEngine", "StepVerdict", "TrainerEngine"]
