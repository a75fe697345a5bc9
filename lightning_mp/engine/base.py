"""What one optimizer step is, written once for both front ends (Lightning's Trainer and Fabric).

:class:`~lightning_mp.MixedPrecision` only adapts: at setup it chooses one engine (a Trainer attached to the model
or not) and hands every hook to it. An engine turns the hooks of its front end into these stages of a step::

    forward      before_forward, convert_input, convert_output     autocast is the plugin's; the engine copies the
                                                                   running statistics and checks the inputs
    backward     pre_backward, backward, post_backward             the loss is multiplied by the loss scale (fp16)
    prepare      prepare_step                                      once per optimizer step, before unscale, clip and
                                                                   step (O2: the gradients move to the fp32 masters),
                                                                   also before a user's own scaler.unscale_
    unscale      unscale_gradients                                 once per optimizer step, with the inf/NaN check
    clip         clip_gradients, main_params                       on true gradients, re-checked after clipping
    step         optimizer_step                                    skipped when a gradient is inf or NaN
    scale update settle                                            once per iteration, after its last step
    restore      RunningStats.settle                               a skipped step's running statistics go back

Two pieces are shared, so that the engines cannot drift apart:

- :class:`RunningStats` copies the running statistics of the normalisation layers (BatchNorm, InstanceNorm with
  ``track_running_stats``) before the first forward after a step, and puts them back after a skipped step: from a
  bool where the host knows the verdict, else from the device flag with ``torch.where`` (no synchronisation).
- :meth:`StepEngine.checked_closure_step` steps an optimizer that evaluates its closure itself (LBFGS). The loss
  scale cannot be checked between backward and step there, so fp16 refuses it; in bf16 and fp32 the weights and the
  optimizer state are copied before the step and put back when a loss or a gradient was inf or NaN, which counts as
  a skipped step.

The Trainer's engine is :mod:`lightning_mp.engine.trainer`, Fabric's :mod:`lightning_mp.engine.fabric`; neither
imports the other.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mp.policies import PrecisionPolicy
from lightning_mp.scaler import LossScaler
from lightning_mp.stats import PrecisionStats

RUNNING_STAT_NAMES = ("running_mean", "running_var", "num_batches_tracked")


def normalization_layers(module: nn.Module) -> list[nn.Module]:
    """The layers of ``module`` that track running statistics (BatchNorm, InstanceNorm with track_running_stats)."""
    return [
        layer
        for layer in module.modules()
        if getattr(layer, "track_running_stats", False) and getattr(layer, "running_mean", None) is not None
    ]


def _running_stats(layer: nn.Module) -> list[Tensor]:
    return [buffer for buffer in (getattr(layer, name, None) for name in RUNNING_STAT_NAMES) if buffer is not None]


class RunningStats:
    """The running statistics of the models a run steps: copied before a step's forward, put back if it is skipped.

    Example:
        >>> model = nn.BatchNorm1d(2)
        >>> stats = RunningStats()
        >>> stats.track(model)
        >>> stats.save()
        >>> _ = model(torch.randn(4, 2))
        >>> stats.settle(skipped=True)
        >>> model.running_mean.tolist()
        [0.0, 0.0]

    """

    def __init__(self) -> None:
        self._layers: dict[int, list[nn.Module]] = {}
        """Per model (by id), its layers with running statistics."""
        self._saved: dict[int, list[Tensor]] = {}
        """Per layer (by id), its running statistics as they were before the first forward since its last step."""

    def track(self, model: nn.Module) -> None:
        """Copy and restore the running statistics of ``model`` too (once per model)."""
        self._layers.setdefault(id(model), normalization_layers(model))

    @property
    def saved(self) -> bool:
        """Whether a copy waits for its step's verdict."""
        return bool(self._saved)

    def save(self) -> None:
        """Copy the running statistics not yet copied since their model's last step."""
        for layers in self._layers.values():
            for layer in layers:
                if id(layer) not in self._saved:
                    self._saved[id(layer)] = [buffer.detach().clone() for buffer in _running_stats(layer)]

    def settle(self, skipped: bool | Tensor | None, models: Iterable[nn.Module] | None = None) -> None:
        """After a step: drop the copies, and put them back first if the step was skipped.

        Args:
            skipped: the step's verdict: a bool, a device flag (a 0-d tensor, True or > 0 when skipped; decided on
                the device, without a sync), or None when the step was never checked (nothing goes back).
            models: the models the step changed; None means every tracked model.

        """
        chosen = self._layers.values() if models is None else [self._layers.get(id(model), []) for model in models]
        with torch.no_grad():
            for layers in chosen:
                for layer in layers:
                    saved = self._saved.pop(id(layer), None)
                    if saved is None or skipped is None or skipped is False:
                        continue
                    for buffer, before in zip(_running_stats(layer), saved, strict=True):
                        if skipped is True:
                            buffer.copy_(before)
                        else:
                            flag = skipped.to(buffer.device)
                            condition = flag if flag.dtype == torch.bool else flag > 0
                            buffer.copy_(torch.where(condition, before, buffer))

    def clear(self) -> None:
        """Forget the models (at teardown), so that a reused plugin keeps no previous model alive."""
        self._layers.clear()
        self._saved.clear()


def unwrapped(optimizer: Any) -> Any:
    """The torch optimizer behind a wrapper that shares its ``param_groups`` (Lightning's and Fabric's), else itself.

    Both wrappers give the optimizer they wrap as their public ``optimizer`` property.
    """
    inner = getattr(optimizer, "optimizer", None)
    shares_groups = isinstance(inner, Optimizer) and inner.param_groups is getattr(optimizer, "param_groups", None)
    return inner if shares_groups else optimizer


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

    def __init__(self, loss_scaler: LossScaler, policy: PrecisionPolicy) -> None:
        self.loss_scaler = loss_scaler
        self.policy = policy
        self.running_stats = RunningStats()
        self._skipped_by_optimizer: dict[int, bool | Tensor] = {}
        """Per optimizer, its last step's verdict: a bool, or the device flag of a step skipped on the device."""
        self._prepared: set[int] = set()
        """The optimizers (by ``id``) whose gradients the opt level prepared since their last step and the last
        backward: :meth:`prepare_step` asks it once per step, whichever of unscale, clip and step comes first."""
        loss_scaler.prepare_before_unscale(self.before_user_unscale, self._prepared)

    def last_step_skipped(self, optimizer: Optimizer) -> bool:
        """Whether the most recent step of ``optimizer`` was skipped; False before one.

        .. warning:: Where the verdict is a device flag, this reads it: one host sync.
        """
        return bool(self._skipped_by_optimizer.get(id(optimizer), False))

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

    @abstractmethod
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Make ``optimizer``'s gradients true gradients, once per step."""

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

    def settle(self) -> None:  # noqa: B027 (an engine whose scale moves right after the step leaves it empty)
        """Apply a scale update left pending after the last step."""

    def stats(self) -> PrecisionStats:
        """The counters, including the last step even where its scale update is still pending; changes nothing."""
        return self.loss_scaler.stats()

    def teardown(self) -> None:
        """The run ended: apply a pending update and release the models."""
        self.settle()
        self.running_stats.clear()
        self.loss_scaler.prepare_before_unscale(None)

    # ------------------------------------------------------------------------------------------------ shared

    def prepare_step(self, optimizer: Optimizer) -> None:
        """Let the opt level prepare ``optimizer``'s gradients for its step (O2 moves them to the masters), once.

        Unscaling, clipping and stepping each ask, and the first prepares. A backward makes new gradients, which the
        next ask prepares; so does the end of the step (the engines discard ``optimizer`` from ``_prepared`` where
        they tell the opt level ``after_optimizer_step``), also when no backward ran in between.
        """
        if id(optimizer) not in self._prepared:
            self._prepared.add(id(optimizer))
            self.policy.prepare_step(optimizer)

    def before_user_unscale(self, optimizer: Optimizer) -> None:
        """A user's ``scaler.unscale_(optimizer)`` is about to run: prepare the gradients it unscales, once per step.

        The scaler calls this (:meth:`LossScaler.prepare_before_unscale`) for an optimizer, or the
        LightningOptimizer or Fabric wrapper around it, that :meth:`prepare_step` has not prepared yet: without it
        O2's fp32 masters would hold no gradient yet, the scaler would record the optimizer as unscaled having
        unscaled and checked nothing, and the step would apply the scaled half gradients.
        """
        self.prepare_step(unwrapped(optimizer))

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
            loss = closure()
            self._prepared.discard(id(optimizer))  # every evaluation made new gradients, however it ran backward
            self.prepare_step(optimizer)
            finite = all_finite(loss, parameters) and finite
            return loss

        output = take_step(checked_closure)
        skipped = not finite
        if skipped:
            with torch.no_grad():
                for parameter, weight in zip(parameters, weights_before, strict=True):
                    parameter.copy_(weight)
            optimizer.load_state_dict(state_before)
        self.running_stats.settle(skipped, models)
        self._skipped_by_optimizer[id(optimizer)] = skipped
        self.loss_scaler.record_unchecked_step(skipped)
        self._prepared.discard(id(optimizer))
        self.policy.after_optimizer_step(optimizer, skipped)
        return output
