"""Gradient inspection shared by the scaler's error messages and the telemetry callbacks.

:func:`nonfinite_gradients` reads each gradient (one sync per tensor) and is meant for rare paths such as an error
message. The telemetry uses the batched functions: :func:`gradient_summary` turns all gradients into one device vector
with a fixed number of ops, and :func:`largest_magnitudes` takes ``max |g|`` of every gradient in one op. Where each
rank holds only parts of the gradients (FSDP, FSDP2, tensor parallelism), :func:`summary_over_shards` combines the
ranks' summaries into the summary of the whole gradients, the one the same run under DDP gives, counting a tensor that
several ranks hold whole only once.

Private names: :mod:`lightning_mp._private_names` lists them, with the reason for each.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from lightning_mp.scaling.sharded import local_shard


def nonfinite_gradients(
    named_parameters: Iterable[tuple[str, torch.Tensor]], limit: int = 20
) -> list[tuple[str, tuple[int, ...]]]:
    """Name the parameters whose gradient holds an inf or a NaN.

    This reads every gradient and synchronises with the device, so call it on rare paths only (a skipped step,
    an error), never on every step.

    Args:
        named_parameters: ``(name, parameter)`` pairs, as from ``module.named_parameters()``.
        limit: at most this many names are returned, in the order given.

    Returns:
        ``(name, shape)`` for each parameter whose ``.grad`` is not all finite.

    Example:
        >>> layer = torch.nn.Linear(2, 1)
        >>> layer(torch.ones(1, 2)).sum().backward()
        >>> layer.bias.grad[0] = float("inf")
        >>> nonfinite_gradients(layer.named_parameters())
        [('bias', (1,))]

    """
    found: list[tuple[str, tuple[int, ...]]] = []
    with torch.no_grad():
        for name, parameter in named_parameters:
            grad = parameter.grad
            if grad is None:
                continue
            values = grad.coalesce().values() if grad.is_sparse else local_shard(grad)
            if not bool(torch.isfinite(values).all()):
                found.append((name, tuple(parameter.shape)))
                if len(found) >= limit:
                    break
    return found


LOG2_HISTOGRAM_RANGE = (-150, 128)
"""Exponent range of the gradient histogram: every finite non-zero float32 magnitude, subnormals included."""

SUMMARY_FIELDS = ("norm", "nonzero", "largest")
"""The scalars at the head of :func:`gradient_summary`'s vector, in order; the histogram counts follow."""


def gradient_summary(grads: list[torch.Tensor], log2_shift: float = 0.0) -> torch.Tensor:
    """Global statistics of a list of gradients, as one device vector to be read back in a single transfer.

    All gradients are concatenated into one flat float32 vector (one ``view`` per tensor and one ``cat``), and every
    statistic is then one op over that vector, so the cost does not grow with the number of parameters beyond the
    views: the 2-norm, the count of non-zero elements, the largest magnitude, and a histogram of
    ``log2 |g| + log2_shift`` with one bin per power of two over :data:`LOG2_HISTOGRAM_RANGE`. ``torch.histc``
    ignores values outside its range, which drops exactly the zeros (``log2 0 = -inf``) and the infs and NaNs.

    Args:
        grads: dense gradients of any floating dtype; gradients on other devices are first copied to the first one's.
        log2_shift: added to every exponent before binning, e.g. ``log2(loss_scale)`` to show the scaled gradients.

    Returns:
        A float32 vector: ``norm, nonzero, largest``, then ``LOG2_HISTOGRAM_RANGE[1] - LOG2_HISTOGRAM_RANGE[0]``
        counts, bin ``i`` holding the elements with exponent in ``[low + i, low + i + 1)``.

    Example:
        >>> summary = gradient_summary([torch.tensor([0.0, 1.0]), torch.tensor([[3.0, 4.0]])])
        >>> [round(value, 4) for value in summary[:3].tolist()]
        [5.099, 3.0, 4.0]

    """
    low, high = LOG2_HISTOGRAM_RANGE
    device = grads[0].device
    if any(grad.device != device for grad in grads):
        grads = [grad.to(device) for grad in grads]
    with torch.no_grad():
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        if flat.dtype != torch.float32:
            flat = flat.float()
        flat.abs_()
        counts = torch.histc(torch.log2(flat), bins=high - low, min=low - log2_shift, max=high - log2_shift)
        head = torch.stack([torch.linalg.vector_norm(flat), torch.count_nonzero(flat).float(), flat.max()])
        return torch.cat([head, counts])


def summary_over_shards(
    shards: Sequence[torch.Tensor], copies: Sequence[int], device: torch.device, log2_shift: float = 0.0
) -> torch.Tensor:
    """The :func:`gradient_summary` of the whole gradients, from the parts of them that this rank holds.

    Squared norms, non-zero counts, histogram counts and element counts add up over the ranks, but a tensor whose
    local part ``c`` ranks hold (its ``copies``) would count ``c`` times. So each rank weights its sums of such shards
    by ``L / c``, ``L`` being the least common multiple of all the copies, and one division by ``L`` after the
    all-reduce counts every element once; the counts stay whole numbers until then, exact in float32. The shards are
    summarised in one group per number of copies: one group under FSDP, two under tensor parallelism with replicated
    parameters. The largest magnitude is the ranks' maximum. Two all-reduces on the device, no host sync.

    Every rank must call it, in the same order, with the same tensors (by position) and so the same ``copies``,
    whatever its shards hold: an empty shard, or none at all, contributes zeros.

    Args:
        shards: this rank's local part of each gradient (``local_shard``), possibly empty.
        copies: for each shard, how many ranks hold the same part (1 under FSDP's full sharding).
        device: where the summary is built when this rank holds no element at all.
        log2_shift: as in :func:`gradient_summary`.

    Returns:
        The summary of the whole gradients, with their number of elements appended as one more float.

    """
    head = len(SUMMARY_FIELDS)
    common = math.lcm(*copies)
    by_copies: dict[int, list[torch.Tensor]] = {}
    for shard, held_by in zip(shards, copies, strict=True):
        if shard.numel():
            by_copies.setdefault(held_by, []).append(shard)
    # One row per group (squared norm, non-zero count, histogram counts, elements) and its largest magnitude, after
    # a row of zeros: what a rank holding no element at all contributes.
    sums = [torch.zeros(head + LOG2_HISTOGRAM_RANGE[1] - LOG2_HISTOGRAM_RANGE[0], device=device)]
    largest = [torch.zeros(1, device=device)]
    for held_by, group in by_copies.items():
        summary = gradient_summary(group, log2_shift)
        elements = torch.full((1,), float(sum(shard.numel() for shard in group)), device=summary.device)
        group_sums = torch.cat([summary[:1].square(), summary[1:2], summary[head:], elements])
        sums.append(group_sums if held_by == common else group_sums * (common // held_by))
        largest.append(summary[2:3])
    summed = torch.stack(sums).sum(dim=0)
    peak = torch.stack(largest).amax(dim=0)
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    summed = summed / common
    return torch.cat([summed[:1].sqrt(), summed[1:2], peak, summed[2:]])


def largest_magnitudes(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """``max |g|`` of each gradient, in one batched op and without a synchronisation.

    A gradient holding an inf gives inf and one holding a NaN gives NaN, so a non-finite result names a gradient that
    is not finite. Keep the result on the device and read it (``torch.stack(...).tolist()``) only when needed. An empty
    gradient (a zero-element parameter) gives 0: torch's inf-norm has no value for an empty tensor and refuses it. A
    sharded gradient (``DTensor``) gives the largest magnitude of this rank's shard.
    """
    grads = [local_shard(grad) for grad in grads]
    with torch.no_grad():
        filled = [grad for grad in grads if grad.numel()]
        norms = iter(torch._foreach_norm(filled, float("inf")) if filled else ())
        return [next(norms) if grad.numel() else grad.new_zeros(()) for grad in grads]
