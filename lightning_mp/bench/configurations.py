"""The precision setups the benchmark compares: what each one adds to the Trainer, and what it is compared with.

A configuration is a recipe, not an object: :attr:`Configuration.trainer_arguments` builds fresh plugins and
callbacks for every run, so that no state carries from one run to the next. Each configuration names its
reference at the same precision (:attr:`Configuration.builtin`): Lightning's built-in plugin (the report also
compares a monitored setup with the same setup without monitors). Three families:

- the baselines users compare with: strict fp32 (``32-true`` with TF32 off), fp32 with TF32
  (``torch.set_float32_matmul_precision("high")``, CUDA only), and Lightning's ``16-mixed``, ``bf16-mixed`` and
  ``bf16-true``;
- :class:`~lightning_mp.MixedPrecision` at opt levels O1, O2 and lean, in fp16 and bf16;
- O1 with the package's monitors attached, logging to TensorBoard: what watching the training costs;
- FP8 (CUDA GPUs of compute capability 8.9 and up, or the CPU's emulation; needs torchao): the package's FP8 mode
  (``MixedPrecision("bf16-mixed", fp8=recipe)``), the same with its :class:`~lightning_mp.fp8.telemetry.FP8Monitor`
  sampling every 50 steps, and bare torchao (``convert_to_float8_training`` on the same layers, under Lightning's
  ``bf16-mixed``): the reference the FP8 mode must keep up with.

Most CPUs multiply fp16 far more slowly than fp32, so the fp16 setups are ``cuda_only``: left out of the CPU's
defaults (``--configs`` can still ask for them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Literal

import lightning as L
import torch
from torch import nn

from lightning_mp.callbacks import GradientHealthMonitor, LayerDtypeMonitor, LossScaleMonitor, PrecisionSentinel
from lightning_mp.plugin import MixedPrecision
from lightning_mp.settings import PrecisionName

FP32 = "fp32"
MONITOR_EVERY_N_STEPS = 10
"""How often the monitored configurations log to TensorBoard and sample the model."""

Float32Matmul = Literal["highest", "high"]


@dataclass(frozen=True)
class Configuration:
    """One precision setup: the Trainer arguments it adds, and the configuration it is compared with.

    Attributes:
        name: the row's name in the report, and the value ``--configs`` takes.
        description: the setup in words, for the report's header.
        trainer_arguments: builds the Trainer arguments (``precision``, ``plugins``, ``callbacks``) for one run.
        builtin: the name of Lightning's built-in configuration at the same precision (itself for the built-ins).
        cuda_only: left out of the defaults on the CPU, where it would only measure emulation.
        float32_matmul: ``"highest"`` turns TF32 off for matrix products and cuDNN convolutions during the run,
            ``"high"`` turns it on; None leaves torch's settings as they are.
        prepare_network: changes the freshly built network in place before it is compiled and trained (None:
            nothing); bare torchao converts its layers here.

    """

    name: str
    description: str
    trainer_arguments: Callable[[], dict[str, Any]]
    builtin: str
    cuda_only: bool = False
    float32_matmul: Float32Matmul | None = None
    prepare_network: Callable[[nn.Module], None] | None = None


@contextlib.contextmanager
def float32_matmul(precision: Float32Matmul | None) -> Generator[None, None, None]:
    """Set how fp32 matrix products and convolutions run (TF32 or not) for the ``with`` block, then restore it."""
    if precision is None:
        yield
        return
    previous = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision(precision)
    torch.backends.cudnn.allow_tf32 = precision != "highest"
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous[0])
        torch.backends.cudnn.allow_tf32 = previous[1]


def _builtin(precision: str) -> Callable[[], dict[str, Any]]:
    return lambda: {"precision": precision}


def _plugin(precision: PrecisionName, opt_level: str) -> Callable[[], dict[str, Any]]:
    return lambda: {"plugins": [MixedPrecision(precision, opt_level=opt_level)]}


def _three_monitors(precision: PrecisionName, opt_level: str) -> Callable[[], dict[str, Any]]:
    def arguments() -> dict[str, Any]:
        monitors = [LossScaleMonitor(), GradientHealthMonitor(), LayerDtypeMonitor()]
        return {**_plugin(precision, opt_level)(), "callbacks": monitors}

    return arguments


def _four_monitors(precision: PrecisionName, opt_level: str) -> Callable[[], dict[str, Any]]:
    def arguments() -> dict[str, Any]:
        monitors: list[L.Callback] = [
            LossScaleMonitor(),
            GradientHealthMonitor(),
            LayerDtypeMonitor(every_n_steps=MONITOR_EVERY_N_STEPS),
            PrecisionSentinel(every_n_steps=MONITOR_EVERY_N_STEPS),
        ]
        return {**_plugin(precision, opt_level)(), "callbacks": monitors}

    return arguments


FP8_MONITOR_EVERY_N_STEPS = 50
"""How often the monitored FP8 configuration samples its layers: the cadence the FP8 telemetry's cost target names."""


def _fp8_plugin(recipe: str, monitored: bool = False) -> Callable[[], dict[str, Any]]:
    def arguments() -> dict[str, Any]:
        # Imported here: the FP8 mode needs torchao, an optional dependency the other configurations do not.
        from lightning_mp.fp8.telemetry import FP8Monitor

        plugins = [MixedPrecision("bf16-mixed", fp8=recipe)]
        if not monitored:
            return {"plugins": plugins}
        return {"plugins": plugins, "callbacks": [FP8Monitor(every_n_steps=FP8_MONITOR_EVERY_N_STEPS)]}

    return arguments


def _torchao_layers(recipe: str) -> Callable[[nn.Module], None]:
    """Bare torchao: its ``convert_to_float8_training`` on the layers the FP8 mode would choose (same matmuls)."""

    def convert(network: nn.Module) -> None:
        from lightning_mp.fp8.convert import convert_to_fp8
        from lightning_mp.fp8.selection import select_fp8_layers
        from lightning_mp.fp8.settings import FP8Settings

        settings = FP8Settings(recipe)
        convert_to_fp8(network, settings, select_fp8_layers(network, settings).fp8)

    return convert


CONFIGURATIONS: dict[str, Configuration] = {
    config.name: config
    for config in (
        Configuration(FP32, 'Lightning precision="32-true" (TF32 off)', _builtin("32-true"), FP32, False, "highest"),
        Configuration("lightning-bf16", 'Lightning precision="bf16-mixed"', _builtin("bf16-mixed"), "lightning-bf16"),
        Configuration("O1-bf16", "MixedPrecision bf16, O1", _plugin("bf16-mixed", "O1"), "lightning-bf16"),
        Configuration("O2-bf16", "MixedPrecision bf16, O2", _plugin("bf16-mixed", "O2"), "lightning-bf16"),
        Configuration("lean-bf16", "MixedPrecision bf16, lean", _plugin("bf16-mixed", "lean"), "lightning-bf16"),
        Configuration(
            "lean-kahan-bf16", "MixedPrecision bf16, lean-kahan", _plugin("bf16-mixed", "lean-kahan"), "lightning-bf16"
        ),
        Configuration(
            "lean-exact-bf16", "MixedPrecision bf16, lean-exact", _plugin("bf16-mixed", "lean-exact"), "lightning-bf16"
        ),
        Configuration(
            "O1-bf16+monitors", "O1-bf16 with the three monitors", _three_monitors("bf16-mixed", "O1"), "lightning-bf16"
        ),
        Configuration(
            "lightning-fp16", 'Lightning precision="16-mixed"', _builtin("16-mixed"), "lightning-fp16", cuda_only=True
        ),
        Configuration("O1-fp16", "MixedPrecision fp16, O1", _plugin("16-mixed", "O1"), "lightning-fp16", True),
        Configuration("O2-fp16", "MixedPrecision fp16, O2", _plugin("16-mixed", "O2"), "lightning-fp16", True),
        Configuration(
            "fp32-tf32",
            'Lightning precision="32-true", TF32 on (set_float32_matmul_precision("high"))',
            _builtin("32-true"),
            FP32,
            cuda_only=True,
            float32_matmul="high",
        ),
        Configuration(
            "lightning-bf16-true",
            'Lightning precision="bf16-true"',
            _builtin("bf16-true"),
            "lightning-bf16-true",
        ),
        Configuration(
            "O1-fp16+monitors",
            f"O1-fp16 with the four monitors, TensorBoard every {MONITOR_EVERY_N_STEPS} steps",
            _four_monitors("16-mixed", "O1"),
            "lightning-fp16",
            cuda_only=True,
        ),
        Configuration(
            "fp8-tensorwise", 'MixedPrecision bf16, O1, fp8="tensorwise"', _fp8_plugin("tensorwise"), "lightning-bf16"
        ),
        Configuration(
            "fp8-rowwise", 'MixedPrecision bf16, O1, fp8="rowwise"', _fp8_plugin("rowwise"), "lightning-bf16"
        ),
        Configuration(
            "fp8-tensorwise+monitor",
            f"fp8-tensorwise with FP8Monitor sampling every {FP8_MONITOR_EVERY_N_STEPS} steps",
            _fp8_plugin("tensorwise", monitored=True),
            "lightning-bf16",
        ),
        Configuration(
            "torchao-tensorwise",
            'Lightning precision="bf16-mixed", the same layers converted by torchao\'s convert_to_float8_training'
            ' ("tensorwise")',
            _builtin("bf16-mixed"),
            "lightning-bf16",
            prepare_network=_torchao_layers("tensorwise"),
        ),
    )
}
"""Every configuration by name, in the order the reports list them."""

MARKOV_CONFIGURATIONS = (
    FP32,
    "lightning-bf16",
    "O1-bf16",
    "O2-bf16",
    "lean-bf16",
    "O1-bf16+monitors",
    "lightning-fp16",
    "O1-fp16",
    "O2-fp16",
)
"""What the Markov-text model runs by default (the fp16 ones only on CUDA)."""
GPU_WORKLOAD_CONFIGURATIONS = (
    FP32,
    "fp32-tf32",
    "lightning-fp16",
    "lightning-bf16",
    "lightning-bf16-true",
    "O1-fp16",
    "O1-bf16",
    "O2-fp16",
    "O2-bf16",
    "lean-bf16",
    "O1-fp16+monitors",
)
"""What the GPU-sized workloads run by default: the baselines users compare with, then the package's setups."""
QUICK_CONFIGURATIONS = (FP32, "O1-bf16")


def default_configurations(accelerator: str, names: tuple[str, ...] = MARKOV_CONFIGURATIONS) -> list[str]:
    """The configurations of ``names`` that the device runs fast: the fp16 and TF32 ones only on CUDA."""
    return [name for name in names if accelerator == "gpu" or not CONFIGURATIONS[name].cuda_only]
