"""The step engine of Lightning's Trainer: its automatic and manual optimization, hook by hook.

The Trainer calls the plugin at these points of an iteration, and this engine does there::

    training_step context   begin_iteration / end_training_step   copy the running statistics; in manual
                                                                   optimization, move the scale once at the end
    manual_backward / loss  pre_backward, backward, post_backward  scale the loss (fp16); Lightning's hooks
    optimizer.step          optimizer_step                         closure, unscale, on_before_optimizer_step
                                                                   hooks and clipping on true gradients, step
    gradient clipping       clip_gradients                         unscale first, clip, check the result again

1. The gradients are unscaled once per optimizer step, *before* Lightning's ``on_before_optimizer_step`` hooks and
   gradient clipping, so both see true gradients. In manual optimization ``self.clip_gradients(opt, ...)``
   unscales first; an explicit ``scaler.unscale_(opt)`` before it is respected, not repeated. Fused optimizers
   unscale inside their own step, unless clipping needed the true gradients first; their step then does not
   unscale again.
2. The step runs only if every gradient is finite (:class:`~lightning_mp.LossScaler`).
3. The scale moves once per iteration: in automatic optimization right after the step, in manual optimization when
   the training step returns, if any optimizer stepped. A skipped iteration's running statistics then go back
   (:class:`~lightning_mp.engine.running_stats.RunningStats`).
4. LBFGS goes through the shared :meth:`~lightning_mp.engine.base.StepEngine.checked_closure_step`.

The engine calls Lightning's own hooks (``Precision.pre_backward``, ``post_backward``, ``optimizer_step``,
``clip_gradients``) on the plugin, which is Lightning's ``Precision``.

Private names: :mod:`lightning_mp._private_names` lists them, with the reason for each.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer

from lightning_mp.engine.base import StepEngine, check_loss, unwrapped
from lightning_mp.engine.schedulers import SkipAwareScheduler
from lightning_mp.policies import PrecisionPolicy
from lightning_mp.scaler import LossScaler
from lightning_mp.scaling.fused_steps import supports_fused_protocol
from lightning_mp.scaling.per_optimizer import PerOptimizerScalers, RunScaler
from lightning_mp.scaling.steps import Phase
from lightning_mp.scaling.verdict import SKIPPED, TAKEN, StepVerdict


def _trainable_optimizer(module: LightningModule) -> Optimizer:
    """The one optimizer with trainable parameters: the one ``toggle_optimizer`` toggled.

    Raises:
        ValueError: where none, or more than one, has trainable parameters.

    """
    optimizers = list(module.trainer.optimizers)
    trainable = [o for o in optimizers if any(p.requires_grad for g in o.param_groups for p in g["params"])]
    if len(trainable) == 1:
        return trainable[0]
    raise ValueError(
        f"MixedPrecision(scale_per_optimizer=True) cannot tell which of the {len(optimizers)} optimizers this loss"
        " trains, to scale it by that optimizer's scale. Name it: self.manual_backward(loss, for_optimizer=opt), or"
        " call self.toggle_optimizer(opt) first."
    )


def _has_gradients(optimizer: Optimizer) -> bool:
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            if parameter.grad is not None:
                return True
    return False


class TrainerEngine(StepEngine):
    """Backward, clipping and optimizer steps of :class:`~lightning_mp.MixedPrecision` under Lightning's Trainer.

    Args:
        loss_scaler: the run's scaler.
        policy: the opt level's policy.
        lightning: the plugin, as Lightning's ``Precision``: its base hooks run the LightningModule's and the
            callbacks' hooks, and its clipping calls the plugin's :meth:`clip_gradients`.
        skip_scheduler_on_overflow: keep ``interval="step"`` schedulers from advancing on skipped steps.

    """

    def __init__(
        self,
        loss_scaler: RunScaler,
        policy: PrecisionPolicy,
        lightning: Precision,
        skip_scheduler_on_overflow: bool = True,
    ) -> None:
        super().__init__(loss_scaler, policy)
        self.lightning = lightning
        self.skip_scheduler_on_overflow = skip_scheduler_on_overflow

    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        """Hand the optimizers to the opt level, find the running statistics and make step schedulers skip-aware.

        Raises:
            MisconfigurationException: for LBFGS in fp16, where a step cannot be checked before it is taken.

        """
        if self.loss_scaler.scales_loss and any(isinstance(o, LBFGS) for o in optimizers):
            raise self.closure_refusal()
        optimizers = self.policy.connect(model, optimizers)
        if isinstance(self.loss_scaler, PerOptimizerScalers):
            self.loss_scaler.register(optimizers)  # numbered in configure_optimizers' order
        module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        self.loss_scaler.param_names = self.policy.parameter_names(module)
        self.running_stats.clear()
        self.running_stats.track(module)
        if self.skip_scheduler_on_overflow:
            for config in lr_schedulers:
                scheduler: Any = getattr(config, "scheduler", None)
                steps_per_batch = getattr(config, "interval", None) == "step" and hasattr(scheduler, "optimizer")
                if steps_per_batch and not isinstance(scheduler, SkipAwareScheduler):
                    asks = functools.partial(self.last_step_skipped, scheduler.optimizer)
                    config.scheduler = SkipAwareScheduler(scheduler, asks)
        return model, optimizers, lr_schedulers

    def closure_refusal(self) -> Exception:
        """LBFGS in fp16, refused at setup (or at its step) as a misconfiguration."""
        return MisconfigurationException(
            f"MixedPrecision(precision={self.lightning.precision!r}) cannot train with LBFGS: LBFGS evaluates its"
            " closure several times within one step, so the loss scale cannot be checked and adjusted between"
            " backward and step (torch's GradScaler refuses closures too). Use precision='bf16-mixed' or '32-true'"
            " with LBFGS, where a non-finite loss or gradient leaves the weights as they were and counts as a skipped"
            " step."
        )

    def last_step_skipped(self, optimizer: Optimizer) -> bool:
        """Whether the most recent step of ``optimizer`` (or its LightningOptimizer) was skipped; False before one.

        .. warning:: Where the step was decided on the device, this reads its inf flag: one host sync.
        """
        return super().last_step_skipped(unwrapped(optimizer))

    def begin_iteration(self) -> None:
        """Copy the running statistics before the iteration's first forward."""
        self.running_stats.save()

    def end_training_step(self) -> None:
        """In manual optimization the training step took the steps: move the scale once, after the last of them."""
        if self.loss_scaler.steps.stepped():
            self._end_iteration()

    def pre_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:
        """Scale the loss before backward (fp16), then run Lightning's ``on_before_backward`` hooks.

        Raises:
            TypeError: if ``tensor`` is not a tensor (``manual_backward(loss.item())``).

        """
        check_loss("manual_backward", tensor)
        if self.loss_scaler.scales_loss and isinstance(self.loss_scaler, LossScaler):
            tensor = self.loss_scaler.scale(tensor)
        return Precision.pre_backward(self.lightning, tensor, module)

    def backward(self, tensor: Tensor, module: LightningModule, *args: Any, **kwargs: Any) -> None:
        """Lightning's backward: ``module.backward`` of the loss ``pre_backward`` scaled, in the level's context.

        With a scale per optimizer the loss is scaled here, by its optimizer's scale: the one Lightning steps in
        automatic optimization, else ``manual_backward(loss, for_optimizer=opt)``, else the one optimizer
        ``toggle_optimizer`` left trainable.

        Raises:
            ValueError: with a scale per optimizer, where a manual backward names no optimizer and none is toggled.

        """
        named = kwargs.pop("for_optimizer", None)
        scaler = self.loss_scaler
        if isinstance(scaler, PerOptimizerScalers) and scaler.scales_loss:
            optimizer = named if named is not None else args[0] if args and args[0] is not None else None
            tensor = scaler.scale(tensor, unwrapped(optimizer or _trainable_optimizer(module)))
        self.forget_prepared()
        with self.policy.backward_context():
            Precision.backward(self.lightning, tensor, module, *args, **kwargs)

    def post_backward(self, tensor: Tensor, module: LightningModule) -> Any:
        """Run Lightning's ``on_after_backward`` hooks."""
        return Precision.post_backward(self.lightning, tensor, module)

    def main_params(self, optimizer: Optimizer) -> Iterable[Tensor]:
        """The tensors whose gradients Lightning clips: those the step applies (O2: the fp32 masters)."""
        return self.step_parameters(optimizer)

    def clip_gradients(self, optimizer: Any, clip_val: float, algorithm: GradClipAlgorithmType) -> None:
        """Unscale first where that has not happened yet in this step, clip, then check the clipped gradients."""
        optimizer = unwrapped(optimizer)
        if clip_val > 0:
            # Checked before clipping in every precision (bf16 and fp32 only read them): clipping by value would turn
            # an inf into a finite gradient, and a fused optimizer, checked at its step, would take the step.
            self._prepare_gradients(optimizer, unscale=True)
        Precision.clip_gradients(
            self.lightning, optimizer=optimizer, clip_val=clip_val, gradient_clip_algorithm=algorithm
        )
        if clip_val > 0:
            self.policy.gradients_changed(optimizer)
            self.loss_scaler.recheck_gradients(optimizer)

    def optimizer_step(
        self, optimizer: Optimizer, model: LightningModule, closure: Callable[[], Any] | None, **kwargs: Any
    ) -> Any:
        """Backward, unscale, hooks and clipping on true gradients, then a step that is skipped on inf/NaN."""
        assert closure is not None
        if isinstance(optimizer, LBFGS):
            return self._closure_step(optimizer, model, closure, **kwargs)
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            # A training_step that returned None ran no backward: there is nothing to step.
            self.lightning._after_closure(model, optimizer)
            return closure_result
        self._prepare_gradients(optimizer, unscale=not supports_fused_protocol(optimizer))
        self.lightning._after_closure(model, optimizer)
        if not _has_gradients(optimizer):
            # Nothing to check or unscale (torch's GradScaler would refuse such a step): step as Lightning would.
            step_output = self.guarded_step(optimizer, functools.partial(optimizer.step, **kwargs))
            self.end_step(optimizer, TAKEN, restore_running_stats=False)
            return step_output
        step_output = self.guarded_step(optimizer, functools.partial(self.loss_scaler.step, optimizer, **kwargs))
        verdict = self._verdict_of_step(optimizer, model.automatic_optimization)
        self.end_step(optimizer, verdict, restore_running_stats=False)
        return step_output

    def _verdict_of_step(self, optimizer: Optimizer, automatic: bool) -> StepVerdict:
        """The verdict the step of ``optimizer`` ends with; in automatic optimization the scale moves first.

        On an accelerator the scaler's host view of a verdict the device decided is one iteration old after the
        update, so the schedulers then ask the flag itself (two alternate: it holds this step's verdict through the
        next batch). In manual optimization the scale moves when the training step returns, and the optimizer's own
        verdict is needed now.
        """
        loss_scaler = self.loss_scaler
        if not automatic:
            return SKIPPED if loss_scaler.found_inf(optimizer) else TAKEN
        flag = StepVerdict.of(loss_scaler.step_verdict(optimizer)).flag  # read before the update
        self._end_iteration()
        skipped = loss_scaler.last_step_skipped
        if flag is not None and flag.device.type != "cpu":
            return StepVerdict(skipped, flag)
        return SKIPPED if skipped else TAKEN

    def _closure_step(
        self, optimizer: Optimizer, model: LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        """An LBFGS step through Lightning's ``optimizer_step`` (its hooks and clipping run in each evaluation)."""
        return self.checked_closure_step(
            optimizer,
            closure,
            lambda checked: Precision.optimizer_step(self.lightning, optimizer, model, checked, **kwargs),
        )

    def _prepare_gradients(self, optimizer: Optimizer, unscale: bool) -> None:
        """Unscale the gradients, at most once per optimizer step."""
        # Without gradients (a training_step that returned None) there is nothing to unscale, and an unscale_
        # recorded now would wrongly mark the next batch's gradients as already unscaled.
        if unscale and _has_gradients(optimizer) and self.loss_scaler.step_phase(optimizer) is not Phase.UNSCALED:
            self.loss_scaler.unscale_(optimizer)

    def _end_iteration(self) -> None:
        """Move the scale once; put the running statistics back when a step of the iteration was skipped.

        The verdicts of the iteration's steps are combined on the device (the running statistics go back with a
        ``torch.where`` on them), read before the update closes the iteration.
        """
        loss_scaler = self.loss_scaler
        verdict = TAKEN
        if self.running_stats.saved:  # combined only when there are statistics to put back
            stepped = [record.optimizer() for record in loss_scaler.steps.stepped()]
            verdict = StepVerdict.any_of([StepVerdict.of(loss_scaler.step_verdict(o)) for o in stepped if o])
        try:
            loss_scaler.update()
        finally:
            self.running_stats.restore_if_skipped(verdict)
