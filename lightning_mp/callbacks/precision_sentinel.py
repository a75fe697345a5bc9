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
transfer the monitors share per batch (:mod:`lightning_mp.callbacks._host_reads`). The heatmaps are drawn on the
host from numbers already read.

Private names: :mod:`lightning_mp._private_names` lists them, with the reason for each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_mp.arguments.checks import plain_scalar
from lightning_mp.callbacks._heatmaps import HeatmapStyle, render_heatmap, require_matplotlib
from lightning_mp.callbacks._host_reads import host_reads
from lightning_mp.callbacks._logging import (
    log_scalars,
    logging_step,
    only_accumulates,
    tensorboard_writers,
    validate_bool,
    validate_positive_int,
)
from lightning_mp.callbacks._sentinel_rules import (
    Finding,
    RunFacts,
    headroom_log2,
    misconfigurations,
    overflow_risk_finding,
    stale_update_finding,
    underflow_finding,
)
from lightning_mp.callbacks._sharding import CopiesOf, gradient_copies
from lightning_mp.plugin import MixedPrecision
from lightning_mp.scaling.sharded import local_shard

_HALF_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
HEADROOM_STYLE = HeatmapStyle("activation headroom (doublings to fp16 max)", "log2(65504 / max|a|)", "RdYlGn", 0, 16)
UNDERFLOW_STYLE = HeatmapStyle("gradient underflow share (exact zeros)", "share of elements", "viridis", 0, 1)
STALE_STYLE = HeatmapStyle("stale-update share (update below half an ulp)", "share of elements", "magma", 0, 1)
HEATMAP_TAGS = {
    "precision_sentinel/activation_headroom_log2": ("headroom", HEADROOM_STYLE),
    "precision_sentinel/grad_underflow_share": ("underflow", UNDERFLOW_STYLE),
    "precision_sentinel/stale_update_share": ("stale", STALE_STYLE),
}


@dataclass
class _Sample:
    """What one sampled step measured, per layer, on the host."""

    step: int
    headroom: dict[str, float] = field(default_factory=dict)
    underflow: dict[str, float] = field(default_factory=dict)
    stale: dict[str, float] = field(default_factory=dict)


@dataclass
class _Snapshot:
    """The weights and gradient signs of the tensors one optimizer is about to step, kept on the device."""

    parameters: list[torch.Tensor]
    weights_before: list[torch.Tensor]
    grad_signs: list[torch.Tensor]


class PrecisionSentinel(Callback):
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

    def __init__(
        self,
        every_n_steps: int = 50,
        stale_update_share: float = 0.25,
        underflow_growth: float = 0.1,
        headroom_log2: float = 2.0,
        log_heatmaps: bool = True,
        heatmap_every_n_samples: int = 5,
    ) -> None:
        self.every_n_steps = validate_positive_int("every_n_steps", every_n_steps)
        self.stale_update_share = _validate_in_range("stale_update_share", stale_update_share, 0.0, 1.0)
        self.underflow_growth = _validate_in_range("underflow_growth", underflow_growth, 0.0, 1.0)
        self.headroom_log2 = _validate_in_range("headroom_log2", headroom_log2, 0.0, 16.0)
        self.log_heatmaps = validate_bool("log_heatmaps", log_heatmaps)
        self.heatmap_every_n_samples = validate_positive_int("heatmap_every_n_samples", heatmap_every_n_samples)
        self.samples: list[_Sample] = []
        self.warned: set[str] = set()
        self._samples_drawn = 0
        self._lowest_zero_share = math.inf
        self._output_dtypes: set[str] = set()
        self._sampling = False
        self._handles: list[RemovableHandle] = []
        self._activation_maxima: list[tuple[str, torch.Tensor]] = []
        self._snapshots: list[_Snapshot] = []
        self._skipped_before: int | None = None
        self._copies: CopiesOf | None = None
        """Under FSDP and tensor parallelism, how many ranks hold each parameter's local part
        (:mod:`lightning_mp.callbacks._sharding`)."""
        self._declared_sizes: dict[int, int] = {}
        """``id(parameter) -> numel`` before the strategy set the model up: FSDP leaves each rank a shard."""

    # ------------------------------------------------------------------------------------------------ hooks

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.log_heatmaps and tensorboard_writers(trainer):
            require_matplotlib(type(self).__name__)
        host_reads(trainer).join(self)
        self._declared_sizes = {id(parameter): parameter.numel() for parameter in pl_module.parameters()}
        self.samples, self.warned, self._samples_drawn = [], set(), 0
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
        plugin = trainer.precision_plugin
        self._skipped_before = plugin.stats.skipped_steps if isinstance(plugin, MixedPrecision) else None
        for name, module in pl_module.named_modules():
            is_leaf = next(module.children(), None) is None
            if is_leaf or next(module.parameters(recurse=False), None) is not None:
                self._handles.append(module.register_forward_hook(self._activation_recorder(name or "model")))

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if not self._sampling:
            return
        seen = {id(p) for snapshot in self._snapshots for p in snapshot.parameters}
        stepped = [p for group in optimizer.param_groups if not _is_zero(group.get("lr", 1.0)) for p in group["params"]]
        if self._copies is None:
            parameters = [
                p
                for p in stepped
                if p.grad is not None and not p.grad.is_sparse and p.grad.numel() > 0 and id(p) not in seen
            ]
        else:
            # The same tensors, in the same order, on every rank, whatever its shards hold: the counts are summed.
            parameters = [p for p in stepped if id(p) not in seen]
        if not parameters:
            return
        with torch.no_grad():
            grads = [
                local_shard(p.grad) if p.grad is not None else torch.zeros_like(local_shard(p)) for p in parameters
            ]
            # x - 0.0 is x (-0.0 included): a copy of a whole list in one op, where allocating each destination for
            # a copy would cost one op per tensor.
            grad_signs = list(torch._foreach_sub(grads, 0.0))
            torch._foreach_sign_(grad_signs)
            weights_before = list(torch._foreach_sub([local_shard(p) for p in parameters], 0.0))
        self._snapshots.append(_Snapshot(parameters, weights_before, grad_signs))

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: STEP_OUTPUT,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if not self._sampling:
            host_reads(trainer).submit(trainer, self)
            return
        self._remove_hooks()
        if not self._snapshots and only_accumulates(trainer, batch_idx):
            # Accumulating gradients: one micro-batch's activations are enough; the step comes on a later batch.
            host_reads(trainer).submit(trainer, self)
            return
        self._sampling = False
        maxima, self._activation_maxima = self._activation_maxima, []
        snapshots, self._snapshots = self._snapshots, []
        parameters = [p for snapshot in snapshots for p in snapshot.parameters]
        device_values = [torch.stack([value for _, value in maxima])] if maxima else []
        if snapshots:
            device_values.append(_update_counts(snapshots))
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
                host_reads(trainer).submit(trainer, self)
                return
        if not device_values:
            host_reads(trainer).submit(trainer, self)
            return
        step = logging_step(trainer, finished_batch=batch_idx)
        layers = [layer for layer, _ in maxima]
        names = _parameter_names(trainer, pl_module)
        parameter_layers = [_layer_of(names.get(id(p), "unnamed")) for p in parameters]
        plugin = trainer.precision_plugin
        skipped = (
            plugin.stats.skipped_steps > self._skipped_before
            if isinstance(plugin, MixedPrecision) and self._skipped_before is not None
            else None
        )
        # The parameter dtypes are known on the host; collect them now, before an opt level can swap tensors.
        parameter_half = {_HALF_NAMES[p.dtype] for p in pl_module.parameters() if p.dtype in _HALF_NAMES}

        def consume(values: list[float]) -> None:
            sample = _Sample(step)
            for layer, value in zip(layers, values, strict=False):
                sample.headroom[layer] = min(sample.headroom.get(layer, math.inf), headroom_log2(value))
            # The counts are [with a gradient, per tensor..., moved, per tensor...].
            counts = [count / held_by for count, held_by in zip(values[len(layers) :], copies + copies, strict=True)]
            if counts:
                _per_layer_shares(sample, parameter_layers, sizes, counts, skipped)
            self._record(trainer, pl_module, sample, parameter_half)

        host_reads(trainer).submit(trainer, self, torch.cat([v.reshape(-1).float() for v in device_values]), consume)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(self.samples) > self._samples_drawn:
            self._draw(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._remove_hooks()
        self._snapshots, self._activation_maxima, self._sampling = [], [], False

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove_hooks()
        self._snapshots, self._activation_maxima, self._sampling = [], [], False
        host_reads(trainer).leave(self)

    # ------------------------------------------------------------------------------------------------ rules

    def _record(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, sample: _Sample, parameter_half: set[str]
    ) -> None:
        self.samples.append(sample)
        findings: list[Finding | None] = list(misconfigurations(self._facts(trainer, pl_module, parameter_half)))
        if sample.stale:
            findings.append(stale_update_finding(sample.stale, self.stale_update_share))
        if "float16" in self._output_dtypes | parameter_half and sample.headroom:
            findings.append(overflow_risk_finding(sample.headroom, self.headroom_log2))
        zero_share = sample.underflow.get(_ALL_LAYERS)
        if zero_share is not None:
            findings.append(self._underflow(trainer, zero_share))
            self._lowest_zero_share = min(self._lowest_zero_share, zero_share)
        for finding in findings:
            self._warn(finding)
        log_scalars(trainer, _summary_scalars(sample), step=sample.step)
        if len(self.samples) - self._samples_drawn >= self.heatmap_every_n_samples:
            self._draw(trainer)

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

    def _facts(self, trainer: pl.Trainer, pl_module: pl.LightningModule, parameter_half: set[str]) -> RunFacts:
        plugin = trainer.precision_plugin
        precision = str(getattr(plugin, "precision", ""))
        autocast_device = getattr(plugin, "device", None) if precision.endswith("-mixed") else None
        plugin_mixed = precision.endswith("-mixed")
        if isinstance(plugin, MixedPrecision):
            uses_autocast = plugin.policy is not None and plugin.policy.uses_autocast and plugin.half_dtype is not None
            plugin_mixed = uses_autocast
            autocast_device = plugin.device if uses_autocast else None
            scaler_active = plugin.scaler is not None
        else:
            scaler = getattr(plugin, "scaler", None)
            scaler_active = scaler is not None and (not hasattr(scaler, "is_enabled") or scaler.is_enabled())
        return RunFacts(
            model_device=pl_module.device.type,
            autocast_device=autocast_device if isinstance(autocast_device, str) else None,
            half_dtypes=frozenset(self._output_dtypes | parameter_half),
            plugin_mixed=plugin_mixed,
            scaler_active=scaler_active,
            outputs_seen=bool(self.samples and self.samples[-1].headroom),
        )

    def _warn(self, finding: Finding | None) -> None:
        if finding is None or finding.kind in self.warned:
            return
        self.warned.add(finding.kind)
        rank_zero_warn(f"PrecisionSentinel [{finding.kind}]: {finding.message}", category=RuntimeWarning)

    # ------------------------------------------------------------------------------------------------ plumbing

    def _activation_recorder(self, layer: str) -> Any:
        def hook(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            tensor = _first_floating_tensor(output)
            if tensor is None or tensor.numel() == 0:
                return
            if tensor.dtype in _HALF_NAMES:
                self._output_dtypes.add(_HALF_NAMES[tensor.dtype])
            with torch.no_grad():
                largest = torch.linalg.vector_norm(tensor, ord=math.inf, dtype=torch.float32)
            self._activation_maxima.append((layer, largest))

        return hook

    def _draw(self, trainer: pl.Trainer) -> None:
        self._samples_drawn = len(self.samples)
        writers = tensorboard_writers(trainer) if self.log_heatmaps else []
        if not writers:
            return
        steps = [sample.step for sample in self.samples]
        for tag, (attribute, style) in HEATMAP_TAGS.items():
            layers = list(dict.fromkeys(layer for s in self.samples for layer in getattr(s, attribute)))
            layers = [layer for layer in layers if layer != _ALL_LAYERS]
            if not layers:
                continue
            values = [[getattr(s, attribute).get(layer, math.nan) for s in self.samples] for layer in layers]
            image = render_heatmap(style, layers, steps, values)
            for writer in writers:
                writer.add_image(tag, image, global_step=steps[-1], dataformats="HWC")
                writer.flush()

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


_ALL_LAYERS = "(all layers)"


def _update_counts(snapshots: list[_Snapshot]) -> torch.Tensor:
    """Per stepped tensor: elements with a non-zero gradient, then those of them whose weight moved; one vector."""
    with torch.no_grad():
        parameters = [local_shard(p) for snapshot in snapshots for p in snapshot.parameters]
        before = [w for snapshot in snapshots for w in snapshot.weights_before]
        grad_signs = [s for snapshot in snapshots for s in snapshot.grad_signs]
        moved = torch._foreach_sub(parameters, before)
        # The update's sign, not the update, is multiplied: an update that overflowed to inf, times a zero gradient
        # sign, must count 0, where inf * 0 would be NaN and count 1.
        torch._foreach_sign_(moved)
        torch._foreach_mul_(moved, grad_signs)
        with_gradient = torch._foreach_norm(grad_signs, 0)
        with_gradient_and_moved = torch._foreach_norm(moved, 0)
        return torch.stack([*with_gradient, *with_gradient_and_moved]).float()


def _per_layer_shares(
    sample: _Sample, layers: list[str], sizes: list[int], counts: list[float], skipped: bool | None
) -> None:
    """Fill the underflow and stale shares per layer from the per-tensor counts; a skipped step gives no stale share.

    ``skipped`` is None where the plugin does not say; a step on which no element moved is then taken as skipped.
    """
    tensors = len(layers)
    with_gradient, moved = counts[:tensors], counts[tensors : 2 * tensors]
    if skipped is None:
        skipped = sum(moved) == 0
    totals: dict[str, list[float]] = {}
    for layer, size, active, changed in zip(layers, sizes, with_gradient, moved, strict=True):
        total = totals.setdefault(layer, [0.0, 0.0, 0.0])
        total[0] += size
        total[1] += active
        total[2] += changed
    for layer, (elements, active, changed) in totals.items():
        sample.underflow[layer] = 1.0 - active / elements
        if not skipped and active > 0:
            sample.stale[layer] = (active - changed) / active
    sample.underflow[_ALL_LAYERS] = 1.0 - sum(with_gradient) / sum(sizes)


def _summary_scalars(sample: _Sample) -> dict[str, float]:
    scalars = {}
    finite_headroom = [value for value in sample.headroom.values() if math.isfinite(value)]
    if finite_headroom:
        scalars["precision_sentinel/min_activation_headroom_log2"] = min(finite_headroom)
    if _ALL_LAYERS in sample.underflow:
        scalars["precision_sentinel/total_grad_underflow_share"] = sample.underflow[_ALL_LAYERS]
    if sample.stale:
        scalars["precision_sentinel/max_stale_update_share"] = max(sample.stale.values())
    return scalars


def _parameter_names(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[int, str]:
    """``id(tensor) -> name`` for the stepped tensors, named as the model names them (the policy may add names)."""
    policy = getattr(trainer.precision_plugin, "policy", None)
    names = {id(parameter): name for name, parameter in pl_module.named_parameters()}
    if policy is not None:
        names.update(policy.parameter_names(pl_module))
    return names


def _layer_of(parameter_name: str) -> str:
    return parameter_name.rsplit(".", 1)[0] if "." in parameter_name else parameter_name


def _first_floating_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.is_floating_point() else None
    if isinstance(output, (list, tuple)):
        for item in output:
            found = _first_floating_tensor(item)
            if found is not None:
                return found
    return None


def _is_zero(learning_rate: object) -> bool:
    # A tensor learning rate is not read: that would synchronise. Treat it as non-zero.
    return isinstance(learning_rate, (int, float)) and learning_rate == 0


def _validate_in_range(name: str, value: object, low: float, high: float) -> float:
    number = plain_scalar(value)
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not low < number <= high:
        raise ValueError(f"`{name}` must be a number in ({low:g}, {high:g}], got {value!r}.")
    return float(number)
