"""Stochastic rounding of fp32 values to bf16, and the share of updates a rounding loses.

Why rounding matters. A bf16 number has 8 significant bits: next to a weight of 1.0, the smallest change that a
round-to-nearest cast keeps is ``2**-8``. An Adam step of ``lr=1e-3`` on such a weight rounds back to the old value,
every time: the update is lost, and training in pure bf16 (Lightning's ``bf16-true``) stalls where fp32 keeps
learning. **Stochastic rounding** rounds ``x`` up with probability equal to its distance from the lower neighbour,
measured in units of the gap: ``E[round(x)] = x``. A tiny update then moves the weight by one bf16 step once in a
while, and on average by exactly the update, so nothing is lost in expectation. :func:`stale_update_share` measures
what a rounding loses: the share of elements an update meant to change that kept their stored value.

The rounding in bits. Viewed as an int32, an fp32 number is its bf16 truncation in the high 16 bits and the
remainder in the low 16. Adding a uniform random integer in ``[0, 2**16)`` to the int32 view carries into the high
bits with probability ``remainder / 2**16``; masking the low 16 bits then leaves exactly a bf16 value, which a cast
keeps unchanged. Negative numbers work the same on their magnitude, zero stays zero, and a carry into the exponent
is the correct next representable number. That is three tensor ops (``randint``, ``add_``, ``bitwise_and_``) for
any number of values::

    bits = fp32.view(torch.int32); bits.add_(noise_0_to_65535); bits.bitwise_and_(-65536); bf16.copy_(fp32)
"""

from __future__ import annotations

import torch
from torch import Tensor

_LOW_BITS_MASK = -(1 << 16)


def stochastic_round_(values: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Round fp32 ``values`` in place to bf16-representable values, up with probability of the distance below.

    Afterwards ``values.to(torch.bfloat16)`` is exact, and ``E[values]`` equals the values before the call.

    Args:
        values: a contiguous fp32 tensor; finite values.
        generator: the random generator to draw from; None uses torch's default generator.

    Returns:
        ``values``, rounded.

    Raises:
        TypeError: if ``values`` is not fp32.

    Example:
        >>> x = torch.full((100_000,), 1.0 + 2.0**-10)
        >>> _ = stochastic_round_(x, torch.Generator().manual_seed(0))
        >>> sorted(set(x.tolist())) == [1.0, 1.0 + 2.0**-7]
        True
        >>> abs(x.mean().item() - (1.0 + 2.0**-10)) < 1e-4
        True

    """
    if values.dtype is not torch.float32:
        raise TypeError(f"stochastic_round_(values) needs an fp32 tensor, got dtype={values.dtype}.")
    bits = values.view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device, generator=generator)
    return bits.add_(noise).bitwise_and_(_LOW_BITS_MASK).view(torch.float32)


def stale_update_share(before: Tensor, after: Tensor, intended: Tensor) -> float:
    """The share of elements that an update meant to change but that kept their stored value.

    Round-to-nearest loses every update smaller than half a bf16 gap, so its share is high; stochastic rounding
    keeps the updates' expected value, and its share falls as the updates grow relative to the gap.

    Args:
        before: the stored values before the update.
        after: the stored values after the update; same shape.
        intended: the update that was meant (``after - before`` in exact arithmetic); same shape.

    Returns:
        ``#(intended != 0 and after == before) / #(intended != 0)``; 0.0 when no element was meant to change.

    .. warning:: Returns a Python float: on an accelerator this synchronises with the device.

    Example:
        >>> before = torch.ones(4, dtype=torch.bfloat16)
        >>> stale_update_share(before, before + torch.tensor([1.0, 0, 0, 0]), torch.full((4,), 1e-3))
        0.75

    """
    meant = intended != 0
    total = int(meant.sum())
    if total == 0:
        return 0.0
    return int((meant & (after == before)).sum()) / total


__all__ = ["stale_update_share", "stochastic_round_"]
