"""The MixedPrecision plugin: autocast around every step, a loss scaler around backward and the optimizer step.

Pass it to the Trainer, exactly where Lightning's own ``MixedPrecision(precision, device, scaler=None)`` goes (every
call that one accepts, this one accepts with the same meaning; the scaler's knobs are keyword-only)::

    trainer = Trainer(plugins=[MixedPrecision("16-mixed", growth_interval=1000, hysteresis=2)])

or to Fabric, ``Fabric(plugins=[MixedPrecision(...)])``.

The plugin only adapts: it owns the settings, the opt level (:mod:`lightning_mp.policies`) and the loss scaler
(:mod:`lightning_mp.scaler`), and hands every step hook to one step engine chosen when the model is converted: the
Trainer's (:mod:`lightning_mp.engine.trainer`) when a Trainer is attached to the model, else Fabric's
(:mod:`lightning_mp.engine.fabric`). What a step is, and the pieces both engines share, is written once in
:mod:`lightning_mp.engine.base`. Autocast itself is the plugin's ``forward_context``.

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

import contextlib
import threading
import warnings
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import MixedPrecision as LightningMixedPrecision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mp._compile import autocast_by_flags, backward_outside_autocast
from lightning_mp._hardware import choose_precision, device_has_native_bf16, emulated_bf16_warning
from lightning_mp._knobs import with_knob_docs
from lightning_mp._scale_rules import SCALER_DEFAULTS, ScalerSettings
from lightning_mp.engine import FabricEngine, StepEngine, TrainerEngine
from lightning_mp.fp8.convert import check_fp8_device, require_torchao
from lightning_mp.fp8.mode import Fp8Mode, check_fp8_combination
from lightning_mp.fp8.settings import Fp8Recipe, FP8Settings, fp8_settings_from_argument
from lightning_mp.policies import POLICIES, SHARDED_POLICIES, PrecisionPolicy
from lightning_mp.policies.sharded import fsdp2_mixed_precision_policy, refuse_half_weights
from lightning_mp.scaler import LossScaler, ScalingMode
from lightning_mp.scaling.sharded import has_sharded_parameters
from lightning_mp.settings import HALF_DTYPES, PRECISIONS, PluginSettings, PrecisionName
from lightning_mp.stats import PrecisionStats, ScalerView

PLUGIN_DEFAULTS = PluginSettings()
"""The defaults of the plugin's own arguments; the scaler's are :data:`~lightning_mp._scale_rules.SCALER_DEFAULTS`."""
TORCH_SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
"""The keys of ``torch.amp.GradScaler.state_dict()``: Lightning's own plugin loads exactly these."""
PLUGIN_ENTRY_KEYS = ("MixedPrecision", "FSDPMixedPrecision", "FSDPPrecision")
"""The checkpoint entries that hold a loss scaler's state: this plugin's two forms', and Lightning's FSDPPrecision's."""
_RUN_CLAIMS = threading.Lock()
"""Serialises the claims of runs on plugins (:meth:`MixedPrecision._claim_run`)."""


def attached_trainer(module: nn.Module | None) -> Any:
    """The Trainer a LightningModule is attached to; None for Fabric's modules (and no module)."""
    # Under Fabric, LightningModule.trainer returns a stand-in for the Fabric object rather than None.
    if not isinstance(module, LightningModule) or module.fabric is not None:
        return None
    try:
        return module.trainer
    except RuntimeError:  # not attached to a Trainer
        return None


_HALF_WEIGHTS_PRECISION: dict[str, Literal["16-true", "bf16-true"]] = {"16-mixed": "16-true", "bf16-mixed": "bf16-true"}
"""The precision Lightning sees for a run whose opt level keeps half weights (O3, lean)."""


_ASKED_PRECISION: dict[str, str] = {shown: asked for asked, shown in _HALF_WEIGHTS_PRECISION.items()}
"""The mixed precision behind each ``-true`` name Lightning is shown."""


def _mixed(precision: str) -> str:
    """The mixed precision a run was set up with, also where Lightning is shown its ``-true`` name."""
    return _ASKED_PRECISION.get(precision, precision)


@with_knob_docs(PluginSettings, ScalerSettings)
class MixedPrecision(LightningMixedPrecision):
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
            :class:`~lightning_mp.LossScaler` is used as it is. Leave it None to set the knobs below.
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
        fp8: run the linear layers' matmuls in FP8 with torchao's float8 training: a recipe name (``"tensorwise"``,
            ``"rowwise"``, ``"rowwise_with_gw_hp"``) or a :class:`~lightning_mp.fp8.FP8Settings` for the layers kept
            in bf16 and the fallback thresholds. With ``precision="bf16-mixed"`` and ``opt_level`` ``"O1"`` or
            ``"O2"`` only (:mod:`lightning_mp.fp8.mode`); needs the ``fp8`` extra. None (the default) runs no FP8.

    Every knob is declared, documented and checked once, in :class:`~lightning_mp.settings.PluginSettings` and
    :class:`~lightning_mp._scale_rules.ScalerSettings`; :attr:`settings` holds them as validated. Numbers may be
    Python, numpy or 0-d tensor scalars; booleans must be ``True`` or ``False``.

    Raises:
        ValueError: for any argument outside what is allowed; the message names the argument, the value given and
            what is allowed, with a "did you mean" for a near miss such as ``"fp16"`` or ``"o2"``.
        TypeError: if ``scaler`` is not a ``torch.amp.GradScaler``.
        ModuleNotFoundError: if ``fp8`` is given and torchao is not installed (``pip install "lightning_mp[fp8]"``).
        RuntimeError: if ``fp8`` is given and torch or torchao is older than the FP8 mode's floor.

    """

    # Lightning types both as resolved values; this plugin holds "auto" and None until setup learns the device (its
    # own hooks read them only after that), and ``requested_precision`` keeps what was asked for.
    precision: PrecisionName | Literal["16-true", "bf16-true"]  # type: ignore[assignment]
    device: str | None  # type: ignore[assignment]

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
        fp8: Fp8Recipe | FP8Settings | str | None = None,
    ) -> None:
        settings = PluginSettings.from_arguments(
            type(self).__name__,
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
        )
        self.settings = settings
        """Every argument, validated (:class:`~lightning_mp.settings.PluginSettings`)."""
        self.requested_precision: PrecisionName = settings.precision
        self.precision = settings.precision  # resolved at setup when "auto"
        self.opt_level = settings.opt_level
        self.device = settings.device
        self.requested_device = settings.device
        """The ``device`` given; None follows the Trainer's accelerator, or under Fabric the model's device."""
        self.loss_scale = settings.loss_scale
        self.skip_scheduler_on_overflow = settings.skip_scheduler_on_overflow
        self.keep_fp32 = list(settings.keep_fp32)
        self.precision_reason = "asked for" if settings.precision != "auto" else ""
        self._given_loss_scaler = scaler if isinstance(scaler, LossScaler) else None
        """A LossScaler given as ``scaler=``, used as it is; a torch GradScaler is translated into the settings."""
        self._loss_scaler: LossScaler | None = None
        self._policy: PrecisionPolicy | None = None
        self._state_before_setup: dict[str, Any] | None = None
        """A state loaded before setup (or between two runs): setup loads it into the run's scaler and opt level."""
        self._engine: StepEngine | None = None
        """The step engine of the run, chosen at setup: the Trainer's or Fabric's."""
        self._run_thread: int | None = None
        self.fp8_settings = fp8_settings_from_argument(type(self).__name__, fp8)
        """The FP8 mode's validated settings; None when the run has no FP8."""
        if self.fp8_settings is not None:
            check_fp8_combination(type(self).__name__, self.fp8_settings, settings.precision, settings.opt_level)
            require_torchao(type(self).__name__, self.fp8_settings.recipe)
        self._fp8: Fp8Mode | None = None
        """The run's FP8 layers and fallbacks (:mod:`lightning_mp.fp8.mode`), built at setup."""
        self._fp8_before_sharding: Fp8Mode | None = None
        """The FP8 layers :meth:`fp8_convert` converted before FSDP2 sharded the model; the run's from setup on."""
        """The ident of the thread whose run (a Trainer's fit, or a Fabric loop) the plugin drives now."""
        self._run_ended = False
        """Whether the last run was torn down: the next setup (other than a Trainer's validate, test or predict after
        a fit) starts a new run."""

    # ------------------------------------------------------------------------------------------------ properties

    @property
    def half_dtype(self) -> torch.dtype | None:
        """``torch.float16`` or ``torch.bfloat16`` once resolved; None for fp32 (and for "auto" before setup)."""
        return HALF_DTYPES.get(_mixed(self.precision))

    # Lightning's plugin stores a writable ``scaler``; here it is a read-only view of the scaler this plugin owns, and
    # Lightning's hooks that use it are overridden.
    @property
    def scaler(self) -> LossScaler | None:  # type: ignore[override]
        """The loss scaler, or None where nothing is scaled (bf16, fp32) and before setup. Reading it changes nothing.

        Under Fabric the scale moves at the next ``fabric.backward`` (:mod:`lightning_mp.engine.fabric`), so right
        after a step the scaler's own getters still give the scale that step was unscaled with; :attr:`stats` gives
        the one the step leads to.
        """
        if self._loss_scaler is not None and self._loss_scaler.scales_loss:
            return self._loss_scaler
        return None

    @property
    def scaler_view(self) -> ScalerView:
        """The scaler's overflow counter and settings for telemetry, in every precision; never synchronises."""
        scaler = self._loss_scaler
        if scaler is None:
            return ScalerView()
        max_scale = scaler.max_scale if scaler.mode == "dynamic" else None
        return ScalerView(scaler.local_overflow_count, max_scale, scaler.scales_loss)

    @property
    def policy(self) -> PrecisionPolicy | None:
        """The opt level's policy object, once set up."""
        return self._policy

    @property
    def stats(self) -> PrecisionStats:
        """Counters as of the last optimizer step, its scale update included. Reading them changes nothing.

        Reading them never synchronises with the device. Under Fabric, whose scale update waits for the next
        ``fabric.backward`` (:mod:`lightning_mp.engine.fabric`), they count the pending update in without applying
        it; where its inf flag is still on an accelerator, they are one iteration old, as the scale is there.
        """
        if self._engine is not None and self._loss_scaler is not None:
            return self._engine.stats()
        if self._loss_scaler is None:
            scaled = self.precision == "16-mixed" or self.requested_precision == "16-mixed"
            initial = self.settings.scaler.init_scale if self.loss_scale == "dynamic" else self.loss_scale
            return PrecisionStats(loss_scale=float(initial) if scaled else 1.0)
        return self._loss_scaler.stats()

    def local_overflows(self) -> int:
        """Steps on which this process's own gradients overflowed, before the ranks agreed to skip.

        Under DDP every rank skips a step on which any rank overflowed; this count says which rank it was.

        .. warning:: Under DDP this reads a device counter and synchronises; call it on logging steps only.
        """
        return self._loss_scaler.local_overflows() if self._loss_scaler is not None else 0

    def fsdp2_policy(self, keep_fp32: bool = False) -> MixedPrecisionPolicy:
        """The ``MixedPrecisionPolicy`` to pass to FSDP2's ``fully_shard`` so that it carries out this opt level.

        O2 gathers the weights in the half type and reduces gradients in half; O0 and O1 need no cast from FSDP2;
        O3 and lean are refused on a model sharded before the plugin sees it (under Fabric's ``parallelize_fn``, which
        shards after the conversion, O3 trains and lean is refused at the first forward; see
        :mod:`lightning_mp.policies.sharded` for the table and the ``keep_fp32`` recipe)::

            def configure_model(self):
                for block in self.blocks:
                    fully_shard(block, mp_policy=plugin.fsdp2_policy())
                fully_shard(self.head, mp_policy=plugin.fsdp2_policy(keep_fp32=True))  # keep_fp32=["head"]
                fully_shard(self, mp_policy=plugin.fsdp2_policy())

        Args:
            keep_fp32: the policy for a ``keep_fp32`` subtree's own ``fully_shard`` call (gathered in fp32).

        Raises:
            ValueError: when ``precision='auto'`` is not resolved yet (``configure_model`` runs before the plugin
                learns the device); pass ``'16-mixed'`` or ``'bf16-mixed'`` explicitly.

        """
        if self.precision == "auto":
            raise ValueError(
                "MixedPrecision(precision='auto').fsdp2_policy() is not allowed: the precision is chosen at setup,"
                " after configure_model. Pass precision='16-mixed' or 'bf16-mixed' to use fsdp2_policy()."
            )
        return fsdp2_mixed_precision_policy(self.opt_level, self.half_dtype, keep_fp32)

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
        if self._run_ended:
            self._start_new_run()
        self._build_run(device_type)
        if self._engine is None:
            self._engine = self._trainer_engine()

    def _build_run(self, device_type: str, sharded: bool = False) -> None:
        """Resolve the precision and build the opt level's policy and the loss scaler (:meth:`setup_for_device`).

        A ``sharded`` model (FSDP2) gets the opt level's sharded form where it has one (:data:`SHARDED_POLICIES`).
        """
        if self._policy is not None:
            return
        self.settings.check_device("MixedPrecision", device_type)
        self.device = device_type
        if self.requested_precision == "auto":
            self.precision, self.precision_reason = choose_precision(device_type, self.opt_level)
            rank_zero_info(f"lightning_mp: precision='auto' chose {self.precision!r}: {self.precision_reason}.")
        self.settings.check_resolved("MixedPrecision", self.precision, self.precision_reason)
        self._warn_about_slow_half(device_type)
        opt_level = "O0" if self.precision == "32-true" else self.opt_level
        if sharded:
            refuse_half_weights(opt_level, self.precision)
        if self.fp8_settings is not None:
            check_fp8_device(type(self).__name__, self.fp8_settings.recipe, device_type)
            self._fp8 = self._fp8_before_sharding or Fp8Mode(self.fp8_settings)
            self._fp8_before_sharding = None
        self._policy = self._build_policy(opt_level, sharded)
        policy_class = type(self._policy)
        self._loss_scaler = self._build_loss_scaler(device_type, policy_class)
        if policy_class.half_weights:
            # Lightning reads ``precision`` for what the weights are (ModelSummary's model size, for one): O3 and
            # lean keep half weights with no fp32 masters, as its "16-true" and "bf16-true" do.
            self.precision = _HALF_WEIGHTS_PRECISION[self.precision]
        if self._state_before_setup is not None:
            loaded, self._state_before_setup = self._state_before_setup, None
            self.load_state_dict(loaded)

    def _build_policy(self, opt_level: str, sharded: bool = False) -> PrecisionPolicy:
        """The opt level's policy for this run.

        A model that FSDP2 has sharded already gets the level's sharded form (:data:`SHARDED_POLICIES`: O2 onto
        FSDP2's own policy); the FSDP form overrides this to map O2 onto FSDP's own half weights.
        """
        policy_class = SHARDED_POLICIES.get(opt_level, POLICIES[opt_level]) if sharded else POLICIES[opt_level]
        return policy_class(self.half_dtype, keep_fp32=self.keep_fp32)

    def _build_loss_scaler(self, device_type: str, policy_class: type[PrecisionPolicy]) -> LossScaler:
        if self._given_loss_scaler is not None:
            scaler = self._given_loss_scaler
            scaler.allow_fp16_gradients = policy_class.half_gradients
            return scaler
        mode: ScalingMode = "check"
        settings = self.settings.scaler
        if self.precision == "16-mixed" and not self.settings.scaling_disabled:
            if self.loss_scale != "dynamic":
                settings = replace(settings, mode="static", init_scale=self.loss_scale)
            elif policy_class.scales_by_default:
                mode = "dynamic"
        if settings.mode != "static":
            settings = replace(settings, mode=mode)
        scaler = LossScaler.from_settings(settings, device_type)
        scaler.allow_fp16_gradients = policy_class.half_gradients
        return scaler

    def _warn_about_slow_half(self, device_type: str) -> None:
        if device_type != "cpu" or self.half_dtype is None:
            return
        if self.half_dtype is torch.float16:
            rank_zero_warn(
                "lightning_mp: fp16 ('16-mixed') on the CPU is real fp16 with a loss scaler, but most CPUs multiply"
                " fp16 far more slowly than fp32. Use it to test loss scaling; for speed use 'bf16-mixed' on a CPU"
                " with AVX512-BF16 or AMX."
            )
        elif not device_has_native_bf16("cpu"):
            rank_zero_warn(emulated_bf16_warning(self.requested_precision, self.opt_level, self.precision_reason))

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

        """
        self._claim_run()
        previous_run_ended, self._run_ended = self._run_ended, False
        trainer = attached_trainer(module)
        if trainer is not None:
            if trainer.state.fn == TrainerFn.FITTING and self._policy is not None:
                self._start_new_run()
            self._build_run(self._trainer_device_type(module), sharded=has_sharded_parameters(module))
            if not isinstance(self._engine, TrainerEngine):
                self._engine = self._trainer_engine()
            assert self._policy is not None
            self._convert_fp8(module)
            return self._policy.convert_module(module)
        if self._policy is not None and (
            previous_run_ended or (isinstance(self._engine, FabricEngine) and self._engine.has_stepped)
        ):
            self._start_new_run()
        parameter = next(module.parameters(), None)
        placed = parameter.device.type if parameter is not None else "cpu"
        # Fabric converts before it moves the model, and tells a plugin nothing of its accelerator: a model still on
        # the CPU is assumed to go where Fabric's accelerator="auto" would put it, and the first forward confirms it.
        assumed = placed if placed != "cpu" else ("cuda" if torch.cuda.is_available() else "cpu")
        self._build_run(self.device or assumed, sharded=has_sharded_parameters(module))
        assert self._policy is not None and self._loss_scaler is not None
        self._convert_fp8(module)
        module = self._policy.convert_module(module)
        if not isinstance(self._engine, FabricEngine):
            self._engine = FabricEngine(self._loss_scaler, self._policy, self._follow_model_device)
        self._engine.add_module(module)
        return module

    def _convert_fp8(self, module: nn.Module) -> None:
        """Convert the chosen linear layers to FP8 before the opt level converts the module (O2 finds them there).

        Raises:
            ValueError: for a model FSDP2 sharded before the plugin saw it: torchao must convert before sharding.

        """
        if self._fp8 is None or self._fp8.converted(module):
            return
        if has_sharded_parameters(module):
            raise ValueError(
                f"{self!r} got a model FSDP2 sharded already: torchao converts linear layers before fully_shard, not"
                " after. Call plugin.fp8_convert(self) first thing in configure_model, before fully_shard (or"
                " fabric.setup's parallelize_fn)."
            )
        if self._fp8.settings.fsdp_float8_all_gather:
            raise ValueError(
                f"{self!r} has FP8Settings(fsdp_float8_all_gather=True) on a model FSDP2 does not shard: the float8"
                " all-gather is FSDP2's. Call plugin.fp8_convert(self) in configure_model before fully_shard, or set"
                " fsdp_float8_all_gather=False."
            )
        self._fp8.convert(module, self.keep_fp32)

    def fp8_convert(self, module: nn.Module) -> nn.Module:
        """Convert ``module``'s chosen linear layers to FP8 now, for FSDP2: call it before ``fully_shard``.

        torchao's layers must exist before FSDP2 shards their weights (its float8 all-gather wraps them), so under
        ``ModelParallelStrategy`` the conversion cannot wait for the plugin's own ``convert_module``::

            def configure_model(self):
                plugin.fp8_convert(self)
                for block in self.blocks:
                    fully_shard(block, mp_policy=plugin.fsdp2_policy())
                fully_shard(self, mp_policy=plugin.fsdp2_policy())

        A sharded model keeps its FP8 layers after fit (it is not a plain model anyway), and its layers cannot fall
        back mid-run (FSDP2 holds the layer objects); :class:`~lightning_mp.fp8.FP8Settings` ``exclude`` keeps them
        out from the start.

        Returns:
            ``module``, converted in place.

        Raises:
            RuntimeError: when the plugin has no ``fp8``.

        """
        if self.fp8_settings is None:
            raise RuntimeError(f"{self!r}.fp8_convert(...) needs fp8: pass MixedPrecision('bf16-mixed', fp8=...).")
        self._fp8_before_sharding = Fp8Mode(self.fp8_settings)
        self._fp8_before_sharding.convert(module, self.keep_fp32)
        return module

    @property
    def fp8_layers(self) -> list[str]:
        """Names of the layers that compute in FP8 now (relative to the model the plugin converted); empty without."""
        return self._fp8.layers if self._fp8 is not None else []

    @property
    def fp8_fell_back(self) -> dict[str, str]:
        """Layer name -> reason, for the layers returned to bf16 in this run (a resumed checkpoint's included)."""
        return dict(self._fp8.fell_back) if self._fp8 is not None else {}

    def fallback_layers(self, model: nn.Module, requests: Mapping[str, str]) -> dict[str, str]:
        """Return FP8 layers to bf16 for the rest of the run, the same on every rank; see :mod:`lightning_mp.fp8.mode`.

        Each layer becomes a plain ``nn.Linear`` holding the same weight and bias Parameter objects, so the optimizer
        and its state are untouched. The decision is kept in checkpoints.

        .. warning:: Under DDP this runs one collective and reads it on the host: call it on every rank, at the same
            step (with an empty ``requests`` where a rank has none), on logging steps only.

        Args:
            model: the converted model: the LightningModule under the Trainer, the module given to ``fabric.setup``.
            requests: layer name -> reason, for the layers this rank would return to bf16.

        Returns:
            Layer name -> reason, for the layers that fell back now: the union of every rank's requests.

        Raises:
            RuntimeError: when the run has no FP8 (``fp8=None``), or before setup.
            ValueError: for a name that is not an FP8 layer of ``model``.

        """
        if self._fp8 is None:
            raise RuntimeError(
                f"{self!r}.fallback_layer(...) needs an FP8 run: pass MixedPrecision('bf16-mixed', fp8='tensorwise')"
                " (or another recipe), and call it after the Trainer or Fabric set the model up."
            )
        return self._fp8.fallback_layers(model, requests)

    def fallback_layer(self, model: nn.Module, name: str, reason: str) -> bool:
        """Return one FP8 layer to bf16 for the rest of the run (:meth:`fallback_layers` with one request).

        .. warning:: One collective under DDP: every rank must call it (or :meth:`fallback_layers`) at the same step.

        Returns:
            Whether ``name`` fell back now (False when it had fallen back already).

        """
        return name in self.fallback_layers(model, {name: reason})

    @staticmethod
    def _trainer_device_type(module: nn.Module) -> str:
        trainer = attached_trainer(module)
        if trainer is not None:
            return trainer.strategy.root_device.type
        parameter = next(module.parameters(), None)
        return parameter.device.type if parameter is not None else "cpu"

    def _trainer_engine(self) -> TrainerEngine:
        assert self._policy is not None and self._loss_scaler is not None
        return TrainerEngine(self._loss_scaler, self._policy, self, self.skip_scheduler_on_overflow)

    def _follow_model_device(self, run_device: str | None) -> str:
        """Autocast where Fabric put the model; refuse a ``device=`` or an ``"auto"`` choice that the run contradicts.

        Returns:
            The device type to autocast on.

        Raises:
            ValueError: when ``device`` was given and the model is on another device type, or when
                ``precision="auto"`` chose, for the device assumed at ``fabric.setup``, another precision than it
                chooses for the model's device.

        """
        assert self.device is not None
        if run_device is None or run_device == self.device:
            return self.device
        if self.requested_device is not None:
            raise ValueError(
                f"MixedPrecision(device={self.requested_device!r}) does not match Fabric's device: the model runs on"
                f" {run_device!r}. Leave device=None to follow Fabric, or pass device={run_device!r}."
            )
        if self.requested_precision == "auto":
            choice, _ = choose_precision(run_device, self.opt_level)
            if choice != _mixed(self.precision):
                raise ValueError(
                    f"MixedPrecision(precision='auto') chose {_mixed(self.precision)!r} at fabric.setup for"
                    f" {self.device!r}, but Fabric runs the model on {run_device!r}, where 'auto' means {choice!r}."
                    f" Pass MixedPrecision(device={run_device!r}), or the precision itself."
                )
        self.device = run_device
        return run_device

    def _chosen_engine(self) -> StepEngine:
        """The engine chosen at setup.

        Raises:
            RuntimeError: before setup.

        """
        if self._engine is None:
            raise RuntimeError(
                f"{type(self).__name__} was not set up: a Trainer sets it up when it starts, Fabric at"
                " fabric.setup(model, optimizer). Call fabric.setup before fabric.backward or optimizer.step; to use"
                " the plugin outside both, call plugin.setup_for_device('cpu' or 'cuda') first."
            )
        return self._engine

    @override
    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        """Hand the optimizers to the opt level, find the running statistics and make step schedulers skip-aware.

        Raises:
            MisconfigurationException: for LBFGS in fp16, where a step cannot be checked before it is taken.

        """
        if self._engine is None:
            self.setup_for_device(self._trainer_device_type(model))
        return self._chosen_engine().connect(model, optimizers, lr_schedulers)

    def last_step_skipped(self, optimizer: Optimizer) -> bool:
        """Whether the most recent step of ``optimizer`` (or its LightningOptimizer) was skipped; False before one.

        .. warning:: Where the step was decided on the device (fused optimizers; in bf16 and fp32 every optimizer the
            scaler hands to a fused kernel), this reads its inf flag: one host sync. An ``interval="step"``
            scheduler asks it after every step.
        """
        return self._engine.last_step_skipped(optimizer) if self._engine is not None else False

    # ------------------------------------------------------------------------------------------------ steps

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """Run inside the opt level's forward context (O2: half weights), under autocast when the level uses it."""
        policy = self._policy
        if policy is None:
            yield
            return
        compiling = torch.compiler.is_compiling()
        if self._engine is not None and not compiling:
            self._engine.before_forward()
        # Traced inside a compiled model the level's context is left out: a graph cannot swap O2's weights.
        with contextlib.nullcontext() if compiling else policy.forward_context():
            if not policy.uses_autocast or self.half_dtype is None:
                yield
                return
            assert self.device is not None
            if compiling:
                # Traced inside a compiled model (torch.compile after fabric.setup): lightning_mp._compile.
                with autocast_by_flags(self.device, self.half_dtype):
                    yield
                return
            # Compiled regions differentiate outside autocast, as eager autograd does (lightning_mp._compile).
            with torch.autocast(self.device, dtype=self.half_dtype, cache_enabled=False), backward_outside_autocast():
                yield

    @override
    @contextlib.contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        """The training step, in the forward context; the engine learns where it begins and ends.

        In manual optimization the training step takes the optimizer steps itself, so the scale moves when it
        returns, once, after the last of them (:mod:`lightning_mp.engine.trainer`).
        """
        engine = self._chosen_engine()
        engine.begin_iteration()
        with self.forward_context():
            yield
        engine.end_training_step()

    @override
    def convert_input(self, data: Any) -> Any:
        """Leave the inputs as they are (autocast and the opt level cast them); under Fabric, check their device.

        Raises:
            ValueError: under Fabric, when the inputs live on another device type than the model, or the model on
                another than a ``device`` given.

        """
        return self._engine.convert_input(data) if self._engine is not None else data

    @override
    def convert_output(self, data: Any) -> Any:
        """Under Fabric, return the forward's half-precision outputs in fp32, as Fabric's own mixed precision does."""
        return self._engine.convert_output(data) if self._engine is not None else data

    @override
    # Lightning's Trainer hook takes the LightningModule that Fabric's base hook leaves out (Lightning's own ignore).
    def pre_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:  # type: ignore[override]
        """Scale the loss before backward (fp16), then run Lightning's ``on_before_backward`` hooks.

        Under Fabric nothing happens here: Fabric ignores what this returns, and ``backward`` scales the loss.

        Raises:
            TypeError: if ``tensor`` is not a tensor (``manual_backward(loss.item())``).

        """
        return self._chosen_engine().pre_backward(tensor, module)

    @override
    def backward(self, tensor: Tensor, model: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """Back-propagate the loss; under Fabric, apply the pending scale update and scale the loss first."""
        self._chosen_engine().backward(tensor, model, *args, **kwargs)

    @override
    def post_backward(self, tensor: Tensor, module: nn.Module | None) -> Any:
        """Run the policy's and Lightning's ``on_after_backward`` hooks under the Trainer; nothing under Fabric."""
        return self._chosen_engine().post_backward(tensor, module)

    @override
    # Lightning's and Fabric's strategies hand the plugin the torch Optimizer; the base hook accepts any Steppable.
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizer,
        model: LightningModule | None = None,
        closure: Callable[[], Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Backward, unscale, hooks and clipping on true gradients, then a step that is skipped on inf/NaN."""
        return self._chosen_engine().optimizer_step(optimizer, model, closure, **kwargs)

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Unscale (and, in O2, move to the masters) the gradients before ``fabric.clip_gradients`` clips them."""
        self._chosen_engine().unscale_gradients(optimizer)

    @override
    # Fabric types this hook Iterator[Parameter]; its clipping only iterates what this returns, once.
    def main_params(self, optimizer: Optimizer) -> Iterable[Tensor]:  # type: ignore[override]
        """The parameters to clip; under Fabric none on a step that will be skipped (:meth:`FabricEngine.main_params`).

        .. warning:: Under Fabric, after ``fabric.clip_gradients`` unscaled the gradients, this reads the inf/NaN
            flag and synchronises the host with the device.
        """
        return self._chosen_engine().main_params(optimizer)

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip true gradients: unscale first where that has not happened yet in this optimizer step.

        A fused optimizer's step then sees the gradients already unscaled and does not unscale them again. In bf16
        and fp32 nothing is scaled, so the gradients are only checked for inf/NaN before they are clipped. In every
        precision the clipped gradients are checked once more, on the device (:meth:`LossScaler.recheck_gradients`),
        so that a step whose clipping made them non-finite is skipped, never applied.

        Raises:
            ValueError: if ``clip_val`` is NaN or negative (0 means no clipping, as in Lightning).

        """
        if isinstance(clip_val, bool) or not isinstance(clip_val, int | float) or not clip_val >= 0:
            raise ValueError(
                f"clip_gradients(gradient_clip_val={clip_val!r}) is not allowed: expected a number >= 0 (0 clips"
                " nothing, inf computes the norm without clipping). A NaN threshold would write NaN into every"
                " gradient."
            )
        self._chosen_engine().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    # ------------------------------------------------------------------------------------------------ checkpoints

    @override
    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (scale, trackers, counters), the precision and the opt level's own state.

        The top level also holds torch's five ``GradScaler`` keys, so Lightning's own ``MixedPrecision`` (which reads
        this entry under the same class name) resumes from it. After a bf16 or fp32 run, which has no fp16 scale,
        they describe a fresh fp16 scaler.
        """
        if self._engine is not None:
            self._engine.apply_pending_update()
        if self._loss_scaler is None or self._policy is None:
            return dict(self._state_before_setup or {})
        scaler_state = self._loss_scaler.state_dict()
        torch_state = {key: scaler_state[key] for key in TORCH_SCALER_KEYS if key in scaler_state}
        if not self._loss_scaler.scales_loss:
            torch_state.update(scale=float(self.settings.scaler.init_scale), _growth_tracker=0)
        return {
            **torch_state,
            "scaler": scaler_state,
            "precision": _mixed(self.precision),
            "opt_level": self._policy.opt_level,
            "policy": self._policy.state_dict(),
            **({"fp8": self._fp8.state_dict()} if self._fp8 is not None else {}),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from this plugin's state, or from torch's five-key GradScaler dict (Lightning's own plugin).

        Loaded between two runs (after a ``teardown``), the state is the next run's: that run starts from it instead
        of from a new plugin's state.

        Raises:
            ValueError: if the state is malformed (a damaged checkpoint), naming the field, its value and what is
                allowed; checked when it is loaded, before anything changes.

        """
        _check_plugin_state(state_dict)
        if self._run_ended:
            # Loaded between two runs: it is the next run's state, which starts as a new plugin would.
            self._start_new_run()
        if self._loss_scaler is None or self._policy is None:
            self._state_before_setup = dict(state_dict)
            return
        if "scaler" in state_dict:
            scaler_state, saved_precision = state_dict["scaler"], state_dict.get("precision")
        elif "scale" in state_dict:
            scaler_state, saved_precision = state_dict, "16-mixed"
        else:
            scaler_state, saved_precision = {}, None
        if saved_precision == "bf16-mixed" and _mixed(self.precision) == "16-mixed":
            warnings.warn(
                "lightning_mp: resuming an fp16 run from a checkpoint written in bf16. Models trained in bf16 often"
                " have activations beyond fp16's range (65504) and overflow in fp16; consider staying in bf16.",
                UserWarning,
                stacklevel=2,
            )
        if not scaler_state:
            self._warn_missing_scaler_state()
        elif self._loss_scaler.scales_loss and scaler_state.get("mode") == "check":
            # A bf16 or fp32 checkpoint has no meaningful fp16 scale: keep the counters, start from init_scale.
            self._loss_scaler.load_state_dict({**scaler_state, "scale": self._loss_scaler.get_scale()})
        else:
            self._loss_scaler.load_state_dict(scaler_state)
        self._policy.load_state_dict(state_dict.get("policy", {}))
        if self._fp8 is not None:
            self._fp8.load_state_dict(state_dict.get("fp8", {}))
        if self._engine is not None:
            self._engine.state_loaded()

    def _warn_missing_scaler_state(self) -> None:
        if self.scaler is not None:
            warnings.warn(
                "lightning_mp: the checkpoint holds no loss-scaler state, so the loss scale starts again from"
                f" init_scale={self.scaler.get_scale():g} instead of the scale the run had reached.",
                UserWarning,
                stacklevel=3,
            )

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore from another form's entry where this form's is missing; warn when there is no scaler state at all.

        Lightning itself then loads this plugin's entry, or the legacy ``native_amp_scaling_state`` key. A checkpoint
        of the other form (``MixedPrecision`` under DDP, ``FSDPMixedPrecision`` under FSDP) or of Lightning's
        ``FSDPPrecision`` holds its entry under that class's name (:data:`PLUGIN_ENTRY_KEYS`): it is loaded here, so a
        run moved between DDP and FSDP resumes at the scale it had.
        """
        if type(self).__qualname__ in checkpoint or "native_amp_scaling_state" in checkpoint:
            return
        entry = next((key for key in PLUGIN_ENTRY_KEYS if key in checkpoint), None)
        if entry is None:
            self._warn_missing_scaler_state()
        else:
            self.load_state_dict(checkpoint[entry])

    # ------------------------------------------------------------------------------------------------ runs

    def _claim_run(self) -> None:
        """Make this thread's run the plugin's one run; a run of another live thread holds it until its teardown.

        Raises:
            RuntimeError: when another thread's run uses the plugin now: the two would share one scaler and
                opt level, and corrupt each other's steps.

        """
        with _RUN_CLAIMS:
            if self._claimed_by_other_thread():
                raise RuntimeError(
                    f"{self!r} is already driving a run in another thread, and one plugin drives one run at a time:"
                    " its scaler and opt level hold that run's state. Give each Trainer or Fabric its own plugin"
                    " (copy.deepcopy(plugin) copies the settings), or start this run after the other ended (its"
                    " teardown)."
                )
            self._run_thread = threading.get_ident()

    def _claimed_by_other_thread(self) -> bool:
        """Whether a run of another thread, still alive, holds the plugin (asked under ``_RUN_CLAIMS``)."""
        owner = self._run_thread
        return owner not in (None, threading.get_ident()) and any(t.ident == owner for t in threading.enumerate())

    def _start_new_run(self) -> None:
        """Forget the previous run: the next setup builds a fresh opt level, scaler and engine, as a new plugin would.

        A ``LossScaler`` given as ``scaler=`` is the caller's object and keeps its state.
        """
        if self._policy is not None:
            self._policy.teardown()
        if self._fp8 is not None:
            self._fp8.teardown()
        self._policy = None
        self._fp8 = None
        self._loss_scaler = None
        self._engine = None
        self._run_ended = False
        self.precision = self.requested_precision
        self.device = self.requested_device

    def __getstate__(self) -> dict[str, Any]:
        """Pickle (and deep-copy) the settings and the state; under Fabric, after the pending scale update.

        A copy keeps no tie to a running loop (its model and optimizers): its engine is chosen again when a Trainer
        or a Fabric sets it up.
        """
        if self._engine is not None:
            self._engine.apply_pending_update()
        return {**self.__dict__, "_engine": None, "_run_thread": None}

    @override
    def teardown(self) -> None:
        """Apply a pending Fabric scale update, so that the counters include the last step; release the model.

        The opt level drops its references (O2's parameter slots), and so do the running-statistic layers, so that a
        reused plugin keeps no previous model alive. The plugin is then free for another run, in any thread. A
        teardown from another thread than the run's (a second Trainer that was refused the plugin) leaves the run
        alone.
        """
        with _RUN_CLAIMS:
            if self._claimed_by_other_thread():
                return
            self._run_thread = None
            self._run_ended = self._policy is not None
        if self._engine is not None:
            self._engine.teardown()
        if self._policy is not None:
            self._policy.teardown()
        if self._fp8 is not None:
            self._fp8.teardown()
        super().teardown()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(precision={_mixed(self.precision)!r}, opt_level={self.opt_level!r})"


def _check_plugin_state(state_dict: Any) -> None:
    """Raise unless ``state_dict`` has the shape of :meth:`MixedPrecision.state_dict` (or torch's GradScaler dict).

    The values inside ``'scaler'`` and ``'policy'`` are checked by the scaler and the opt level that load them.

    Raises:
        ValueError: naming the field, its value and what is allowed.

    """
    if not isinstance(state_dict, dict):
        raise ValueError(
            f"The checkpoint's MixedPrecision state holds {state_dict!r}; expected a dict, as"
            " MixedPrecision.state_dict() returns (or torch's GradScaler.state_dict()). The checkpoint is damaged."
        )
    for key, allowed in (("scaler", "the loss scaler's state"), ("policy", "the opt level's state"), ("fp8", "FP8's")):
        if key in state_dict and not isinstance(state_dict[key], dict):
            raise ValueError(
                f"The checkpoint's MixedPrecision state has {key!r}={state_dict[key]!r}; expected a dict ({allowed})."
            )
    precision = state_dict.get("precision", "auto")
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(
            f"The checkpoint's MixedPrecision state has 'precision'={precision!r}; expected one of {list(PRECISIONS)}."
        )
    opt_level = state_dict.get("opt_level", "O1")
    if not isinstance(opt_level, str) or opt_level not in POLICIES:
        raise ValueError(
            f"The checkpoint's MixedPrecision state has 'opt_level'={opt_level!r}; expected one of {list(POLICIES)}."
        )


__all__ = ["MixedPrecision"]
