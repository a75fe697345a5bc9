"""The plugin's settings: every argument of :class:`~lightning_mp.MixedPrecision` declared, documented, checked once.

:class:`PluginSettings` holds the plugin's own settings (precision, device, opt level, static loss scale, ...) and the
loss scaler's (:class:`~lightning_mp.scaling.rules.ScalerSettings`, the same object :class:`~lightning_mp.LossScaler`
takes). Each setting is a field with its default, its one documentation and its one check
(:mod:`lightning_mp.arguments.setting_docs`);
the rules that involve two settings (fp16 with ``skip_nonfinite=False``, a static scale outside fp16, an opt level the
precision cannot run) are in ``__post_init__``, and :meth:`PluginSettings.check_resolved` refuses a static scale or
a scaler once ``precision="auto"`` has chosen another precision than fp16 at setup, and
:meth:`PluginSettings.check_device` a run on another device than ``device`` or a GradScaler's. Building one
therefore validates every argument, and a built one is valid.

A ``torch.amp.GradScaler`` passed as ``MixedPrecision(scaler=...)`` is translated into the scaler's settings in one
place, :meth:`PluginSettings.from_arguments`: its scale, growth and backoff factors and growth interval become
``init_scale``, ``growth_factor``, ``backoff_factor`` and ``growth_interval``; a disabled one turns scaling off; its
device is kept, for setup to refuse a run on another device type. The plugin takes those four settings as None by
default only so that a setting given beside a scaler is an error rather than silently overridden.

Private names: :mod:`lightning_mp._private_names` lists them, with the reason for each.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, fields
from typing import Any, Literal, cast

import torch

from lightning_mp.arguments.checks import (
    arguments_of,
    caller,
    check_choice,
    check_flag,
    check_number,
    exact,
    plain_scalar,
)
from lightning_mp.arguments.setting_docs import setting
from lightning_mp.overrides import Fp32Overrides, KeepFp32Pattern
from lightning_mp.policies import POLICIES
from lightning_mp.scaler import LossScaler
from lightning_mp.scaling.rules import FLOAT32_MAX, SCALER_DEFAULTS, STATIC_SCALE_FLOOR, ScalerSettings

__all__ = [
    "EVAL_PRECISIONS",
    "HALF_DTYPES",
    "PRECISIONS",
    "TORCH_SCALER_SETTINGS",
    "EvalPrecisionName",
    "PluginSettings",
    "PrecisionName",
]

PrecisionName = Literal["auto", "16-mixed", "bf16-mixed", "32-true"]
PRECISIONS: tuple[str, ...] = ("auto", "16-mixed", "bf16-mixed", "32-true")
EvalPrecisionName = Literal["auto", "16-mixed", "bf16-mixed", "32-true", "16-true", "bf16-true"]
EVAL_PRECISIONS: tuple[str, ...] = (*PRECISIONS, "16-true", "bf16-true")
HALF_DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}
"""The half dtype of each mixed precision."""
TORCH_SCALER_SETTINGS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")
"""The settings a ``torch.amp.GradScaler`` carries, which a ``scaler=`` sets."""
DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps")
PRECISION_ALIASES: dict[Any, str] = {
    **dict.fromkeys((16, "16", "fp16", "float16", "half", "16-true", "mixed", "amp"), "16-mixed"),
    **dict.fromkeys(("bf16", "bfloat16", "bf16-true"), "bf16-mixed"),
    **dict.fromkeys((32, "32", "fp32", "float32", "full"), "32-true"),
}
"""Common spellings of the precisions, for the "did you mean" of an error message."""
EVAL_PRECISION_ALIASES: dict[Any, str] = {
    **dict.fromkeys((16, "16", "fp16", "float16", "half"), "16-true"),
    **dict.fromkeys(("bf16", "bfloat16"), "bf16-true"),
    **dict.fromkeys((32, "32", "fp32", "float32", "full"), "32-true"),
    "mixed": "16-mixed",
    "amp": "16-mixed",
}
"""Common spellings of the evaluation precisions, for the "did you mean" of an error message."""
OPT_LEVEL_ALIASES: dict[Any, str] = {level: f"O{level}" for level in range(4)}


def _precision(name: str, precision: Any) -> PrecisionName:
    check_choice(name, precision, PRECISIONS, PRECISION_ALIASES)
    return cast(PrecisionName, precision)


def _eval_precision(name: str, precision: Any) -> EvalPrecisionName | None:
    if precision is None:
        return None
    check_choice(name, precision, EVAL_PRECISIONS, EVAL_PRECISION_ALIASES)
    return cast(EvalPrecisionName, precision)


def _device_type(name: str, device: Any) -> str | None:
    """The device type of ``"cuda"``, ``"cuda:0"`` or ``torch.device("cuda", 0)``; None stays None."""
    if device is None:
        return None
    with contextlib.suppress(RuntimeError, TypeError):
        device = torch.device(device).type
    check_choice(name, device, DEVICE_TYPES)
    return device


def _opt_level(name: str, opt_level: Any) -> str:
    check_choice(name, opt_level, POLICIES, OPT_LEVEL_ALIASES)
    return opt_level


def _static_scale_or_dynamic(name: str, loss_scale: Any) -> float | Literal["dynamic"]:
    loss_scale = plain_scalar(loss_scale)
    if isinstance(loss_scale, str) and loss_scale == "dynamic":
        return "dynamic"
    try:
        return check_number(name, loss_scale, at_least=STATIC_SCALE_FLOOR, at_most=FLOAT32_MAX)
    except ValueError:
        raise ValueError(
            f"{caller()}(loss_scale={loss_scale!r}) is not allowed: loss_scale must be 'dynamic' or a static scale, a"
            f" finite number >= {exact(STATIC_SCALE_FLOOR)} and <= {exact(FLOAT32_MAX)} (float32's largest)."
        ) from None


def _keep_fp32(name: str, patterns: Any) -> tuple[KeepFp32Pattern, ...]:
    return tuple(Fp32Overrides(patterns).patterns)


def _chunk_numel(name: str, numel: Any) -> int | None:
    return None if numel is None else check_number(name, numel, at_least=1, integer=True)


@dataclass(frozen=True)
class PluginSettings:
    """Every argument of :class:`~lightning_mp.MixedPrecision`, checked once when the object is built.

    The plugin's own settings are the fields below; the loss scaler's are in ``scaler``. ``scaler_given``,
    ``torch_scaler_device`` and ``scaling_disabled`` record a scaler given as ``scaler=`` (:meth:`from_arguments`).

    Raises:
        ValueError: naming the argument, the value and what is allowed, with a "did you mean" for a near miss.

    Example:
        >>> PluginSettings(precision="16-mixed", opt_level="O2").scaler.growth_interval
        2000

    """

    precision: PrecisionName = field(
        default="auto",
        metadata=setting(
            '``"auto"`` (bf16 where the device runs it natively, else fp16 on GPUs and fp32 on CPUs), ``"16-mixed"``'
            ' (fp16 with loss scaling; real fp16 on the CPU too), ``"bf16-mixed"`` or ``"32-true"``. The annotation'
            " also takes any string or int, so that LightningCLI hands ``fp16`` or ``16`` to the constructor, whose"
            " error says \"did you mean '16-mixed'\", instead of refusing it in its own type check; ``on_min_scale``"
            " and ``loss_scale`` take any string for the same reason.",
            _precision,
        ),
    )
    device: str | None = field(
        default=None,
        metadata=setting(
            'the autocast device type (``"cpu"``, ``"cuda"``, ...; an index as in ``"cuda:0"`` is ignored, as autocast'
            " works per device type); None takes it from the Trainer's accelerator at setup, or under Fabric from the"
            " device Fabric moved the model to (checked at every forward; a contradicting ``device`` raises).",
            _device_type,
        ),
    )
    opt_level: str = field(
        default="O1",
        metadata=setting(
            '``"O0"`` (fp32 baseline) or ``"O1"`` (autocast, fp32 weights), and any other registered level.',
            _opt_level,
        ),
    )
    loss_scale: float | Literal["dynamic"] = field(
        default="dynamic",
        metadata=setting(
            '``"dynamic"``, or a static scale (fp16 only): any normal float32, from ``2**-126`` (whose inverse is'
            " finite) to float32's largest.",
            _static_scale_or_dynamic,
        ),
    )
    skip_scheduler_on_overflow: bool = field(
        default=True,
        metadata=setting('keep ``interval="step"`` schedulers from advancing on skipped steps.', check_flag),
    )
    keep_fp32: tuple[KeepFp32Pattern, ...] = field(
        default=(),
        metadata=setting(
            "modules that run in fp32 (autocast off, inputs cast to fp32, weights fp32 in O2 and O3): module types,"
            " qualified names, or regular expressions prefixed with ``re:`` (:mod:`lightning_mp.overrides`); None or"
            " empty keeps none.",
            _keep_fp32,
        ),
    )
    scale_per_optimizer: bool = field(
        default=False,
        metadata=setting(
            "give each optimizer its own dynamic loss scale (fp16): a non-finite gradient skips only its"
            " optimizer's step and backs off only its scale; each backward names its optimizer"
            " (``manual_backward(loss, for_optimizer=opt)``, ``fabric.backward(loss, for_optimizer=opt)``, or the"
            " optimizer ``toggle_optimizer`` left trainable) (:mod:`lightning_mp.scaling.per_optimizer`).",
            check_flag,
        ),
    )
    eval_precision: EvalPrecisionName | None = field(
        default=None,
        metadata=setting(
            "the precision validation, test and predict run in, inside ``fit`` and in ``trainer.validate``, ``test``"
            ' and ``predict`` (under Fabric, inside ``plugin.evaluation()``): ``"16-mixed"`` or ``"bf16-mixed"``'
            ' (autocast over fp32 weights), ``"16-true"`` or ``"bf16-true"`` (half weights, no autocast),'
            ' ``"32-true"``, or ``"auto"`` (what ``precision="auto"`` chooses); None evaluates as the model trains.'
            " Evaluation leaves training bitwise as it would be without it (:mod:`lightning_mp.policies.evaluation`).",
            _eval_precision,
        ),
    )
    master_chunk_numel: int | None = field(
        default=None,
        metadata=setting(
            '``opt_level="lean-exact"`` only: the most parameter elements whose fp32 masters an optimizer step'
            " rebuilds at once, an integer >= 1 (a larger parameter is a chunk of its own). Beyond the gradients, the"
            " step then adds one chunk's rebuilt masters, 4 bytes per element, and the optimizer's temporaries for it"
            " (none for fused AdamW). None takes ``2**24``: 64 MiB of masters.",
            _chunk_numel,
        ),
    )
    scaler: ScalerSettings = SCALER_DEFAULTS
    """The loss scaler's settings."""
    scaler_given: bool = False
    """Whether a scaler was given as ``scaler=``: a torch GradScaler, or a LossScaler used as it is."""
    torch_scaler_device: str | None = None
    """The device type of a ``torch.amp.GradScaler`` given as ``scaler=``: setup refuses a run on another one."""
    scaling_disabled: bool = False
    """Whether the ``scaler=`` given was a disabled GradScaler: nothing is scaled, non-finite steps are skipped."""

    def __post_init__(self) -> None:
        with arguments_of(type(self).__name__):
            self._check_settings()

    def _check_settings(self) -> None:
        for setting_field in fields(self):
            if "check" in setting_field.metadata:
                value = setting_field.metadata["check"](setting_field.name, getattr(self, setting_field.name))
                object.__setattr__(self, setting_field.name, value)
        if not self.scaler.skip_nonfinite and self.precision == "16-mixed":
            raise ValueError(
                f"{caller()}(precision='16-mixed', skip_nonfinite=False) is not allowed: fp16 overflows routinely, and"
                " a scaled step whose gradients overflowed must be skipped. Use skip_nonfinite=False with"
                " 'bf16-mixed' or '32-true' only."
            )
        precision, opt_level = self.precision, self.opt_level
        if self.loss_scale != "dynamic" and precision in ("bf16-mixed", "32-true"):
            raise ValueError(
                f"{caller()}(precision={precision!r}, loss_scale={self.loss_scale!r}) is not allowed: only fp16 is"
                " scaled (bf16 has fp32's exponent range). Use loss_scale='dynamic' (the default) here, or"
                " precision='16-mixed' for a static fp16 scale."
            )
        if opt_level == "lean-exact" and precision in ("16-mixed", "32-true"):
            raise ValueError(
                f"{caller()}(precision={precision!r}, opt_level='lean-exact') is not allowed: lean-exact keeps each"
                " fp32 master as its bf16 weight plus the 16 bits rounding dropped, and only bf16 is the top half of an"
                " fp32 (fp16's exponent is narrower, so its bits are not). Use precision='bf16-mixed' (or 'auto'), or"
                " opt_level='O2' for fp16."
            )
        if self.master_chunk_numel is not None and opt_level != "lean-exact":
            raise ValueError(
                f"{caller()}(opt_level={opt_level!r}, master_chunk_numel={self.master_chunk_numel!r}) is not allowed:"
                f" master_chunk_numel sizes the chunks in which lean-exact rebuilds its packed masters, and {opt_level}"
                " packs none. Leave master_chunk_numel out, or use opt_level='lean-exact'."
            )
        if opt_level.startswith("lean") and precision in ("16-mixed", "32-true"):
            raise ValueError(
                f"{caller()}(precision={precision!r}, opt_level={opt_level!r}) is not allowed: {opt_level} keeps"
                " weights and optimizer states in bf16. Use precision='bf16-mixed' (or 'auto'), or opt_level='O2'"
                " for fp16."
            )
        if precision == "32-true" and opt_level not in ("O0", "O1"):
            raise ValueError(
                f"{caller()}(precision='32-true', opt_level={opt_level!r}) is not allowed: {opt_level} casts to a half"
                " type. Use precision='16-mixed' or 'bf16-mixed', or opt_level='O0'."
            )
        if self.scale_per_optimizer and (self.scaler_given or self.loss_scale != "dynamic"):
            given = "scaler=..." if self.scaler_given else f"loss_scale={self.loss_scale!r}"
            raise ValueError(
                f"{caller()}(scale_per_optimizer=True, {given}) is not allowed: a scale per optimizer is dynamic and"
                " built by the plugin. Leave scaler=None and loss_scale='dynamic', or scale_per_optimizer=False."
            )
        if opt_level == "O0" and precision in HALF_DTYPES:
            raise ValueError(
                f"{caller()}(precision={precision!r}, opt_level='O0') is not allowed: O0 is the fp32 baseline. Use"
                " precision='32-true' or 'auto' with O0, or opt_level='O1' or higher for mixed precision."
            )

    @classmethod
    def from_arguments(
        cls, scaler: torch.amp.GradScaler | None, torch_fields: dict[str, Any], **settings: Any
    ) -> PluginSettings:
        """The settings of ``MixedPrecision(..., scaler=scaler, **torch_fields, **settings)``.

        Args:
            scaler: the ``scaler=`` argument: None, a ``torch.amp.GradScaler`` (translated into the scaler's settings
                here), or a :class:`~lightning_mp.LossScaler` (used as it is, so its settings are not read).
            torch_fields: the settings of :data:`TORCH_SCALER_SETTINGS` as given; None means the default.
            settings: every other setting, the plugin's and the scaler's, by name.

        Raises:
            TypeError: if ``scaler`` is not a ``torch.amp.GradScaler``.
            ValueError: if a scaler is given with bf16 or fp32, or together with one of its own settings.

        """
        plugin_names = {setting_field.name for setting_field in fields(cls) if "check" in setting_field.metadata}
        plugin_fields = {name: value for name, value in settings.items() if name in plugin_names}
        scaler_fields = {name: value for name, value in settings.items() if name not in plugin_names}
        given = {name: plain_scalar(value) for name, value in torch_fields.items() if value is not None}
        torch_scaler_device, scaling_disabled = None, False
        if scaler is not None:
            precision, loss_scale = plugin_fields.get("precision"), plugin_fields.get("loss_scale", "dynamic")
            if not isinstance(scaler, torch.amp.GradScaler):
                raise TypeError(f"{caller()}(scaler={scaler!r}) is not allowed: scaler must be a torch.amp.GradScaler.")
            if precision in ("bf16-mixed", "32-true"):
                raise ValueError(
                    f"{caller()}(precision={precision!r}, scaler={type(scaler).__name__}) is not allowed:"
                    f" `precision={precision!r}` does not use a scaler. Pass scaler=None, or precision='16-mixed'."
                )
            if given or loss_scale != "dynamic":
                names = ", ".join([*given, *(["loss_scale"] if loss_scale != "dynamic" else [])])
                raise ValueError(
                    f"{caller()}(scaler=..., {names}=...) is not allowed: the scaler's own settings are used. Set them"
                    " on the GradScaler, or pass the settings without a scaler."
                )
            if not isinstance(scaler, LossScaler):
                torch_scaler_device = torch.device(scaler._device).type
                scaling_disabled = not scaler.is_enabled()
                if not scaling_disabled:
                    given = {
                        "init_scale": scaler.get_scale(),
                        "growth_factor": scaler.get_growth_factor(),
                        "backoff_factor": scaler.get_backoff_factor(),
                        "growth_interval": scaler.get_growth_interval(),
                    }
        scaler_settings = ScalerSettings(**given, **scaler_fields)
        return cls(
            **plugin_fields,
            scaler=scaler_settings,
            scaler_given=scaler is not None,
            torch_scaler_device=torch_scaler_device,
            scaling_disabled=scaling_disabled,
        )

    def check_device(self, device_type: str) -> None:
        """Refuse a run on ``device_type`` when ``device`` or a torch GradScaler's device says otherwise (setup).

        Raises:
            ValueError: naming the device asked for and the run's.

        """
        if self.device is not None and self.device != device_type:
            raise ValueError(
                f"{caller()}(device={self.device!r}) does not match the Trainer's accelerator, which runs on"
                f" {device_type!r}. Leave device=None to follow the Trainer."
            )
        scaler_device = self.torch_scaler_device
        if scaler_device is not None and scaler_device != device_type:
            raise ValueError(
                f"{caller()}(scaler=GradScaler({scaler_device!r})) cannot scale a run on {device_type!r}: torch"
                f" disables a GradScaler built for {scaler_device!r} where that device is missing, so fp16 would train"
                f" unscaled. Pass torch.amp.GradScaler({device_type!r}, ...) (enabled=False to turn scaling off)."
            )

    def check_resolved(self, precision: str, reason: str) -> None:
        """Refuse a static ``loss_scale`` or a ``scaler`` once ``precision="auto"`` has chosen a precision besides fp16.

        Args:
            precision: the precision chosen at setup.
            reason: why it was chosen, for the message.

        Raises:
            ValueError: when a static ``loss_scale`` or a ``scaler`` was given and the choice is not fp16.

        """
        if precision != "16-mixed" and (self.loss_scale != "dynamic" or self.scaler_given):
            given = f"loss_scale={self.loss_scale!r}" if self.loss_scale != "dynamic" else "scaler=..."
            raise ValueError(
                f"{caller()}({given}) needs fp16, but the precision is {precision!r} ({reason}). Use"
                " precision='16-mixed' for a static scale or a GradScaler."
            )
