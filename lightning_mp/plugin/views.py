"""What the plugin shows of its run: the precision and device setup resolved, the policy, the scaler and the counters.

Every view here only reads. Before setup they answer from the settings (the precision asked for, the ``device``
given, the initial scale); once a run is set up, from its one resolved setup
(:class:`~lightning_mp.plugin.resolved.ResolvedSetup`), its loss scaler and its engine. None of them synchronises
with the device, except :meth:`RunViews.local_overflows` under DDP and :meth:`RunViews.last_step_skipped` for a step
decided on the device, which say so.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.optim import Optimizer

from lightning_mp.engine.base import StepEngine
from lightning_mp.plugin.resolved import ShownPrecision
from lightning_mp.plugin.run import Run
from lightning_mp.policies import PrecisionPolicy
from lightning_mp.policies.sharded import fsdp2_mixed_precision_policy
from lightning_mp.scaler import LossScaler
from lightning_mp.scaling.per_optimizer import PerOptimizerScalers
from lightning_mp.scaling.stats import PrecisionStats, ScalerView
from lightning_mp.settings import HALF_DTYPES, PluginSettings, PrecisionName


class RunViews:
    """The read-only views of :class:`~lightning_mp.MixedPrecision` (module docstring)."""

    settings: PluginSettings
    requested_precision: PrecisionName
    requested_device: str | None
    opt_level: str
    _run: Run | None
    _engine: StepEngine | None

    # Lightning declares ``precision`` and ``device`` as attributes; here both are read from the run's one resolved
    # setup, or from the settings before setup (the plugin's class line says so to the type checker).
    @property
    def precision(self) -> PrecisionName | ShownPrecision:
        """What Lightning reads: the precision asked for (maybe ``"auto"``) until setup, then the resolved one.

        Where the opt level keeps half weights (O3, lean) it is named ``"16-true"`` or ``"bf16-true"``.
        """
        return self._run.setup.shown_precision if self._run is not None else self.requested_precision

    @property
    def device(self) -> str | None:
        """The device type autocast runs on; before setup the ``device`` given (None: learnt at setup)."""
        return self._run.setup.device if self._run is not None else self.requested_device

    @property
    def precision_reason(self) -> str:
        """Why the precision is what it is: ``"asked for"``, or why ``"auto"`` chose it (empty until it has)."""
        if self._run is not None:
            return self._run.setup.reason
        return "" if self.requested_precision == "auto" else "asked for"

    @property
    def half_dtype(self) -> torch.dtype | None:
        """``torch.float16`` or ``torch.bfloat16`` once resolved; None for fp32 (and for "auto" before setup)."""
        return self._run.setup.half_dtype if self._run is not None else HALF_DTYPES.get(self.requested_precision)

    # Lightning's plugin stores a writable ``scaler``; here it is a read-only view of the scaler this plugin owns, and
    # Lightning's hooks that use it are overridden.
    @property
    def scaler(self) -> LossScaler | None:
        """The loss scaler, or None where nothing is scaled (bf16, fp32) and before setup. Reading it changes nothing.

        With ``scale_per_optimizer=True`` it is the first optimizer's; :attr:`scalers` has each one's.

        Under Fabric the scale moves at the next ``fabric.backward`` (:mod:`lightning_mp.engine.fabric`), so right
        after a step the scaler's own getters still give the scale that step was unscaled with; :attr:`stats` gives
        the one the step leads to.
        """
        if self._run is None or not self._run.loss_scaler.scales_loss:
            return None
        scaler = self._run.loss_scaler
        return scaler.scalers[0] if isinstance(scaler, PerOptimizerScalers) else scaler

    @property
    def scalers(self) -> tuple[LossScaler, ...]:
        """Every loss scaler of the run, by optimizer number.

        One per optimizer with ``scale_per_optimizer=True``, else the one :attr:`scaler` (none where nothing is
        scaled, and before setup).
        """
        if self._run is not None and isinstance(self._run.loss_scaler, PerOptimizerScalers):
            return tuple(self._run.loss_scaler.scalers)
        return (self.scaler,) if self.scaler is not None else ()

    @property
    def scaler_view(self) -> ScalerView:
        """The scaler's overflow counter and settings for telemetry, in every precision; never synchronises."""
        if self._run is None:
            return ScalerView()
        scaler = self._run.loss_scaler
        max_scale = scaler.max_scale if scaler.mode == "dynamic" else None
        return ScalerView(scaler.local_overflow_count, max_scale, scaler.scales_loss)

    @property
    def policy(self) -> PrecisionPolicy | None:
        """The opt level's policy object, once set up."""
        return self._run.policy if self._run is not None else None

    @property
    def stats(self) -> PrecisionStats:
        """Counters as of the last optimizer step, its scale update included. Reading them changes nothing.

        Reading them never synchronises with the device. Under Fabric, whose scale update waits for the next
        ``fabric.backward`` (:mod:`lightning_mp.engine.fabric`), they count the pending update in without applying
        it; where its inf flag is still on an accelerator, they are one iteration old, as the scale is there.
        """
        if self._engine is not None:
            return self._engine.stats()
        if self._run is not None:
            return self._run.loss_scaler.stats()
        initial = self.settings.scaler.init_scale if self.settings.loss_scale == "dynamic" else self.settings.loss_scale
        return PrecisionStats(loss_scale=float(initial) if self.requested_precision == "16-mixed" else 1.0)

    def local_overflows(self) -> int:
        """Steps on which this process's own gradients overflowed, before the ranks agreed to skip.

        Under DDP every rank skips a step on which any rank overflowed; this count says which rank it was.

        .. warning:: Under DDP this reads a device counter and synchronises; call it on logging steps only.
        """
        return self._run.loss_scaler.local_overflows() if self._run is not None else 0

    def last_step_skipped(self, optimizer: Optimizer) -> bool:
        """Whether the most recent step of ``optimizer`` (or its LightningOptimizer) was skipped; False before one.

        .. warning:: Where the step was decided on the device (fused optimizers; in bf16 and fp32 every optimizer the
            scaler hands to a fused kernel), this reads its inf flag: one host sync. An ``interval="step"``
            scheduler asks it after every step.
        """
        return self._engine.last_step_skipped(optimizer) if self._engine is not None else False

    def fsdp2_policy(self, keep_fp32: bool = False) -> MixedPrecisionPolicy:
        """The ``MixedPrecisionPolicy`` to pass to FSDP2's ``fully_shard`` so that it carries out this opt level.

        O2 gathers the weights in the half type and reduces gradients in half; O0 and O1 need no cast from FSDP2;
        O3 and lean are refused on a model sharded before the plugin sees it (under Fabric's ``parallelize_fn``, which
        shards after the conversion, O3 trains and lean is refused at the first forward; see
        :mod:`lightning_mp.policies.sharded` for the table and the ``keep_fp32`` recipe)::

            def configure_model(self):
                for block in self.blocks:
                    fully_shard(block, mp_policy=plugin.fsdp2_policy())
                fully_shard(self.head, mp_policy=plugin.fsdp2_policy(keep_fp32=True))  # keep_fp32=["head"]
                fully_shard(self, mp_policy=plugin.fsdp2_policy())

        Args:
            keep_fp32: the policy for a ``keep_fp32`` subtree's own ``fully_shard`` call (gathered in fp32).

        Raises:
            ValueError: when ``precision='auto'`` is not resolved yet (``configure_model`` runs before the plugin
                learns the device); pass ``'16-mixed'`` or ``'bf16-mixed'`` explicitly.

        """
        if self.precision == "auto":
            raise ValueError(
                "MixedPrecision(precision='auto').fsdp2_policy() is not allowed: the precision is chosen at setup,"
                " after configure_model. Pass precision='16-mixed' or 'bf16-mixed' to use fsdp2_policy()."
            )
        return fsdp2_mixed_precision_policy(self.opt_level, self.half_dtype, keep_fp32)


__all__ = ["RunViews"]
