"""The MixedPrecision plugin: autocast around every step, a loss scaler around backward and the optimizer step.

Pass it to the Trainer::

    trainer = Trainer(plugins=[MixedPrecision("16-mixed", growth_interval=1000, hysteresis=2)])

What happens in a training step:

1. The forward pass (training, validation, test and predict steps) runs under ``torch.autocast`` when the opt level
   uses autocast (O1), in fp16 or bf16.
2. ``pre_backward`` multiplies the loss by the loss scale (fp16 only), so that small gradients survive fp16.
3. In ``optimizer_step`` the gradients are unscaled (one fused pass that also detects inf/NaN) *before* Lightning's
   ``on_before_optimizer_step`` hooks and gradient clipping, so both see true gradients.
4. The optimizer step runs only if every gradient is finite. A skipped step changes no parameter and no optimizer
   state, and ``interval="step"`` learning-rate schedulers do not advance on it.
5. The scaler updates the scale (:mod:`lightning_mp.scaler`), and :attr:`MixedPrecision.stats` is refreshed from
   host-side counters, with no extra device synchronisation.

In bf16 and fp32 nothing is scaled, but non-finite steps are still detected and skipped, so no precision ever
writes a NaN into the weights. The scaler's state and the counters are saved in Lightning checkpoints and restored
exactly on resume.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Generator, Sequence
from dataclasses import replace
from typing import Any, Literal

import torch
from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_mp._hardware import choose_precision, device_has_native_bf16
from lightning_mp._scale_rules import COLLAPSE_FLOOR, FLOAT32_MAX
from lightning_mp._schedulers import make_skip_aware, mark_step
from lightning_mp._validation import check_choice, check_number
from lightning_mp.overrides import Fp32Overrides
from lightning_mp.policies import POLICIES, PrecisionPolicy
from lightning_mp.scaler import LossScaler, ScalerSettings, ScalingMode
from lightning_mp.stats import PrecisionStats

PrecisionName = Literal["auto", "16-mixed", "bf16-mixed", "32-true"]
DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps")
_HALF_DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


class MixedPrecision(Precision):
    """Mixed-precision training for Lightning: autocast, a dynamic loss scaler that goes past torch's, and counters.

    Args:
        precision: ``"auto"`` (bf16 where the device runs it natively, else fp16 on GPUs and fp32 on CPUs),
            ``"16-mixed"`` (fp16 with loss scaling; real fp16 on the CPU too), ``"bf16-mixed"`` or ``"32-true"``.
        opt_level: ``"O0"`` (fp32 baseline) or ``"O1"`` (autocast, fp32 weights), and any other registered level.
        device: the autocast device type; None takes it from the Trainer's accelerator at setup.
        init_scale: the first loss scale (fp16).
        growth_factor: scale multiplier after ``growth_interval`` clean steps; > 1.
        backoff_factor: scale multiplier on overflow; in (0, 1).
        growth_interval: clean steps in a row before the scale grows; >= 1.
        hysteresis: overflows tolerated before the scale backs off (DeepSpeed's and Megatron's meaning);
            1 is torch's behaviour.
        consecutive_hysteresis: refill the hysteresis after every clean step instead of only after a growth.
        min_scale: the scale's floor; None means the collapse floor ``2**-24``.
        max_scale: the scale never grows past this.
        on_min_scale: ``"raise"`` :class:`~lightning_mp.errors.LossScaleCollapseError` or ``"warn"`` and stay at the
            floor when an overflow would push the scale below it.
        loss_scale: ``"dynamic"``, or a positive float for a static scale (fp16 only).
        skip_scheduler_on_overflow: keep ``interval="step"`` schedulers from advancing on skipped steps.
        keep_fp32: modules that run in fp32 (autocast off, inputs cast to fp32, weights fp32 in O2 and O3): module
            types, qualified names, or regular expressions prefixed with ``re:`` (:mod:`lightning_mp.overrides`).
        max_consecutive_skips: stop with :class:`~lightning_mp.errors.NonFiniteStepsError` after this many skipped
            steps in a row, in every precision; None never stops.

    Raises:
        ValueError: for any argument outside what is allowed; the message names the argument, the value given and
            what is allowed.

    """

    def __init__(
        self,
        precision: PrecisionName = "auto",
        opt_level: str = "O1",
        device: str | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        consecutive_hysteresis: bool = False,
        min_scale: float | None = None,
        max_scale: float = 2.0**24,
        on_min_scale: Literal["raise", "warn"] = "raise",
        loss_scale: float | Literal["dynamic"] = "dynamic",
        skip_scheduler_on_overflow: bool = True,
        keep_fp32: Sequence[type | str] = (),
        max_consecutive_skips: int | None = 100,
    ) -> None:
        owner = type(self).__name__
        check_choice(owner, "precision", precision, ("auto", "16-mixed", "bf16-mixed", "32-true"))
        check_choice(owner, "opt_level", opt_level, POLICIES)
        if device is not None:
            check_choice(owner, "device", device, DEVICE_TYPES)
        self._scaler_settings = ScalerSettings(
            owner=owner,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            min_scale=min_scale,
            max_scale=max_scale,
            consecutive_hysteresis=consecutive_hysteresis,
            on_min_scale=on_min_scale,
            max_consecutive_skips=max_consecutive_skips,
        )
        if loss_scale != "dynamic":
            loss_scale = check_number(owner, "loss_scale", loss_scale, at_least=COLLAPSE_FLOOR, at_most=FLOAT32_MAX)
            if precision == "bf16-mixed":
                raise ValueError(
                    f"{owner}(precision='bf16-mixed', loss_scale={loss_scale!r}) is not allowed: bf16 has fp32's"
                    " exponent range and is never scaled. Use loss_scale='dynamic' (the default) with bf16, or"
                    " precision='16-mixed' for a static fp16 scale."
                )
        if precision == "32-true" and opt_level not in ("O0", "O1"):
            raise ValueError(
                f"{owner}(precision='32-true', opt_level={opt_level!r}) is not allowed: {opt_level} casts to a half"
                " type. Use precision='16-mixed' or 'bf16-mixed', or opt_level='O0'."
            )
        if opt_level == "O0" and precision in _HALF_DTYPES:
            raise ValueError(
                f"{owner}(precision={precision!r}, opt_level='O0') is not allowed: O0 is the fp32 baseline. Use"
                " precision='32-true' or 'auto' with O0, or opt_level='O1' or higher for mixed precision."
            )
        self.requested_precision: PrecisionName = precision
        self.precision = precision  # resolved at setup when "auto"
        self.opt_level = opt_level
        self.device = device
        self.loss_scale = loss_scale
        self.skip_scheduler_on_overflow = skip_scheduler_on_overflow
        self.keep_fp32 = Fp32Overrides(keep_fp32).patterns
        self.precision_reason = "asked for" if precision != "auto" else ""
        self._loss_scaler: LossScaler | None = None
        self._policy: PrecisionPolicy | None = None
        self._pending_state: dict[str, Any] | None = None

    # ------------------------------------------------------------------------------------------------ properties

    @property
    def half_dtype(self) -> torch.dtype | None:
        """``torch.float16`` or ``torch.bfloat16`` once resolved; None for fp32 (and for "auto" before setup)."""
        return _HALF_DTYPES.get(self.precision)

    @property
    def scaler(self) -> LossScaler | None:
        """The loss scaler, or None where nothing is scaled (bf16, fp32) and before setup."""
        if self._loss_scaler is not None and self._loss_scaler.scales_loss:
            return self._loss_scaler
        return None

    @property
    def policy(self) -> PrecisionPolicy | None:
        """The opt level's policy object, once set up."""
        return self._policy

    @property
    def stats(self) -> PrecisionStats:
        """Counters at the end of the last optimizer step. Reading them never synchronises with the device."""
        if self._loss_scaler is None:
            scaled = self.precision == "16-mixed" or self.requested_precision == "16-mixed"
            initial = self._scaler_settings.init_scale if self.loss_scale == "dynamic" else self.loss_scale
            return PrecisionStats(loss_scale=float(initial) if scaled else 1.0)
        return self._loss_scaler.stats()

    def local_overflows(self) -> int:
        """Steps on which this process's own gradients overflowed, before the ranks agreed to skip.

        Under DDP every rank skips a step on which any rank overflowed; this count says which rank it was.

        .. warning:: Under DDP this reads a device counter and synchronises; call it on logging steps only.
        """
        return self._loss_scaler.local_overflows() if self._loss_scaler is not None else 0

    # ------------------------------------------------------------------------------------------------ setup

    def setup_for_device(self, device_type: str) -> None:
        """Resolve the precision for ``device_type``, and build the opt level's policy and the loss scaler.

        The plugin calls this itself when the Trainer sets up; call it directly only to use the plugin outside a
        Trainer. Idempotent.

        Raises:
            ValueError: if ``device`` was given and differs from ``device_type``.

        """
        if self._policy is not None:
            return
        if self.device is not None and self.device != device_type:
            raise ValueError(
                f"MixedPrecision(device={self.device!r}) does not match the Trainer's accelerator, which runs on"
                f" {device_type!r}. Leave device=None to follow the Trainer."
            )
        self.device = device_type
        if self.requested_precision == "auto":
            if self.opt_level == "O0":
                self.precision, self.precision_reason = "32-true", "opt_level='O0' is the fp32 baseline"
            else:
                self.precision, self.precision_reason = choose_precision(device_type)
                if self.precision == "32-true" and self.opt_level != "O1":
                    self.precision, self.precision_reason = (
                        "bf16-mixed",
                        f"opt_level={self.opt_level!r} needs a half type; bf16 needs no loss scaling",
                    )
            rank_zero_info(f"lightning_mp: precision='auto' chose {self.precision!r}: {self.precision_reason}.")
        if self.precision != "16-mixed" and self.loss_scale != "dynamic":
            raise ValueError(
                f"MixedPrecision(loss_scale={self.loss_scale!r}) needs fp16, but the precision is {self.precision!r}"
                f" ({self.precision_reason}). Use precision='16-mixed' for a static scale."
            )
        self._warn_about_slow_half(device_type)
        opt_level = "O0" if self.precision == "32-true" else self.opt_level
        policy_class = POLICIES[opt_level]
        self._policy = policy_class(self.half_dtype, keep_fp32=self.keep_fp32)
        self._loss_scaler = self._build_loss_scaler(device_type, policy_class)
        if self._pending_state is not None:
            pending, self._pending_state = self._pending_state, None
            self.load_state_dict(pending)

    def _build_loss_scaler(self, device_type: str, policy_class: type[PrecisionPolicy]) -> LossScaler:
        mode: ScalingMode = "check"
        settings = self._scaler_settings
        if self.precision == "16-mixed":
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
            rank_zero_warn(
                "lightning_mp: this CPU has no native bf16 (no AVX512-BF16 or AMX), so 'bf16-mixed' is emulated and"
                " can be much slower than fp32. precision='auto' would pick '32-true' here."
            )

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Resolve the precision from the Trainer's device, then let the opt level convert the module in place."""
        self.setup_for_device(self._trainer_device_type(module))
        assert self._policy is not None
        return self._policy.convert_module(module)

    @staticmethod
    def _trainer_device_type(module: nn.Module) -> str:
        trainer = getattr(module, "_trainer", None)
        if trainer is not None:
            return trainer.strategy.root_device.type
        parameter = next(module.parameters(), None)
        return parameter.device.type if parameter is not None else "cpu"

    @override
    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        """Hand the optimizers to the opt level, name the parameters and make step schedulers skip-aware."""
        if self._policy is None:
            self.setup_for_device(self._trainer_device_type(model))
        assert self._policy is not None and self._loss_scaler is not None
        optimizers = self._policy.connect(model, optimizers)
        module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        self._loss_scaler.param_names = self._policy.parameter_names(module)
        if self.skip_scheduler_on_overflow:
            for config in lr_schedulers:
                if getattr(config, "interval", None) == "step":
                    make_skip_aware(config.scheduler)
        return model, optimizers, lr_schedulers

    # ------------------------------------------------------------------------------------------------ steps

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """Run under autocast in the half dtype when the opt level uses autocast."""
        if self._policy is None or not self._policy.uses_autocast or self.half_dtype is None:
            yield
            return
        assert self.device is not None
        with torch.autocast(self.device, dtype=self.half_dtype, cache_enabled=False):
            yield

    @override
    def pre_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:  # type: ignore[override]
        """Scale the loss before backward (fp16), then run Lightning's ``on_before_backward`` hooks."""
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizable,
        model: LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Backward, unscale, hooks and clipping on true gradients, then a step that is skipped on inf/NaN."""
        loss_scaler, policy = self._loss_scaler, self._policy
        assert loss_scaler is not None and policy is not None, "MixedPrecision was not set up by a Trainer"
        if isinstance(optimizer, LBFGS):
            if loss_scaler.scales_loss:
                raise MisconfigurationException("AMP and the LBFGS optimizer are not compatible.")
            # LBFGS re-evaluates the closure itself, so the step cannot be checked before it runs.
            output = super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
            loss_scaler.record_unchecked_step()
            return output
        closure_result = closure()
        # In automatic optimization a training_step that returned None ran no backward: there is nothing to step.
        no_backward = closure_result is None and model.automatic_optimization
        if no_backward:
            self._after_closure(model, optimizer)
            return closure_result
        policy.prepare_gradients(optimizer)  # type: ignore[arg-type]
        if not _optimizer_handles_unscaling(optimizer):
            loss_scaler.unscale_(optimizer)  # type: ignore[arg-type]
        self._after_closure(model, optimizer)
        step_output = loss_scaler.step(optimizer, **kwargs)  # type: ignore[arg-type]
        loss_scaler.update()
        skipped = loss_scaler.last_step_skipped
        mark_step(optimizer, skipped)
        policy.after_optimizer_step(optimizer, skipped)  # type: ignore[arg-type]
        return step_output

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip the (already unscaled) gradients. Fused optimizers unscale inside their step, so they cannot clip."""
        if clip_val > 0 and _optimizer_handles_unscaling(optimizer):
            raise RuntimeError(
                f"The current optimizer, {type(optimizer).__qualname__}, does not allow for gradient clipping"
                " because it performs unscaling of gradients internally. HINT: Are you using a 'fused' optimizer?"
            )
        super().clip_gradients(optimizer=optimizer, clip_val=clip_val, gradient_clip_algorithm=gradient_clip_algorithm)

    # ------------------------------------------------------------------------------------------------ checkpoints

    @override
    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (scale, trackers, counters), the precision and the opt level's own state."""
        if self._loss_scaler is None or self._policy is None:
            return dict(self._pending_state or {})
        return {
            "scaler": self._loss_scaler.state_dict(),
            "precision": self.precision,
            "opt_level": self._policy.opt_level,
            "policy": self._policy.state_dict(),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from this plugin's state, or from torch's five-key GradScaler dict (Lightning's own plugin)."""
        if self._loss_scaler is None or self._policy is None:
            self._pending_state = dict(state_dict)
            return
        if "scaler" in state_dict:
            scaler_state, saved_precision = state_dict["scaler"], state_dict.get("precision")
        elif "scale" in state_dict:
            scaler_state, saved_precision = state_dict, "16-mixed"
        else:
            scaler_state, saved_precision = {}, None
        if saved_precision == "bf16-mixed" and self.precision == "16-mixed":
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

    def _warn_missing_scaler_state(self) -> None:
        if self.scaler is not None:
            warnings.warn(
                "lightning_mp: the checkpoint holds no loss-scaler state, so the loss scale starts again from"
                f" init_scale={self.scaler.get_scale():g} instead of the scale the run had reached.",
                UserWarning,
                stacklevel=3,
            )

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Let the opt level adjust the checkpoint (O2 stores the fp32 master weights)."""
        if self._policy is not None:
            self._policy.on_save_checkpoint(checkpoint)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Load the scaler state of old Lightning checkpoints, warn when there is none; let the opt level inspect it."""
        if type(self).__qualname__ not in checkpoint:
            if "native_amp_scaling_state" in checkpoint:
                # Lightning restores this legacy key only into its own MixedPrecision class, so this plugin must.
                self.load_state_dict(checkpoint["native_amp_scaling_state"])
            else:
                self._warn_missing_scaler_state()
        if self._policy is not None:
            self._policy.on_load_checkpoint(checkpoint)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(precision={self.precision!r}, opt_level={self.opt_level!r})"


__all__ = ["MixedPrecision"]
