"""Gradient inspection shared by the scaler's error messages and the telemetry callbacks."""

from __future__ import annotations

from collections.abc import Iterable

import torch


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
            values = grad.coalesce().values() if grad.is_sparse else grad
            if not bool(torch.isfinite(values).all()):
                found.append((name, tuple(parameter.shape)))
                if len(found) >= limit:
                    break
    return found
