"""A thin adapter over torchao's float8 training: convert the chosen linear layers, and put plain ones back.

:func:`convert_to_fp8` hands the model to ``torchao.float8.convert_to_float8_training`` with a ``module_filter_fn``
that admits exactly the layers :func:`~lightning_mp.fp8.selection.select_fp8_layers` chose. torchao replaces each
one, in its parent, by a ``Float8Linear`` that holds the *same* ``weight`` and ``bias`` Parameter objects, so an
optimizer built before the conversion (Fabric) or after it (the Trainer) steps the same tensors, and the model's
``state_dict`` keeps its keys: an FP8 checkpoint is a bf16 checkpoint. At every matmul the ``Float8Linear`` computes
a scale from each operand's current amax (dynamic scaling), casts the input and the weight to e4m3 and the output
gradient to e5m2 (e4m3 in the rowwise recipes), multiplies with ``torch._scaled_mm`` and returns the high-precision
result. A transformers ``Conv1D`` (a linear layer with its weight stored transposed) becomes a
:class:`~lightning_mp.fp8.transposed.Float8TransposedLinear` instead, which also keeps its Parameter objects and its
``state_dict``, and runs the same FP8 matmul.

:func:`restore_linear` undoes it: each ``Float8Linear`` is replaced by a plain ``nn.Linear`` built on the meta
device and given the very same ``weight`` and ``bias`` Parameter objects, so nothing is copied, and an optimizer's
state (keyed by those objects) still belongs to them. The plugin calls it at teardown, so that after fit the model
holds no torchao object (``torch.save`` of the whole model loads without torchao), and for a single layer when it
falls back to bf16 mid-run (:func:`fallback_layer`). Hooks registered on a ``Float8Linear`` stay with that replaced
object. A ``Float8TransposedLinear`` gives back the original ``Conv1D``, holding the same Parameters.

The checks the FP8 mode needs before it starts are here too: torchao installed (the ``fp8`` extra), the torch and
torchao versions at or above the mode's floor (:data:`TORCH_FLOOR`, :data:`TORCHAO_FLOOR`), and a CUDA GPU able to
multiply in FP8 (compute capability 8.9: Ada, Hopper, Blackwell). The CPU runs the same code through torch's CPU
``_scaled_mm``: slow, exact to the FP8 rounding, and meant for tests.

``Float8Linear`` is torchao's class, not documented as public API; it is named only to recognise converted layers.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Collection
from dataclasses import replace
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_mp.arguments.checks import caller
from lightning_mp.fp8.host import fp8_host_of
from lightning_mp.fp8.settings import FP8Settings
from lightning_mp.fp8.transposed import Float8TransposedLinear, is_conv1d

__all__ = [
    "FP8_EXTRA_INSTALL",
    "MIN_COMPUTE_CAPABILITY",
    "TORCHAO_FLOOR",
    "TORCH_FLOOR",
    "check_fp8_device",
    "convert_to_fp8",
    "fallback_layer",
    "fp8_layer_names",
    "fp8_unavailable",
    "is_fp8_linear",
    "require_torchao",
    "restore_linear",
]

FP8_EXTRA_INSTALL = 'pip install -e ".[fp8]"'
TORCH_FLOOR = (2, 11, 0)
"""torchao 0.18.0's wheels are built against torch 2.11: below it torchao skips its kernels and is untested."""
TORCHAO_FLOOR = (0, 18, 0)
"""The torchao release the FP8 mode is written and tested against (``torchao.float8``'s recipes and config)."""
MIN_COMPUTE_CAPABILITY = (8, 9)
"""FP8 tensor cores: Ada (8.9: L4, L40S), Hopper (9.0: H100, H200), Blackwell (10.0: B200)."""


def _release(text: str) -> tuple[int, ...]:
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)``; a pre-release counts as its release."""
    numbers = []
    for part in text.split("+")[0].split(".")[:3]:
        digits = "".join(character for character in part if character.isdigit()) or "0"
        numbers.append(int(digits) if part[:1].isdigit() else 0)
    return tuple(numbers)


def _dotted(release: tuple[int, ...]) -> str:
    return ".".join(map(str, release))


def fp8_unavailable() -> str | None:
    """Why the FP8 mode cannot run in this environment (torchao missing, torch or torchao too old); None if it can.

    Reads package versions only: nothing is imported, so it is safe where an old torchao would fail to import.
    """
    torch_release = _release(torch.__version__)
    if torch_release < TORCH_FLOOR:
        return (
            f"needs torch >= {_dotted(TORCH_FLOOR)} (torchao's float8 training is built against it); this is torch"
            f" {torch.__version__}. Upgrade torch, or train without fp8 (the rest of the package runs on torch >= 2.8)."
        )
    try:
        installed = version("torchao")
    except PackageNotFoundError:
        return (
            f"needs torchao, which is not installed. Install the fp8 extra from the repository: {FP8_EXTRA_INSTALL},"
            f' or torchao itself: pip install "torchao>={_dotted(TORCHAO_FLOOR)}" (it installs no torch of its own).'
        )
    if _release(installed) < TORCHAO_FLOOR:
        return (
            f"needs torchao >= {_dotted(TORCHAO_FLOOR)}; this is torchao {installed}. Upgrade it:"
            f' pip install --upgrade "torchao>={_dotted(TORCHAO_FLOOR)}".'
        )
    return None


def require_torchao(recipe: str) -> Any:
    """Import ``torchao.float8``; refuse clearly when torchao is missing or torch or torchao is below the floor.

    Returns:
        The ``torchao.float8`` module.

    Raises:
        ModuleNotFoundError: when torchao is not installed, naming the ``fp8`` extra.
        RuntimeError: when torch or torchao is older than the FP8 mode's floor, naming both versions.

    """
    problem = fp8_unavailable()
    if problem is not None:
        message = f"{caller()}(fp8={recipe!r}) {problem}"
        if "not installed" in problem:
            raise ModuleNotFoundError(message, name="torchao")
        raise RuntimeError(message)
    return importlib.import_module("torchao.float8")


def check_fp8_device(recipe: str, device_type: str, device: torch.device | None = None) -> None:
    """Refuse a device that cannot multiply in FP8: a CUDA GPU below compute capability 8.9, or not CUDA nor CPU.

    Raises:
        RuntimeError: naming the GPU, its compute capability and what to use instead.

    """
    asked = f"{caller()}(fp8={recipe!r})"
    if device_type == "cpu":
        return
    if device_type != "cuda":
        raise RuntimeError(
            f"{asked} runs on CUDA GPUs of compute capability >= 8.9, and on the CPU for tests; this run is on"
            f" {device_type!r}. Train without fp8 there: MixedPrecision('bf16-mixed')."
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_COMPUTE_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise RuntimeError(
            f"{asked} needs a GPU with FP8 tensor cores (compute capability >= 8.9: L4, L40S, H100, H200, B200);"
            f" {name} has compute capability {capability[0]}.{capability[1]}. Use MixedPrecision('bf16-mixed')"
            " without fp8 there: bf16 is the fastest precision this GPU multiplies in."
        )


def is_fp8_linear(module: nn.Module) -> bool:
    """Whether ``module`` is a linear layer converted to FP8: torchao's ``Float8Linear``, or a transposed one's form.

    False for everything while torchao is not imported, since nothing can be converted before; it imports nothing.
    """
    float8_linear = sys.modules.get("torchao.float8.float8_linear")
    return float8_linear is not None and isinstance(module, (float8_linear.Float8Linear, Float8TransposedLinear))


def fp8_layer_names(model: nn.Module) -> list[str]:
    """Qualified names of the layers of ``model`` that compute in FP8 now, in ``named_modules`` order."""
    return [name for name, module in model.named_modules() if is_fp8_linear(module)]


def convert_to_fp8(model: nn.Module, settings: FP8Settings, layers: Collection[str]) -> list[str]:
    """Convert the linear layers named in ``layers`` (names relative to ``model``) to FP8, in place.

    Returns:
        The names converted, in ``named_modules`` order.

    """
    float8 = importlib.import_module("torchao.float8")
    config = float8.Float8LinearConfig.from_recipe_name(settings.recipe)
    if settings.fsdp_float8_all_gather:
        config = replace(config, enable_fsdp_float8_all_gather=True)
    chosen = set(layers)
    float8.convert_to_float8_training(
        model, module_filter_fn=lambda module, name: name in chosen and not is_fp8_linear(module), config=config
    )
    for name, module in list(model.named_modules()):
        if name in chosen and is_conv1d(module):
            parent, child = _parent(model, name)
            setattr(parent, child, Float8TransposedLinear(module, config))
    return fp8_layer_names(model)


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent_name, _, child = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), child


def restore_linear(model: nn.Module, names: Collection[str] | None = None) -> list[str]:
    """Put plain ``nn.Linear`` layers (and ``Conv1D`` ones) back in place of FP8 ones, with the same Parameter objects.

    Args:
        model: the model, converted in place by :func:`convert_to_fp8`.
        names: the FP8 layers to restore (names relative to ``model``); None restores every one.

    Returns:
        The names restored.

    Raises:
        ValueError: when a name given is not an FP8 layer of ``model``.

    """
    present = fp8_layer_names(model)
    chosen = present if names is None else list(names)
    unknown = [name for name in chosen if name not in present]
    if unknown:
        raise ValueError(
            f"restore_linear(names={unknown!r}) is not allowed: those are not FP8 layers of the model; its FP8 layers"
            f" are {present}."
        )
    for name in chosen:
        parent, child = _parent(model, name)
        fp8_layer = getattr(parent, child)
        if isinstance(fp8_layer, Float8TransposedLinear):
            setattr(parent, child, fp8_layer.restored())
            continue
        with torch.device("meta"):
            plain = nn.Linear(fp8_layer.in_features, fp8_layer.out_features, bias=False)
        plain.weight = fp8_layer.weight
        plain.bias = fp8_layer.bias
        plain.train(fp8_layer.training)
        setattr(parent, child, plain)
    return chosen


def fallback_layer(model: nn.Module, name: str, reason: str) -> bool:
    """Return the FP8 layer ``name`` of ``model`` to bf16 for the rest of the run, keeping its Parameter objects.

    Under a Trainer whose plugin is :class:`~lightning_mp.MixedPrecision` with ``fp8``, this is the plugin's
    :meth:`~lightning_mp.MixedPrecision.fallback_layer`: the decision is agreed across ranks by one collective,
    logged with ``reason`` and kept in the plugin's checkpoint entry, so a resumed run keeps the layer in bf16.
    Elsewhere (Fabric, a bare model) the layer is restored on this process only.

    .. warning:: Under a Trainer with DDP this is a collective: every rank must call it at the same step.

    Returns:
        Whether the layer fell back now (False where it was not an FP8 layer any more).

    """
    host = fp8_host_of(model)
    if host is not None:
        return name in host.fallback_layers(model, {name: reason})
    if name not in fp8_layer_names(model):
        return False
    restore_linear(model, [name])
    rank_zero_info(f"lightning_mp: FP8 layer {name!r} returns to bf16 for the rest of the run: {reason}.")
    return True
