"""fp16's range check: a master parameter beyond 65504 would make its fp16 model parameter inf.

Such a weight would make every gradient non-finite and every step skipped, with nothing naming the cause. O2 in fp16
therefore checks the chosen master parameters when it converts the model, and every master after a skipped step,
and refuses the ones out of range by name (:class:`HalfOverflowError`). bf16 has fp32's range: nothing to check.

.. warning:: The check reads values back to the host (a synchronisation on CUDA): once at setup and once after each
    skipped step. Clean steps are not checked; a weight that outgrows fp16 makes its model parameter inf, the
    gradients non-finite and the step skipped, and that skip names it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


class HalfOverflowError(RuntimeError):
    """fp32 weights beyond the half type's range: their half model parameters would be inf, and every step skipped.

    Args:
        names: qualified names of the parameters.
        largest: the largest magnitude found in each.
        dtype: the half type.

    """

    def __init__(self, names: Sequence[str], largest: Sequence[float], dtype: torch.dtype) -> None:
        self.names = list(names)
        limit = torch.finfo(dtype).max
        shown = ", ".join(f"{name} (max |w| = {value:.4g})" for name, value in zip(names, largest, strict=True))
        super().__init__(
            f"lightning_mp O2: weights beyond {dtype}'s largest value {limit:g} cannot be copied to {dtype} without"
            f" becoming inf: {shown}. Train in bf16 (precision='bf16-mixed'), which has fp32's range, keep these"
            " modules in fp32 (keep_fp32=[...]), or bring the weights into range (weight decay, a smaller init)."
        )


def overflowing_weights(named: Sequence[tuple[str, Tensor]], dtype: torch.dtype) -> tuple[list[str], list[float]]:
    """The names and largest magnitudes of the tensors whose values exceed ``dtype``'s range.

    .. warning:: Reads one value per call back to the host (a synchronisation on CUDA).
    """
    if not named:
        return [], []
    largest = torch.stack([tensor.detach().abs().amax().float() for _, tensor in named]).tolist()
    limit = torch.finfo(dtype).max
    hits = [(name, value) for (name, _), value in zip(named, largest, strict=True) if value > limit]
    return [name for name, _ in hits], [value for _, value in hits]


def check_range(named: Sequence[tuple[str, Tensor]], half_dtype: torch.dtype | None) -> None:
    """Refuse the tensors beyond fp16's range by name; nothing to check for another type.

    Raises:
        HalfOverflowError: if ``half_dtype`` is fp16 and a tensor exceeds its range.

    """
    if half_dtype != torch.float16:
        return
    names, largest = overflowing_weights(named, torch.float16)
    if names:
        raise HalfOverflowError(names, largest, torch.float16)
