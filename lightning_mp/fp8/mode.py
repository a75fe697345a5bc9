"""The FP8 mode of :class:`~lightning_mp.MixedPrecision`: one run's FP8 layers, fallbacks and checkpoint state.

Why ``MixedPrecision("bf16-mixed", fp8="tensorwise")`` rather than a separate plugin or a precision string such as
``"fp8-mixed"``: FP8 replaces only the linear layers' matmuls, and everything else (autocast for the rest of the
model, the opt level's weights and masters, the non-finite step check, ``keep_fp32``, the counters, checkpoints,
DDP, the callbacks) is the bf16 run's. A flag on the same plugin keeps one object to configure, to pass to the
Trainer or Fabric and to checkpoint, and lets an FP8 checkpoint resume in bf16 and back by changing one argument.
A recipe name is the short form; :class:`~lightning_mp.fp8.settings.FP8Settings` carries the rest (the layers kept,
the fallback thresholds), validated once, as a ready ``scaler=`` carries the scaler's settings.

What combines with FP8, checked when the plugin is built (:func:`check_fp8_combination`):

- ``precision="bf16-mixed"`` only. fp16 is refused: FP8's dynamic scales already do what a loss scale does for the
  matmuls, and fp16 elsewhere would add an overflow-prone range for nothing. ``"auto"`` and ``"32-true"`` are
  refused too, so that what runs is what was asked for.
- ``opt_level="O1"`` (fp32 weights, autocast; the FP8 layers cast their fp32 weight to FP8 at each matmul) and
  ``"O2"`` (bf16 weights with fp32 masters; the FP8 layers cast the bf16 copy). ``O0`` (pure fp32), ``O3`` and the
  ``lean`` levels (half weights without masters: FP8's coarse steps on top of bf16 weight updates lose them) are
  refused by name.

One run, in order:

1. ``convert_module`` (before the opt level converts, the model moves and DDP wraps it): the rules of
   :mod:`lightning_mp.fp8.selection` choose the layers (``keep_fp32`` layers stay out too), torchao converts them in
   place (:mod:`lightning_mp.fp8.convert`), and one line at rank zero says how many layers and parameters run FP8
   and which stay bf16 and why. Under FSDP2 the model converts itself earlier, with ``plugin.fp8_convert(self)`` in
   ``configure_model`` before ``fully_shard`` (torchao's layers must exist before FSDP2 shards their weights), and the
   plugin finds it converted.
2. Training runs torchao's layers as they are: no hook, no sync, no extra op of this package.
3. :meth:`Fp8Mode.fallback_layers` returns layers to bf16 mid-run. Every rank calls it at the same step with the
   layers it would return (possibly none), and one ``all_reduce`` (MAX over a flag per FP8 layer, in the same order on
   every rank) makes the decision the union, identical everywhere. Each layer is replaced by a plain ``nn.Linear``
   with the same Parameter objects, so the optimizer state stays the same objects; the reason is logged and kept in
   the plugin's checkpoint entry, so a resumed run keeps those layers in bf16. Under O2 call it where the model shows
   its fp32 masters (between an optimizer step and the next forward: ``on_train_batch_start``/``_end``): the plain
   layer then holds the master and computes from it under autocast, as an O1 layer does, for the rest of the run.
4. ``teardown`` (after fit, also a failed one): every FP8 layer becomes a plain ``nn.Linear`` again, except in a
   model FSDP2 sharded, which is no plain model anyway and whose layer objects FSDP2 holds.

.. warning:: :meth:`Fp8Mode.fallback_layers` runs one collective under DDP and reads its result on the host: call it
    on logging steps only, on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_mp.arguments.checks import caller
from lightning_mp.fp8.convert import check_fp8_device, convert_to_fp8, fp8_layer_names, require_torchao, restore_linear
from lightning_mp.fp8.selection import Fp8Selection, select_fp8_layers, shortfall_warning, summary_line
from lightning_mp.fp8.settings import FP8Settings
from lightning_mp.fp8.telemetry import FP8Monitor

__all__ = [
    "FP8_OPT_LEVELS",
    "Fp8Mode",
    "check_fp8_combination",
    "check_fp8_device",
    "require_torchao",
    "warn_if_fallback_unwatched",
]
"""The plugin's interface to FP8: it imports from this module and :mod:`lightning_mp.fp8.settings`, nothing else of
``fp8/`` (the device and torchao checks are :mod:`lightning_mp.fp8.convert`'s, offered here)."""

FP8_OPT_LEVELS = ("O1", "O2")
"""The opt levels the FP8 mode combines with."""


def check_fp8_combination(
    settings: FP8Settings, precision: str, opt_level: str, eval_precision: str | None = None
) -> None:
    """Refuse a precision or an opt level FP8 does not combine with (module docstring), naming it and the fix.

    Raises:
        ValueError: naming the argument, its value and what is allowed.

    """
    asked = f"{caller()}(precision={precision!r}, fp8={settings.recipe!r})"
    if precision == "16-mixed":
        raise ValueError(
            f"{asked} is not supported: FP8 runs beside bf16, not fp16 (FP8's per-matmul scales replace the loss"
            " scale, and fp16 elsewhere would only add overflows). Use precision='bf16-mixed' with fp8, or"
            " '16-mixed' without it."
        )
    if precision != "bf16-mixed":
        raise ValueError(
            f"{asked} is not supported: fp8 needs precision='bf16-mixed' (the layers that stay out of FP8 run in"
            " bf16). Pass precision='bf16-mixed'."
        )
    if opt_level not in FP8_OPT_LEVELS:
        raise ValueError(
            f"{caller()}(opt_level={opt_level!r}, fp8={settings.recipe!r}) is not supported: fp8 combines with"
            f" opt_level {' or '.join(repr(level) for level in FP8_OPT_LEVELS)} (fp32 or fp32-master weights);"
            f" {opt_level!r} is refused. Use opt_level='O1' (the default) or 'O2'."
        )
    if eval_precision not in (None, "bf16-mixed"):
        raise ValueError(
            f"{caller()}(eval_precision={eval_precision!r}, fp8={settings.recipe!r}) is not supported: the FP8 layers"
            " compute in FP8 in evaluation too, so no other precision could be honoured. Leave eval_precision=None"
            " (or 'bf16-mixed') with fp8, or evaluate a model trained without fp8."
        )


def warn_if_fallback_unwatched(settings: FP8Settings, callbacks: Sequence[object]) -> None:
    """Warn where ``FP8Settings(fallback=True)`` has no :class:`~lightning_mp.FP8Monitor` among a Trainer's callbacks.

    The fallback returns layers to bf16 by what the monitor measures: without one, no layer ever falls back.
    """
    if settings.fallback and not any(isinstance(callback, FP8Monitor) for callback in callbacks):
        rank_zero_warn(
            "lightning_mp: FP8Settings(fallback=True) falls back by what FP8Monitor measures, and this Trainer has"
            " none, so no layer will fall back. Add callbacks=[FP8Monitor()] (it takes the settings' thresholds)."
        )


def _converted_inside(model: nn.Module, converted: nn.Module) -> nn.Module:
    """``converted`` where ``model`` wraps it (the module ``fabric.setup`` returned, DDP's), else ``model``.

    Fabric's and DDP's wrappers both expose the module they wrap as ``module``.
    """
    wrapper = model
    for _ in range(4):
        if wrapper is converted:
            return converted
        inner = getattr(wrapper, "module", None)
        if not isinstance(inner, nn.Module):
            break
        wrapper = inner
    return model


def _is_sharded(module: nn.Module) -> bool:
    return any(isinstance(parameter, DTensor) for parameter in module.parameters(recurse=False))


class Fp8Mode:
    """One run's FP8 state: the model converted, the layers that fell back and why.

    Args:
        settings: the validated FP8 settings.

    """

    def __init__(self, settings: FP8Settings) -> None:
        self.settings = settings
        self.fell_back: dict[str, str] = {}
        """Layer name -> reason, for every layer returned to bf16 during the run (kept across resume)."""
        self.selection: Fp8Selection | None = None
        self._model: nn.Module | None = None
        self._keep_fp32: list[Any] = []

    @property
    def layers(self) -> list[str]:
        """Names of the layers computing in FP8 now, relative to the converted model; empty before setup."""
        return fp8_layer_names(self._model) if self._model is not None else []

    def converted(self, model: nn.Module) -> bool:
        """Whether ``model`` is the model this run converted already (:meth:`MixedPrecision.fp8_convert`)."""
        return self._model is model

    def convert(self, model: nn.Module, keep_fp32: list[Any]) -> None:
        """Choose and convert the FP8 layers of ``model`` in place, and log the setup line at rank zero."""
        restore_linear(model)  # a model left converted by an interrupted run starts from plain layers
        self.selection = select_fp8_layers(model, self.settings, self.fell_back, keep_fp32=keep_fp32)
        convert_to_fp8(model, self.settings, self.selection.fp8)
        self._model = model
        self._keep_fp32 = list(keep_fp32)
        rank_zero_info(f"lightning_mp: {summary_line(self.selection, self.settings.recipe)}")
        warning = shortfall_warning(self.selection, self.settings.recipe)
        if warning is not None:
            rank_zero_warn(warning)

    def fallback_layers(self, model: nn.Module, requests: Mapping[str, str]) -> dict[str, str]:
        """Return the layers any rank asks for to bf16, on every rank alike (module docstring, point 3).

        Args:
            model: the converted model (the LightningModule under the Trainer, the module given to Fabric).
            requests: layer name -> reason, for the layers this rank would return to bf16; may be empty. A layer
                that fell back already is ignored.

        Returns:
            Layer name -> reason, for the layers that fell back now (on every rank the same names; the reason is
            this rank's own, or says another rank asked).

        Raises:
            ValueError: for a name that is not an FP8 layer of ``model`` now, or a reason that is not a string.
            RuntimeError: before the model was converted, or when ``model`` is not the converted model.

        """
        if self._model is None:
            raise RuntimeError(
                "fallback_layer(...) needs a running FP8 model: call it after the Trainer or Fabric set the model up."
            )
        model = _converted_inside(model, self._model)
        if model is not self._model:
            raise RuntimeError(
                f"fallback_layer(model={type(model).__name__}) is not the model the FP8 mode converted"
                f" ({type(self._model).__name__}); pass the LightningModule (Trainer), or under Fabric the module"
                " given to fabric.setup or the one it returned, whose layer names the FP8 mode knows."
            )
        current = self.layers
        if any(_is_sharded(model.get_submodule(name)) for name in requests if name in current):
            raise RuntimeError(
                f"fallback_layer(name={next(iter(requests))!r}) is not supported on a model FSDP2 sharded: FSDP2 holds"
                " the layer objects. Keep the layer out of FP8 with FP8Settings(exclude=[...]) and resume from the"
                " last checkpoint."
            )
        requests = {name: reason for name, reason in requests.items() if name not in self.fell_back}
        for name, reason in requests.items():
            if name not in current:
                raise ValueError(
                    f"fallback_layer(name={name!r}) is not allowed: it is not an FP8 layer of the model now; its FP8"
                    f" layers are {current}."
                )
            if not isinstance(reason, str):
                raise ValueError(f"fallback_layer(reason={reason!r}) is not allowed: the reason must be a string.")
        flags = torch.tensor([name in requests for name in current], dtype=torch.int32)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            device = next(model.parameters()).device if dist.get_backend() != "gloo" else torch.device("cpu")
            flags = flags.to(device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        decided = [name for name, flag in zip(current, flags.tolist(), strict=True) if flag]
        fell = {name: requests.get(name, "another rank asked for it") for name in decided}
        restore_linear(model, decided)
        self.fell_back.update(fell)
        for name, reason in fell.items():
            rank_zero_info(f"lightning_mp: FP8 layer {name!r} returns to bf16 for the rest of the run: {reason}.")
        return fell

    def state_dict(self) -> dict[str, Any]:
        """The recipe and the layers that fell back, for the plugin's checkpoint entry."""
        return {"recipe": self.settings.recipe, "fell_back": dict(self.fell_back)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Keep a checkpoint's fallbacks: layers still in FP8 that fell back in the saved run return to bf16 now.

        Raises:
            ValueError: when ``fell_back`` is not a dict of names to reasons (a damaged checkpoint).

        """
        fell_back = state.get("fell_back", {})
        if not isinstance(fell_back, dict) or not all(
            isinstance(name, str) and isinstance(reason, str) for name, reason in fell_back.items()
        ):
            raise ValueError(
                f"The checkpoint's MixedPrecision state has 'fp8'={dict(state)!r}; expected 'fell_back' to map layer"
                " names to reasons. The checkpoint is damaged."
            )
        self.fell_back.update(fell_back)
        if self._model is not None:
            returned = [name for name in fell_back if name in self.layers]
            restore_linear(self._model, returned)
            if returned:
                # The setup line was written before the checkpoint: say what runs FP8 now.
                self.selection = select_fp8_layers(
                    self._model, self.settings, self.fell_back, keep_fp32=self._keep_fp32
                )
                line = summary_line(self.selection, self.settings.recipe)
                rank_zero_info(f"lightning_mp: after the checkpoint's fallbacks: {line}")

    def teardown(self) -> None:
        """Put plain ``nn.Linear`` layers back everywhere, except in a model FSDP2 sharded; forget the model."""
        if self._model is not None and not any(_is_sharded(layer) for layer in self._model.modules()):
            restore_linear(self._model)
        self._model = None
