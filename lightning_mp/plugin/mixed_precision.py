"""The MixedPrecision plugin: autocast around every step, a loss scaler around backward and the optimizer step.

Pass it to the Trainer, exactly where Lightning's own ``MixedPrecision(precision, device, scaler=None)`` goes (every
call that one accepts, this one accepts with the same meaning; the scaler's settings are keyword-only)::

    trainer = Trainer(plugins=[MixedPrecision("16-mixed", growth_interval=1000, hysteresis=2)])

or to Fabric, ``Fabric(plugins=[MixedPrecision(...)])``.

The plugin only adapts Lightning's ``Precision`` interface. When the Trainer or Fabric sets a run up, it has the
factory (:mod:`lightning_mp.plugin.run`) build the run in one piece: the setup resolved once for the device
(:mod:`lightning_mp.plugin.resolved`: ``"auto"``, the opt level that runs, the precision Lightning is shown), the opt
level's policy (:mod:`lightning_mp.policies`), the loss scaler (:mod:`lightning_mp.scaler`) and FP8. It chooses one
step engine when the model is converted: the Trainer's (:mod:`lightning_mp.engine.trainer`) when a Trainer is
attached to the model, else Fabric's (:mod:`lightning_mp.engine.fabric`); every step hook is handed to it
(:mod:`lightning_mp.plugin.step_hooks`). What a step is, and the pieces both engines share, is written once in
:mod:`lightning_mp.engine.base`. Autocast itself is the plugin's ``forward_context``. The checkpoint entry is
:mod:`lightning_mp.plugin.checkpoint`'s, the claim of one run at a time :mod:`lightning_mp.plugin.claims`'s, and what
the plugin shows of its run (precision, device, scaler, counters) :mod:`lightning_mp.plugin.views`'s.

What happens in a training iteration under the Trainer:

1. The forward pass (training, validation, test and predict steps) runs under ``torch.autocast`` when the opt level
   uses autocast (O1, and O2 around its half weights), in fp16 or bf16. Before the first forward after an
   optimizer step, the running statistics of the normalisation layers that track them (BatchNorm, InstanceNorm with
   ``track_running_stats``) are copied.
2. ``pre_backward`` multiplies the loss by the loss scale (fp16 only). Every backward of the iteration uses the
   same scale, also under gradient accumulation and with several optimizers.
3. The gradients are unscaled once per optimizer step (one fused pass that also detects inf/NaN) *before*
   Lightning's ``on_before_optimizer_step`` hooks and gradient clipping, so both see true gradients. In manual
   optimization ``self.clip_gradients(opt, ...)`` unscales first; an explicit ``scaler.unscale_(opt)`` before it is
   respected, not repeated. Fused optimizers unscale inside their own step, unless clipping needed the true
   gradients first; their step then does not unscale again.
4. The optimizer step runs only if every gradient is finite. A skipped step changes no parameter, no optimizer
   state and no running statistic, and ``interval="step"`` learning-rate schedulers do not advance on it.
5. The scale moves once per iteration (:mod:`lightning_mp.scaler`), so ``growth_interval`` counts iterations: in
   automatic optimization right after the step, in manual optimization when the training step returns, if any
   optimizer stepped. :attr:`MixedPrecision.stats` then holds the counters.

LBFGS evaluates its closure several times per step, so a loss scale cannot be checked between backward and step:
fp16 refuses it. In bf16 and fp32 the plugin copies the weights and the optimizer state before the step and puts
them back when a loss or a gradient was inf or NaN, which counts as a skipped step (under Fabric too).

In bf16 and fp32 nothing is scaled, but non-finite steps are still detected and skipped, so no precision ever
writes a NaN into the weights. The scaler's state and the counters are saved in Lightning checkpoints and restored
exactly on resume. The checkpoint entry also holds torch's five GradScaler keys, so Lightning's own plugin resumes
from it (or, after a bf16/fp32 run, starts from the initial scale).

A plugin drives one run at a time, and each run starts as with a new plugin, whichever drove the previous one: a
Trainer's fit, a ``fabric.setup`` after a Trainer's run or after the previous Fabric loop's steps, and a
``setup_for_device`` after a run ended build the opt level and the scaler again, so neither the previous run's
scale, counters and skip streaks nor a checkpoint's rounding state reach it; its own checkpoint (``ckpt_path``,
``fabric.load``) restores them, also when loaded between two runs. :attr:`MixedPrecision.stats` keeps the last run's
counters until the next run starts. A run from another live thread while one runs is refused; the run ends at
``teardown`` (the Trainer's, or ``plugin.teardown()`` for Fabric).

The plugin subclasses Lightning's ``MixedPrecision`` so that Lightning's ``ThroughputMonitor`` counts FLOPs in the
half dtype, and so that Lightning itself restores the legacy ``native_amp_scaling_state`` checkpoint key.

Private names: :mod:`lightning_mp._private_names` lists them, with the reason for each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Literal

import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mp.arguments.checks import arguments_of
from lightning_mp.arguments.setting_docs import with_setting_docs
from lightning_mp.engine.base import StepEngine
from lightning_mp.engine.fabric import FabricEngine
from lightning_mp.engine.trainer import TrainerEngine
from lightning_mp.fp8.mode import Fp8Mode, check_fp8_combination, require_torchao
from lightning_mp.fp8.settings import Fp8Recipe, FP8Settings, fp8_settings_from_argument
from lightning_mp.front_ends import attached_trainer, fabric_device_type, trainer_device_type
from lightning_mp.plugin.checkpoint import CheckpointEntry
from lightning_mp.plugin.claims import RunClaim
from lightning_mp.plugin.fp8 import Fp8Methods
from lightning_mp.plugin.resolved import follow_device
from lightning_mp.plugin.run import Run, build_run, fabric_engine, policy_class_for, trainer_engine
from lightning_mp.plugin.step_hooks import StepHooks
from lightning_mp.plugin.views import RunViews
from lightning_mp.policies import PrecisionPolicy
from lightning_mp.scaler import LossScaler
from lightning_mp.scaling.rules import SCALER_DEFAULTS, ScalerSettings
from lightning_mp.scaling.sharded import has_sharded_parameters
from lightning_mp.settings import EvalPrecisionName, PluginSettings, PrecisionName

PLUGIN_DEFAULTS = PluginSettings()
"""The defaults of the plugin's own arguments; the scaler's are :data:`~lightning_mp.scaling.rules.SCALER_DEFAULTS`."""


# RunViews makes Lightning's writable ``precision``, ``device`` and ``scaler`` read-only views of the run.
@with_setting_docs(PluginSettings, ScalerSettings)
class MixedPrecision(Fp8Methods, CheckpointEntry, RunViews, StepHooks):  # type: ignore[misc]
    """Mixed-precision training for Lightning: autocast, a dynamic loss scaler that goes past torch's, and counters.

    Args:
        precision: ``"auto"`` (bf16 where the device runs it natively, else fp16 on GPUs and fp32 on CPUs),
            ``"16-mixed"`` (fp16 with loss scaling; real fp16 on the CPU too), ``"bf16-mixed"`` or ``"32-true"``. The
            annotation also takes any string or int, so that LightningCLI hands ``fp16`` or ``16`` to the constructor,
            whose error says "did you mean '16-mixed'", instead of refusing it in its own type check; ``on_min_scale``
            and ``loss_scale`` take any string for the same reason.
        device: the autocast device type (``"cpu"``, ``"cuda"``, ...; an index as in ``"cuda:0"`` is ignored, as
            autocast works per device type); None takes it from the Trainer's accelerator at setup, or under Fabric from
            the device Fabric moved the model to (checked at every forward; a contradicting ``device`` raises).
        scaler: a ``torch.amp.GradScaler`` whose settings (scale, growth and backoff factors, growth interval,
            ``enabled``) the loss scaler takes over, as Lightning's plugin would use it; fp16 only. A
            :class:`~lightning_mp.LossScaler` is used as it is. Leave it None to set the settings below.
        opt_level: ``"O0"`` (fp32 baseline) or ``"O1"`` (autocast, fp32 weights), and any other registered level.
        init_scale: the first loss scale (fp16), in ``[min_scale, max_scale]``; a static scale is any normal float32,
            from ``2**-126`` (whose inverse is finite) to float32's largest; unused when nothing is scaled. None means
            65536.
        growth_factor: scale multiplier after ``growth_interval`` clean iterations; > 1 (the scale stops at
            ``max_scale``). None means 2.
        backoff_factor: scale multiplier on an overflow that exhausts the hysteresis; in (0, 1). None means 0.5.
        growth_interval: clean iterations in a row before the scale grows, in [1, 2**31 - 1]. An iteration is one scale
            update (after its last optimizer step), so several optimizers or accumulated batches count once. None means
            2000.
        hysteresis: overflows tolerated before the scale backs off (DeepSpeed's and Megatron's meaning), in [1,
            2**31 - 1]; 1 is torch's behaviour.
        consecutive_hysteresis: refill the hysteresis after every clean iteration, not only after a growth.
        min_scale: the scale's floor, from ``2**-24`` to ``max_scale``; None means the collapse floor ``2**-24``.
        max_scale: the scale never grows past this; from ``2**-24`` to float32's largest value.
        on_min_scale: ``"raise"`` :class:`~lightning_mp.errors.LossScaleCollapseError`, or ``"warn"`` and stay at the
            floor, when an overflow would push the scale below the floor.
        loss_scale: ``"dynamic"``, or a static scale (fp16 only): any normal float32, from ``2**-126`` (whose inverse is
            finite) to float32's largest.
        skip_scheduler_on_overflow: keep ``interval="step"`` schedulers from advancing on skipped steps.
        keep_fp32: modules that run in fp32 (autocast off, inputs cast to fp32, weights fp32 in O2 and O3): module
            types, qualified names, or regular expressions prefixed with ``re:`` (:mod:`lightning_mp.overrides`); None
            or empty keeps none.
        max_consecutive_skips: stop with :class:`~lightning_mp.errors.NonFiniteStepsError` after this many skipped steps
            in a row of one optimizer (1 to 2**31 - 1), in every precision; None never stops.
        skip_nonfinite: skip every step whose gradients hold an inf or a NaN, without a host sync for torch's Adam,
            AdamW, SGD and Adagrad (:mod:`lightning_mp.scaler`). Only where nothing is scaled (bf16, fp32) may it be
            False: then nothing is checked, as in Lightning's ``"bf16-mixed"`` and ``"32-true"``, a step writes inf/NaN
            into the weights, and ``skipped_steps`` stays 0. A scaled run (fp16) always skips: its overflows are
            routine.
        scale_per_optimizer: give each optimizer its own dynamic loss scale (fp16): a non-finite gradient skips only
            its optimizer's step and backs off only its scale; each backward names its optimizer
            (``manual_backward(loss, for_optimizer=opt)``, ``fabric.backward(loss, for_optimizer=opt)``, or the
            optimizer ``toggle_optimizer`` left trainable) (:mod:`lightning_mp.scaling.per_optimizer`).
        eval_precision: the precision validation, test and predict run in, inside ``fit`` and in
            ``trainer.validate``, ``test`` and ``predict`` (under Fabric, inside ``plugin.evaluation()``):
            ``"16-mixed"`` or ``"bf16-mixed"`` (autocast over fp32 weights), ``"16-true"`` or ``"bf16-true"`` (half
            weights, no autocast), ``"32-true"``, or ``"auto"`` (what ``precision="auto"`` chooses); None evaluates as
            the model trains. Evaluation leaves training bitwise as it would be without it
            (:mod:`lightning_mp.policies.evaluation`).
        master_chunk_numel: ``opt_level="lean-exact"`` only: the most parameter elements whose fp32 masters an
            optimizer step rebuilds at once, an integer >= 1 (a larger parameter is a chunk of its own). Beyond the
            gradients, the step then adds one chunk's rebuilt masters, 4 bytes per element, and the optimizer's
            temporaries for it (none for fused AdamW). None takes ``2**24``: 64 MiB of masters.
        fp8: run the linear layers' matmuls in FP8 with torchao's float8 training: a recipe name (``"tensorwise"``,
            ``"rowwise"``, ``"rowwise_with_gw_hp"``) or a :class:`~lightning_mp.fp8.FP8Settings` for the layers kept
            in bf16 and the fallback thresholds. With ``precision="bf16-mixed"`` and ``opt_level`` ``"O1"`` or
            ``"O2"`` only (:mod:`lightning_mp.fp8.mode`); needs the ``fp8`` extra. None (the default) runs no FP8.

    Every setting is declared, documented and checked once, in :class:`~lightning_mp.settings.PluginSettings` and
    :class:`~lightning_mp.scaling.rules.ScalerSettings`; :attr:`settings` holds them as validated. Numbers may be
    Python, numpy or 0-d tensor scalars; booleans must be ``True`` or ``False``.

    Raises:
        ValueError: for any argument outside what is allowed; the message names the argument, the value given and
            what is allowed, with a "did you mean" for a near miss such as ``"fp16"`` or ``"o2"``.
        TypeError: if ``scaler`` is not a ``torch.amp.GradScaler``.
        ModuleNotFoundError: if ``fp8`` is given and torchao is not installed (``pip install -e ".[fp8]"``).
        RuntimeError: if ``fp8`` is given and torch or torchao is older than the FP8 mode's floor.

    """

    def __init__(
        self,
        precision: PrecisionName | str | int = PLUGIN_DEFAULTS.precision,
        device: str | None = PLUGIN_DEFAULTS.device,
        scaler: torch.amp.GradScaler | None = None,
        *,
        opt_level: str = PLUGIN_DEFAULTS.opt_level,
        init_scale: float | None = None,
        growth_factor: float | None = None,
        backoff_factor: float | None = None,
        growth_interval: int | None = None,
        hysteresis: int = SCALER_DEFAULTS.hysteresis,
        consecutive_hysteresis: bool = SCALER_DEFAULTS.consecutive_hysteresis,
        min_scale: float | None = SCALER_DEFAULTS.min_scale,
        max_scale: float = SCALER_DEFAULTS.max_scale,
        on_min_scale: Literal["raise", "warn"] | str = SCALER_DEFAULTS.on_min_scale,
        loss_scale: float | Literal["dynamic"] | str = PLUGIN_DEFAULTS.loss_scale,
        skip_scheduler_on_overflow: bool = PLUGIN_DEFAULTS.skip_scheduler_on_overflow,
        keep_fp32: Sequence[type | str] | None = PLUGIN_DEFAULTS.keep_fp32,
        max_consecutive_skips: int | None = SCALER_DEFAULTS.max_consecutive_skips,
        skip_nonfinite: bool = SCALER_DEFAULTS.skip_nonfinite,
        scale_per_optimizer: bool = PLUGIN_DEFAULTS.scale_per_optimizer,
        eval_precision: EvalPrecisionName | str | int | None = PLUGIN_DEFAULTS.eval_precision,
        master_chunk_numel: int | None = PLUGIN_DEFAULTS.master_chunk_numel,
        fp8: Fp8Recipe | FP8Settings | str | None = None,
    ) -> None:
        with arguments_of(type(self).__name__):
            settings = PluginSettings.from_arguments(
                scaler,
                {
                    "init_scale": init_scale,
                    "growth_factor": growth_factor,
                    "backoff_factor": backoff_factor,
                    "growth_interval": growth_interval,
                },
                precision=precision,
                device=device,
                opt_level=opt_level,
                hysteresis=hysteresis,
                consecutive_hysteresis=consecutive_hysteresis,
                min_scale=min_scale,
                max_scale=max_scale,
                on_min_scale=on_min_scale,
                loss_scale=loss_scale,
                skip_scheduler_on_overflow=skip_scheduler_on_overflow,
                keep_fp32=keep_fp32,
                max_consecutive_skips=max_consecutive_skips,
                skip_nonfinite=skip_nonfinite,
                scale_per_optimizer=scale_per_optimizer,
                eval_precision=eval_precision,
                master_chunk_numel=master_chunk_numel,
            )
            self.settings = settings
            """Every argument, validated (:class:`~lightning_mp.settings.PluginSettings`)."""
            self.requested_precision: PrecisionName = settings.precision
            self.requested_device = settings.device
            """The ``device`` given; None follows the Trainer's accelerator, or under Fabric the model's device."""
            self.opt_level = settings.opt_level
            self.loss_scale = settings.loss_scale
            self.skip_scheduler_on_overflow = settings.skip_scheduler_on_overflow
            self.keep_fp32 = list(settings.keep_fp32)
            self.fp8_settings = fp8_settings_from_argument(fp8)
            """The FP8 mode's validated settings; None when the run has no FP8."""
            if self.fp8_settings is not None:
                check_fp8_combination(
                    self.fp8_settings, settings.precision, settings.opt_level, settings.eval_precision
                )
                require_torchao(self.fp8_settings.recipe)
        self._given_loss_scaler = scaler if isinstance(scaler, LossScaler) else None
        """A LossScaler given as ``scaler=``, used as it is; a torch GradScaler is translated into the settings."""
        self._run: Run | None = None
        """The run's resolved setup, opt level, loss scaler and FP8 (:mod:`lightning_mp.plugin.run`), built at setup."""
        self._engine: StepEngine | None = None
        """The step engine of the run, chosen at setup: the Trainer's or Fabric's."""
        self._state_before_setup: dict[str, Any] | None = None
        """A state loaded before setup, which the run loads when it is built."""
        self._fp8_before_sharding: Fp8Mode | None = None
        """The FP8 layers :meth:`fp8_convert` converted before FSDP2 sharded the model; the run's from setup on."""
        self._claim = RunClaim()
        """The thread whose run the plugin drives, and whether that run ended (:mod:`lightning_mp.plugin.claims`)."""

    # ------------------------------------------------------------------------------------------------ setup

    def setup_for_device(self, device_type: str) -> None:
        """Resolve the precision for ``device_type``, and build the opt level's policy, the loss scaler and an engine.

        The plugin calls this itself when the Trainer or Fabric sets up; call it directly only to use the plugin
        outside both, whose hooks then behave as under the Trainer. Idempotent.

        After a run ended (its ``teardown``) it starts a new one, as a new plugin would (module docstring).

        Raises:
            ValueError: if ``device`` was given and differs from ``device_type``, or ``scaler`` is a torch
                GradScaler built for another device.

        """
        if self._claim.ended:
            self._start_new_run()
        run = self._ensure_run(device_type)
        if self._engine is None:
            self._engine = trainer_engine(run, self, self.skip_scheduler_on_overflow)

    def _ensure_run(self, device_type: str, sharded: bool = False) -> Run:
        """The run, built for ``device_type`` unless it is built already; a state loaded before it is loaded into it."""
        if self._run is not None:
            return self._run
        with arguments_of(type(self).__name__):
            self._run = build_run(
                self.settings,
                device_type,
                lambda opt_level: self._policy_class(opt_level, sharded),
                self.keep_fp32,
                sharded=sharded,
                given_loss_scaler=self._given_loss_scaler,
                fp8_settings=self.fp8_settings,
                fp8_converted=self._fp8_before_sharding,
            )
        self._fp8_before_sharding = None
        if self._state_before_setup is not None:
            loaded, self._state_before_setup = self._state_before_setup, None
            self.load_state_dict(loaded)
        return self._run

    def _policy_class(self, opt_level: str, sharded: bool) -> type[PrecisionPolicy]:
        """The opt level's policy class for this run; the FSDP form maps O2 onto FSDP's own half weights."""
        return policy_class_for(opt_level, sharded)

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Choose the step engine, resolve the precision for the run's device, and let the opt level convert.

        A Trainer attached to the module chooses the Trainer's engine, its absence Fabric's. A Trainer's fit starts
        a new run (module docstring), and so does a ``fabric.setup`` after a run that ended (a Trainer's, whose
        teardown ends it; a Fabric loop torn down by ``plugin.teardown()``) or after the previous Fabric loop's
        steps: the opt level and the scaler are built afresh. Fabric's second ``setup`` before any step (a GAN's
        two models) joins the run, and so does a ``fabric.setup`` after ``setup_for_device``, whose loaded state
        it keeps.

        Raises:
            RuntimeError: when a run in another thread uses the plugin now.
            TypeError: under ``DeepSpeedStrategy``, naming :class:`~lightning_mp.deepspeed.DeepSpeedMixedPrecision`.

        """
        previous_run_ended = self._claim.claim(self)
        trainer = attached_trainer(module)
        if trainer is not None and isinstance(trainer.strategy, DeepSpeedStrategy):
            raise TypeError(
                f"{type(self).__name__} does not run under DeepSpeedStrategy, which trains with DeepSpeed's own fp16"
                " or bf16 engine: both would scale and cast. Use"
                f" lightning_mp.deepspeed.DeepSpeedMixedPrecision({self.requested_precision!r}) there."
            )
        if trainer is not None:
            if trainer.state.fn == TrainerFn.FITTING and self._run is not None:
                self._start_new_run()
            run = self._ensure_run(trainer_device_type(module), has_sharded_parameters(module))
            if not isinstance(self._engine, TrainerEngine):
                self._engine = trainer_engine(run, self, self.skip_scheduler_on_overflow)
            self._convert_fp8(module)
            run.evaluation.track(module)
            return run.policy.convert_module(module)
        if self._run is not None and (
            previous_run_ended or (isinstance(self._engine, FabricEngine) and self._engine.has_stepped)
        ):
            self._start_new_run()
        run = self._ensure_run(self.requested_device or fabric_device_type(module), has_sharded_parameters(module))
        self._convert_fp8(module)
        run.evaluation.track(module)
        module = run.policy.convert_module(module)
        if not isinstance(self._engine, FabricEngine):
            self._engine = fabric_engine(run, self._follow_model_device, repr(self))
        self._engine.add_module(module)
        return module

    def _follow_model_device(self, run_device: str | None) -> str:
        """Autocast where Fabric put the model; refuse a ``device=`` or an ``"auto"`` choice that the run contradicts.

        Raises:
            ValueError: as :func:`~lightning_mp.plugin.resolved.follow_device`.

        """
        run = self._run
        assert run is not None
        if run_device is None or run_device == run.setup.device:
            return run.setup.device
        self._run = replace(run, setup=follow_device(run.setup, self.settings, run_device))
        return run_device

    @override
    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        """Hand the optimizers to the opt level, find the running statistics and make step schedulers skip-aware.

        Raises:
            MisconfigurationException: for LBFGS in fp16, where a step cannot be checked before it is taken.

        """
        if self._engine is None:
            self.setup_for_device(trainer_device_type(model))
        return self._chosen_engine().connect(model, optimizers, lr_schedulers)

    # ------------------------------------------------------------------------------------------------ runs

    def _start_new_run(self) -> None:
        """Forget the previous run: the next setup builds a fresh opt level, scaler and engine, as a new plugin would.

        A ``LossScaler`` given as ``scaler=`` is the caller's object and keeps its state.
        """
        if self._run is not None:
            self._run.teardown()
        self._run = None
        self._engine = None
        self._claim.ended = False

    def __getstate__(self) -> dict[str, Any]:
        """Pickle (and deep-copy) the settings and the state; under Fabric, after the pending scale update.

        A copy keeps no tie to a running loop (its model and optimizers): its engine is chosen again when a Trainer
        or a Fabric sets it up.
        """
        if self._engine is not None:
            self._engine.apply_pending_update()
        return {**self.__dict__, "_engine": None, "_claim": RunClaim(ended=self._claim.ended)}

    @override
    def teardown(self) -> None:
        """Apply a pending Fabric scale update, so that the counters include the last step; release the model.

        The opt level drops its references (O2's parameter slots), and so do the running-statistic layers, so that a
        reused plugin keeps no previous model alive. The plugin is then free for another run, in any thread. A
        teardown from another thread than the run's (a second Trainer that was refused the plugin) leaves the run
        alone.
        """
        if not self._claim.release(had_run=self._run is not None):
            return
        if self._engine is not None:
            self._engine.teardown()
        if self._run is not None:
            self._run.teardown()
        super().teardown()

    def __repr__(self) -> str:
        precision = self._run.setup.precision if self._run is not None else self.requested_precision
        fp8 = "" if self.fp8_settings is None else f", fp8={self.fp8_settings.recipe!r}"
        return f"{type(self).__name__}(precision={precision!r}, opt_level={self.opt_level!r}{fp8})"


__all__ = ["PLUGIN_DEFAULTS", "MixedPrecision"]
