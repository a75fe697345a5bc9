"""The step engine of Fabric: the same loss scaling, skipping and opt levels, driven by Fabric's own loop.

Fabric calls a precision plugin at fewer points than the Trainer, and with other signatures::

    fabric.setup(model, optimizer)       convert_module(module)               opt level converts the model
    model(x)                             convert_input, forward_context       autocast (O1); O2's half weights
    fabric.backward(loss)                pre_backward, backward, post_backward
    fabric.clip_gradients(...)           unscale_gradients(optimizer)         then clips main_params(optimizer)
    optimizer.step()                     optimizer_step(optimizer, **kwargs)
    fabric.save / fabric.load            state_dict / load_state_dict         when the plugin is in the state

Fabric converts the model before it moves it to its device, and tells a plugin nothing of its accelerator. Without a
``device=``, the plugin sets up for the device the model is on, or for CUDA where a CPU model will likely move, and at
every forward (``convert_input``) autocasts where the model now is (:meth:`FabricEngine.device_type`); a ``device=``
or an ``"auto"`` precision choice that the model's device contradicts raises there.

Fabric saves only what the user puts in the state, so the plugin goes there beside the model and the optimizer:
``fabric.save(path, {"model": model, "optimizer": optimizer, "precision": plugin})``. Its state holds the scaler
(scale, trackers, counters); the model and the optimizer hold the fp32 weights and states at every opt level but O3.

:class:`FabricEngine` does, at those points, what the plugin does in the Trainer's optimizer step:

1. ``backward`` first applies a pending scale update (rule below), then multiplies the loss by the scale and runs
   ``backward``. Fabric ignores what ``pre_backward`` returns, so the loss is scaled here.
2. The first time an optimizer is seen (its first step or clip), the opt level connects it (O3 checks its ``eps``)
   and a step post-hook is registered on it, so that the plugin knows, without a host
   synchronisation, whether ``optimizer.step()`` really ran.
3. ``unscale_gradients`` (Fabric calls it before clipping) and ``optimizer_step`` unscale the gradients once per
   step, with the fused inf/NaN check; clipping therefore sees true gradients. Fused optimizers too: their step is
   then handed the inf flag and no ``grad_scale``, so it does not unscale a second time. A user's own
   ``plugin.scaler.unscale_(optimizer)`` (of the Fabric optimizer or the one it wraps, torch's "unscale, clip,
   step" recipe) is respected, not repeated: the scaler asks the engine to ready the optimizer first
   (:meth:`FabricEngine.prepare_step`). On a step that will be
   skipped there is nothing to clip: ``main_params`` then gives a stand-in with a zero gradient instead of the
   parameters, so ``fabric.clip_gradients`` returns a zero norm (instead of raising on the non-finite one) and
   clipping by value has something to clip. Fabric does not show the plugin its clipping arguments, so the step
   checks clipped gradients again (:meth:`LossScaler.recheck_gradients`, on the device): a NaN ``max_norm`` or
   ``clip_val`` makes every gradient NaN, and that step is skipped, never applied.
4. The step is skipped when a gradient is not finite (under DDP when one on any rank is not); the opt level then
   hears of it (O2 names weights beyond fp16's range). A step decided on the device (a fused optimizer; in bf16 and
   fp32 every optimizer with a fused form) skips inside its kernel, unseen by the host: the opt level hears of that
   skip at the next ``fabric.backward``, after the scale update.
5. BatchNorm's running statistics are copied at the first forward after a model's step, and put back after a
   skipped step, with a device-side select on the inf flag (no host synchronisation, fused optimizers included;
   :class:`~lightning_mp.engine.running_stats.RunningStats`). A model compiled after ``fabric.setup`` traces the forward
   context, so it gets no such copy.
6. LBFGS, which evaluates its closure itself, steps through the shared
   :meth:`~lightning_mp.engine.base.StepEngine.checked_closure_step`, as under the Trainer: fp16 refuses it, and
   in bf16 and fp32 a step whose closure met an inf or NaN is undone and counted as skipped.

When the scale moves. Fabric has no end-of-iteration hook, and an iteration may step several optimizers on
gradients produced by one backward. Updating the scale right after the first of those steps would unscale the
others by a scale their gradients were not produced under. So the update after a step is left **pending**, and
applied lazily at the first of:

- the next ``fabric.backward`` (before its loss is scaled),
- a second step (or clip) of an optimizer that already stepped since the last update,
- the plugin's ``state_dict`` (``fabric.save``), or ``teardown``.

Every optimizer therefore unscales by the scale its gradients were produced under, and the scale moves once per
backward-and-steps iteration, gradient accumulation included. Reading the plugin's
:attr:`~lightning_mp.MixedPrecision.stats` or :attr:`~lightning_mp.MixedPrecision.scaler` applies nothing:
:meth:`FabricEngine.stats` counts the pending update in on copies (:meth:`LossScaler.stats_with_pending`). Read the
stats after the iteration's last step.

Each step ends in :meth:`~lightning_mp.engine.base.StepEngine.end_step`, as under the Trainer, with a
:class:`~lightning_mp.engine.verdict.StepVerdict`: the host's answer (the step's kernel did not run) and, where the
device decided, its inf flag, on which the running statistics go back with ``torch.where``, without a sync.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_mp.engine.base import StepEngine, check_loss, unwrapped
from lightning_mp.engine.verdict import SKIPPED, TAKEN, StepVerdict
from lightning_mp.overrides import cast_low_precision
from lightning_mp.policies import PrecisionPolicy
from lightning_mp.policies.sharded import refuse_sharding_after_conversion
from lightning_mp.scaler import LossScaler
from lightning_mp.scaling.stats import PrecisionStats


def check_input_device(data: Any, device_type: str) -> None:
    """Raise when a tensor in ``data`` is on another device type than the plugin's autocast would cover.

    Without this check, inputs left on another device than the model's would run outside autocast, unnoticed.

    Raises:
        ValueError: naming the device types and the fix.

    """
    found: set[str] = set()
    apply_to_collection(data, Tensor, lambda tensor: found.add(tensor.device.type))
    other = sorted(found - {device_type})
    if other:
        raise ValueError(
            f"MixedPrecision autocasts on {device_type!r}, where the model is, but the model's inputs are on {other}."
            f" Move them to the model's device first (fabric.to_device(batch))."
        )


class FabricEngine(StepEngine):
    """Backward, clipping and optimizer steps of :class:`~lightning_mp.MixedPrecision` under Fabric.

    Args:
        loss_scaler: the run's scaler (in every precision: bf16 and fp32 use its check-only mode).
        policy: the opt level's policy.
        follow_device: given the device type the models are on now (None without parameters), returns the device
            type to autocast on, or raises where the plugin's settings contradict it.

    """

    def __init__(
        self, loss_scaler: LossScaler, policy: PrecisionPolicy, follow_device: Callable[[str | None], str]
    ) -> None:
        super().__init__(loss_scaler, policy)
        # Fabric loads an optimizer's state before its first step, where the opt level first sees it.
        policy.optimizers_connect_late = True
        self.follow_device = follow_device
        self.modules: list[nn.Module] = []
        self.update_pending = False
        self.scaler_state_loaded = False
        """The plugin's own state was loaded (``fabric.load`` with the plugin in the state)."""
        self._connected: list[weakref.ReferenceType[Optimizer]] = []
        """The optimizers the opt level has connected, in the order it first saw them."""
        self._unscaled: set[int] = set()
        self._stepped_since_update: set[int] = set()
        self._ran: set[int] = set()
        self._stand_ins: dict[str, Tensor] = {}
        self._user_wrappers: dict[int, Any] = {}
        """Per optimizer (by ``id``), the Fabric wrapper a user's ``scaler.unscale_`` was given in this step."""
        self._finite_before_clipping: set[int] = set()
        """Optimizers whose gradients ``main_params`` found finite before ``fabric.clip_gradients`` clipped them."""
        self._stepped_on_device: list[Optimizer] = []
        """Fused optimizers stepped since the last update: they skip inside their kernel, unseen by the host."""
        self._skipped_on_device: list[Optimizer] = []
        """Fused optimizers whose skipped step the opt level has not heard of yet."""
        self._sharding_checked = False
        """Whether the first forward checked that the models were not sharded after their conversion."""

    @property
    def has_stepped(self) -> bool:
        """Whether an optimizer stepped (or clipped) in this loop: a later ``fabric.setup`` starts another run."""
        return bool(self._connected)

    def apply_pending_update(self) -> None:
        """Apply the pending scale update, if a step happened since the last one."""
        if not self.update_pending:
            return
        self.update_pending = False
        self._stepped_since_update.clear()
        self.loss_scaler.update()
        if self.loss_scaler.last_step_skipped:
            self._skipped_on_device.extend(self._stepped_on_device)
        self._stepped_on_device.clear()

    @override
    def last_step_skipped(self, optimizer: Optimizer) -> bool:
        """Whether the host saw the most recent step of ``optimizer`` skipped; False before one. Never syncs.

        A step the device decided (step 4 of the module docstring) counts as taken here: the host learns of its skip
        at the scale update, when the opt level hears of it.
        """
        verdict = self._last_verdicts.get(id(optimizer))
        return verdict is not None and verdict.skipped

    @override
    def stats(self) -> PrecisionStats:
        """The counters with the pending update counted in, without applying it (reading has no side effect)."""
        return self.loss_scaler.stats_with_pending() if self.update_pending else self.loss_scaler.stats()

    def add_module(self, module: nn.Module) -> None:
        """Drive a model set up by this Fabric (a GAN's two; each optimizer is connected with the model it steps)."""
        if all(known is not module for known in self.modules):
            self.modules.append(module)
            self.running_stats.track(module)

    def device_type(self) -> str | None:
        """The device type the models' parameters are on now (Fabric moves them after the plugin converted them)."""
        # A loop, not next() over a generator expression: this runs in every forward, also inside a model compiled
        # after fabric.setup, and dynamo before torch 2.9 cannot trace next(generator, default).
        for module in self.modules:
            for parameter in module.parameters():
                return parameter.device.type
        return None

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
        """Copy the running statistics not yet copied since their model's last step.

        At the first forward, refuse a model that Fabric's strategy sharded after the plugin converted it, where the
        opt level does not combine with the sharding (O2, lean: :mod:`lightning_mp.policies.sharded`).
        """
        if not self._sharding_checked:
            self._sharding_checked = True
            refuse_sharding_after_conversion(self.policy, self.modules)
        self.running_stats.save()

    def convert_input(self, data: Any) -> Any:
        """Check that the inputs are where the model is, and autocast there.

        Raises:
            ValueError: when the inputs live on another device type than the model, or the model on another than
                a ``device`` given.

        """
        check_input_device(data, self.follow_device(self.device_type()))
        return data

    def convert_output(self, data: Any) -> Any:
        """Return the forward's half-precision outputs in fp32, as Fabric's own mixed precision does."""
        return cast_low_precision(data, torch.get_default_dtype())

    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:
        """Nothing: Fabric ignores what this returns, so :meth:`backward` scales the loss."""
        return tensor

    def backward(self, tensor: Tensor, module: Any, *args: Any, **kwargs: Any) -> None:
        """Apply the previous iteration's pending scale update, then back-propagate the scaled loss.

        Raises:
            TypeError: if ``tensor`` is not a tensor (a loss read with ``.item()`` has no graph to differentiate).
            HalfOverflowError: under O2, when the previous step of a fused optimizer was skipped because a weight's
                fp16 copy was inf (the host learns of such a skip at the scale update, one iteration late).

        """
        check_loss("fabric.backward", tensor)
        self.apply_pending_update()
        while self._skipped_on_device:
            self.policy.after_optimizer_step(self._skipped_on_device.pop(), True)
        self.forget_prepared()
        with self.policy.backward_context():
            self.loss_scaler.scale(tensor).backward(*args, **kwargs)

    def post_backward(self, tensor: Tensor, module: Any) -> Any:
        """Nothing: Fabric has no hooks to run after backward."""
        return tensor

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Make the optimizer's gradients true gradients (once per step), for clipping before ``optimizer.step``.

        A fused optimizer is unscaled here too: its step then finds the gradients unscaled and does not unscale
        them again (the scaler hands it no ``grad_scale``, only the inf flag), as in torch's AMP recipe.
        """
        self._unscale(optimizer)

    def clip_gradients(self, optimizer: Optimizer, clip_val: float, algorithm: GradClipAlgorithmType) -> None:
        """Clip as ``fabric.clip_gradients`` does: unscale, then clip :meth:`main_params` (none on a skipped step)."""
        if clip_val <= 0:
            return
        self._unscale(optimizer)
        if algorithm == GradClipAlgorithmType.VALUE:
            torch.nn.utils.clip_grad_value_(self.main_params(optimizer), clip_value=clip_val)
        else:
            torch.nn.utils.clip_grad_norm_(self.main_params(optimizer), clip_val)
        self.policy.after_unscale(optimizer)

    def main_params(self, optimizer: Optimizer) -> list[Tensor]:
        """The parameters whose gradients Fabric clips; none on a step that will be skipped for inf/NaN gradients.

        .. warning:: After the gradients were unscaled this reads the inf/NaN flag, which synchronises the host
            with the device, also where the step itself would skip on the device (fused optimizers, and bf16/fp32
            steps handed to the fused kernel). Clipping a step that is skipped is pointless, and with
            ``error_if_nonfinite=True`` (Fabric's default) it would raise.
        """
        parameters = self.step_parameters(optimizer)
        if parameters and id(optimizer) in self._unscaled:
            if self.loss_scaler.found_inf(optimizer):
                # Not an empty list: torch's clip_grad_value_ fails on one (clip_grad_norm_ would return 0 for it).
                return [self._stand_in(parameters[0].device)]
            self._finite_before_clipping.add(id(optimizer))
        return parameters

    def _stand_in(self, device: torch.device) -> Tensor:
        """A tensor with a zero gradient, clipped in place of the parameters of a step that will be skipped."""
        stand_in = self._stand_ins.get(str(device))
        if stand_in is None:
            stand_in = self._stand_ins[str(device)] = torch.zeros(1, device=device)
            stand_in.grad = torch.zeros(1, device=device)
        return stand_in

    def optimizer_step(self, optimizer: Optimizer, model: Any, closure: Callable[[], Any] | None, **kwargs: Any) -> Any:
        """Unscale, then step unless a gradient is inf or NaN; the scale update waits (module docstring).

        Raises:
            TypeError: for LBFGS with a scaled loss (it re-evaluates its closure, so its step cannot be checked),
                or without a closure.

        """
        if isinstance(optimizer, LBFGS):
            return self._closure_step(optimizer, closure, **kwargs)
        # A closure runs forward and fabric.backward; the scaler must see the gradients before the step. Its loss
        # is what step(closure) returns, as with torch's optimizers.
        closure_loss = closure() if closure is not None else None
        if id(optimizer) in self._unscaled:
            # Unscaled and checked for fabric.clip_gradients: clipping (a NaN max_norm or clip_val) may have made
            # the checked gradients non-finite since.
            self.loss_scaler.recheck_gradients(optimizer)
        self._unscale(optimizer)
        self._ran.discard(id(optimizer))
        output = self.loss_scaler.step(optimizer, **kwargs)
        if closure is not None:
            output = closure_loss
        skipped = id(optimizer) not in self._ran
        flag = self.loss_scaler.step_verdict(optimizer)
        if isinstance(flag, Tensor):
            if not skipped:
                # The kernel ran but may have skipped on the device (a fused optimizer, or bf16/fp32's fused hand-off).
                self._stepped_on_device.append(optimizer)
            verdict = StepVerdict(skipped, flag)
        else:
            verdict = SKIPPED if skipped else TAKEN
        self._unscaled.discard(id(optimizer))
        self._stepped_since_update.add(id(optimizer))
        self.update_pending = True
        if skipped and id(optimizer) in self._finite_before_clipping:
            warnings.warn(
                "lightning_mp: fabric.clip_gradients made finite gradients inf or NaN, so this optimizer step was"
                " skipped. Pass fabric.clip_gradients a max_norm or clip_val that is a positive number (not NaN),"
                " and a norm_type that is a positive number.",
                RuntimeWarning,
                stacklevel=3,
            )
        self._finite_before_clipping.discard(id(optimizer))
        self.end_step(optimizer, verdict, self._modules_of(optimizer))
        return output

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
            optimizer, closure, lambda checked: optimizer.step(checked, **kwargs), self._modules_of(optimizer)
        )

    def _modules_of(self, optimizer: Optimizer) -> list[nn.Module]:
        """The models with a parameter that ``optimizer`` steps (one optimizer may step several models)."""
        stepped = {id(parameter) for group in optimizer.param_groups for parameter in group["params"]}
        return [m for m in self.modules if any(id(parameter) in stepped for parameter in m.parameters())]

    def _module_of(self, optimizer: Optimizer) -> nn.Module:
        owners = self._modules_of(optimizer)
        return owners[0] if owners else self.modules[-1]

    @override
    def prepare_step(self, optimizer: Optimizer) -> None:
        """The scaler is about to unscale or check ``optimizer``'s gradients (the engine's, or a user's own call).

        The optimizer (the Fabric optimizer or the one it wraps) is connected, a scale update its gradients were not
        made under is applied, a wrapper is remembered (so that the step finds the gradients unscaled and does not
        unscale them again), and the opt level readies the gradients.
        """
        inner = unwrapped(optimizer)
        self._connect(inner)
        if id(inner) in self._stepped_since_update:
            # A second step of this optimizer with no backward in between: its gradients were made after the update.
            self.apply_pending_update()
        if inner is not optimizer:
            self._user_wrappers[id(inner)] = optimizer
        self.policy.prepare_step(inner)

    def _unscale(self, optimizer: Optimizer) -> None:
        if id(optimizer) in self._unscaled:
            return
        wrapper = self._user_wrappers.pop(id(optimizer), None)
        if wrapper is not None:
            self.loss_scaler.adopt_unscale(wrapper, optimizer)
        if not self.loss_scaler.is_unscaled(optimizer):  # else the user's scaler.unscale_ did it, on true gradients
            self.loss_scaler.unscale_(optimizer)
        self._unscaled.add(id(optimizer))

    def _connect(self, optimizer: Optimizer) -> None:
        if any(reference() is optimizer for reference in self._connected):
            return
        self._warn_if_resumed_without_scaler_state(optimizer)
        module = self._module_of(optimizer)
        self.policy.connect(module, [optimizer])
        self.loss_scaler.param_names.update(self.policy.parameter_names(module))
        optimizer.register_step_post_hook(self._record_step)
        self._connected.append(weakref.ref(optimizer))

    def _record_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self._ran.add(id(optimizer))

    def _warn_if_resumed_without_scaler_state(self, optimizer: Optimizer) -> None:
        """Warn when an optimizer arrives with a loaded state but the plugin's state was not loaded.

        That is a resume (``fabric.load`` of the model and the optimizer) that left the plugin out of the state: the
        fp16 scale then starts again from ``init_scale``. Fine-tuning from weights alone has no optimizer state.
        """
        resumed = optimizer.state and not self.scaler_state_loaded and self.loss_scaler.optimizer_steps == 0
        if resumed and self.loss_scaler.scales_loss:
            warnings.warn(
                "lightning_mp: fabric.load restored the optimizer but not the plugin's state, so the loss scale"
                f" starts again from init_scale={self.loss_scaler.get_scale():g}. To resume the scale, save and"
                ' load the plugin in the state too: {"model": model, "optimizer": optimizer, "precision": plugin}.',
                UserWarning,
                stacklevel=2,
            )
