"""The step engine of Fabric: the same loss scaling, skipping and opt levels, driven by Fabric's own loop.

Fabric calls a precision plugin at fewer points than the Trainer, and with other signatures::

    fabric.setup(model, optimizer)       convert_module(module)               opt level converts the model
    model(x)                             convert_input, forward_context       autocast; inputs on the model's device
    fabric.backward(loss)                pre_backward, backward, post_backward
    fabric.clip_gradients(...)           unscale_gradients(optimizer)         then clips main_params(optimizer)
    optimizer.step()                     optimizer_step(optimizer, **kwargs)
    fabric.save / fabric.load            state_dict / load_state_dict         when the plugin is in the state

Fabric saves only what the user puts in the state, so the plugin goes there beside the model and the optimizer:
``fabric.save(path, {"model": model, "optimizer": optimizer, "precision": plugin})``.

:class:`FabricEngine` does, at those points, what the plugin does in the Trainer's optimizer step:

1. ``backward`` applies a pending scale update (below), then multiplies the loss by the scale and runs ``backward``.
2. The first time an optimizer's gradients are readied (its first step or clip, or a user's ``scaler.unscale_``),
   the opt level connects it and a step post-hook tells its record whether ``optimizer.step()`` really ran.
3. ``unscale_gradients`` (before clipping) and ``optimizer_step`` unscale the gradients once per step, so clipping
   sees true gradients; a fused optimizer's step is then handed the found_inf flag and no ``grad_scale``. On a step
   that will be skipped there is nothing to clip: ``main_params`` gives a placeholder with a zero gradient instead,
   so ``fabric.clip_gradients`` returns a zero norm. Clipped gradients are checked again at the step, so a NaN
   ``max_norm`` skips the step instead of reaching the weights.
4. A step with a non-finite gradient (on any rank) is skipped, on the device where a fused kernel decides; the opt
   level hears of that at the scale update. Running statistics go back after a skip, without a sync.
5. LBFGS steps through the shared :meth:`~lightning_mp.engine.base.StepEngine.checked_closure_step`.

When the scale moves. Fabric has no end-of-iteration hook, and one backward may feed several optimizers' steps, so
the update after a step is left pending and applied at the first of: the next ``fabric.backward``, a second step (or
clip) of an optimizer that already stepped since the update, the plugin's ``state_dict``, or ``teardown``. A step is
pending while its optimizer's record is STEPPED (:mod:`lightning_mp.scaling.steps`); reading the plugin's ``stats``
counts the pending update in on copies and applies nothing.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_mp.engine.base import StepEngine, check_loss, unwrapped
from lightning_mp.engine.fabric_models import (
    FabricModels,
    refuse_deepspeed_engine,
    warn_if_resumed_without_plugin_state,
    zero_gradient_placeholder,
)
from lightning_mp.overrides import cast_low_precision
from lightning_mp.policies import PrecisionPolicy
from lightning_mp.scaling.per_optimizer import PerOptimizerScalers, RunScaler
from lightning_mp.scaling.stats import PrecisionStats
from lightning_mp.scaling.steps import Phase
from lightning_mp.scaling.verdict import StepVerdict


class FabricEngine(StepEngine):
    """Backward, clipping and optimizer steps of :class:`~lightning_mp.MixedPrecision` under Fabric.

    Args:
        loss_scaler: the run's scaler (in every precision: bf16 and fp32 use its check-only mode).
        policy: the opt level's policy.
        models: the models Fabric sets up with the plugin, and where they run.

    """

    def __init__(self, loss_scaler: RunScaler, policy: PrecisionPolicy, models: FabricModels) -> None:
        super().__init__(loss_scaler, policy)
        # Fabric loads an optimizer's state before its first step, where the opt level first sees it.
        policy.optimizers_connect_late = True
        self.models = models
        self.scaler_state_loaded = False
        """The plugin's own state was loaded (``fabric.load`` with the plugin in the state)."""

    @property
    def has_stepped(self) -> bool:
        """Whether an optimizer stepped (or clipped) in this loop: a later ``fabric.setup`` starts another run."""
        return any(record.connected for record in self.loss_scaler.steps.records())

    @property
    def update_pending(self) -> bool:
        """Whether a step since the last scale update waits for it."""
        return bool(self.loss_scaler.steps.stepped())

    def apply_pending_update(self) -> None:
        """Apply the pending scale update; a skip the device decided reaches the opt level now."""
        stepped = self.loss_scaler.steps.stepped()
        if not stepped:
            return
        on_device = [record.optimizer() for record in stepped if record.decided_on_device]
        self.loss_scaler.update()
        if self.loss_scaler.last_step_skipped:
            for optimizer in on_device:
                if optimizer is not None:
                    self.policy.after_optimizer_step(optimizer, True)

    @override
    def last_step_skipped(self, optimizer: Optimizer) -> bool:
        """Whether the host saw the most recent step of ``optimizer`` skipped (a device's skip counts as taken)."""
        verdict = self.last_verdict(optimizer)
        return verdict is not None and verdict.skipped

    @override
    def stats(self) -> PrecisionStats:
        """The counters with the pending update counted in, without applying it (reading has no side effect)."""
        return self.loss_scaler.stats_with_pending() if self.update_pending else self.loss_scaler.stats()

    def add_module(self, module: nn.Module) -> None:
        """Drive a model set up by this Fabric (a GAN's two; each optimizer is connected with the model it steps)."""
        if self.models.add(module):
            self.running_stats.track(module)

    def state_loaded(self) -> None:
        """The plugin's state was loaded: a restored optimizer state is a resume with its scale."""
        self.scaler_state_loaded = True

    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        """Connect the optimizers now, rather than at their first step or clip."""
        for optimizer in optimizers:
            self._connect(optimizer)
        return model, optimizers, lr_schedulers

    def closure_refusal(self) -> Exception:
        """LBFGS with a scaled loss, refused at its step."""
        return TypeError(
            "MixedPrecision('16-mixed') cannot step LBFGS: it re-evaluates its closure inside step(), so the"
            " scaled gradients cannot be checked and unscaled first. Use precision='bf16-mixed' or '32-true'."
        )

    def before_forward(self) -> None:
        """Copy the running statistics not yet copied since their model's last step; check the sharding once."""
        self.models.check_sharding_once(self.policy)
        self.running_stats.save()

    def convert_input(self, data: Any) -> Any:
        """Check that the inputs are where the model is (a ValueError names the devices), and autocast there."""
        self.models.check_input(data)
        return data

    def convert_output(self, data: Any) -> Any:
        """Return the forward's half-precision outputs in fp32, as Fabric's own mixed precision does."""
        return cast_low_precision(data, torch.get_default_dtype())

    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:
        """Nothing: Fabric ignores what this returns, so :meth:`backward` scales the loss."""
        return tensor

    def backward(self, tensor: Tensor, module: Any, *args: Any, **kwargs: Any) -> None:
        """Apply the previous iteration's pending scale update, then back-propagate the scaled loss.

        With a scale per optimizer, ``fabric.backward(loss, for_optimizer=optimizer)`` names the optimizer whose
        scale the loss is multiplied by; elsewhere ``for_optimizer`` is accepted and changes nothing.

        Raises:
            TypeError: if ``tensor`` is not a tensor (a loss read with ``.item()`` has no graph to differentiate), or
                the model is a DeepSpeed engine (Fabric's ``DeepSpeedStrategy``, whose fp16/bf16 engine would cast
                and scale as well).
            ValueError: with a scale per optimizer, where the backward names no optimizer.
            HalfOverflowError: under O2, when the previous step of a fused optimizer was skipped because a weight's
                fp16 copy was inf (the host learns of such a skip at the scale update, one iteration late).

        """
        check_loss("fabric.backward", tensor)
        refuse_deepspeed_engine(module, self.models.plugin)
        named = kwargs.pop("for_optimizer", None)
        scaler = self.loss_scaler
        if isinstance(scaler, PerOptimizerScalers) and scaler.scales_loss and named is None:
            raise ValueError(
                "MixedPrecision(scale_per_optimizer=True) scales each loss by its optimizer's scale: name the optimizer"
                " this loss trains, fabric.backward(loss, for_optimizer=optimizer)."
            )
        self.apply_pending_update()
        self.forget_prepared()
        with self.policy.backward_context():
            if isinstance(scaler, PerOptimizerScalers):
                scaler.scale(tensor, unwrapped(named)).backward(*args, **kwargs)
            else:
                scaler.scale(tensor).backward(*args, **kwargs)

    def post_backward(self, tensor: Tensor, module: Any) -> Any:
        """Nothing: Fabric has no hooks to run after backward."""
        return tensor

    @override
    def prepare_step(self, optimizer: Optimizer) -> None:
        """The scaler is about to unscale or check ``optimizer``'s gradients (the engine's, or a user's own call).

        The optimizer (the Fabric optimizer or the one it wraps) is connected, a scale update its gradients were not
        made under is applied, and the opt level readies the gradients.
        """
        inner = unwrapped(optimizer)
        self._connect(inner)
        if self.loss_scaler.step_phase(inner) is Phase.STEPPED:
            # A second step of this optimizer with no backward in between: its gradients were made after the update.
            self.apply_pending_update()
        self.policy.prepare_step(inner)

    def clip_gradients(self, optimizer: Optimizer, clip_val: float, algorithm: GradClipAlgorithmType) -> None:
        """Clip as ``fabric.clip_gradients`` does: unscale, then clip :meth:`main_params` (none on a skipped step)."""
        if clip_val <= 0:
            return
        self.unscale_gradients(optimizer)
        if algorithm == GradClipAlgorithmType.VALUE:
            torch.nn.utils.clip_grad_value_(self.main_params(optimizer), clip_value=clip_val)
        else:
            torch.nn.utils.clip_grad_norm_(self.main_params(optimizer), clip_val)
        self.policy.gradients_changed(optimizer)

    def main_params(self, optimizer: Optimizer) -> list[Tensor]:
        """The tensors whose gradients Fabric clips; none on a step that will be skipped for inf/NaN gradients.

        .. warning:: After the gradients were unscaled this reads the inf/NaN flag, which synchronises the host
            with the device, also where the step itself would skip on the device (fused optimizers, and bf16/fp32
            steps handed to the fused kernel). Clipping a step that is skipped is pointless, and with
            ``error_if_nonfinite=True`` (Fabric's default) it would raise.
        """
        parameters = self.step_parameters(optimizer)
        record = self.loss_scaler.steps.known(optimizer)
        if parameters and record is not None and record.phase is Phase.UNSCALED:
            if self.loss_scaler.found_inf(optimizer):
                return [zero_gradient_placeholder(parameters[0].device)]
            record.finite_when_clipped = True
        return parameters

    def optimizer_step(self, optimizer: Optimizer, model: Any, closure: Callable[[], Any] | None, **kwargs: Any) -> Any:
        """Unscale, then step unless a gradient is inf or NaN; the scale update waits (module docstring).

        Raises:
            TypeError: for LBFGS with a scaled loss (it re-evaluates its closure, so its step cannot be checked),
                or without a closure.

        """
        if isinstance(optimizer, LBFGS):
            return self._closure_step(optimizer, closure, **kwargs)
        # A closure runs forward and fabric.backward before the scaler sees the gradients; its loss is returned.
        closure_loss = closure() if closure is not None else None
        if self.loss_scaler.step_phase(optimizer) is Phase.UNSCALED:
            # Unscaled and checked for fabric.clip_gradients: clipping may have made the gradients non-finite since.
            self.loss_scaler.recheck_gradients(optimizer)
        self.unscale_gradients(optimizer)
        record = self.loss_scaler.steps.of(optimizer)
        record.kernel_ran = False
        output = self.guarded_step(optimizer, functools.partial(self.loss_scaler.step, optimizer, **kwargs))
        verdict = StepVerdict.after_kernel(record.kernel_ran, self.loss_scaler.step_verdict(optimizer))
        if verdict.skipped and record.finite_when_clipped:
            _warn_clipping_made_gradients_nonfinite()
        self.end_step(optimizer, verdict, self.models.modules_of(optimizer))
        return closure_loss if closure is not None else output

    def _closure_step(self, optimizer: Optimizer, closure: Callable[[], Any] | None, **kwargs: Any) -> Any:
        """An LBFGS step, checked as under the Trainer; the scale update before it is not left pending."""
        if self.loss_scaler.scales_loss:
            raise self.closure_refusal()
        if closure is None:
            raise TypeError(
                f"{type(optimizer).__name__}.step(closure=None) is not allowed: it evaluates the loss itself. Pass"
                " optimizer.step(closure), with a closure that runs the forward and fabric.backward and returns the"
                " loss."
            )
        self.apply_pending_update()
        self._connect(optimizer)
        return self.checked_closure_step(
            optimizer, closure, lambda checked: optimizer.step(checked, **kwargs), self.models.modules_of(optimizer)
        )

    def _connect(self, optimizer: Optimizer) -> None:
        record = self.loss_scaler.steps.of(optimizer)
        if record.connected:
            return
        warn_if_resumed_without_plugin_state(optimizer, self.loss_scaler, self.scaler_state_loaded)
        module = self.models.module_of(optimizer)
        self.policy.connect(module, [optimizer])  # may refuse the optimizer: asked again at its next step
        record.connected = True
        self.loss_scaler.param_names.update(self.policy.parameter_names(module))
        optimizer.register_step_post_hook(self._record_step)

    def _record_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self.loss_scaler.steps.of(optimizer).kernel_ran = True


def _warn_clipping_made_gradients_nonfinite() -> None:
    warnings.warn(
        "lightning_mp: fabric.clip_gradients made finite gradients inf or NaN, so this optimizer step was skipped."
        " Pass fabric.clip_gradients a max_norm or clip_val that is a positive number (not NaN), and a norm_type"
        " that is a positive number.",
        RuntimeWarning,
        stacklevel=4,
    )
