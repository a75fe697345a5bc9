"""The models one Fabric sets up with the plugin: where they are, which ones an optimizer steps, and their inputs.

Fabric converts a model before it moves it to its device and tells a precision plugin nothing of its accelerator, so
the Fabric engine asks these models where they are at every forward (:meth:`FabricModels.device_type`) and checks
that the inputs are there too (:func:`check_input_device`); an optimizer is connected with the model it steps
(:meth:`FabricModels.module_of`); and, once, at the first forward, a model that Fabric's strategy sharded after the
plugin converted it is refused where the opt level does not combine with the sharding
(:func:`~lightning_mp.policies.sharded.refuse_sharding_after_conversion`). A model that is a DeepSpeed engine
(Fabric's ``DeepSpeedStrategy``) is refused at its first backward (:func:`refuse_deepspeed_engine`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mp.front_ends import is_deepspeed_engine
from lightning_mp.policies import PrecisionPolicy
from lightning_mp.policies.sharded import refuse_sharding_after_conversion
from lightning_mp.scaling.per_optimizer import RunScaler


def check_input_device(data: Any, device_type: str) -> None:
    """Raise when a tensor in ``data`` is on another device type than the plugin's autocast would cover.

    Without this check, inputs left on another device than the model's would run outside autocast, unnoticed.

    Raises:
        ValueError: naming the device types and the fix.

    """
    found: set[str] = set()
    apply_to_collection(data, Tensor, lambda tensor: found.add(tensor.device.type))
    other = sorted(found - {device_type})
    if other:
        raise ValueError(
            f"MixedPrecision autocasts on {device_type!r}, where the model is, but the model's inputs are on {other}."
            f" Move them to the model's device first (fabric.to_device(batch))."
        )


def warn_if_resumed_without_plugin_state(optimizer: Optimizer, loss_scaler: RunScaler, state_loaded: bool) -> None:
    """Warn when an optimizer arrives with a loaded state but the plugin's state was not loaded.

    That is a resume (``fabric.load`` of the model and the optimizer) that left the plugin out of the state: the fp16
    scale then starts again from ``init_scale``. Fine-tuning from weights alone has no optimizer state.
    """
    resumed = optimizer.state and not state_loaded and loss_scaler.optimizer_steps == 0
    if resumed and loss_scaler.scales_loss:
        warnings.warn(
            "lightning_mp: fabric.load restored the optimizer but not the plugin's state, so the loss scale starts"
            f" again from init_scale={loss_scaler.get_scale():g}. To resume the scale, save and load the plugin in"
            ' the state too: {"model": model, "optimizer": optimizer, "precision": plugin}.',
            UserWarning,
            stacklevel=4,
        )


_PLACEHOLDERS: dict[str, Tensor] = {}


def zero_gradient_placeholder(device: torch.device) -> Tensor:
    """A tensor with a zero gradient on ``device``, clipped in place of the parameters of a step that will be skipped.

    Not an empty list: torch's ``clip_grad_value_`` fails on one (``clip_grad_norm_`` would return 0 for it).
    """
    placeholder = _PLACEHOLDERS.get(str(device))
    if placeholder is None:
        placeholder = _PLACEHOLDERS[str(device)] = torch.zeros(1, device=device)
    placeholder.grad = torch.zeros(1, device=device)
    return placeholder


class FabricModels:
    """The models set up by one Fabric with the plugin (a GAN's two).

    Args:
        follow_device: given the device type the models are on now (None without parameters), returns the device
            type to autocast on, or raises where the plugin's settings contradict it.
        plugin: the plugin as the user built it (its ``repr``), which a refusal of a model names.

    """

    def __init__(self, follow_device: Callable[[str | None], str], plugin: str = "MixedPrecision") -> None:
        self.follow_device = follow_device
        self.plugin = plugin
        self.modules: list[nn.Module] = []
        self._sharding_checked = False

    def add(self, module: nn.Module) -> bool:
        """Drive ``module`` too; whether it is new."""
        if any(known is module for known in self.modules):
            return False
        self.modules.append(module)
        return True

    def device_type(self) -> str | None:
        """The device type the models' parameters are on now (Fabric moves them after the plugin converted them)."""
        # A loop, not next() over a generator expression: this runs in every forward, also inside a model compiled
        # after fabric.setup, and dynamo before torch 2.9 cannot trace next(generator, default).
        for module in self.modules:
            for parameter in module.parameters():
                return parameter.device.type
        return None

    def check_input(self, data: Any) -> None:
        """Raise where ``data`` lives on another device type than the models (or the models on another than asked).

        Raises:
            ValueError: naming the device types and the fix.

        """
        check_input_device(data, self.follow_device(self.device_type()))

    def check_sharding_once(self, policy: PrecisionPolicy) -> None:
        """At the first forward, refuse models sharded after their conversion where the opt level cannot combine."""
        if not self._sharding_checked:
            self._sharding_checked = True
            refuse_sharding_after_conversion(policy, self.modules)

    def modules_of(self, optimizer: Optimizer) -> list[nn.Module]:
        """The models with a parameter that ``optimizer`` steps (one optimizer may step several models)."""
        stepped = {id(parameter) for group in optimizer.param_groups for parameter in group["params"]}
        return [m for m in self.modules if any(id(parameter) in stepped for parameter in m.parameters())]

    def module_of(self, optimizer: Optimizer) -> nn.Module:
        """The model ``optimizer`` is connected with: the first it steps, else the last set up."""
        owners = self.modules_of(optimizer)
        return owners[0] if owners else self.modules[-1]


def refuse_deepspeed_engine(module: Any, plugin: str) -> None:
    """Refuse a backward through a DeepSpeed engine: under Fabric's ``DeepSpeedStrategy`` DeepSpeed casts and scales.

    ``plugin`` is the plugin as the user built it (its ``repr``: precision, opt level, FP8 recipe), which the message
    names.

    Raises:
        TypeError: naming this package's DeepSpeed plugin and how Fabric takes it.

    """
    if is_deepspeed_engine(module):
        raise TypeError(
            f"{plugin} does not run under Fabric's DeepSpeedStrategy: DeepSpeed's own fp16 or bf16 engine"
            " would cast and scale too. Use lightning_mp.DeepSpeedMixedPrecision there, which maps this package's"
            " settings onto DeepSpeed's engine and counts its skipped steps: plugin = DeepSpeedMixedPrecision(...);"
            " Fabric(strategy=DeepSpeedStrategy(..., **plugin.strategy_arguments()), plugins=[plugin])."
        )
