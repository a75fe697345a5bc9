"""Logs what mixed precision does to the gradients, and names the parameters behind every overflow.

Half precision has a narrow range. fp16's largest finite value is 65504 and its smallest subnormal is about 6e-8;
bf16 reaches as far as fp32 but keeps only 8 bits of mantissa. Gradients leave that range in two ways:

- **Underflow**: small gradients round to exactly zero and the weights they belong to stop learning. The share
  of gradient elements that are exactly zero (``precision/grad_zero_fraction``) rises when it happens.
- **Overflow**: large scaled gradients become inf, and the step is skipped. The headroom
  (``precision/grad_headroom_log2``) is ``log2(65504 / max |scaled gradient|)``, how many doublings of the loss
  scale are left before the largest parameter gradient overflows; it nears zero before the skips begin. It is
  logged in fp16 only, the one format with a loss scale. It watches the parameter gradients: an activation
  gradient inside backward can overflow first, so read it as a warning, not a guarantee.

The histogram ``precision/grad_log2_magnitude`` (TensorBoard only) shows where the gradient elements sit on the
exponent axis, as backward produced them, so multiplied by the loss scale in fp16. fp16 holds exponents from -24
(subnormals) to just under 16: mass piling up at the left edge of that window means underflow, at the right edge,
overflow. Raising the loss scale shifts the whole histogram right by log2 of the factor.

``precision/grad_norm`` is the global 2-norm of the gradients after unscaling, the true norm the optimizer sees,
which is what gradient clipping thresholds are compared with.

**Under FSDP** (Lightning's ``FSDPStrategy``, sharded), **FSDP2** (``fully_shard``: ``DTensor`` gradients) and
**tensor parallelism** (``parallelize_module``) each rank holds only parts of the gradients, so on a logging step
every rank summarises its parts and two all-reduces combine them
(:func:`lightning_mp.scaling.gradients.summary_over_shards`):
the scalars and the histogram are those of the whole gradients, as under DDP. A tensor that several ranks hold whole
(a ``Replicate()`` DTensor, a plain norm beside tensor-parallel layers) counts once, not once per rank. Overflow
reports name each parameter by its full name, with the shape the model declared, not its shard's.

**Overflow forensics.** On every skipped step a TensorBoard text entry under ``precision/overflow`` names the
parameters whose gradients are not finite (at most 20, with their shapes) and the step, and a warning says the
same every ``warn_every_n_skips`` skips. Under DDP the names are the union over the ranks.

The non-finite parameters are named when the overflow is detected: Lightning calls ``on_before_optimizer_step``
inside the optimizer step, after the plugin has unscaled the gradients and before the step runs or is skipped, in
automatic and in manual optimization alike. There the monitor computes ``max |g|`` of every gradient in one batched
op (``torch._foreach_norm`` with ``ord=inf``) and keeps the result on the device. Whether that step was skipped is
known on the host once the step returns (``plugin.stats``); only then, and only for a skipped step, is the vector
read, in one transfer. So the names survive a ``zero_grad`` that follows ``opt.step()`` in manual optimization, and
a clean step never reads anything.

**Cost**, counted with :mod:`lightning_mp.bench.counting`:

- a step that does not log: one op (the batched ``max |g|``), no synchronisation;
- a logging step: one ``view`` per gradient, one ``cat`` into a flat float32 copy, then one op per statistic and
  one ``histc`` for the whole histogram (:func:`lightning_mp.scaling.gradients.gradient_summary`). The resulting vector
  is read at the end of the batch in the one transfer the monitors share (:mod:`lightning_mp.measuring.host_reads`).
  The flat copy holds twice the gradients' size for the duration of the hook;
- a skipped step: one more transfer, of one number per parameter tensor.

Private names: :mod:`lightning_mp._private_names` lists them, with the reason for each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mp.callbacks._plugin_lookup import require_mixed_precision
from lightning_mp.callbacks._sharding import gradient_copies
from lightning_mp.measuring.host_reads import Consumer, host_reads
from lightning_mp.measuring.logging_steps import (
    log_scalars,
    log_text,
    logging_step,
    require_logger,
    should_log,
    tensorboard_writers,
    validate_bool,
    validate_positive_int,
)
from lightning_mp.measuring.monitors import TelemetryCallback
from lightning_mp.scaling.fused_steps import supports_fused_protocol
from lightning_mp.scaling.gradients import (
    LOG2_HISTOGRAM_RANGE,
    SUMMARY_FIELDS,
    gradient_summary,
    largest_magnitudes,
    summary_over_shards,
)
from lightning_mp.scaling.sharded import local_shard

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

_MAX_REPORTED_PARAMETERS = 20
_FP16_MAX = torch.finfo(torch.float16).max


@dataclass
class _Capture:
    """``max |g|`` of each stepped tensor, kept on the device until the step is known to be clean or skipped."""

    parameters: list[torch.Tensor]
    largest: list[torch.Tensor]
    optimizer_steps_before: int


class GradientHealthMonitor(TelemetryCallback):
    r"""Log the true gradient norm, the underflow share, the fp16 headroom, and name the parameters that overflow.

    **Logged metrics** (at the trainer's logging step, every ``log_every_n_steps``):

    - ``precision/grad_norm``: global 2-norm of all gradients after unscaling.
    - ``precision/grad_zero_fraction``: share of gradient elements that are exactly zero, in [0, 1].
    - ``precision/grad_headroom_log2``: ``log2(65504 / max |scaled gradient|)``, fp16 only.
    - ``precision/grad_log2_magnitude`` (TensorBoard histogram): ``log2 |scaled gradient|`` of the non-zero finite
      elements, one bucket per power of two.
    - ``precision/overflow`` (TensorBoard text): on every skipped step, the parameters with inf or NaN gradients.

    The scalars are read in ``on_before_optimizer_step``, after the plugin has unscaled the gradients. On a step
    whose gradients are not finite the scalars are not logged (the overflow entry reports that step instead), so
    the charts stay readable. Under DDP the gradients are already averaged across ranks at that point, so the
    scalars describe the global gradient.

    .. warning:: A logging step synchronises the host with the device once, to read all the statistics in one
        transfer; a skipped step once more, to name its non-finite parameters. Other steps never synchronise.

    Args:
        warn_every_n_skips: emit a warning naming the non-finite parameters on the first skipped step and then
            once every this many skipped steps.
        log_histogram: write the ``precision/grad_log2_magnitude`` histogram to TensorBoard loggers.

    Raises:
        ValueError: If ``warn_every_n_skips`` is not an integer >= 1, or ``log_histogram`` is not a bool.
        MisconfigurationException:
            If the ``Trainer`` has no logger, or does not use :class:`~lightning_mp.MixedPrecision`.

    Example::

        from lightning import Trainer
        from lightning_mp import MixedPrecision
        from lightning_mp.callbacks import GradientHealthMonitor

        trainer = Trainer(plugins=[MixedPrecision("16-mixed")], callbacks=[GradientHealthMonitor()])

    """

    def __init__(self, warn_every_n_skips: int = 10, log_histogram: bool = True) -> None:
        self.warn_every_n_skips = validate_positive_int("warn_every_n_skips", warn_every_n_skips)
        self.log_histogram = validate_bool("log_histogram", log_histogram)
        self._skips_reported = 0
        self._capture: _Capture | None = None
        self._summary: tuple[torch.Tensor, Consumer] | None = None
        self._declared_shapes: dict[int, tuple[int, ...]] = {}
        """``id(parameter) -> shape`` before the strategy set the model up: FSDP leaves each rank a flat shard."""
        self._declared_names: dict[int, str] = {}
        """``id(parameter) -> name`` before the strategy set the model up: FSDP's nested units prefix the names."""

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._declared_shapes = {id(parameter): tuple(parameter.shape) for parameter in pl_module.parameters()}
        self._declared_names = {id(parameter): name for name, parameter in pl_module.named_parameters()}
        require_logger(trainer, type(self).__name__)
        require_mixed_precision(trainer, type(self).__name__)
        host_reads(trainer).join(self)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._skips_reported = require_mixed_precision(trainer, type(self).__name__).stats.skipped_steps
        self._capture = None

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        plugin = require_mixed_precision(trainer, type(self).__name__)
        # Manual optimization may step several times per batch: settle the previous step before capturing this one.
        self._report_if_skipped(trainer, pl_module)
        parameters = [
            p for group in optimizer.param_groups for p in group["params"] if p.grad is not None and p.grad.numel() > 0
        ]
        dense = [p for p in parameters if not p.grad.is_sparse]
        copies_of = gradient_copies(trainer)
        if parameters:
            self._capture = _Capture(dense, largest_magnitudes([p.grad for p in dense]), plugin.stats.optimizer_steps)
        # Under FSDP every rank summarises its shards, those without any too: the ranks combine their summaries.
        if (
            should_log(trainer)
            and (parameters or copies_of is not None)
            and (trainer.is_global_zero or copies_of is not None)
        ):
            grads = [p.grad.coalesce().values() if p.grad.is_sparse else p.grad for p in parameters]
            copies = None if copies_of is None else [copies_of(p) for p in parameters]
            summary = self._summarise(trainer, grads, optimizer, copies)
            if trainer.is_global_zero:
                self._summary = summary

    @override
    def batch_ended(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_idx: int) -> None:
        self._report_if_skipped(trainer, pl_module, finished_batch=batch_idx)
        summary, self._summary = self._summary, None
        host_reads(trainer).submit(trainer, self, *(summary or (None, None)))

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        host_reads(trainer).leave(self)
        self._summary = self._capture = None

    def _summarise(
        self, trainer: pl.Trainer, grads: list[torch.Tensor], optimizer: Optimizer, copies: list[int] | None
    ) -> tuple[torch.Tensor, Consumer]:
        """The gradient summary on the device, and the function that logs it once it has been read.

        With ``copies`` (FSDP, tensor parallelism: how many ranks hold each gradient's local part, per gradient) the
        ranks' summaries of their shards are combined, a collective that every rank joins.
        """
        plugin = require_mixed_precision(trainer, type(self).__name__)
        loss_scale = plugin.stats.loss_scale if plugin.scaler is not None else 1.0
        # A fused optimizer unscales inside its own step, so its gradients still carry the scale here.
        scale_in_grads = loss_scale if supports_fused_protocol(optimizer) else 1.0
        elements = sum(grad.numel() for grad in grads)
        in_fp16 = plugin.half_dtype == torch.float16
        step = logging_step(trainer)
        writers = tensorboard_writers(trainer) if self.log_histogram else []
        log2_shift = math.log2(loss_scale / scale_in_grads)
        if copies is None:
            summary = gradient_summary(grads, log2_shift=log2_shift)
        else:
            # This rank's part of each gradient (DTensors' local parts); a part can be empty on this rank.
            shards = [local_shard(grad) for grad in grads]
            summary = summary_over_shards(shards, copies, trainer.strategy.root_device, log2_shift)

        def log(values: list[float]) -> None:
            total = elements
            if copies is not None:
                # The combined summary ends with the number of elements of the whole gradients.
                values, total = values[:-1], round(values[-1])
            head = dict(zip(SUMMARY_FIELDS, values, strict=False))
            if not math.isfinite(head["norm"]):
                return
            metrics = {
                "precision/grad_norm": head["norm"] / scale_in_grads,
                "precision/grad_zero_fraction": 1.0 - head["nonzero"] / total,
            }
            if in_fp16 and head["largest"] > 0:
                largest_scaled = head["largest"] * loss_scale / scale_in_grads
                metrics["precision/grad_headroom_log2"] = math.log2(_FP16_MAX / largest_scaled)
            log_scalars(trainer, metrics, step=step)
            if writers:
                _log_magnitude_histogram(writers, values[len(SUMMARY_FIELDS) :], step)

        return summary, log

    def _report_if_skipped(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, finished_batch: int | None = None
    ) -> None:
        stats = require_mixed_precision(trainer, type(self).__name__).stats
        capture = self._capture
        if capture is not None and stats.optimizer_steps > capture.optimizer_steps_before:
            self._capture = None
            if stats.optimizer_steps != capture.optimizer_steps_before + 1 or not stats.last_step_skipped:
                capture = None
        elif capture is not None:
            return
        if stats.skipped_steps <= self._skips_reported:
            return
        first_new_skip = self._skips_reported + 1
        self._skips_reported = stats.skipped_steps

        local = _nonfinite_names(trainer, pl_module, capture, self._declared_names, self._declared_shapes)
        # Skips are identical on every rank, so every rank reaches this collective together.
        names = _union_over_ranks(trainer, local)
        step = logging_step(trainer, finished_batch)
        log_text(trainer, "precision/overflow", _overflow_markdown(step, names, stats.loss_scale), step)

        # Warn on skips 1, 1 + N, 1 + 2N, ...; several skips can land in one batch under manual optimization.
        if any((skip - 1) % self.warn_every_n_skips == 0 for skip in range(first_new_skip, stats.skipped_steps + 1)):
            shown = ", ".join(f"{name} {list(shape)}" for name, shape in names) or "none found"
            rank_zero_warn(
                f"Step {step}: the optimizer step was skipped because gradients were not finite"
                f" ({stats.skipped_steps} skipped so far, loss scale now {stats.loss_scale:g})."
                f" Non-finite gradients: {shown}.",
                category=RuntimeWarning,
            )


def _log_magnitude_histogram(writers: list[SummaryWriter], bucket_counts: list[float], step: int) -> None:
    """Write the power-of-two histogram; min, max, sum and sum of squares are taken from the bucket edges."""
    low, _ = LOG2_HISTOGRAM_RANGE
    filled = [index for index, count in enumerate(bucket_counts) if count > 0]
    if not filled:
        return
    # Buckets are one power of two wide: the centres give the moments to within half a bucket.
    centres = [low + index + 0.5 for index in range(len(bucket_counts))]
    for writer in writers:
        writer.add_histogram_raw(
            "precision/grad_log2_magnitude",
            min=float(low + filled[0]),
            max=float(low + filled[-1] + 1),
            num=int(sum(bucket_counts)),
            sum=sum(count * centre for count, centre in zip(bucket_counts, centres, strict=True)),
            sum_squares=sum(count * centre**2 for count, centre in zip(bucket_counts, centres, strict=True)),
            bucket_limits=[float(low + index + 1) for index in range(len(bucket_counts))],
            bucket_counts=bucket_counts,
            global_step=step,
        )


def _nonfinite_names(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    capture: _Capture | None,
    declared_names: dict[int, str],
    declared_shapes: dict[int, tuple[int, ...]],
) -> list[tuple[str, tuple[int, ...]]]:
    """Name the captured tensors whose largest gradient magnitude was inf or NaN: one transfer for all of them.

    Names and shapes are those the model declared before the strategy set it up, where known (FSDP renames nested
    parameters and leaves each rank a flat shard); the opt level names the tensors it steps in place of them.
    """
    if capture is None or not capture.largest:
        return []
    largest = torch.stack([value.float().to(capture.largest[0].device) for value in capture.largest]).tolist()
    names_by_id = {**_parameter_names(trainer, pl_module), **declared_names}
    found = [
        (
            names_by_id.get(id(parameter), f"parameter {position}"),
            declared_shapes.get(id(parameter), tuple(parameter.shape)),
        )
        for position, (parameter, value) in enumerate(zip(capture.parameters, largest, strict=True))
        if not math.isfinite(value)
    ]
    return found[:_MAX_REPORTED_PARAMETERS]


def _parameter_names(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[int, str]:
    """``id(tensor) -> name`` for the tensors the optimizers step, named as the model names them.

    The opt level's policy gives the names, so that a level whose optimizers step tensors other than the module's
    own parameters can still name them as the model does.
    """
    policy = getattr(trainer.precision_plugin, "policy", None)
    if policy is not None:
        return policy.parameter_names(pl_module)
    return {id(parameter): name for name, parameter in pl_module.named_parameters()}


def _union_over_ranks(
    trainer: pl.Trainer, names: list[tuple[str, tuple[int, ...]]]
) -> list[tuple[str, tuple[int, ...]]]:
    """Merge the non-finite parameters found on each rank, capped at the report limit."""
    if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        gathered: list[list[tuple[str, tuple[int, ...]]] | None] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, names)
        names = [entry for rank_names in gathered for entry in rank_names or []]
    return list(dict.fromkeys(names))[:_MAX_REPORTED_PARAMETERS]


def _overflow_markdown(step: int, names: list[tuple[str, tuple[int, ...]]], loss_scale: float) -> str:
    lines = [
        f"**Step {step}**: optimizer step skipped because gradients were not finite. Loss scale is now {loss_scale:g}.",
        "",
    ]
    if not names:
        lines.append("No parameter gradient was non-finite: the overflow was found by the scaler's check.")
        return "\n".join(lines)
    lines += ["| parameter | shape |", "|---|---|"]
    lines += [f"| `{name}` | {list(shape)} |" for name, shape in names]
    if len(names) == _MAX_REPORTED_PARAMETERS:
        lines += ["", f"At most {_MAX_REPORTED_PARAMETERS} parameters are listed."]
    return "\n".join(lines)
