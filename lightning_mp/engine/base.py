"""What one optimizer step is, written once for both front ends (Lightning's Trainer and Fabric).

:class:`~lightning_mp.MixedPrecision` only adapts: at setup it chooses one engine (a Trainer attached to the model
or not) and hands every hook to it. An engine turns the hooks of its front end into these stages of a step::

    forward      before_forward, convert_input, convert_output     autocast is the plugin's; the engine copies the
                                                                   running statistics and checks the inputs
    backward     pre_backward, backward, post_backward             the loss is multiplied by the loss scale (fp16)
    prepare      prepare_step (asked by the scaler)                once per optimizer step, before unscale, clip and
                                                                   step (O2: fp32 copies of the gradients on the
                                                                   masters), also before a user's own unscale_
    unscale      unscale_gradients                                 once per optimizer step, with the inf/NaN check
    clip         clip_gradients, main_params                       on true gradients, re-checked after clipping
    step         optimizer_step                                    skipped when a gradient is inf or NaN
    end of step  end_step                                          after a step or a skip, under both front ends
    scale update apply_pending_update                              once per iteration, after its last step
    restore      RunningStats.restore_if_skipped                   a skipped step's running statistics go back

:meth:`StepEngine.end_step` is the one place a step ends, whichever front end took it and however it ended
(stepped, skipped, stepped without gradients, undone after a non-finite closure): it puts the running statistics
back where the step was skipped, remembers the :class:`~lightning_mp.scaling.verdict.StepVerdict` for
:meth:`StepEngine.last_step_skipped`, and tells the opt level (``after_optimizer_step``: O2 names the weights beyond
fp16's range after a skip).

For the run the engine is the loss scaler's :class:`~lightning_mp.scaling.steps.StepPreparation`: before the scaler
first unscales or checks an optimizer's gradients in an iteration (a user's own ``scaler.unscale_(optimizer)``, torch's
"unscale, clip, step" recipe, included) it asks the engine to ready them (the opt level's ``prepare_step``: O2 gives
its fp32 masters a copy of the gradients), and it checks the gradients of the tensors the opt level names
(:meth:`StepEngine.step_parameters`). The scaler's methods stay the scaler's: the engine calls them as any user does.

Two pieces are shared, so that the engines cannot drift apart:

- :class:`~lightning_mp.engine.running_stats.RunningStats` (its own module) copies the running statistics of the
  normalisation layers before the first forward after a step, and puts them back after a skipped step.
- :meth:`StepEngine.checked_closure_step` steps an optimizer that evaluates its closure itself (LBFGS). The loss
  scale cannot be checked between backward and step there, so fp16 refuses it; in bf16 and fp32 the weights and the
  optimizer state are copied before the step and put back when a loss or a gradient was inf or NaN, which counts as
  a skipped step.

The Trainer's engine is :mod:`lightning_mp.engine.trainer`, Fabric's :mod:`lightning_mp.engine.fabric`; neither
imports the other.
"""

from __future__ import annotations

import copy
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mp.engine.running_stats import RunningStats
from lightning_mp.policies import PrecisionPolicy
from lightning_mp.scaling.per_optimizer import RunScaler
from lightning_mp.scaling.stats import PrecisionStats
from lightning_mp.scaling.steps import Phase
from lightning_mp.scaling.verdict import StepVerdict


def unwrapped(optimizer: Any) -> Any:
    """The torch optimizer behind Lightning's or Fabric's wrapper (a LightningOptimizer, Fabric's), else itself.

    Both front ends wrap an optimizer in an object of a class made for it, a subclass of the optimizer's own class,
    that shares its ``param_groups`` and gives it as the public ``optimizer`` property: such a wrapper steps the
    very parameters of the optimizer it wraps, and the engines treat it as that optimizer. An optimizer that wraps
    another of another class (a Lookahead, say) is an optimizer of its own, as the opt level and the scaler see it.
    """
    inner = getattr(optimizer, "optimizer", None)
    if not isinstance(inner, Optimizer) or not isinstance(optimizer, type(inner)):
        return optimizer
    return inner if inner.param_groups is getattr(optimizer, "param_groups", None) else optimizer


def check_loss(call: str, tensor: Any) -> None:
    """Raise unless ``tensor`` is a tensor that backward can differentiate.

    Raises:
        TypeError: naming ``call``, the value and what is allowed.

    """
    if not isinstance(tensor, Tensor):
        raise TypeError(
            f"{call}(tensor={tensor!r}) is not allowed: expected the loss as a torch.Tensor that requires grad, got"
            f" a {type(tensor).__name__}. Pass the tensor the model's forward produced, not its .item()."
        )


def all_finite(loss: Any, parameters: Sequence[Tensor]) -> bool:
    """Whether ``loss`` and every gradient of ``parameters`` are finite (one synchronisation)."""
    checks = [torch.isfinite(p.grad).all() for p in parameters if p.grad is not None]
    if loss is not None:
        checks.append(torch.isfinite(torch.as_tensor(loss)).all())
    return bool(torch.stack(checks).all()) if checks else True


class StepEngine(ABC):
    """The stages of an optimizer step under mixed precision, as a front end's hooks reach them.

    Args:
        loss_scaler: the run's scaler (in every precision: bf16 and fp32 use its check-only mode).
        policy: the opt level's policy.

    """

    def __init__(self, loss_scaler: RunScaler, policy: PrecisionPolicy) -> None:
        self.loss_scaler = loss_scaler
        self.policy = policy
        self.running_stats = RunningStats()
        loss_scaler.attach_preparation(self)

    def last_verdict(self, optimizer: Optimizer) -> StepVerdict | None:
        """The verdict of the most recent step of ``optimizer`` (or of the optimizer a wrapper wraps); None before."""
        record = self.loss_scaler.steps.known(optimizer)
        return None if record is None else record.verdict

    def last_step_skipped(self, optimizer: Optimizer) -> bool:
        """Whether the most recent step of ``optimizer`` was skipped; False before one.

        .. warning:: Where the remembered verdict holds a device flag, this reads it: one host sync.
        """
        verdict = self.last_verdict(optimizer)
        if verdict is None:
            return False
        return bool(verdict.flag) if verdict.flag is not None else verdict.skipped

    @abstractmethod
    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        """Hand the optimizers to the opt level (Lightning's ``connect`` hook)."""

    def state_loaded(self) -> None:  # noqa: B027 (only an engine that warns about a missing state needs to know)
        """The plugin's checkpoint state was loaded into the scaler and the opt level."""

    # ------------------------------------------------------------------------------------------------ iteration

    def begin_iteration(self) -> None:  # noqa: B027 (a front end without a training-step hook never calls it)
        """The training step starts (before its first forward)."""

    def end_training_step(self) -> None:  # noqa: B027 (a front end without a training-step hook never calls it)
        """The training step returned."""

    # ------------------------------------------------------------------------------------------------ forward

    def before_forward(self) -> None:  # noqa: B027 (a stage an engine may leave empty)
        """Called at every eager forward, before the opt level's forward context and autocast are entered."""

    def convert_input(self, data: Any) -> Any:
        """The forward's inputs, as the model receives them."""
        return data

    def convert_output(self, data: Any) -> Any:
        """The forward's outputs, as the user receives them."""
        return data

    # ------------------------------------------------------------------------------------------------ backward

    @abstractmethod
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:
        """The loss that backward differentiates."""

    @abstractmethod
    def backward(self, tensor: Tensor, module: Any, *args: Any, **kwargs: Any) -> None:
        """Back-propagate the (scaled) loss."""

    @abstractmethod
    def post_backward(self, tensor: Tensor, module: Any) -> Any:
        """After backward."""

    # ------------------------------------------------------------------------------------------------ unscale, clip

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Make ``optimizer``'s gradients true gradients, once per step (a user's ``scaler.unscale_`` counts)."""
        if self.loss_scaler.step_phase(optimizer) is not Phase.UNSCALED:
            self.loss_scaler.unscale_(optimizer)

    @abstractmethod
    def clip_gradients(self, optimizer: Optimizer, clip_val: float, algorithm: GradClipAlgorithmType) -> None:
        """Clip ``optimizer``'s true gradients (``clip_val`` checked by the plugin: a number >= 0)."""

    @abstractmethod
    def main_params(self, optimizer: Optimizer) -> Iterable[Tensor]:
        """The parameters whose gradients are clipped."""

    # ------------------------------------------------------------------------------------------------ step, update

    @abstractmethod
    def optimizer_step(self, optimizer: Optimizer, model: Any, closure: Callable[[], Any] | None, **kwargs: Any) -> Any:
        """Unscale, then step unless a gradient is inf or NaN."""

    def guarded_step(self, optimizer: Optimizer, step: Callable[[], Any]) -> Any:
        """Run ``step``, a step of ``optimizer``; one that raises leaves the opt level's weights whole.

        Every step the engines take goes through here: the scaler's, LBFGS's checked one, a plain one. A step hook,
        a closure or the optimizer itself may raise after the opt level readied the step (O2's masters in the
        groups): the opt level then puts its parameters back with what the step wrote
        (:meth:`~lightning_mp.policies.PrecisionPolicy.step_raised`), and the error goes on to the caller.
        """
        try:
            return step()
        except BaseException:
            self.policy.step_raised(unwrapped(optimizer))
            raise

    def apply_pending_update(self) -> None:  # noqa: B027 (an engine whose scale moves right after a step has none)
        """Apply a scale update left pending after the last step."""

    def stats(self) -> PrecisionStats:
        """The counters, including the last step even where its scale update is still pending; changes nothing."""
        return self.loss_scaler.stats()

    def teardown(self) -> None:
        """The run ended: apply a pending update and release the models."""
        self.apply_pending_update()
        self.running_stats.clear()
        self.loss_scaler.detach_preparation(self)

    # ------------------------------------------------------------------------------------------------ shared

    def prepare_step(self, optimizer: Optimizer) -> None:
        """The scaler is about to unscale or check ``optimizer``'s gradients: the opt level readies them.

        ``optimizer`` may be the LightningOptimizer or Fabric wrapper around the one the engine steps.
        """
        self.policy.prepare_step(unwrapped(optimizer))

    def step_parameters(self, optimizer: Optimizer) -> list[Tensor]:
        """The tensors whose gradients the step of ``optimizer`` applies (O2: the fp32 masters)."""
        return self.policy.step_parameters(unwrapped(optimizer))

    def gradients_changed(self, optimizer: Optimizer) -> None:
        """The scaler unscaled (or clipping changed) the gradients: the opt level writes them where users read them."""
        self.policy.gradients_changed(unwrapped(optimizer))

    def forget_prepared(self) -> None:
        """A backward made new gradients: the scaler readies each optimizer's again before it next checks them."""
        self.loss_scaler.forget_prepared()

    def end_step(
        self,
        optimizer: Optimizer,
        verdict: StepVerdict,
        models: Iterable[nn.Module] | None = None,
        restore_running_stats: bool = True,
    ) -> None:
        """End a step of ``optimizer``, taken or skipped: the bookkeeping both front ends share.

        Puts the running statistics of ``models`` back where the step was skipped, remembers the verdict for
        :meth:`last_step_skipped`, and tells the opt level.

        Args:
            optimizer: the optimizer that stepped or skipped.
            verdict: the step's verdict; the opt level hears the host's answer (``verdict.skipped``).
            models: the models the step changed, whose running statistics go back on a skip; None means all.
            restore_running_stats: False where the running statistics go back once per iteration instead (the
                Trainer's, after the scale update).

        """
        if restore_running_stats:
            self.running_stats.restore_if_skipped(verdict, models)
        self.loss_scaler.steps.of(optimizer).verdict = verdict
        self.policy.after_optimizer_step(optimizer, verdict.skipped)

    @abstractmethod
    def closure_refusal(self) -> Exception:
        """The error for an optimizer that evaluates its closure itself (LBFGS) with a scaled loss."""

    def checked_closure_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        take_step: Callable[[Callable[[], Any]], Any],
        models: Iterable[nn.Module] | None = None,
    ) -> Any:
        """Step an optimizer that evaluates its closure itself (LBFGS); undo the step if anything was non-finite.

        Args:
            optimizer: the optimizer, e.g. LBFGS.
            closure: the user's closure (forward and backward), returning the loss.
            take_step: steps ``optimizer`` with the checked closure it is given, as the front end steps it.
            models: the models the step changes, whose running statistics go back on a skip; None means all.

        Raises:
            Exception: :meth:`closure_refusal` with a scaled loss (fp16).

        .. warning:: Checks every loss and gradient the closure produces, which synchronises with the device each
            time (LBFGS reads its loss on the host anyway).
        """
        if self.loss_scaler.scales_loss:
            raise self.closure_refusal()
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        weights_before = [p.detach().clone() for p in parameters]
        state_before = copy.deepcopy(optimizer.state_dict())
        finite = True

        def checked_closure() -> Any:
            nonlocal finite
            self.policy.before_closure(optimizer)
            loss = closure()
            self.policy.prepare_step(optimizer)  # every evaluation made new gradients, however it ran backward
            finite = all_finite(loss, parameters) and finite
            return loss

        output = self.guarded_step(optimizer, functools.partial(take_step, checked_closure))
        if not finite:
            with torch.no_grad():
                for parameter, weight in zip(parameters, weights_before, strict=True):
                    parameter.copy_(weight)
            optimizer.load_state_dict(state_before)
        self.loss_scaler.record_unchecked_step(not finite)
        self.end_step(optimizer, StepVerdict(skipped=not finite), models)
        return output
