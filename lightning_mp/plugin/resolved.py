"""What a run's setup resolves, once: the device, the precision, the opt level that runs, the precision Lightning sees.

A plugin is built from what the user asked for (:class:`~lightning_mp.settings.PluginSettings`), but the device is
known only when the Trainer or Fabric sets the run up. :func:`resolve_setup` then turns the settings and the device
into one frozen :class:`ResolvedSetup`, which the plugin's hooks read and none derives again:

* ``precision="auto"`` becomes bf16 where the device runs it natively, else fp16 on GPUs and MPS and fp32 on CPUs
  (:func:`~lightning_mp.plugin.hardware.choose_precision`), with the reason, logged once;
* fp32 runs the ``O0`` opt level, whichever level was asked for: there is nothing to cast;
* ``eval_precision`` becomes what validation, test and predict compute with
  (:func:`~lightning_mp.policies.evaluation.eval_mode`), ``"auto"`` as ``precision="auto"`` chooses;
* an opt level that keeps half weights with no fp32 masters (O3, lean) is shown to Lightning as ``"16-true"`` or
  ``"bf16-true"``, the names of Lightning's own half-weight runs, so that its ``ModelSummary`` sizes the model by its
  half weights. The checkpoint, ``repr(plugin)`` and ``plugin.requested_precision`` keep the mixed name.

Under Fabric the model may move after setup; :func:`follow_device` gives the setup for the device the model is on
now, or refuses a move that the settings contradict.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_mp.plugin.hardware import (
    ResolvedPrecision,
    choose_precision,
    device_has_native_bf16,
    emulated_bf16_warning,
)
from lightning_mp.policies import PrecisionPolicy
from lightning_mp.policies.evaluation import EvalMode, eval_mode
from lightning_mp.settings import HALF_DTYPES, PluginSettings

ShownPrecision = Literal["16-mixed", "bf16-mixed", "32-true", "16-true", "bf16-true"]
"""The precision Lightning reads from the plugin once it is set up."""

HALF_WEIGHTS_SHOWN: dict[str, ShownPrecision] = {"16-mixed": "16-true", "bf16-mixed": "bf16-true"}
"""The name Lightning sees for a run whose opt level keeps half weights with no fp32 masters (O3, lean)."""


@dataclass(frozen=True)
class ResolvedSetup:
    """The facts of one run that depend on its device, resolved once at setup (module docstring)."""

    device: str
    """The device type autocast runs on (``"cpu"``, ``"cuda"``, ...)."""
    precision: ResolvedPrecision
    """The mixed precision the run trains in: what ``"auto"`` chose, or what was asked for."""
    reason: str
    """Why: ``"asked for"``, or why ``"auto"`` chose it."""
    opt_level: str
    """The opt level that runs: ``"O0"`` in fp32, else the one asked for."""
    policy_class: type[PrecisionPolicy]
    """The opt level's policy class for this run (its sharded or FSDP form where the model needs it)."""
    half_dtype: torch.dtype | None
    """``torch.float16`` or ``torch.bfloat16``; None in fp32."""
    shown_precision: ShownPrecision
    """The precision Lightning reads: :attr:`precision`, or its ``-true`` name where the weights are half."""
    evaluation: EvalMode
    """What validation, test and predict compute with (:mod:`lightning_mp.policies.evaluation`)."""


def resolve_setup(
    settings: PluginSettings, device_type: str, policy_class_for: Callable[[str], type[PrecisionPolicy]]
) -> ResolvedSetup:
    """Resolve the settings for a run on ``device_type``; warn where its half type is slow there.

    Args:
        settings: the plugin's validated settings.
        device_type: the device type the run is on.
        policy_class_for: the policy class of an opt level for this run (the plugin's, which its FSDP form changes).

    Raises:
        ValueError: if ``device`` or a torch GradScaler's device differs from ``device_type``, or ``"auto"`` chose a
            precision that a static ``loss_scale`` or a ``scaler`` cannot run.

    """
    settings.check_device(device_type)
    if settings.precision == "auto":
        precision, reason = choose_precision(device_type, settings.opt_level)
        rank_zero_info(f"lightning_mp: precision='auto' chose {precision!r}: {reason}.")
    else:
        precision, reason = settings.precision, "asked for"
    settings.check_resolved(precision, reason)
    half_dtype = HALF_DTYPES.get(precision)
    _warn_about_slow_half(settings, device_type, half_dtype, reason)
    opt_level = "O0" if half_dtype is None else settings.opt_level
    policy_class = policy_class_for(opt_level)
    shown = HALF_WEIGHTS_SHOWN[precision] if policy_class.half_weights else precision
    evaluation = _evaluation(settings, device_type, precision, shown)
    return ResolvedSetup(device_type, precision, reason, opt_level, policy_class, half_dtype, shown, evaluation)


def _evaluation(settings: PluginSettings, device_type: str, precision: str, shown: str) -> EvalMode:
    return eval_mode(settings.eval_precision, [precision, shown], lambda: choose_precision(device_type, "O1")[0])


def follow_device(setup: ResolvedSetup, settings: PluginSettings, run_device: str) -> ResolvedSetup:
    """The setup for a model Fabric runs on ``run_device``, where setup assumed ``setup.device``.

    Raises:
        ValueError: when ``device`` was given and differs, or when ``precision="auto"`` chooses another precision
            for ``run_device`` than it chose for the device assumed at ``fabric.setup``.

    """
    if settings.device is not None:
        raise ValueError(
            f"MixedPrecision(device={settings.device!r}) does not match Fabric's device: the model runs on"
            f" {run_device!r}. Leave device=None to follow Fabric, or pass device={run_device!r}."
        )
    if settings.precision == "auto":
        choice, _ = choose_precision(run_device, settings.opt_level)
        if choice != setup.precision:
            raise ValueError(
                f"MixedPrecision(precision='auto') chose {setup.precision!r} at fabric.setup for {setup.device!r},"
                f" but Fabric runs the model on {run_device!r}, where 'auto' means {choice!r}. Pass"
                f" MixedPrecision(device={run_device!r}), or the precision itself."
            )
    evaluation = _evaluation(settings, run_device, setup.precision, setup.shown_precision)
    return replace(setup, device=run_device, evaluation=evaluation)


def _warn_about_slow_half(
    settings: PluginSettings, device_type: str, half_dtype: torch.dtype | None, reason: str
) -> None:
    if device_type != "cpu" or half_dtype is None:
        return
    if half_dtype is torch.float16:
        rank_zero_warn(
            "lightning_mp: fp16 ('16-mixed') on the CPU is real fp16 with a loss scaler, but most CPUs multiply"
            " fp16 far more slowly than fp32. Use it to test loss scaling; for speed use 'bf16-mixed' on a CPU"
            " with AVX512-BF16 or AMX."
        )
    elif not device_has_native_bf16("cpu"):
        rank_zero_warn(emulated_bf16_warning(settings.precision, settings.opt_level, reason))


__all__ = ["HALF_WEIGHTS_SHOWN", "ResolvedSetup", "ShownPrecision", "follow_device", "resolve_setup"]
