"""Gradient Health Monitor
=======================

Logs what mixed precision does to the gradients, and names the parameters behind every overflow.

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

**Overflow forensics.** On every skipped step a TensorBoard text entry under ``precision/overflow`` names the
parameters whose gradients are not finite (at most 20, with their shapes) and the step, and a warning says the
same every ``warn_every_n_skips`` skips. Under DDP the names are the union over the ranks.

**Cost.** The statistics are computed on logging steps only, in one pass over the gradients and one transfer to
the host. The forensics run on skipped steps only. Other steps cost nothing.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mp._gradients import nonfinite_gradients
from lightning_mp.callbacks._logging import (
    log_scalars,
    log_text,
    logging_step,
    require_logger,
    require_mixed_precision,
    should_log,
    tensorboard_writers,
    validate_positive_int,
)

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

_MAX_REPORTED_PARAMETERS = 20
_FP16_MAX = torch.finfo(torch.float16).max
_HISTOGRAM_LOG2_RANGE = (-64, 32)


class GradientHealthMonitor(Callback):
    r"""Log the true gradient norm, the underflow share, the fp16 headroom, and name the parameters that overflow.

    **Logged metrics** (at the trainer's logging step, every ``log_every_n_steps``):

    - ``precision/grad_norm``: global 2-norm of all gradients after unscaling.
    - ``precision/grad_zero_fraction``: share of gradient elements that are exactly zero, in [0, 1].
    - ``precision/grad_headroom_log2``: ``log2(65504 / max |scaled gradient|)``, fp16 only.
    - ``precision/grad_log2_magnitude`` (TensorBoard histogram): ``log2 |scaled gradient|`` of the non-zero finite
      elements, clamped to [-64, 32].
    - ``precision/overflow`` (TensorBoard text): on every skipped step, the parameters with inf or NaN gradients.

    The scalars are read in ``on_before_optimizer_step``, after the plugin has unscaled the gradients. On a step
    whose gradients are not finite the scalars are not logged (the overflow entry reports that step instead), so
    the charts stay readable. Under DDP the gradients are already averaged across ranks at that point, so the
    scalars describe the global gradient.

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
        if not isinstance(log_histogram, bool):
            raise ValueError(f"`log_histogram` must be True or False, got {log_histogram!r}.")
        self.log_histogram = log_histogram
        self._seen_skipped_steps = 0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        require_logger(trainer, type(self).__name__)
        require_mixed_precision(trainer, type(self).__name__)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._seen_skipped_steps = require_mixed_precision(trainer, type(self).__name__).stats.skipped_steps

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if not should_log(trainer):
            return
        plugin = require_mixed_precision(trainer, type(self).__name__)
        grads = [
            p.grad.coalesce().values() if p.grad.is_sparse else p.grad
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None and p.grad.numel() > 0
        ]
        if not grads:
            return
        total_norm, zero_fraction, largest = _gradient_summary(grads)
        if not math.isfinite(total_norm):
            return
        loss_scale = plugin.stats.loss_scale if plugin.scaler is not None else 1.0
        # A fused optimizer unscales inside its own step, so its gradients still carry the scale here.
        scale_in_grads = loss_scale if _optimizer_handles_unscaling(optimizer) else 1.0
        metrics = {"precision/grad_norm": total_norm / scale_in_grads, "precision/grad_zero_fraction": zero_fraction}
        if plugin.half_dtype == torch.float16 and largest > 0:
            largest_scaled = largest * loss_scale / scale_in_grads
            metrics["precision/grad_headroom_log2"] = math.log2(_FP16_MAX / largest_scaled)
        step = logging_step(trainer)
        log_scalars(trainer, metrics, step=step)
        writers = tensorboard_writers(trainer) if self.log_histogram else []
        if writers:
            _log_magnitude_histogram(writers, grads, loss_scale / scale_in_grads, step)

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: STEP_OUTPUT,
        batch: Any,
        batch_idx: int,
    ) -> None:
        stats = require_mixed_precision(trainer, type(self).__name__).stats
        if stats.skipped_steps <= self._seen_skipped_steps:
            return
        first_new_skip = self._seen_skipped_steps + 1
        self._seen_skipped_steps = stats.skipped_steps

        # Skips are identical on every rank, so every rank reaches this collective together.
        local = nonfinite_gradients(_stepped_parameters(trainer, pl_module), _MAX_REPORTED_PARAMETERS)
        names = _union_over_ranks(trainer, local)
        step = logging_step(trainer)
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


def _gradient_summary(grads: list[torch.Tensor]) -> tuple[float, float, float]:
    """Global 2-norm, share of exact zeros and largest magnitude, read back in a single transfer."""
    with torch.no_grad():
        device = grads[0].device
        norms = torch.stack([torch.linalg.vector_norm(g.float()).to(device) for g in grads])
        zeros = torch.stack([(g == 0).sum().to(device) for g in grads]).sum()
        largest = torch.stack([g.abs().max().float().to(device) for g in grads if g.numel() > 0]).max()
        elements = sum(g.numel() for g in grads)
        total_norm, zero_count, largest_value = torch.stack(
            [torch.linalg.vector_norm(norms), zeros.float(), largest]
        ).tolist()
    return total_norm, zero_count / elements, largest_value


def _log_magnitude_histogram(writers: list[SummaryWriter], grads: list[torch.Tensor], scale: float, step: int) -> None:
    """Histogram of ``log2 |grad * scale|`` over the non-zero finite elements, binned on the device, one transfer."""
    low, high = _HISTOGRAM_LOG2_RANGE
    shift = math.log2(scale)
    with torch.no_grad():
        device = grads[0].device
        counts = torch.zeros(high - low, dtype=torch.float64, device=device)
        # Masks instead of boolean indexing, which would synchronise with the device once per tensor.
        summaries = []
        for grad in grads:
            magnitudes = grad.detach().abs().double().flatten().to(device)
            valid = (magnitudes > 0) & torch.isfinite(magnitudes)
            exponents = torch.where(valid, torch.log2(magnitudes) + shift, 0.0).clamp_(low, high)
            bins = (exponents - low).long().clamp_(0, high - low - 1)
            counts.scatter_add_(0, bins, valid.double())
            summaries.append(
                torch.stack(
                    [
                        valid.sum().double(),
                        exponents.mul(valid).sum(),
                        exponents.square().mul(valid).sum(),
                        torch.where(valid, exponents, float(low)).max(),
                        torch.where(valid, exponents, float(high)).min(),
                    ]
                )
            )
        stacked = torch.stack(summaries)
        summary = torch.cat(
            [stacked[:, :3].sum(0), stacked[:, 3].max().reshape(1), stacked[:, 4].min().reshape(1), counts]
        ).tolist()
    number, total, total_squares, largest, least = summary[:5]
    bucket_counts = summary[5:]
    if number == 0:
        return
    for writer in writers:
        writer.add_histogram_raw(
            "precision/grad_log2_magnitude",
            min=least,
            max=largest,
            num=int(number),
            sum=total,
            sum_squares=total_squares,
            bucket_limits=[float(limit) for limit in range(low + 1, high + 1)],
            bucket_counts=bucket_counts,
            global_step=step,
        )


def _stepped_parameters(trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[tuple[str, torch.Tensor]]:
    """The tensors the optimizers step, named as the model names them, then any model parameter not among them.

    Under opt level O2 the optimizers step fp32 masters, which hold the gradients at this point; the policy knows
    which model parameter each master stands for.
    """
    plugin = trainer.precision_plugin
    policy = getattr(plugin, "policy", None)
    names_by_id = (
        policy.parameter_names(pl_module)
        if policy is not None
        else {id(parameter): name for name, parameter in pl_module.named_parameters()}
    )
    named: dict[str, torch.Tensor] = {}
    for index, optimizer in enumerate(trainer.optimizers):
        for group_index, group in enumerate(optimizer.param_groups):
            for position, parameter in enumerate(group["params"]):
                fallback = f"optimizers[{index}].param_groups[{group_index}][{position}]"
                named.setdefault(names_by_id.get(id(parameter), fallback), parameter)
    for name, parameter in pl_module.named_parameters():
        named.setdefault(name, parameter)
    return list(named.items())


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
