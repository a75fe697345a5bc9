"""DeepSpeed on the CPU for tests: Lightning's DeepSpeedStrategy refuses a CPU accelerator, DeepSpeed's CPU backend
compiles a shared-memory op at its first start (about a minute) and takes fp16 for unsupported without AVX512-FP16.

:func:`deepspeed_on_cpu` switches the op off and tells DeepSpeed's CPU accelerator that fp16 runs (it does, emulated);
:class:`CPUDeepSpeedStrategy` is Lightning's strategy with DDP's environment setup and a CPU device per rank. Real
DeepSpeed engines (ZeRO stages, fp16 loss scaler, bf16 optimizer) run underneath; only the device checks differ.
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.fabric.strategies import DeepSpeedStrategy as FabricDeepSpeedStrategy
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy


def deepspeed_on_cpu() -> None:
    """Import DeepSpeed for the CPU (skipping the test where it is not installed) and make it start quickly."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    deepspeed = pytest.importorskip("deepspeed")
    from deepspeed.accelerator import get_accelerator

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        pytest.skip(f"DeepSpeed chose the {accelerator.device_name()!r} accelerator; these tests run its CPU one")
    accelerator.is_fp16_supported = lambda: True


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy on CPU processes: DDP's environment setup, device ``cpu:<local rank>``."""

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)  # type: ignore[arg-type]

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu", self.local_rank)

    def setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()


def deepspeed_trainer(plugin: Any, strategy: Any = None, devices: int = 1, **options: Any) -> L.Trainer:
    """A quiet Trainer of 6 steps on ``devices`` CPU processes under ``strategy`` (ZeRO 2 on the CPU by default)."""
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "max_steps": 6,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    settings.update(options)
    if strategy is None:
        deepspeed_on_cpu()
        strategy = CPUDeepSpeedStrategy(stage=2)
    return L.Trainer(devices=devices, strategy=strategy, plugins=[plugin], **settings)


class CPUFabricDeepSpeedStrategy(FabricDeepSpeedStrategy):
    """Fabric's DeepSpeedStrategy on CPU processes: DDP's environment setup, device ``cpu:<local rank>``."""

    def setup_environment(self) -> None:
        FabricDDPStrategy.setup_environment(self)  # type: ignore[arg-type]

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu", self.local_rank)

    def _setup_distributed(self) -> None:
        reset_seed()
        self._set_world_ranks()
        self._init_deepspeed_distributed()
        if not self._config_initialized:
            self._format_config()
            self._config_initialized = True
