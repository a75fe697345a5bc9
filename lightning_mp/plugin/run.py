"""The factory of a run: from the settings and the device, the opt level's policy, the loss scaler, FP8 and an engine.

A plugin drives one run at a time. When the Trainer or Fabric sets a run up, :func:`build_run` makes every object the
run steps with, all at once, so that a run is either whole or not there:

1. :func:`~lightning_mp.plugin.resolved.resolve_setup` resolves the precision for the device;
2. the opt level's policy (:mod:`lightning_mp.policies`) is built in the run's half type; a model FSDP2 has sharded
   gets the level's sharded form (:data:`~lightning_mp.policies.SHARDED_POLICIES`), and a half-weight level is
   refused there;
3. the loss scaler (:mod:`lightning_mp.scaler`): dynamic in fp16 where the level scales by default, static for a
   fixed ``loss_scale``, else one that only checks for inf/NaN (bf16, fp32, a disabled torch GradScaler); a
   :class:`~lightning_mp.LossScaler` given as ``scaler=`` is used as it is;
4. FP8's layers and fallbacks (:mod:`lightning_mp.fp8.mode`), when the plugin has ``fp8``;
5. the evaluation in ``eval_precision`` (:mod:`lightning_mp.plugin.evaluation`), refused on a sharded model where it
   would need other weights than the shards'.

The step engine is not part of the run: the front end that converts the model chooses it (:func:`trainer_engine`,
:func:`fabric_engine`), so a run that ``setup_for_device`` built steps with the Trainer's engine until a
``fabric.setup`` joins it with Fabric's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from lightning.pytorch.plugins.precision import Precision

from lightning_mp.engine.fabric import FabricEngine
from lightning_mp.engine.fabric_models import FabricModels
from lightning_mp.engine.trainer import TrainerEngine
from lightning_mp.fp8.mode import Fp8Mode, check_fp8_device
from lightning_mp.fp8.settings import FP8Settings
from lightning_mp.plugin.evaluation import Evaluation, refuse_swapped_weights_when_sharded
from lightning_mp.plugin.resolved import ResolvedSetup, resolve_setup
from lightning_mp.policies import POLICIES, SHARDED_POLICIES, LeanExactPolicy, PrecisionPolicy
from lightning_mp.policies.sharded import refuse_half_weights
from lightning_mp.scaler import LossScaler, ScalingMode
from lightning_mp.scaling.per_optimizer import PerOptimizerScalers, RunScaler
from lightning_mp.settings import PluginSettings


@dataclass(frozen=True)
class Run:
    """The objects one run steps with, built together by :func:`build_run`."""

    setup: ResolvedSetup
    """What setup resolved: the device, the precision, the opt level that runs."""
    policy: PrecisionPolicy
    """The opt level's policy."""
    loss_scaler: RunScaler
    """The loss scaler; in bf16 and fp32 one that only checks for inf/NaN; with ``scale_per_optimizer``, one per
    optimizer (:mod:`lightning_mp.scaling.per_optimizer`)."""
    fp8: Fp8Mode | None
    """FP8's layers and fallbacks; None without ``fp8``."""
    evaluation: Evaluation
    """The models evaluated in ``eval_precision``, and the weights of the evaluation in progress."""

    def teardown(self) -> None:
        """Have the opt level, FP8 and the evaluation drop their references to the model."""
        self.evaluation.teardown()
        self.policy.teardown()
        if self.fp8 is not None:
            self.fp8.teardown()


def policy_class_for(opt_level: str, sharded: bool) -> type[PrecisionPolicy]:
    """The policy class of ``opt_level``: its sharded form for a model FSDP2 has sharded, where it has one."""
    return SHARDED_POLICIES.get(opt_level, POLICIES[opt_level]) if sharded else POLICIES[opt_level]


def build_run(
    settings: PluginSettings,
    device_type: str,
    policy_class_for: Callable[[str], type[PrecisionPolicy]],
    keep_fp32: list[type | str],
    *,
    sharded: bool = False,
    given_loss_scaler: LossScaler | None = None,
    fp8_settings: FP8Settings | None = None,
    fp8_converted: Fp8Mode | None = None,
) -> Run:
    """Resolve the settings for ``device_type`` and build the run's policy, loss scaler and FP8 (module docstring).

    Args:
        settings: the plugin's validated settings.
        device_type: the device type of the run.
        policy_class_for: the policy class of an opt level for this run.
        keep_fp32: the modules the opt level keeps in fp32 (the plugin's ``keep_fp32``).
        sharded: whether FSDP2 sharded the model already: half-weight levels are refused.
        given_loss_scaler: a LossScaler given as ``scaler=``, used as it is.
        fp8_settings: the FP8 settings; None runs no FP8.
        fp8_converted: FP8 layers converted before FSDP2 sharded the model (``plugin.fp8_convert``), the run's own.

    Raises:
        ValueError: if the device contradicts ``device`` or a torch GradScaler's, ``"auto"`` chose a precision the
            settings cannot run, or the device cannot run the FP8 recipe.

    """
    setup = resolve_setup(settings, device_type, policy_class_for)
    if sharded:
        refuse_half_weights(setup.policy_class, setup.precision)
        refuse_swapped_weights_when_sharded(setup.evaluation, setup.policy_class)
    fp8 = None
    if fp8_settings is not None:
        check_fp8_device(fp8_settings.recipe, device_type)
        fp8 = fp8_converted or Fp8Mode(fp8_settings)
    policy_class = setup.policy_class
    if issubclass(policy_class, LeanExactPolicy):
        policy: PrecisionPolicy = policy_class(
            setup.half_dtype, keep_fp32=keep_fp32, master_chunk_numel=settings.master_chunk_numel
        )
    else:
        policy = policy_class(setup.half_dtype, keep_fp32=keep_fp32)
    loss_scaler = given_loss_scaler or _build_loss_scaler(settings, setup)
    loss_scaler.allow_fp16_gradients = setup.policy_class.half_gradients
    return Run(setup, policy, loss_scaler, fp8, Evaluation(policy))


def _build_loss_scaler(settings: PluginSettings, setup: ResolvedSetup) -> RunScaler:
    mode: ScalingMode = "check"
    scaler_settings = settings.scaler
    if setup.precision == "16-mixed" and not settings.scaling_disabled:
        if settings.loss_scale != "dynamic":
            scaler_settings = replace(scaler_settings, mode="static", init_scale=settings.loss_scale)
        elif setup.policy_class.scales_by_default:
            mode = "dynamic"
    if scaler_settings.mode != "static":
        scaler_settings = replace(scaler_settings, mode=mode)
    if settings.scale_per_optimizer and scaler_settings.mode == "dynamic":
        return PerOptimizerScalers(scaler_settings, setup.device)
    return LossScaler.from_settings(scaler_settings, setup.device)


def trainer_engine(run: Run, lightning: Precision, skip_scheduler_on_overflow: bool) -> TrainerEngine:
    """The Trainer's engine for ``run``; ``lightning`` is the plugin, whose base hooks run Lightning's."""
    return TrainerEngine(run.loss_scaler, run.policy, lightning, skip_scheduler_on_overflow)


def fabric_engine(run: Run, follow_device: Callable[[str | None], str], plugin: str) -> FabricEngine:
    """Fabric's engine for ``run``; ``follow_device`` gives the device to autocast on where the model is now."""
    return FabricEngine(run.loss_scaler, run.policy, FabricModels(follow_device, plugin))


__all__ = ["Run", "build_run", "fabric_engine", "policy_class_for", "trainer_engine"]
