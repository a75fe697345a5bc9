"""Watches for the precision failures that stay silent, warns once about each with the fix, and draws heatmaps.

Silent means they do not crash, do not produce a NaN and do not show in the loss curve for a long time. The heatmaps
show them per layer over the steps.

**What it measures.** On the first training step and then every ``every_n_steps`` steps (a *sampled* step, at the
same steps as Lightning's ``log_every_n_steps=every_n_steps``), on rank zero only:

- **Activation headroom**, per layer: ``log2(65504 / max |output|)``, the number of doublings left before the
  layer's output overflows fp16. Forward hooks on the leaf modules take one ``max |output|`` each (one op per layer)
  during that step's forward pass and are removed at the end of the batch.
- **Gradient underflow share**, per layer: the share of gradient elements that are exactly zero, read in
  ``on_before_optimizer_step`` (after unscaling).
- **Stale-update share**, per layer: the share of the weights with a non-zero update that the optimizer step did not
  change at all. A floating-point weight ``w`` only moves if the update is at least half an ulp of ``w``: in bf16
  (8 bits of mantissa) an update below ``|w| / 256`` is rounded away, so a bf16 weight of 1.0 ignores every update
  smaller than about 0.004. That is what happens with bf16 weights, under opt level O3, or with tiny learning rates
  in fp16, and nothing reports it: the loss just stops improving.

**The stale-update estimator.** Knowing the intended update exactly would mean running the optimizer a second time in
fp32. The sentinel instead uses the one fact every common optimizer (SGD, momentum, Adam, AdamW, RMSprop, ...)
shares: a parameter element with a non-zero gradient gets a non-zero update. On a sampled step it keeps, for each
stepped tensor, the sign of the gradient and a copy of the weight, taken in ``on_before_optimizer_step``; at the end of
the batch it takes the sign of ``w_after - w_before`` (exactly zero if and only if the stored value did not change:
IEEE subtraction of two different floats is never zero). An element is *stale* if its gradient was non-zero and its
weight did not move; per tensor that is ``count(sign(g) != 0) - count(sign(g) * sign(dw) != 0)``, two batched
L0 norms. Groups with ``lr == 0`` are left out, and a skipped step is not counted:
:class:`~lightning_mp.MixedPrecision` says which steps it skipped; under another plugin a step on which no element
moved at all is taken as skipped (so there a model whose every update is lost reads as skipped, not as stale). The
whole measurement is a handful of ``torch._foreach_*`` ops whatever the number of tensors, and costs
one copy of the weights and one of the gradient signs, on sampled steps only. Optimizers that step fp32 master
weights (opt level O2) show no stale updates, which is exactly why masters exist.

**The warnings** (each kind once per fit, through ``rank_zero_warn`` as ``RuntimeWarning``), with their rules in
:mod:`lightning_mp.callbacks._sentinel_rules`:

- ``stale_updates``: a layer's stale-update share reaches ``stale_update_share``;
- ``underflow``: the share of zero gradients has grown by ``underflow_growth`` over its lowest value while the
  dynamic loss scale sits at its ceiling (``max_scale``), so the scaler cannot push the gradients back up;
- ``overflow_risk``: in a run that computes in fp16, a layer's activation headroom falls below ``headroom_log2``
  doublings, before anything has overflowed;
- misconfigurations: ``autocast_device`` (autocast runs for another device type than the model's, or no layer runs
  in half precision under a mixed-precision plugin), ``scaler_in_bf16`` (a loss scaler is active while the model
  computes in bf16), ``fp16_without_scaling`` (the model computes in fp16 and nothing scales the loss).

**Pictures.** Every ``heatmap_every_n_samples`` samples, and at the end of training, three heatmaps (layers down,
sampled steps across) go to every TensorBoard logger as images: ``precision_sentinel/activation_headroom_log2``,
``precision_sentinel/grad_underflow_share`` and ``precision_sentinel/stale_update_share``. Three scalars summarise
each sample for every logger: ``precision_sentinel/min_activation_headroom_log2``,
``precision_sentinel/total_grad_underflow_share`` and ``precision_sentinel/max_stale_update_share``. (A scalar and an
image must not share a tag: TensorBoard's server would show only one of them.)

**Cost.** A step that is not sampled costs nothing: no hook is attached and no op runs. A sampled step costs one op
per leaf module, about ten batched ops for the gradients and weights, and its values join the one device-to-host
transfer the monitors share per batch (:mod:`lightning_mp.measuring.host_reads`). The heatmaps are drawn on the
host from numbers already read.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mp.arguments.checks import plain_scalar
from lightning_mp.callbacks._sentinel_measures import (
    ALL_LAYERS,
    HALF_NAMES,
    Sample,
    Snapshot,
    first_floating_tensor,
    largest_magnitude,
    layer_of,
    measured_layers,
    parameter_names,
    per_layer_shares,
    run_facts,
    skipped_steps,
    stepped_parameters,
    summary_scalars,
    take_snapshot,
    update_counts,
)
from lightning_mp.callbacks._sentinel_rules import (
    Finding,
    headroom_log2,
    misconfigurations,
    overflow_risk_finding,
    stale_update_finding,
    underflow_finding,
)
from lightning_mp.callbacks._sharding import CopiesOf, gradient_copies
from lightning_mp.measuring.heatmaps import HeatmapStyle
from lightning_mp.measuring.logging_steps import log_scalars, logging_step, only_accumulates
from lightning_mp.measuring.monitors import HeatmapQuantities, SampledMonitor
from lightning_mp.plugin import MixedPrecision

HEADROOM_STYLE = HeatmapStyle("activation headroom (doublings to fp16 max)", "log2(65504 / max|a|)", "RdYlGn", 0, 16)
UNDERFLOW_STYLE = HeatmapStyle("gradient underflow share (exact zeros)", "share of elements", "viridis", 0, 1)
STALE_STYLE = HeatmapStyle("stale-update share (update below half an ulp)", "share of elements", "magma", 0, 1)
HEATMAP_TAGS: HeatmapQuantities = {
    "precision_sentinel/activation_headroom_log2": ("headroom", HEADROOM_STYLE),
    "precision_sentinel/grad_underflow_share": ("underflow", UNDERFLOW_STYLE),
    "precision_sentinel/stale_update_share": ("stale", STALE_STYLE),
}


class PrecisionSentinel(SampledMonitor[Sample]):
    r"""Warn once, with the fix, about stale updates, underflow, overflow risk and precision misconfiguration.

    Works with any precision plugin (Lightning's included); the underflow rule needs
    :class:`~lightning_mp.MixedPrecision`, which knows the loss scale's ceiling. Heatmaps need a
    :class:`~lightning.pytorch.loggers.TensorBoardLogger` and matplotlib; the warnings need neither.

    .. warning:: A sampled step synchronises the host once, in the transfer the monitors share. Other steps never do.

    Args:
        every_n_steps: sample every this many training steps, at the steps ``log_every_n_steps`` would log (the
            first step is always sampled, so that misconfigurations show at once).
        stale_update_share: warn when a layer's share of stale updates reaches this, in (0, 1].
        underflow_growth: warn when the share of zero gradients has grown by this much (in (0, 1]) while the loss
            scale is at its ceiling.
        headroom_log2: warn when a layer's fp16 activation headroom falls below this many doublings, in (0, 16].
        log_heatmaps: write the per-layer heatmaps to TensorBoard loggers.
        heatmap_every_n_samples: redraw the heatmaps every this many samples (and at the end of training).

    Raises:
        ValueError: if an argument is outside its range, or a boolean is not ``True`` or ``False``; the message names
            the argument, the value and what is allowed.
        ModuleNotFoundError: in ``setup``, if ``log_heatmaps`` is on, a TensorBoard logger is attached and
            matplotlib is missing.

    Example::

        from lightning import Trainer
        from lightning_mp import MixedPrecision
        from lightning_mp.callbacks import PrecisionSentinel

        trainer = Trainer(plugins=[MixedPrecision("16-mixed")], callbacks=[PrecisionSentinel(every_n_steps=100)])

    """

    heatmap_quantities = HEATMAP_TAGS

    def __init__(
        self,
        every_n_steps: int = 50,
        stale_update_share: float = 0.25,
        underflow_growth: float = 0.1,
        headroom_log2: float = 2.0,
        log_heatmaps: bool = True,
        heatmap_every_n_samples: int = 5,
    ) -> None:
        super().__init__(every_n_steps, log_heatmaps, heatmap_every_n_samples)
        self.stale_update_share = _validate_in_range("stale_update_share", stale_update_share, 0.0, 1.0)
        self.underflow_growth = _validate_in_range("underflow_growth", underflow_growth, 0.0, 1.0)
        self.headroom_log2 = _validate_in_range("headroom_log2", headroom_log2, 0.0, 16.0)
        self.warned: set[str] = set()
        self._lowest_zero_share = math.inf
        self._output_dtypes: set[str] = set()
        self._activation_maxima: list[tuple[str, torch.Tensor]] = []
        self._snapshots: list[Snapshot] = []
        self._skipped_before: int | None = None
        self._copies: CopiesOf | None = None
        """Under FSDP and tensor parallelism, how many ranks hold each parameter's local part
        (:mod:`lightning_mp.callbacks._sharding`)."""
        self._declared_sizes: dict[int, int] = {}
        """``id(parameter) -> numel`` before the strategy set the model up: FSDP leaves each rank a shard."""

    # ------------------------------------------------------------------------------------------------ hooks

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "fit":
            return
        self._declared_sizes = {id(parameter): parameter.numel() for parameter in pl_module.parameters()}
        self.warned = set()
        self._lowest_zero_share = math.inf
        self._output_dtypes = set()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._sampling:
            return  # still sampling the optimizer step that gradient accumulation delays
        step = logging_step(trainer)
        self._copies = gradient_copies(trainer)
        # The first step, then the steps Lightning logs at with log_every_n_steps=every_n_steps. Under FSDP every rank
        # samples its gradient shards, for rank zero to combine them.
        sampling_rank = trainer.is_global_zero or self._copies is not None
        self._sampling = sampling_rank and (step == 0 or (step + 1) % self.every_n_steps == 0)
        if not self._sampling or not trainer.is_global_zero:
            return
        self._skipped_before = skipped_steps(trainer.precision_plugin)
        for name, module in measured_layers(pl_module):
            self.watch(module, self._activation_recorder(name))

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if not self._sampling:
            return
        seen = {id(p) for snapshot in self._snapshots for p in snapshot.parameters}
        parameters = stepped_parameters(optimizer, seen, every_rank_counts=self._copies is not None)
        if not parameters:
            return
        master_param = getattr(getattr(trainer.precision_plugin, "policy", None), "master_param", None)
        weights = [master_param(p) for p in parameters] if master_param is not None else None
        self._snapshots.append(take_snapshot(parameters, weights))

    @override
    def sample_ended(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_idx: int) -> None:
        if not self._snapshots and only_accumulates(trainer, batch_idx):
            # Accumulating gradients: one micro-batch's activations are enough; the step comes on a later batch.
            self.submit(trainer)
            return
        self._sampling = False
        maxima, self._activation_maxima = self._activation_maxima, []
        snapshots, self._snapshots = self._snapshots, []
        parameters = [p for snapshot in snapshots for p in snapshot.parameters]
        device_values = [torch.stack([value for _, value in maxima])] if maxima else []
        if snapshots:
            device_values.append(update_counts(snapshots))
        sizes = [p.numel() for p in parameters]
        copies = [1] * len(parameters)
        if self._copies is not None and snapshots:
            # Each rank counted its parts: the sums over the ranks count each whole tensor once per rank holding the
            # same part (divided on the host, once read), and the sizes are the whole tensors', declared before FSDP.
            counts = device_values[-1]
            torch.distributed.all_reduce(counts)
            copies = [self._copies(p) for p in parameters]
            sizes = [self._declared_sizes.get(id(p), p.numel()) for p in parameters]
            if not trainer.is_global_zero:
                self.submit(trainer)
                return
        if not device_values:
            self.submit(trainer)
            return
        step = logging_step(trainer, finished_batch=batch_idx)
        layers = [layer for layer, _ in maxima]
        names = parameter_names(trainer, pl_module)
        parameter_layers = [layer_of(names.get(id(p), "unnamed")) for p in parameters]
        skipped_so_far, before = skipped_steps(trainer.precision_plugin), self._skipped_before
        skipped = None if skipped_so_far is None or before is None else skipped_so_far > before
        # The parameter dtypes are known on the host; collect them now, before an opt level can swap tensors.
        parameter_half = {HALF_NAMES[p.dtype] for p in pl_module.parameters() if p.dtype in HALF_NAMES}

        def consume(values: list[float]) -> None:
            sample = Sample(step)
            for layer, value in zip(layers, values, strict=False):
                sample.headroom[layer] = min(sample.headroom.get(layer, math.inf), headroom_log2(value))
            # The counts are [with a gradient, per tensor..., moved, per tensor...].
            counts = [count / held_by for count, held_by in zip(values[len(layers) :], copies + copies, strict=True)]
            if counts:
                per_layer_shares(sample, parameter_layers, sizes, counts, skipped)
            self._record(trainer, pl_module, sample, parameter_half)

        self.submit(trainer, torch.cat([v.reshape(-1).float() for v in device_values]), consume)

    @override
    def stop_sampling(self) -> None:
        super().stop_sampling()
        self._snapshots, self._activation_maxima = [], []

    # ------------------------------------------------------------------------------------------------ rules

    def _record(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, sample: Sample, parameter_half: set[str]
    ) -> None:
        self.keep_sample(sample)
        findings: list[Finding | None] = list(
            misconfigurations(
                run_facts(
                    trainer.precision_plugin,
                    model_device=pl_module.device.type,
                    half_dtypes=frozenset(self._output_dtypes | parameter_half),
                    outputs_seen=bool(self.samples and self.samples[-1].headroom),
                )
            )
        )
        if sample.stale:
            findings.append(stale_update_finding(sample.stale, self.stale_update_share))
        if "float16" in self._output_dtypes | parameter_half and sample.headroom:
            findings.append(overflow_risk_finding(sample.headroom, self.headroom_log2))
        zero_share = sample.underflow.get(ALL_LAYERS)
        if zero_share is not None:
            findings.append(self._underflow(trainer, zero_share))
            self._lowest_zero_share = min(self._lowest_zero_share, zero_share)
        for finding in findings:
            self._warn(finding)
        log_scalars(trainer, summary_scalars(sample), step=sample.step)
        self.draw_if_due(trainer)

    def _underflow(self, trainer: pl.Trainer, zero_share: float) -> Finding | None:
        plugin = trainer.precision_plugin
        if not isinstance(plugin, MixedPrecision) or math.isinf(self._lowest_zero_share):
            return None
        view = plugin.scaler_view
        ceiling = (
            view.max_scale if view.max_scale is not None else (plugin.stats.loss_scale if view.scales_loss else None)
        )
        return underflow_finding(
            zero_share, self._lowest_zero_share, self.underflow_growth, plugin.stats.loss_scale, ceiling
        )

    def _warn(self, finding: Finding | None) -> None:
        if finding is None or finding.kind in self.warned:
            return
        self.warned.add(finding.kind)
        rank_zero_warn(f"PrecisionSentinel [{finding.kind}]: {finding.message}", category=RuntimeWarning)

    # ------------------------------------------------------------------------------------------------ plumbing

    def _activation_recorder(self, layer: str) -> Any:
        def hook(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            tensor = first_floating_tensor(output)
            if tensor is None or tensor.numel() == 0:
                return
            if tensor.dtype in HALF_NAMES:
                self._output_dtypes.add(HALF_NAMES[tensor.dtype])
            self._activation_maxima.append((layer, largest_magnitude(tensor)))

        return hook

    @override
    def heatmap_rows(self, quantity: str) -> dict[str, list[float]]:
        layers = dict.fromkeys(layer for sample in self.samples for layer in getattr(sample, quantity))
        return {
            layer: [getattr(sample, quantity).get(layer, math.nan) for sample in self.samples]
            for layer in layers
            if layer != ALL_LAYERS
        }


def _validate_in_range(name: str, value: object, low: float, high: float) -> float:
    number = plain_scalar(value)
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not low < number <= high:
        raise ValueError(f"`{name}` must be a number in ({low:g}, {high:g}], got {value!r}.")
    return float(number)
