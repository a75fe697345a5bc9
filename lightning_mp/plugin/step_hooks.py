"""Lightning's and Fabric's step hooks, each handed to the run's step engine; autocast is the forward context.

The Trainer and Fabric call a precision plugin at fixed points of a step (``forward_context``, ``pre_backward``,
``backward``, ``optimizer_step``, ``clip_gradients``, ...). :class:`StepHooks` answers each of them by handing it to
the engine chosen when the model was converted: the Trainer's (:mod:`lightning_mp.engine.trainer`) or Fabric's
(:mod:`lightning_mp.engine.fabric`). What a step is, and what both engines share, is written once in
:mod:`lightning_mp.engine.base`; the hooks here add autocast, which is the forward context: the opt level's forward
context around ``torch.autocast`` in the run's half type and device. Validation, test and predict steps, and
``plugin.evaluation()`` blocks, run in ``eval_precision`` (:mod:`lightning_mp.plugin.evaluation`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterable
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import MixedPrecision as LightningMixedPrecision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mp.engine.base import StepEngine
from lightning_mp.plugin.compile import autocast_by_flags, backward_outside_autocast
from lightning_mp.plugin.run import Run
from lightning_mp.policies.evaluation import EvalWeights


class StepHooks(LightningMixedPrecision):
    """The step hooks of :class:`~lightning_mp.MixedPrecision`, handed to the run's engine (module docstring)."""

    _run: Run | None
    _engine: StepEngine | None

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """Run inside the opt level's forward context (O2: half weights), under autocast when the level uses it."""
        run = self._run
        if run is None:
            yield
            return
        compiling = torch.compiler.is_compiling()
        if self._engine is not None and not compiling:
            self._engine.before_forward()
        setup, policy = run.setup, run.policy
        if run.evaluation.active:
            autocast_dtype = setup.evaluation.autocast_dtype
        else:
            autocast_dtype = setup.half_dtype if policy.uses_autocast else None
        # Traced inside a compiled model the level's context is left out: a graph cannot swap O2's weights.
        with contextlib.nullcontext() if compiling else policy.forward_context():
            if autocast_dtype is None:
                yield
                return
            if compiling:
                # Traced inside a compiled model (torch.compile after fabric.setup): lightning_mp.plugin.compile.
                with autocast_by_flags(setup.device, autocast_dtype):
                    yield
                return
            # Compiled regions differentiate outside autocast, as eager autograd does (lightning_mp.plugin.compile).
            with torch.autocast(setup.device, dtype=autocast_dtype, cache_enabled=False), backward_outside_autocast():
                yield

    @override
    @contextlib.contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        """The training step, in the forward context; the engine learns where it begins and ends.

        In manual optimization the training step takes the optimizer steps itself, so the scale moves when it
        returns, once, after the last of them (:mod:`lightning_mp.engine.trainer`).
        """
        engine = self._chosen_engine()
        if self._run is not None and self._run.evaluation.weights is not None:
            self._run.evaluation.drop()  # training is about to change the weights an evaluation copied
        engine.begin_iteration()
        with self.forward_context():
            yield
        engine.end_training_step()

    @override
    @contextlib.contextmanager
    def val_step_context(self) -> Generator[None, None, None]:
        """The validation step, in ``eval_precision`` (:mod:`lightning_mp.plugin.evaluation`)."""
        with self._evaluation_step():
            yield

    @override
    @contextlib.contextmanager
    def test_step_context(self) -> Generator[None, None, None]:
        """The test step, in ``eval_precision`` (:mod:`lightning_mp.plugin.evaluation`)."""
        with self._evaluation_step():
            yield

    @override
    @contextlib.contextmanager
    def predict_step_context(self) -> Generator[None, None, None]:
        """The predict step, in ``eval_precision`` (:mod:`lightning_mp.plugin.evaluation`)."""
        with self._evaluation_step():
            yield

    @contextlib.contextmanager
    def _evaluation_step(self) -> Generator[None, None, None]:
        run = self._run
        if run is None or torch.compiler.is_compiling():
            with self.forward_context():
                yield
            return
        with run.evaluation.step(run.setup.evaluation), self.forward_context():
            yield

    @property
    def evaluation_weights(self) -> EvalWeights | None:
        """The weights of the evaluation run in progress, with the bytes its copies hold; None outside one."""
        return self._run.evaluation.weights if self._run is not None else None

    @contextlib.contextmanager
    def evaluation(self) -> Generator[None, None, None]:
        """Evaluate in ``eval_precision`` inside this block: the way to do so under Fabric, or in a Trainer callback.

        The weights evaluation computes with are made when the block opens and freed when it closes; every forward
        of a set-up model inside it runs in ``eval_precision``. Training is left bitwise as it would be without the
        block. Use it as you would ``torch.no_grad()``::

            model.eval()
            with torch.no_grad(), plugin.evaluation():
                logits = model(batch)

        Raises:
            RuntimeError: before the plugin was set up (``fabric.setup``, or a Trainer's start).

        """
        run = self._run
        if run is None:
            raise RuntimeError(
                f"{type(self).__name__}.evaluation() needs a set-up run: call it after fabric.setup(model, ...) or"
                " inside a Trainer's fit, validate, test or predict."
            )
        with run.evaluation.block(run.setup.evaluation):
            yield

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


__all__ = ["StepHooks"]
