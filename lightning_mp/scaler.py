"""Dynamic loss scaling with hysteresis, bounds, a static and a check-only mode, and per-optimizer skip counters.

Why scale at all: fp16 keeps 5 exponent bits, so gradients smaller than 2**-24 flush to zero and the model stops
learning from them. Multiplying the loss by a large factor ``S`` before ``backward`` shifts every gradient up by
``S`` into fp16's range; dividing the fp32 gradients by ``S`` before the optimizer step undoes it exactly.

:class:`LossScaler` is a ``torch.amp.GradScaler`` (code that checks ``isinstance(scaler, GradScaler)``, Lightning's
included, keeps working) and a thin facade: each job lives in a module of :mod:`lightning_mp.scaling`, whose
docstring teaches it, and the scale rules in :mod:`lightning_mp.scaling.rules`. What differs between the modes
(dynamic, static, check-only) is one strategy object of :mod:`~lightning_mp.scaling.modes`, chosen when the scaler is
built; the facade never asks which mode it runs in. One iteration (any number of optimizers, torch's contract:
``update()`` once, after the last ``step``):

* ``unscale_`` (explicit, or implicit in ``step``) runs one fused kernel per device and dtype over the optimizer's
  gradients (:mod:`~lightning_mp.scaling.kernels`): in fp16 it multiplies them by the preallocated ``1/S`` and sets
  that optimizer's preallocated inf flag (:mod:`~lightning_mp.scaling.inf_flags`); in bf16 and fp32 ("check" mode,
  nothing scaled) it takes the inf-norm of each gradient and checks the norms, so the gradients are read and never
  rewritten. Under DDP the flag is all-reduced (max) right there, on every path, so every rank takes the same
  decision: one collective per step, always issued in the same order, no deadlock. Under FSDP2 each rank checks
  its local shard of every gradient, empty shards left out, and the same all-reduce makes the decision unanimous
  (:mod:`~lightning_mp.scaling.sharded`). Under :class:`~lightning_mp.MixedPrecision` the run's step engine is
  attached as the scaler's :class:`~lightning_mp.scaling.steps.StepPreparation`: before the first unscale or check of
  an optimizer in an iteration the scaler asks it to ready the gradients, and it names the tensors whose gradients
  the step applies (O2: the fp32 masters), so an explicit ``unscale_`` and the engine's unscale the same gradients.
* ``step`` of a fused optimizer (Adam, AdamW, SGD, Adagrad with ``fused=True``, or any optimizer that declares
  ``_step_supports_amp_scaling``) follows torch's ``GradScaler.step``: the optimizer gets the flag as ``found_inf``
  and, when nothing unscaled its gradients yet, the scale as ``grad_scale`` (times a ``grad_scale`` the user set),
  and skips the update on the device; one whose ``step`` takes ``grad_scaler=`` gets the scaler instead.
* In check mode (bf16, fp32), Adam, AdamW, SGD and Adagrad in their foreach or single-tensor form are handed to
  torch's fused kernel of the same update rule, which skips on the device: no host sync, where reading the flag
  cost one per step (:mod:`~lightning_mp.scaling.fused_steps`).
* Everything else decides on the host: ``step`` reads the flag (the one host sync, which torch's recipe makes too)
  and skips ``optimizer.step()`` when it is set. That is fp16 with a non-fused optimizer, and in check mode the
  optimizers torch cannot skip on the device: custom optimizers without the protocol, subclasses of torch's (their
  ``step`` may differ), complex parameters, sparse gradients, ``differentiable=True``, and fused SGD's first step
  with momentum. In check mode in one process such an optimizer gets no flag at all: ``unscale_`` stacks its
  gradients' inf-norms and ``step`` reads them on the host (the same one sync). ``skip_nonfinite=False`` turns the
  check off in check mode, as Lightning's bf16 and fp32 plugins have none: no op and no sync for any optimizer, and
  a non-finite step then reaches the weights.
* ``update`` moves the scale by the pure rules of :mod:`lightning_mp.scaling.rules` (hysteresis, growth capped at
  ``max_scale``, backoff, collapse at the floor). Where every flag of the iteration is already on the host they run
  there and the device scale is rewritten only when it changes; otherwise (fused optimizers) they run on the device
  (:mod:`~lightning_mp.scaling.device_rules`). The host applies the same rules on the flags once it can read them
  without waiting (:mod:`~lightning_mp.scaling.found_inf_copies`): at once on the CPU, one iteration late on an
  accelerator. The update (:mod:`~lightning_mp.scaling.updates`) counts the steps in the
  :mod:`~lightning_mp.scaling.counters`, keeps :meth:`LossScaler.get_scale` and :meth:`LossScaler.stats` free, and
  raises :class:`~lightning_mp.errors.LossScaleCollapseError` and :class:`~lightning_mp.errors.NonFiniteStepsError`
  at most one iteration late, naming the parameters whose gradients were not finite
  (:mod:`~lightning_mp.scaling.nonfinite`).

Skips and streaks are counted per optimizer (:mod:`~lightning_mp.scaling.steps` gives each an index): an
optimizer whose gradients are never finite stops the run even if another one steps cleanly, and the error names it.
``state_dict`` holds torch's five keys and the counters; ``load_state_dict`` validates a dict field by field
(:mod:`~lightning_mp.scaling.checkpoint`).

The scaler's state is declared by its parts: the settings, the host :class:`~lightning_mp.scaling.rules.ScaleState`
and the counters are plain data and pickle as they are; the device tensors, flags, optimizer references and the
iteration in progress pickle as empty (each part says so in its ``__getstate__``), so an unpickled scaler rebuilds
them lazily.

``LossScaler`` subclasses ``torch.amp.GradScaler`` and runs its ``__init__``, so that the object is a GradScaler; every
method a caller uses is overridden here, so none of torch's private state (``_scale``, ``_growth_tracker``,
``_per_optimizer_states``, ...) is read or written.

Private names: :mod:`lightning_mp._private_names` lists them, with the reason for each.
"""

from __future__ import annotations

import operator
from dataclasses import replace
from typing import Any

import torch
from typing_extensions import override

from lightning_mp.arguments.checks import arguments_of
from lightning_mp.arguments.setting_docs import with_setting_docs
from lightning_mp.scaling.checkpoint import state_dict_of, validated_state
from lightning_mp.scaling.device_rules import DeviceScale
from lightning_mp.scaling.devices import checked_device_type, default_device
from lightning_mp.scaling.modes import scaling_for
from lightning_mp.scaling.pending import stats_after_update
from lightning_mp.scaling.rules import COLLAPSE_FLOOR, SCALER_DEFAULTS, OnMinScale, ScalerSettings, ScalingMode
from lightning_mp.scaling.stats import PrecisionStats
from lightning_mp.scaling.steps import OWN_PARAMETERS, Phase, StepPreparation, StepStates
from lightning_mp.scaling.updates import ScaleUpdates

__all__ = ["COLLAPSE_FLOOR", "LossScaler", "OnMinScale", "ScalerSettings", "ScalingMode"]


def _reads(path: str, doc: str) -> Any:
    """A read-only property giving the scaler's ``path`` (``"settings.hysteresis"``), documented by ``doc``."""
    return property(operator.attrgetter(path), doc=doc)


@with_setting_docs(ScalerSettings)
class LossScaler(torch.amp.GradScaler):
    """A ``torch.amp.GradScaler`` with hysteresis, scale bounds, static and check-only modes, and counters.

    The module docstring describes the algorithm. Use it through :class:`~lightning_mp.MixedPrecision`, or by hand
    exactly like a GradScaler::

        scaler = LossScaler("cpu", growth_interval=1000, hysteresis=2)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)          # optional: clip here, gradients are true
        scaler.step(optimizer)              # skipped when a gradient is inf/NaN
        scaler.update()                     # once per iteration, after the last step

    Args:
        device: the device type of the gradients (``"cpu"``, ``"cuda"``, ...); None picks ``"cuda"`` when it is
            available, else ``"cpu"``.
        init_scale: the first loss scale (fp16), in ``[min_scale, max_scale]``; a static scale is any normal float32,
            from ``2**-126`` (whose inverse is finite) to float32's largest; unused when nothing is scaled.
        growth_factor: scale multiplier after ``growth_interval`` clean iterations; > 1 (the scale stops at
            ``max_scale``).
        backoff_factor: scale multiplier on an overflow that exhausts the hysteresis; in (0, 1).
        growth_interval: clean iterations in a row before the scale grows, in [1, 2**31 - 1]. An iteration is one scale
            update (after its last optimizer step), so several optimizers or accumulated batches count once.
        hysteresis: overflows tolerated before the scale backs off (DeepSpeed's and Megatron's meaning), in [1,
            2**31 - 1]; 1 is torch's behaviour.
        consecutive_hysteresis: refill the hysteresis after every clean iteration, not only after a growth.
        min_scale: the scale's floor, from ``2**-24`` to ``max_scale``; None means the collapse floor ``2**-24``.
        max_scale: the scale never grows past this; from ``2**-24`` to float32's largest value.
        on_min_scale: ``"raise"`` :class:`~lightning_mp.errors.LossScaleCollapseError`, or ``"warn"`` and stay at the
            floor, when an overflow would push the scale below the floor.
        mode: ``"dynamic"``, ``"static"`` (a fixed ``init_scale``) or ``"check"`` (nothing scaled, non-finite steps
            skipped: bf16 and fp32).
        max_consecutive_skips: stop with :class:`~lightning_mp.errors.NonFiniteStepsError` after this many skipped steps
            in a row of one optimizer (1 to 2**31 - 1), in every precision; None never stops.
        skip_nonfinite: skip every step whose gradients hold an inf or a NaN, without a host sync for torch's Adam,
            AdamW, SGD and Adagrad (:mod:`lightning_mp.scaler`). Only where nothing is scaled (bf16, fp32) may it be
            False: then nothing is checked, as in Lightning's ``"bf16-mixed"`` and ``"32-true"``, a step writes inf/NaN
            into the weights, and ``skipped_steps`` stays 0. A scaled run (fp16) always skips: its overflows are
            routine.

    Each setting is declared, documented and checked once, in :class:`~lightning_mp.scaling.rules.ScalerSettings`;
    :attr:`settings` holds them as validated.

    Raises:
        ValueError: for any argument outside its allowed range, naming it, its value and what is allowed.

    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        init_scale: float = SCALER_DEFAULTS.init_scale,
        growth_factor: float = SCALER_DEFAULTS.growth_factor,
        backoff_factor: float = SCALER_DEFAULTS.backoff_factor,
        growth_interval: int = SCALER_DEFAULTS.growth_interval,
        hysteresis: int = SCALER_DEFAULTS.hysteresis,
        consecutive_hysteresis: bool = SCALER_DEFAULTS.consecutive_hysteresis,
        min_scale: float | None = SCALER_DEFAULTS.min_scale,
        max_scale: float = SCALER_DEFAULTS.max_scale,
        on_min_scale: OnMinScale = SCALER_DEFAULTS.on_min_scale,
        mode: ScalingMode = SCALER_DEFAULTS.mode,
        max_consecutive_skips: int | None = SCALER_DEFAULTS.max_consecutive_skips,
        skip_nonfinite: bool = SCALER_DEFAULTS.skip_nonfinite,
    ) -> None:
        with arguments_of(type(self).__name__):
            settings = ScalerSettings(
                init_scale=init_scale,
                growth_factor=growth_factor,
                backoff_factor=backoff_factor,
                growth_interval=growth_interval,
                hysteresis=hysteresis,
                consecutive_hysteresis=consecutive_hysteresis,
                min_scale=min_scale,
                max_scale=max_scale,
                on_min_scale=on_min_scale,
                mode=mode,
                max_consecutive_skips=max_consecutive_skips,
                skip_nonfinite=skip_nonfinite,
            )
            self._setup(device, settings)

    @classmethod
    def from_settings(cls, settings: ScalerSettings, device: str | torch.device | None = None) -> LossScaler:
        """A scaler with already validated settings (what :class:`~lightning_mp.MixedPrecision` uses)."""
        if not isinstance(settings, ScalerSettings):
            raise TypeError(f"LossScaler.from_settings(settings={settings!r}): expected a ScalerSettings.")
        scaler = cls.__new__(cls)
        scaler._setup(device, settings)
        return scaler

    def _setup(self, device: str | torch.device | None, settings: ScalerSettings) -> None:
        with arguments_of(type(self).__name__):
            device_type = checked_device_type(default_device() if device is None else device)
            scaling = scaling_for(settings)
        self._scaling = scaling
        """The mode's strategy (:mod:`~lightning_mp.scaling.modes`): whatever differs between the modes."""
        self.settings = settings
        super().__init__(
            device_type,
            init_scale=settings.initial_state().scale,
            growth_factor=settings.growth_factor,
            backoff_factor=settings.backoff_factor,
            growth_interval=settings.growth_interval,
            enabled=True,
        )
        self.allow_fp16_gradients = False
        """Set by opt levels whose gradients are fp16 themselves (O3): torch refuses to unscale those by default."""
        self.param_names: dict[int, str] = {}
        """``id(parameter) -> qualified name``, so that errors can name the parameters that overflowed."""
        self._device_scale = DeviceScale()
        self._steps = StepStates(self._scaling, self._device_scale, device_type)
        """What the step knows of each optimizer, and the iteration's flags (:mod:`~lightning_mp.scaling.steps`)."""
        self._host = ScaleUpdates(
            settings,
            self._scaling,
            self._device_scale,
            self._steps.flags,
            self._steps,
        )
        """The host's scale and counters, updated from each iteration (:mod:`~lightning_mp.scaling.updates`)."""

    # ------------------------------------------------------------------------------------------------ settings

    mode: ScalingMode = _reads("settings.mode", '``"dynamic"``, ``"static"`` or ``"check"``.')
    hysteresis: int = _reads("settings.hysteresis", "Overflows tolerated before the scale backs off.")
    min_scale: float | None = _reads("settings.min_scale", "The floor asked for; None means ``2**-24``.")
    max_scale: float = _reads("settings.max_scale", "The ceiling.")
    max_consecutive_skips: int | None = _reads(
        "settings.max_consecutive_skips", "Skipped steps in a row of one optimizer that stop the run; None never stops."
    )
    scales_loss: bool = _reads(
        "_scaling.scales_loss", "Whether the loss is multiplied at all (dynamic or static mode)."
    )

    @override
    def get_growth_factor(self) -> float:
        """The multiplier applied after ``growth_interval`` clean iterations."""
        return self.settings.growth_factor

    @override
    def set_growth_factor(self, new_factor: float) -> None:
        """Set ``growth_factor``, validated like the constructor's argument."""
        self._replace_settings(growth_factor=new_factor)

    @override
    def get_backoff_factor(self) -> float:
        """The multiplier applied on an overflow that exhausts the hysteresis."""
        return self.settings.backoff_factor

    @override
    def set_backoff_factor(self, new_factor: float) -> None:
        """Set ``backoff_factor``, validated like the constructor's argument."""
        self._replace_settings(backoff_factor=new_factor)

    @override
    def get_growth_interval(self) -> int:
        """Clean iterations in a row before the scale grows."""
        return self.settings.growth_interval

    @override
    def set_growth_interval(self, new_interval: int) -> None:
        """Set ``growth_interval``, validated like the constructor's argument."""
        self._replace_settings(growth_interval=new_interval)

    def _replace_settings(self, **changes: Any) -> None:
        host = self._host
        with arguments_of(type(self).__name__):
            self.settings = replace(self.settings, init_scale=host.state.scale, **changes)
        host.state = replace(
            host.state, growth_tracker=min(host.state.growth_tracker, self.settings.growth_interval - 1)
        )
        self._device_scale.trackers_current = False

    # ------------------------------------------------------------------------------------------------ the step

    @override
    def scale(self, outputs: Any) -> Any:
        """Multiply the loss (a tensor, or an iterable of tensors) by the current scale; in check mode return it.

        Raises:
            ValueError: when ``outputs`` is neither a tensor nor an iterable of tensors.

        """
        return self._scaling.scale(outputs, self._device_scale, self._host.state)

    @property
    def steps(self) -> StepStates:
        """What the step knows of each optimizer: one record each, with its phase (:mod:`~lightning_mp.scaling.steps`).

        The step engines read and write the records of the optimizers they step through it.
        """
        return self._steps

    def step_phase(self, optimizer: torch.optim.Optimizer) -> Phase:
        """Where ``optimizer`` is in this iteration: ready, prepared, unscaled or stepped.

        An unscaled optimizer's second :meth:`unscale_` would raise. A Lightning or Fabric wrapper is the optimizer it
        wraps.
        """
        return self._steps.phase(optimizer)

    def found_inf(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the gradients unscaled for ``optimizer`` in this iteration hold an inf or NaN (False before).

        .. warning:: Reads the device flag on the host: a synchronisation on CUDA.
        """
        return self._steps.phase(optimizer) in (Phase.UNSCALED, Phase.STEPPED) and bool(self._steps.verdict(optimizer))

    def step_verdict(self, optimizer: torch.optim.Optimizer) -> bool | torch.Tensor | None:
        """Whether ``optimizer``'s step of this iteration is (or will be) skipped, without waiting for a device.

        A bool where the host already knows; else the device flag (a 0-d tensor, 1.0 when skipped), for sync-free
        use such as ``torch.where``; None before :meth:`unscale_` ran for it.
        """
        return self._steps.verdict(optimizer)

    def attach_preparation(self, preparation: StepPreparation) -> None:
        """Have ``preparation`` ready each optimizer's gradients and name the tensors that hold them, for a run.

        :class:`~lightning_mp.MixedPrecision` attaches its step engine when a run starts and detaches it at the end.
        """
        self._steps.preparation = preparation

    def detach_preparation(self, preparation: StepPreparation) -> None:
        """Stop using ``preparation`` (if it is the one attached): the gradients are the parameters' own again."""
        if self._steps.preparation is preparation:
            self._steps.preparation = OWN_PARAMETERS

    def forget_prepared(self) -> None:
        """A backward made new gradients: the next unscale or check of each optimizer readies them again."""
        self._steps.forget_prepared()

    @override
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place (fp16) and check them for inf/NaN.

        In check mode (bf16, fp32) the gradients are only read. Runs at most once per optimizer and iteration, like
        torch's (use :meth:`step_phase` to ask first). Under DDP the flag is all-reduced with ``max``.

        Raises:
            RuntimeError: when called twice for ``optimizer`` in one iteration, or after its ``step``.

        """
        self._steps.check(optimizer, True, self._host.state, self.allow_fp16_gradients)

    def recheck_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Check ``optimizer``'s unscaled gradients again before its step, and skip the step if one is now inf or NaN.

        For code that changes the gradients after :meth:`unscale_` (clipping with a NaN threshold makes them NaN):
        the check is folded into the step's verdict, on the device where the verdict is a device flag, and such a
        step is skipped and counted like an overflow. Does nothing before :meth:`unscale_`.
        """
        self._steps.recheck(optimizer)

    @property
    def local_overflow_count(self) -> torch.Tensor | int:
        """:meth:`local_overflows` without a sync: a 0-d device tensor under DDP (for one gathering collective)."""
        local = self._steps.flags.local_overflows
        return local if local is not None else self.skipped_steps

    def local_overflows(self) -> int:
        """Iterations on which this rank's own gradients overflowed, before the DDP all-reduce.

        .. warning:: Under DDP this reads a device counter and synchronises; call it on logging steps only.
        """
        local = self._steps.flags.local_overflows
        return self.skipped_steps if local is None else int(local.item())

    @override
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale if needed, then run ``optimizer.step()`` unless a gradient is inf or NaN.

        .. warning:: An optimizer that cannot skip on the device reads the inf flag: one host sync, as in torch. The
            module docstring says which optimizer skips where.

        Raises:
            RuntimeError: when called twice for ``optimizer`` in one iteration, or with a ``closure``.

        """
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        return self._steps.step(optimizer, self, self._remember_nonfinite, *args, **kwargs)

    @override
    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Check ``optimizer``'s gradients for inf/NaN without unscaling them (torch's check before a fused step).

        The same pass as :meth:`unscale_`, multiplying by one; fp16 gradients are allowed, as in torch.
        """
        return self._steps.check(optimizer, False, self._host.state, self.allow_fp16_gradients)

    @override
    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The inf flag of each device found for ``optimizer`` in this iteration (torch's protocol getter)."""
        return self._steps.found_inf_per_device(optimizer)

    def _remember_nonfinite(self, index: int, found_inf: torch.Tensor | float) -> None:
        self._host.remember_nonfinite(index, found_inf, self.settings.max_consecutive_skips, self.param_names)

    @override
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """End the iteration: move the scale once, by the rules, after every optimizer of the iteration stepped.

        Args:
            new_scale: set the scale to this value instead; it must lie in ``[floor, max_scale]`` (in static mode
                any normal float32, from ``2**-126``, whose inverse is finite, to float32's largest).

        Raises:
            LossScaleCollapseError: when an overflow would push the scale below its floor and
                ``on_min_scale="raise"`` (on an accelerator with a fused optimizer: one iteration later).
            NonFiniteStepsError: when one optimizer skipped ``max_consecutive_skips`` steps in a row.
            ValueError: for a ``new_scale`` outside the allowed range.

        .. warning:: A ``new_scale`` tensor is read on the host (one sync) to be validated.

        """
        record = self._steps.close()
        if new_scale is not None:
            with arguments_of(f"{type(self).__name__}.update"):
                record.new_scale = self._scaling.checked_new_scale(new_scale, self.settings)
        elif not record.checked:
            raise AssertionError("No inf checks were recorded prior to update.")
        self._scaling.move_on_device(record, self._device_scale, self._host.state, self.settings)
        self._host.end_iteration(record, self.settings, self.param_names)

    def record_unchecked_step(self, skipped: bool = False) -> None:
        """End an iteration whose one step was checked outside this scaler (LBFGS evaluates its own closure).

        ``skipped``: the caller found a non-finite loss or gradient and undid the step; it counts like any skip.
        """
        self._steps.record_unchecked_step(skipped)
        self.update()

    # ------------------------------------------------------------------------------------------------ reading

    @override
    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 in check mode). Never synchronises.

        Exact on the CPU. On an accelerator, after an iteration whose flag stayed on the device (fused
        optimizers), it is the scale as of the previous iteration until the next :meth:`update`.
        """
        return self._scaling.loss_scale(self._host.state.scale)

    @override
    def _get_growth_tracker(self) -> int:
        return self._host.state.growth_tracker

    hysteresis_tracker: int = _reads(
        "_host.state.hysteresis_left", "Overflows still tolerated before the next backoff."
    )
    optimizer_steps: int = _reads("_host.counters.optimizer_steps", "Optimizer steps asked for, skipped ones included.")
    skipped_steps: int = _reads(
        "_host.counters.skipped_steps", "Steps skipped because a gradient held an inf or a NaN."
    )
    scale_backoffs: int = _reads("_host.counters.scale_backoffs", "Iterations after which the scale moved down.")
    scale_growths: int = _reads("_host.counters.scale_growths", "Iterations after which the scale moved up.")
    last_step_skipped: bool = _reads(
        "_host.counters.last_step_skipped", "Whether a step of the last counted iteration was skipped."
    )
    consecutive_skips: int = _reads(
        "_host.counters.consecutive_skips", "The longest current streak of skipped steps among the optimizers."
    )

    def stats(self) -> PrecisionStats:
        """A snapshot of the counters; see :class:`~lightning_mp.scaling.stats.PrecisionStats`. Never synchronises.

        As fresh as :meth:`get_scale`: exact on the CPU, at most one iteration old on an accelerator.
        """
        return PrecisionStats.from_counters(self.get_scale(), self.last_step_skipped, self._host.counters.counters())

    def stats_with_pending(self) -> PrecisionStats:
        """:meth:`stats` as they will read after this iteration's :meth:`update`, computed on copies; changes nothing.

        For a caller whose update waits (Fabric's, until the next backward). Never raises (a collapse raises at the
        update itself). Where a flag is still on an accelerator, this is :meth:`stats`.
        """
        stats = stats_after_update(
            self._steps.record, self._host.counters, self._host.state, self.settings, self._scaling
        )
        return self.stats() if stats is None else stats

    # ------------------------------------------------------------------------------------------------ state

    @override
    def __getstate__(self) -> dict[str, Any]:
        """Pickle the settings, the host state and the counters; device tensors and optimizers are rebuilt lazily.

        Raises:
            AssertionError: in the middle of an iteration, as torch's GradScaler.

        """
        self._host.apply_waiting_iteration(self.settings, self.param_names)
        if any(record.phase in (Phase.UNSCALED, Phase.STEPPED) for record in self._steps.records()):
            raise AssertionError(
                "A GradScaler instance may only be pickled at the beginning of an iteration, or at the end after"
                " scaler.update()."
            )
        # The step states leave the records and the run's preparation out: a copy keeps no tie to a model.
        return dict(self.__dict__)

    @override
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: torch's five keys, then trackers, bounds, mode and counters.

        A torch GradScaler can load this dict too: it reads the five keys it knows.

        .. warning:: On an accelerator, when the last iteration's flag is still on the device, this waits for it.
        """
        self._host.apply_waiting_iteration(self.settings, self.param_names)
        return state_dict_of(self.settings, self._host.state, self._host.counters, len(self._steps))

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scale, the trackers and the counters, validated and fitted to this run's settings.

        Accepts torch's five-key GradScaler dict as well (counters then start from zero). This run's settings win,
        with a warning; what is clamped and what is refused is in :mod:`~lightning_mp.scaling.checkpoint`.

        Raises:
            RuntimeError: if ``state_dict`` is empty.
            ValueError: if a field is malformed; the message names the key, the value and what was expected.

        """
        with arguments_of(f"{type(self).__name__}.load_state_dict"):
            loaded = validated_state(state_dict, self.settings)
        host = self._host
        host.counters = replace(loaded.counters, last_nonfinite=host.counters.last_nonfinite)
        if loaded.scale_state is not None:
            host.state = loaded.scale_state
        self._device_scale.trackers_current = False
        self._device_scale.write_scale(self._host.state, self._scaling.scales_loss)
        self._device_scale.write_trackers(self._host.state)
