"""MixedPrecision's settings and accounting under Lightning's ``DeepSpeedStrategy``.

Under ``DeepSpeedStrategy`` DeepSpeed owns the precision: ``"16-mixed"`` runs its fp16 engine (fp16 weights, fp32
masters, its own dynamic loss scaler) and ``"bf16-mixed"`` its bf16 optimizer (bf16 weights, fp32 masters), ZeRO
stages 1 to 3 included. Lightning accepts only a ``DeepSpeedPrecision`` there, and it neither reads DeepSpeed's skip
signal nor holds the learning-rate scheduler on a skipped step: it removes DeepSpeed's scheduler and steps it itself,
so the learning rate and the schedule run ahead of the weights, silently, whenever DeepSpeed skips.

:class:`DeepSpeedMixedPrecision` is a ``DeepSpeedPrecision`` that adds what this package does elsewhere:

1. **Settings.** It takes :class:`~lightning_mp.MixedPrecision`'s arguments, checks them the same way, and writes
   DeepSpeed's precision section of the strategy's config from them before DeepSpeed starts
   (:func:`deepspeed_precision_config`): ``init_scale`` (a power of two) becomes ``initial_scale_power``,
   ``growth_interval`` ``loss_scale_window``, ``hysteresis`` and ``consecutive_hysteresis`` keep their names,
   ``min_scale`` becomes ``min_loss_scale``, a static ``loss_scale`` ``loss_scale``; bf16 gets
   ``check_grad_overflow`` on, so that a bf16 step with non-finite gradients is skipped. What DeepSpeed has no
   equivalent for (a growth factor other than 2, a backoff factor other than 0.5, a maximum scale, ``keep_fp32``,
   FP8, an evaluation precision, a scale per optimizer) and the opt levels it cannot express (its engines keep half
   weights with fp32 masters, which is O2) are refused by name at construction. A precision section the user already
   wrote in the DeepSpeed config is refused too: the plugin's arguments are the one place the settings live.
2. **Accounting.** After each optimizer step at a gradient-accumulation boundary it reads the engine: whether the
   step was applied (``engine.was_step_applied()``, decided by DeepSpeed over every rank, so the ranks agree) and
   the fp16 loss scale (``engine.optimizer.loss_scale``). ``plugin.stats`` gives the same counters as
   :class:`~lightning_mp.MixedPrecision`'s (:class:`~lightning_mp.scaling.stats.PrecisionStats`), which
   :class:`~lightning_mp.callbacks.LossScaleMonitor` logs under the same tags; the counters are saved with the
   checkpoint, and DeepSpeed saves its scaler itself.
3. **Schedulers.** Each ``interval="step"`` scheduler in Lightning's configuration is put behind a
   :class:`~lightning_mp.engine.schedulers.SkipAwareScheduler` at the first step, so a skipped step does not advance
   the learning rate, as everywhere else in this package.

**Under Fabric** the same class serves Fabric's ``DeepSpeedStrategy``, which gives a precision plugin no view of
the strategy before DeepSpeed starts: the strategy writes DeepSpeed's precision section from its own loss-scale
arguments, so pass it the plugin's (:meth:`DeepSpeedMixedPrecision.strategy_arguments`). At the first backward the
plugin compares the engine DeepSpeed built with its settings and stops the run, before any step, where they differ
(:func:`engine_mismatches`). Each ``optimizer.step()`` runs the engine's step (Fabric hands the plugin the engine's
optimizer, which stepped alone would bypass DeepSpeed's skip accounting) and is counted as under the Trainer; the
scheduler given to ``fabric.setup`` is DeepSpeed's, which DeepSpeed itself holds on a skipped step.

DeepSpeed is the optional extra ``.[deepspeed]``; it builds from source, so install it after torch with
``pip install --no-build-isolation`` (a build in an isolated environment would fetch another torch).
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import DeepSpeedPrecision
from torch import nn
from typing_extensions import override

from lightning_mp.arguments.checks import arguments_of, caller
from lightning_mp.engine.schedulers import SkipAwareScheduler
from lightning_mp.front_ends import attached_trainer, is_deepspeed_engine
from lightning_mp.scaling.rules import SCALER_DEFAULTS
from lightning_mp.scaling.stats import PrecisionStats
from lightning_mp.settings import TORCH_SCALER_SETTINGS, PluginSettings

DEEPSPEED_PRECISIONS = ("16-mixed", "bf16-mixed", "32-true")
"""The precisions DeepSpeed runs with its own engines: fp16, bf16, and none."""
_COUNTERS = ("optimizer_steps", "skipped_steps", "scale_backoffs", "scale_growths", "consecutive_skips")


def deepspeed_precision_config(settings: PluginSettings) -> dict[str, Any]:
    """The DeepSpeed config's precision section (``{"fp16": {...}}``, ``{"bf16": {...}}`` or ``{}``) for ``settings``.

    Example:
        >>> deepspeed_precision_config(PluginSettings.from_arguments(None, {}, precision="bf16-mixed"))
        {'bf16': {'enabled': True, 'check_grad_overflow': True}}

    """
    if settings.precision == "bf16-mixed":
        return {"bf16": {"enabled": True, "check_grad_overflow": True}}
    if settings.precision != "16-mixed":
        return {}
    scaler = settings.scaler
    fp16: dict[str, Any] = {
        "enabled": True,
        "loss_scale": 0 if settings.loss_scale == "dynamic" else float(settings.loss_scale),
        "initial_scale_power": round(math.log2(scaler.init_scale)),
        "loss_scale_window": scaler.growth_interval,
        "hysteresis": scaler.hysteresis,
        "consecutive_hysteresis": scaler.consecutive_hysteresis,
        "min_loss_scale": scaler.min_scale if scaler.min_scale is not None else 1,
    }
    return {"fp16": fp16}


def engine_mismatches(settings: PluginSettings, engine: Any) -> list[str]:
    """What of ``settings`` the DeepSpeed ``engine`` was not built with: ``["init_scale=65536, plugin 4096", ...]``.

    Reads the engine's public precision getters: which half type it runs, and for fp16 its static or dynamic scale
    and the dynamic scaler's arguments (under DeepSpeed's names), compared with :func:`deepspeed_precision_config`.
    """
    found: list[str] = []
    for name, enabled, wanted in (
        ("fp16", engine.fp16_enabled(), settings.precision == "16-mixed"),
        ("bf16", engine.bfloat16_enabled(), settings.precision == "bf16-mixed"),
    ):
        if bool(enabled) != wanted:
            found.append(f"{name} {'on' if enabled else 'off'}, plugin {settings.precision!r}")
    fp16 = deepspeed_precision_config(settings).get("fp16")
    if fp16 is None or found:
        return found
    if engine.loss_scale() != fp16["loss_scale"]:
        found.append(f"loss_scale={engine.loss_scale()!r}, plugin {fp16['loss_scale']!r}")
    elif fp16["loss_scale"] == 0:
        built = engine.dynamic_loss_scale_args()
        wanted_args = {
            "init_scale": 2 ** fp16["initial_scale_power"],
            "scale_window": fp16["loss_scale_window"],
            "delayed_shift": fp16["hysteresis"],
            "consecutive_hysteresis": fp16["consecutive_hysteresis"],
            "min_scale": fp16["min_loss_scale"],
        }
        found += [
            f"{key}={built.get(key)!r}, plugin {value!r}"
            for key, value in wanted_args.items()
            if built.get(key) != value
        ]
    return found


def refuse_what_deepspeed_cannot_express(settings: PluginSettings) -> None:
    """Refuse, naming the argument, each setting DeepSpeed's precision engines have no equivalent for.

    Raises:
        ValueError: for the first such setting, with what to use instead.

    """
    refusals: list[tuple[bool, str]] = [
        (
            settings.precision not in DEEPSPEED_PRECISIONS,
            f"precision={settings.precision!r}: DeepSpeed runs '16-mixed' (its fp16 engine), 'bf16-mixed' (its bf16"
            " optimizer) or '32-true'",
        ),
        (
            settings.opt_level != ("O0" if settings.precision == "32-true" else "O2"),
            f"opt_level={settings.opt_level!r}: DeepSpeed's fp16 and bf16 engines keep half weights with fp32 masters,"
            " which is O2 (O0 in '32-true'); O1's autocast, O3, lean and lean-exact have no DeepSpeed form. Leave"
            " opt_level out, or use MixedPrecision with DDP or FSDP for the other levels",
        ),
    ]
    scaler = settings.scaler
    if settings.precision == "16-mixed":
        init_scale = scaler.init_scale
        refusals += [
            (
                scaler.growth_factor != 2.0,
                f"growth_factor={scaler.growth_factor!r}: DeepSpeed's scaler doubles; leave growth_factor out",
            ),
            (
                scaler.backoff_factor != 0.5,
                f"backoff_factor={scaler.backoff_factor!r}: DeepSpeed's scaler halves; leave backoff_factor out",
            ),
            (
                init_scale <= 0 or 2.0 ** round(math.log2(init_scale)) != init_scale,
                f"init_scale={init_scale!r}: DeepSpeed takes a power of two (initial_scale_power); use 2.0**k",
            ),
            (
                scaler.max_scale != SCALER_DEFAULTS.max_scale,
                f"max_scale={scaler.max_scale!r}: DeepSpeed's scaler has no ceiling; leave max_scale out",
            ),
        ]
    refusals += [
        (
            bool(settings.keep_fp32),
            f"keep_fp32={settings.keep_fp32!r}: DeepSpeed casts the whole model; use MixedPrecision under DDP or FSDP",
        ),
        (
            settings.eval_precision is not None,
            f"eval_precision={settings.eval_precision!r}: DeepSpeed evaluates with the weights it trains; leave it out",
        ),
        (
            settings.scale_per_optimizer,
            "scale_per_optimizer=True: DeepSpeed runs one optimizer with one scale; leave it out",
        ),
        (
            scaler.max_consecutive_skips != SCALER_DEFAULTS.max_consecutive_skips,
            f"max_consecutive_skips={scaler.max_consecutive_skips!r}: DeepSpeed's engine has no such stop; leave"
            " it out",
        ),
        (
            not scaler.skip_nonfinite,
            "skip_nonfinite=False: DeepSpeed always skips a step with non-finite gradients; leave it out",
        ),
        (
            scaler.on_min_scale != SCALER_DEFAULTS.on_min_scale,
            f"on_min_scale={scaler.on_min_scale!r}: DeepSpeed decides what happens at its minimum scale; leave it out",
        ),
    ]
    for refused, reason in refusals:
        if refused:
            argument, why = reason.split(": ", 1)
            raise ValueError(f"{caller()}({argument}) is not allowed under DeepSpeedStrategy: {why}.")


def _deepspeed_settings(precision: str, kwargs: dict[str, Any]) -> PluginSettings:
    """``MixedPrecision``'s settings of these arguments with DeepSpeed's defaults, refusing what DeepSpeed lacks."""
    for name, why in (("scaler", "DeepSpeed runs its own loss scaler"), ("fp8", "DeepSpeed has no FP8 training")):
        value = kwargs.pop(name, None)
        if value is not None:
            shown = "..." if name == "scaler" else repr(value)
            raise ValueError(
                f"{caller()}({name}={shown}) is not allowed under DeepSpeedStrategy: {why}. Leave {name} out, or"
                " use MixedPrecision under DDP or FSDP."
            )
    kwargs.setdefault("opt_level", "O0" if precision == "32-true" else "O2")
    kwargs.setdefault("hysteresis", 2)
    scaler_arguments = {name: kwargs.pop(name, None) for name in TORCH_SCALER_SETTINGS}
    if precision == "16-mixed" and scaler_arguments["growth_interval"] is None:
        scaler_arguments["growth_interval"] = 1000  # DeepSpeed's loss_scale_window
    settings = PluginSettings.from_arguments(None, scaler_arguments, precision=precision, **kwargs)
    refuse_what_deepspeed_cannot_express(settings)
    return settings


def _lightning_precision_sections(strategy: Any) -> dict[str, Any]:
    """The precision sections Lightning's ``DeepSpeedStrategy`` writes by itself, with its default arguments."""
    defaults = inspect.signature(type(strategy).__init__).parameters
    names = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")
    fp16 = {"enabled": True, **{name: defaults[name].default for name in names if name in defaults}}
    return {"fp16": fp16, "bf16": {"enabled": True}}


class DeepSpeedMixedPrecision(DeepSpeedPrecision):
    """A ``DeepSpeedPrecision`` with :class:`~lightning_mp.MixedPrecision`'s settings, counters and scheduler hold.

    Takes :class:`~lightning_mp.MixedPrecision`'s arguments; those DeepSpeed cannot express are refused (module
    docstring). The defaults are DeepSpeed's own where it has one (a scale of ``2**16``, a window of 1000 steps,
    hysteresis 2, a minimum scale of 1).

    Args:
        precision: ``"16-mixed"``, ``"bf16-mixed"`` or ``"32-true"``.
        **kwargs: :class:`~lightning_mp.MixedPrecision`'s keyword arguments.

    Raises:
        ValueError: for a setting DeepSpeed has no equivalent for, naming it; otherwise as
            :class:`~lightning_mp.MixedPrecision`.

    Example::

        trainer = Trainer(strategy=DeepSpeedStrategy(stage=2), plugins=[DeepSpeedMixedPrecision("16-mixed")])

        # Fabric: the strategy writes DeepSpeed's config, from the plugin's settings
        plugin = DeepSpeedMixedPrecision("16-mixed", init_scale=2.0**12)
        fabric = Fabric(strategy=DeepSpeedStrategy(stage=2, **plugin.strategy_arguments()), plugins=[plugin])

    """

    def __init__(self, precision: str = "16-mixed", **kwargs: Any) -> None:
        with arguments_of(type(self).__name__):
            settings = _deepspeed_settings(precision, kwargs)
        self.settings = settings
        """Every argument, validated as :class:`~lightning_mp.MixedPrecision` validates it."""
        # PluginSettings narrows precision to this package's names, Lightning types it as its own Literal.
        super().__init__(self.settings.precision)  # type: ignore[arg-type]
        self.skip_scheduler_on_overflow = self.settings.skip_scheduler_on_overflow
        self._counters = dict.fromkeys(_COUNTERS, 0)
        fp16 = self.settings.precision == "16-mixed"
        self._loss_scale = float(self.settings.scaler.init_scale) if fp16 else 1.0
        self._last_skipped = False
        self._wrapped_schedulers = False
        self._fabric_engine: Any = None
        """Under Fabric, the DeepSpeed engine its first backward checked and ran through: the one whose step the
        plugin runs (None before that backward)."""

    def strategy_arguments(self) -> dict[str, Any]:
        """The keyword arguments of Lightning's ``DeepSpeedStrategy`` that carry the plugin's loss-scale settings.

        For Fabric, whose strategy writes DeepSpeed's precision section from them: ``DeepSpeedStrategy(stage=2,
        **plugin.strategy_arguments())``. Empty in ``"bf16-mixed"`` and ``"32-true"``, which have no loss scale.

        Raises:
            ValueError: for ``consecutive_hysteresis=True``, which the strategy takes no argument for, naming the
                config section that carries it.

        Example:
            >>> DeepSpeedMixedPrecision("16-mixed", init_scale=2.0**12).strategy_arguments()["initial_scale_power"]
            12

        """
        section = deepspeed_precision_config(self.settings)
        fp16 = section.get("fp16")
        if fp16 is None:
            return {}
        if fp16["consecutive_hysteresis"]:
            raise ValueError(
                f"{type(self).__name__}(consecutive_hysteresis=True) has no DeepSpeedStrategy argument: pass"
                f" DeepSpeedStrategy(config={{..., 'fp16': {fp16!r}}}) instead of strategy_arguments()."
            )
        names = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")
        return {name: fp16[name] for name in names}

    # ------------------------------------------------------------------------------------------------ config

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Write the precision section of the strategy's DeepSpeed config from the plugin's settings.

        Under Fabric the strategy wrote it already, from its own arguments (:meth:`strategy_arguments`); the first
        backward checks the engine built from it.

        Raises:
            ValueError: if the DeepSpeed config already has an ``fp16`` or ``bf16`` section, naming it.

        """
        trainer = attached_trainer(module)
        if trainer is None:  # Fabric: its strategy wrote the config already, checked at the first backward
            return super().convert_module(module)
        strategy = getattr(trainer, "strategy", None)
        config = getattr(strategy, "config", None)
        if isinstance(config, dict):
            lightning_defaults = _lightning_precision_sections(strategy)
            for key in ("fp16", "bf16", "bfloat16"):
                if key in config and config[key] != lightning_defaults.get(key):
                    raise ValueError(
                        f"DeepSpeedStrategy has a {key!r} precision section of its own ({config[key]!r}, from its"
                        f" config= or its loss-scale arguments) while {type(self).__name__} sets the precision: remove"
                        " it and pass the settings to the plugin (init_scale, growth_interval, hysteresis, min_scale,"
                        " loss_scale)."
                    )
                config.pop(key, None)
            config.update(deepspeed_precision_config(self.settings))
        return super().convert_module(module)

    # ------------------------------------------------------------------------------------------------ step

    @override
    def pre_backward(self, tensor: Any, module: Any) -> Any:
        """Lightning's ``on_before_backward`` hooks under the Trainer; under Fabric, check the engine once."""
        if attached_trainer(module) is not None:
            return super().pre_backward(tensor, module)
        if self._fabric_engine is None:
            self._check_fabric_engine(module)
        return tensor

    @override
    def backward(self, tensor: Any, model: Any, *args: Any, **kwargs: Any) -> None:
        """DeepSpeed's backward: the Trainer's engine, or the one Fabric hands."""
        if attached_trainer(model) is not None:
            super().backward(tensor, model, *args, **kwargs)
        else:
            model.backward(tensor, *args, **kwargs)

    @override
    def post_backward(self, tensor: Any, module: Any) -> Any:
        """Lightning's ``on_after_backward`` hooks under the Trainer; nothing under Fabric."""
        if attached_trainer(module) is not None:
            return super().post_backward(tensor, module)
        return tensor

    def _check_fabric_engine(self, engine: Any) -> None:
        """Stop a Fabric run before its first step where DeepSpeed's engine is not what the settings ask for."""
        if not is_deepspeed_engine(engine):
            raise TypeError(
                f"{type(self).__name__} runs under DeepSpeedStrategy, and Fabric's strategy here handed a"
                f" {type(engine).__name__}: pass strategy=DeepSpeedStrategy(...), or use lightning_mp.MixedPrecision"
                " with the other strategies."
            )
        found = engine_mismatches(self.settings, engine)
        if found:
            raise ValueError(
                f"Fabric's DeepSpeedStrategy built DeepSpeed's engine with other precision settings than"
                f" {type(self).__name__}'s: {'; '.join(found)}. Fabric gives a precision plugin no view of the"
                " strategy's config: pass the plugin's settings to the strategy, DeepSpeedStrategy(...,"
                " **plugin.strategy_arguments()), and remove any fp16/bf16 section of your own from its config."
            )
        self._fabric_engine = engine

    def _fabric_step(self, optimizer: Any, closure: Any, **kwargs: Any) -> Any:
        """Fabric's step: through the engine that owns ``optimizer``, so that DeepSpeed's own step runs.

        Fabric means to step the engine, but hands the engine's optimizer (its optimizer type check does not
        recognise the engine): stepped alone, that would apply the update and skip everything DeepSpeed does around
        it (the skip count, the accumulation boundary, its scheduler held on a skipped step).
        """
        if closure is not None:
            raise TypeError(
                "optimizer.step(closure) is not allowed under DeepSpeedStrategy: DeepSpeed's engine steps without a"
                " closure. Run the forward and fabric.backward, then call optimizer.step()."
            )
        engine = self._fabric_engine
        if engine is None or optimizer not in (engine, engine.optimizer):
            return optimizer.step(**kwargs)
        boundary = bool(engine.is_gradient_accumulation_boundary())
        output = engine.step(**kwargs)
        if boundary:
            self._count_step(engine)
        return output

    @override
    # Lightning's DeepSpeedPrecision takes (optimizer, model, closure); Fabric hands (engine, **kwargs).
    def optimizer_step(self, optimizer: Any, model: Any = None, closure: Any = None, **kwargs: Any) -> Any:
        """DeepSpeed's step, then its verdict read into the counters; a skipped step holds the schedulers.

        Under the Trainer the plugin holds each step scheduler; under Fabric DeepSpeed holds the scheduler given to
        ``fabric.setup`` itself.
        """
        if model is None:  # Fabric
            return self._fabric_step(optimizer, closure, **kwargs)
        trainer: pl.Trainer = model.trainer
        engine = trainer.model
        if not self._wrapped_schedulers:
            self._hold_schedulers_on_skips(trainer)
        # trainer.model is the DeepSpeedEngine here; its type is the LightningModule's for mypy.
        boundary = bool(engine.is_gradient_accumulation_boundary())  # type: ignore[union-attr, operator]
        output = super().optimizer_step(optimizer, model, closure, **kwargs)
        if boundary:
            self._count_step(engine)
        return output

    def _count_step(self, engine: Any) -> None:
        skipped = not engine.was_step_applied()
        scale = float(getattr(engine.optimizer, "loss_scale", 1.0)) if self.settings.precision == "16-mixed" else 1.0
        counters = self._counters
        counters["optimizer_steps"] += 1
        counters["skipped_steps"] += skipped
        counters["consecutive_skips"] = counters["consecutive_skips"] + 1 if skipped else 0
        counters["scale_backoffs"] += scale < self._loss_scale
        counters["scale_growths"] += scale > self._loss_scale
        self._loss_scale = scale
        self._last_skipped = skipped

    def _hold_schedulers_on_skips(self, trainer: pl.Trainer) -> None:
        self._wrapped_schedulers = True
        if not self.skip_scheduler_on_overflow:
            return
        for config in trainer.strategy.lr_scheduler_configs:
            if config.interval == "step" and not isinstance(config.scheduler, SkipAwareScheduler):
                hold = SkipAwareScheduler(config.scheduler, lambda: self._last_skipped)
                # The wrapper forwards everything to the scheduler, whose type Lightning's config declares.
                config.scheduler = hold  # type: ignore[assignment]

    # ------------------------------------------------------------------------------------------------ accounting

    @property
    def stats(self) -> PrecisionStats:
        """The counters at the end of the last optimizer step, read from DeepSpeed's engine."""
        scale = self._loss_scale if self.settings.precision == "16-mixed" else 1.0
        return PrecisionStats.from_counters(scale, self._last_skipped, self._counters)

    def local_overflows(self, trainer: pl.Trainer) -> int:
        """Skipped steps attributed to this rank: DeepSpeed decides over all ranks at once, so rank 0 counts each."""
        return self._counters["skipped_steps"] if trainer.global_rank == 0 else 0

    @override
    def state_dict(self) -> dict[str, Any]:
        """The counters and the last scale seen; DeepSpeed's checkpoint keeps its scaler."""
        return {"counters": dict(self._counters), "loss_scale": self._loss_scale}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            ValueError: if a counter is missing or not an int, naming it.

        """
        counters = state_dict.get("counters", {})
        for name in _COUNTERS:
            if not isinstance(counters.get(name), int):
                raise ValueError(
                    f"The checkpoint's {type(self).__name__} state has counters[{name!r}]={counters.get(name)!r};"
                    " expected an int."
                )
        self._counters = {name: counters[name] for name in _COUNTERS}
        self._loss_scale = float(state_dict.get("loss_scale", self._loss_scale))


__all__ = ["DEEPSPEED_PRECISIONS", "DeepSpeedMixedPrecision", "deepspeed_precision_config", "engine_mismatches"]
