"""An fp32 value as a bf16 value plus a 16-bit remainder, exactly: the rule behind ``lean-exact`` and O2's bf16 copy.

bf16 is the top half of an fp32 (sign, the same 8 exponent bits, 7 of fp32's 23 mantissa bits). So an fp32 master
``x`` can be stored as the bf16 value ``b`` the model computes with plus the 16 bits that rounding ``x`` to ``b``
dropped, and rebuilt from them exactly. On the int32 bit patterns::

    b = round(x)                  # the model's bf16 weight
    r = bits(x) - (bits(b) << 16)   # the remainder, a signed 16-bit integer
    bits(x) = (bits(b) << 16) + r   # the rebuild, exact

Which rounding. ``r`` fits 16 bits only if every bf16 value is the rounding of exactly ``2**16`` fp32 patterns.
Round-to-nearest-even (torch's ``.to(torch.bfloat16)``) gives an even ``b`` both ties around it, ``2**16 + 1``
patterns, and an odd ``b`` neither, ``2**16 - 1``: an even ``b`` could not tell its two ties apart. Rounding to
nearest with **ties away from zero** gives each ``b`` the patterns from ``bits(b) << 16`` minus ``0x8000`` to plus
``0x7FFF``, exactly ``2**16``, so ``r`` lies in ``[-0x8000, 0x7FFF]``. It differs from round-to-nearest-even only
where ``x`` lies exactly halfway between two bf16 values (one fp32 value in ``2**16``) and ``b`` is then the one away
from zero. :func:`round_to_bf16` computes it as torch's rounding of ``x`` with its lowest bit set: that bit moves a tie
just past halfway, and no other value across it.

Both O2 in bf16 (its masters written into the model) and ``lean-exact`` (:mod:`lightning_mp.policies.lean_exact`)
round with :func:`round_to_bf16`, so the two compute with the same bf16 weights and give the same results, bit for
bit. Sign and magnitude: the rule acts on the bit patterns, so a negative value rounds on its magnitude like a
positive one. An fp32 inf or NaN master is not a trained weight's value; its bf16 copy is NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor


def round_to_bf16(master: Tensor) -> Tensor:
    """``master`` (fp32) rounded to bf16: to nearest, ties away from zero.

    Example:
        >>> tie = torch.tensor([1.0 + 2**-8], dtype=torch.float32)  # halfway between two bf16 values
        >>> round_to_bf16(tie).item(), tie.to(torch.bfloat16).item()
        (1.0078125, 1.0)

    """
    return torch.bitwise_or(master.view(torch.int32), 1).view(torch.float32).to(torch.bfloat16)


WRITE_CHUNK_NUMEL = 1 << 22
"""The most elements one chunk of :func:`write_rounded`, :func:`take_remainders`, :func:`round_into` or
:func:`unpack` holds: each runs a fixed few ops per chunk, whatever the number of tensors in it. Only
:func:`write_rounded` makes a temporary, a chunk's fp32 copy (16 MiB)."""


def dense_flat(tensor: Tensor) -> Tensor | None:
    """A 1-D view of ``tensor``'s elements in memory order, if they fill their span; None for a strided slice.

    Any dense layout qualifies: contiguous, ``channels_last``, transposed.
    """
    if tensor.is_contiguous():
        return tensor.view(-1)
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(tensor.shape, tensor.stride(), strict=True) if sz != 1):
        if stride != expected:
            return None
        expected *= size
    return tensor.as_strided((tensor.numel(),), (1,))


def chunks(sizes: list[int], chunk_numel: int = WRITE_CHUNK_NUMEL) -> list[tuple[int, int]]:
    """``(start, end)`` ranges of ``sizes`` holding at most ``chunk_numel`` elements each (or one larger tensor)."""
    ranges: list[tuple[int, int]] = []
    start = 0
    while start < len(sizes):
        end, numel = start, 0
        while end < len(sizes) and (end == start or numel + sizes[end] <= chunk_numel):
            numel += sizes[end]
            end += 1
        ranges.append((start, end))
        start = end
    return ranges


def write_rounded(targets: list[Tensor], masters: list[Tensor], chunk_numel: int = WRITE_CHUNK_NUMEL) -> None:
    """Write each fp32 ``masters[i]`` into the bf16 ``targets[i]`` (same shape and layout) as :func:`round_to_bf16`.

    Per chunk, the masters are concatenated, their lowest bit set in place, and the pieces cast into the targets in
    one foreach copy. A strided slice is written on its own.
    """
    flat_targets: list[Tensor] = []
    flat_masters: list[Tensor] = []
    for target, master in zip(targets, masters, strict=True):
        if target.is_contiguous() and master.is_contiguous():  # the common case, without a call per weight
            flat_targets.append(target.view(-1))
            flat_masters.append(master.view(-1))
            continue
        flat_target, flat_master = dense_flat(target), dense_flat(master)
        if flat_target is None or flat_master is None or target.stride() != master.stride():
            target.copy_(torch.bitwise_or(master.view(torch.int32), 1).view(torch.float32))
        else:
            flat_targets.append(flat_target)
            flat_masters.append(flat_master)
    sizes = [master.numel() for master in flat_masters]
    for start, end in chunks(sizes, chunk_numel):
        bits = torch.cat(flat_masters[start:end]).view(torch.int32).bitwise_or_(1)
        torch._foreach_copy_(flat_targets[start:end], bits.view(torch.float32).split_with_sizes(sizes[start:end]))


def take_remainders(masters: list[Tensor], chunk_numel: int = WRITE_CHUNK_NUMEL) -> list[Tensor]:
    """The int16 remainder of each fp32 master over its :func:`round_to_bf16`, flat in memory order.

    The remainder ``bits(x) - (bits(round(x)) << 16)`` lies in ``[-0x8000, 0x7FFF]`` and equals ``bits(x)`` modulo
    ``2**16``: it **is** the master's low 16 bits, read as a signed integer. So taking it is one strided copy per
    chunk (the low half of each 32-bit word, little-endian), with no arithmetic and no temporary; the remainders are
    views of one int16 tensor per chunk.
    """
    flat_masters = _flats(masters)
    sizes = [master.numel() for master in flat_masters]
    remainders: list[Tensor] = []
    for start, end in chunks(sizes, chunk_numel):
        total = sum(sizes[start:end])
        buffer = torch.empty(total, dtype=torch.int16, device=flat_masters[start].device)
        pieces = list(buffer.split_with_sizes(sizes[start:end]))
        whole = one_flat(flat_masters[start:end])
        if whole is not None:
            buffer.copy_(low_halves(whole))
        else:
            torch._foreach_copy_(pieces, [low_halves(master) for master in flat_masters[start:end]])
        remainders += pieces
    return remainders


def round_into(weights: list[Tensor], masters: list[Tensor], chunk_numel: int = WRITE_CHUNK_NUMEL) -> None:
    """Write :func:`round_to_bf16` of each fp32 master into its bf16 weight (the same layout), consuming the master.

    Its lowest bit is set in place (one op per chunk), then one foreach copy casts. Take the remainders first
    (:func:`take_remainders`).
    """
    flat_weights, flat_masters = _flats(weights), _flats(masters)
    sizes = [master.numel() for master in flat_masters]
    for start, end in chunks(sizes, chunk_numel):
        whole = one_flat(flat_masters[start:end])
        for tensor in [whole] if whole is not None else flat_masters[start:end]:
            tensor.view(torch.int32).bitwise_or_(1)
        torch._foreach_copy_(flat_weights[start:end], flat_masters[start:end])


def unpack(weights: list[Tensor], remainders: list[Tensor], chunk_numel: int = WRITE_CHUNK_NUMEL) -> list[Tensor]:
    """The fp32 master of each bf16 ``weights[i]`` and flat int16 ``remainders[i]``, exactly, laid out as the weight.

    Per chunk, one foreach copy widens the weights' bits into one int32 tensor and one shift moves them into the high
    halves of its 32-bit words; the masters are views of it. The remainders are added through the halves
    (little-endian), with no temporary: an int32 add of int16 remainders would widen them into one as large as the
    masters. The low halves take the remainders as they are, which is their sum modulo ``2**16``; each high half then
    takes its remainder's sign (``-1`` or ``0``: the low half shifted right by 15 in place, and added), and the low
    halves the remainders again.
    """
    flat_weights = _flats(weights)
    sizes = [weight.numel() for weight in flat_weights]
    masters: list[Tensor] = []
    for start, end in chunks(sizes, chunk_numel):
        bits = torch.empty(sum(sizes[start:end]), dtype=torch.int32, device=flat_weights[start].device)
        pieces = list(bits.split_with_sizes(sizes[start:end]))
        torch._foreach_copy_(pieces, [weight.view(torch.int16) for weight in flat_weights[start:end]])
        bits.bitwise_left_shift_(16)
        halves = bits.view(torch.int16)
        low, high = halves[0::2], halves[1::2]
        chunk_remainders = remainders[start:end]
        whole = one_flat(chunk_remainders)
        if whole is not None:
            low.copy_(whole)
            high.add_(low.bitwise_right_shift_(15))
            low.copy_(whole)
        else:
            lows = [low_halves(piece) for piece in pieces]
            torch._foreach_copy_(lows, chunk_remainders)
            high.add_(low.bitwise_right_shift_(15))
            torch._foreach_copy_(lows, chunk_remainders)
        chunk_weights = weights[start:end]
        values = bits.view(torch.float32).split_with_sizes(sizes[start:end])
        masters += [value.as_strided(w.shape, w.stride()) for value, w in zip(values, chunk_weights, strict=True)]
    return masters


def low_halves(flat: Tensor) -> Tensor:
    """The low 16 bits of each 32-bit element of the 1-D ``flat``, as int16 (a strided view; little-endian)."""
    return flat.view(torch.int16)[0::2]


def one_flat(flats: list[Tensor]) -> Tensor | None:
    """One 1-D view spanning the 1-D ``flats`` when they lie side by side, in order, in one storage; else None."""
    first = flats[0]
    storage, offset, total = first.untyped_storage().data_ptr(), first.storage_offset(), 0
    for flat in flats:
        if flat.untyped_storage().data_ptr() != storage or flat.storage_offset() != offset + total:
            return None
        total += flat.numel()
    return first.as_strided((total,), (1,), offset)


def _flats(tensors: list[Tensor]) -> list[Tensor]:
    # The contiguous case without a Python call per tensor: this runs at every step.
    return [tensor.view(-1) if tensor.is_contiguous() else _flat(tensor) for tensor in tensors]


def _flat(tensor: Tensor) -> Tensor:
    flat = dense_flat(tensor)
    if flat is None:
        raise ValueError(f"A tensor of shape {tuple(tensor.shape)} and strides {tensor.stride()} is a strided slice.")
    return flat


def remainder_of(master: Tensor, weight: Tensor) -> Tensor:
    """The int16 remainder of ``master`` (fp32) over ``weight``, its :func:`round_to_bf16`."""
    high = weight.view(torch.int16).to(torch.int32).bitwise_left_shift_(16)
    return master.view(torch.int32).sub(high).to(torch.int16)


def join(weight: Tensor, remainder: Tensor) -> Tensor:
    """The fp32 master that ``weight`` (bf16) and ``remainder`` (int16) hold, exactly; a new tensor.

    Example:
        >>> master = torch.randn(1000)
        >>> weight = round_to_bf16(master)
        >>> torch.equal(join(weight, remainder_of(master, weight)), master)
        True

    """
    bits = weight.view(torch.int16).to(torch.int32).bitwise_left_shift_(16)
    return bits.add_(remainder).view(torch.float32)


__all__ = [
    "WRITE_CHUNK_NUMEL",
    "chunks",
    "dense_flat",
    "join",
    "low_halves",
    "one_flat",
    "remainder_of",
    "round_into",
    "round_to_bf16",
    "take_remainders",
    "unpack",
    "write_rounded",
]
