"""Lean: bf16 weights, gradients and optimizer states, stepped with stochastic rounding. Half the memory of fp32.

Select it with ``MixedPrecision("bf16-mixed", opt_level="lean")``, or ``opt_level="lean-kahan"`` to add a bf16
Kahan compensation buffer per weight.

Memory. fp32 training, O1 and a master-weight O2 hold 16 bytes per parameter with AdamW (4 weight, 4 gradient,
8 moment estimates). Lean holds 8: weight, gradient and both moment estimates in bf16 (10 with Kahan compensation).
The activations are bf16 too, since the whole model computes in bf16.

Why it still trains like fp32. Plain bf16 training (Lightning's ``bf16-true``, this package's O3) rounds every
update to the nearest bf16 value, so updates smaller than half a bf16 gap are lost for good. Lean computes each
update in fp32 with torch's own Adam, AdamW or SGD rule and writes weights and states back with **stochastic
rounding**, which keeps the update's expected value (:mod:`lightning_mp.stochastic_rounding` has the algorithm, the
reasons for not using torchao, and the checkpointed random generator). Optionally Kahan compensation keeps the part
that rounding dropped and adds it to the next update.

The pieces:

1. ``convert_module`` casts the model to bf16 in place as O3 does, except that normalisation layers and
   ``keep_fp32`` subtrees stay fp32 and run in fp32 regions
   (:func:`~lightning_mp.policies.casting.convert_to_half`, shared with O3, whose hooks teardown removes). The model
   returns bf16 outputs, as Lightning's ``bf16-true`` does: an fp32 copy of the logits, and the fp32
   log-probabilities that the loss would save for backward, would cost 8 bytes per logit at the peak of the step.
   torch's ``cross_entropy`` accumulates bf16 inputs in fp32; call ``logits.float()`` in the loss to compute it in
   fp32.
2. ``connect`` attaches a :class:`~lightning_mp.stochastic_rounding.StochasticRoundingStep` to each optimizer
   through torch's optimizer hooks. The optimizer object stays the user's: schedulers, ``param_groups`` and
   ``add_param_group`` work, and its ``state_dict`` holds the bf16 states in torch's own format plus the rounding
   generator's state, so a resumed run continues exactly. fp32 parameters are stepped by the optimizer itself.
   Optimizers may be connected one at a time and in any number (Fabric connects each at its first step).
3. The policy's own state (saved with the plugin's) repeats each connected optimizer's rounding state, in connection
   order, for loops that load an optimizer's state before the policy has connected it (Fabric's ``load``). An
   optimizer that arrives with a state but no such copy (the plugin left out of Fabric's state) is warned about: its
   rounding restarts from the seed. Saved states are checked when they are loaded.
4. A skipped step (non-finite gradients) changes no weight, moment estimate or compensation buffer, and is decided
   on the device with every optimizer form (fused, foreach, single-tensor): the loss scaler hands the inf flag to
   torch's fused kernel, which the rounding step hands it on to, so a steady step makes no host sync
   (:mod:`~lightning_mp.stochastic_rounding.step`, point 4). Casts per step: two per bf16 weight, in the optimizer step
   (none in forward or backward); the same module says why both are needed.

Only ``torch.optim.Adam``, ``AdamW`` and ``SGD`` are supported (their ``fused`` and ``foreach`` forms included);
another optimizer is refused at setup with a :class:`TypeError`.

Weight averaging. Lightning's ``WeightAveraging`` (``EMAWeightAveraging`` included) and ``StochasticWeightAveraging``
copy the model in their ``setup``, before the plugin casts it, so the averaged copy keeps fp32 weights beside the bf16
model (4 more bytes per parameter). That is what an average needs: an EMA with ``decay=0.999`` moves by a thousandth
of the difference each step, far below half a bf16 gap, so a bf16 copy would barely move. Per-tensor averaging
(``avg_fn``, Lightning's ``EMAWeightAveraging``) promotes bf16 to fp32 and works. torch's foreach averaging
(``multi_avg_fn``, or no function on a device with foreach kernels) needs one dtype across both models and fails in
the middle of training, so ``convert_module`` refuses it at setup with a :class:`ValueError` naming ``avg_fn``.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import WeightAveraging
from torch import nn
from torch.optim import Optimizer
from torch.optim.swa_utils import AveragedModel
from typing_extensions import override

from lightning_mp.overrides import Fp32Overrides
from lightning_mp.policies.base import PrecisionPolicy
from lightning_mp.policies.casting import convert_to_half
from lightning_mp.stochastic_rounding import StochasticRoundingStep, check_rounding_state


class LeanPolicy(PrecisionPolicy):
    """bf16 weights, gradients and optimizer states, stepped with stochastic rounding; fp32 norms and ``keep_fp32``.

    Args:
        half_dtype: must be ``torch.bfloat16``.
        keep_fp32: module types, qualified names or ``re:`` patterns whose modules stay fp32.

    Raises:
        ValueError: if ``half_dtype`` is not bf16, or a ``keep_fp32`` entry is invalid.

    """

    half_weights: ClassVar[bool] = True
    computes_with_half_weights: ClassVar[bool] = True

    opt_level = "lean"
    uses_autocast = False
    scales_by_default = False

    def __init__(self, half_dtype: torch.dtype | None, keep_fp32: Sequence[type | str] = ()) -> None:
        if half_dtype is not torch.bfloat16:
            raise ValueError(
                f"{type(self).__name__}(half_dtype={half_dtype!r}) is not allowed: opt_level={self.opt_level!r}"
                " keeps weights and optimizer states in bf16, which needs no loss scaling. Use"
                " MixedPrecision('bf16-mixed', opt_level=...), or opt_level='O2' for fp16."
            )
        super().__init__(half_dtype, keep_fp32)
        self.overrides = Fp32Overrides(self.keep_fp32)
        # Weak: each step lives as long as its optimizer (whose hooks hold it), so a plugin reused for another model
        # keeps nothing of the previous one alive.
        self._steps: weakref.WeakValueDictionary[int, StochasticRoundingStep] = weakref.WeakValueDictionary()
        self._connected: list[weakref.ReferenceType[StochasticRoundingStep]] = []
        """The steps in the order their optimizers were connected: the order of :meth:`state_dict`."""
        self._saved_rounding: list[dict[str, Any]] = []

    def __getstate__(self) -> dict[str, Any]:
        """Pickle (and deep-copy) the settings and loaded state, not the weak ties to the connected optimizers.

        A copy connects the optimizers of its own run, as a fresh policy does.
        """
        return {**self.__dict__, "_steps": None, "_connected": []}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._steps = weakref.WeakValueDictionary()

    def rounding_step(self, optimizer: Optimizer) -> StochasticRoundingStep | None:
        """The stochastic-rounding step attached to ``optimizer``, if it was connected."""
        step = self._steps.get(id(optimizer))
        return step if step is not None and step.optimizer is optimizer else None

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Cast every weight and floating buffer outside normalisations and ``keep_fp32`` to bf16, in place.

        Raises:
            ValueError: if a Trainer's ``WeightAveraging`` callback averages with torch's foreach update, which needs
                the fp32 averaged copy and the bf16 model to share dtypes.

        """
        convert_to_half(
            module,
            torch.bfloat16,
            self.overrides,
            keep_normalization_fp32=True,
            float_outputs=False,
            handles=self.hook_handles,
        )
        for callback in _weight_averaging_callbacks(module):
            averaged = _averaged_model(callback)
            if averaged is not None and uses_foreach_update(averaged) and _dtypes(averaged.module) != _dtypes(module):
                raise ValueError(
                    f"{type(callback).__name__}(multi_avg_fn={_name(averaged.multi_avg_fn)},"
                    f" avg_fn={_name(averaged.avg_fn)})"
                    f" cannot average a model trained with opt_level={self.opt_level!r}: its averaged copy keeps fp32"
                    " weights (a bf16 average would lose the small updates) while the model's are bf16, and torch's"
                    " foreach averaging needs one dtype. Pass a per-tensor avg_fn instead: EMAWeightAveraging(decay=d)"
                    " or WeightAveraging(avg_fn=get_ema_avg_fn(decay)) for an EMA, WeightAveraging(avg_fn="
                    "get_swa_avg_fn()) for an equal average (both from torch.optim.swa_utils); or use opt_level='O2',"
                    " whose model keeps fp32 weights."
                )
        return module

    @override
    def connect(self, module: nn.Module, optimizers: list[Optimizer]) -> list[Optimizer]:
        """Make each optimizer step its bf16 parameters with stochastic rounding; the optimizers stay the same objects.

        Connecting an optimizer again is a no-op, and optimizers may be connected one at a time (Fabric does).

        Raises:
            TypeError: if an optimizer is not ``Adam``, ``AdamW`` or ``SGD``.

        """
        optimizers = super().connect(module, optimizers)
        self._connected = [reference for reference in self._connected if reference() is not None]
        for optimizer in optimizers:
            if self.rounding_step(optimizer) is None:
                step = StochasticRoundingStep(optimizer, kahan=self.kahan)
                index = len(self._connected)
                if index < len(self._saved_rounding):
                    step.load_rounding_state(self._saved_rounding[index], f"['policy']['rounding'][{index}]")
                elif optimizer.state:
                    _warn_rounding_restarts(optimizer)
                self._steps[id(optimizer)] = step
                self._connected.append(weakref.ref(step))
        return optimizers

    @override
    def state_dict(self) -> dict[str, Any]:
        """The rounding state of each connected optimizer, in connection order.

        The optimizers' own ``state_dict`` holds the same; this copy serves loops that load optimizer states before
        the policy connects (Fabric connects at the first step).
        """
        return {"rounding": [step.rounding_state() for reference in self._connected if (step := reference())]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the rounding state of connected optimizers now, and of the others when they connect.

        Raises:
            ValueError: if a rounding state is malformed, naming its field, before anything changes.

        """
        rounding = state_dict.get("rounding", [])
        if not isinstance(rounding, list):
            raise ValueError(
                f"The checkpoint's ['policy']['rounding'] holds {rounding!r}; expected a list of rounding states, one"
                " per optimizer."
            )
        self._saved_rounding = [
            check_rounding_state(f"['policy']['rounding'][{index}]", saved) for index, saved in enumerate(rounding)
        ]
        steps = [step for reference in self._connected if (step := reference()) is not None]
        for index, (step, saved) in enumerate(zip(steps, self._saved_rounding, strict=False)):
            step.load_rounding_state(saved, f"['policy']['rounding'][{index}]")


def _warn_rounding_restarts(optimizer: Optimizer) -> None:
    """Warn that a resumed optimizer's stochastic rounding restarts: its saved rounding state was not loaded.

    An optimizer with a state before it is connected was loaded first (Fabric's ``load``), while no hook was there
    to take the rounding state out of its ``state_dict``; only the plugin's own state repeats it.
    """
    warnings.warn(
        f"lightning_mp: {type(optimizer).__name__} was restored before opt_level='lean' connected it, and the"
        " plugin's state was not loaded, so its stochastic rounding restarts from the seed: the resumed run is not"
        " bit for bit the uninterrupted one. Save and load the plugin in the state too:"
        ' {"model": model, "optimizer": optimizer, "precision": plugin}.',
        UserWarning,
        stacklevel=4,
    )


_FOREACH_AVERAGING_DEVICE_TYPES = ("cuda", "xpu", "mtia")
"""Device types on which ``AveragedModel`` without ``avg_fn`` averages with a foreach update
(``torch.utils._foreach_utils``'s list, kept here), besides a PrivateUse1 backend's."""


def uses_foreach_update(averaged: AveragedModel) -> bool:
    """Whether ``averaged.update_parameters`` averages with a foreach function, which needs one dtype per pair."""
    if averaged.multi_avg_fn is not None:
        return True
    device_type = averaged.n_averaged.device.type
    # torch.device("privateuseone") is named as the PrivateUse1 backend is currently named.
    foreach_device = device_type in _FOREACH_AVERAGING_DEVICE_TYPES or device_type == torch.device("privateuseone").type
    return averaged.avg_fn is None and foreach_device


def _averaged_model(callback: WeightAveraging) -> AveragedModel | None:
    """The callback's averaged copy of the model, created in its ``setup``; None before.

    Found by type among the callback's attributes, not by the attribute's name: this relies on Lightning keeping the
    ``AveragedModel`` on the callback (it offers no public way to it), and holds if the attribute is renamed.
    """
    return next((value for value in vars(callback).values() if isinstance(value, AveragedModel)), None)


def _weight_averaging_callbacks(module: nn.Module) -> list[WeightAveraging]:
    """The ``WeightAveraging`` callbacks of the Trainer ``module`` is attached to; none outside a Trainer."""
    if not isinstance(module, LightningModule) or module.fabric is not None:
        return []
    try:
        trainer = module.trainer
    except RuntimeError:  # not attached to a Trainer
        return []
    # Trainer.callbacks is public, but the callback connector assigns it outside __init__, where mypy does not see it.
    callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]
    return [callback for callback in callbacks if isinstance(callback, WeightAveraging)]


def _name(function: object) -> str:
    """``function``'s qualified name; its ``repr`` when it has none (``None``)."""
    return getattr(function, "__qualname__", repr(function))


def _dtypes(module: nn.Module) -> list[torch.dtype]:
    """The dtypes of ``module``'s parameters and buffers, in the order ``AveragedModel`` pairs them."""
    return [tensor.dtype for tensor in (*module.parameters(), *module.buffers())]


class LeanKahanPolicy(LeanPolicy):
    """:class:`LeanPolicy` with a bf16 Kahan compensation buffer per bf16 weight (2 more bytes per parameter)."""

    opt_level = "lean-kahan"
    kahan = True


__all__ = ["LeanKahanPolicy", "LeanPolicy"]
