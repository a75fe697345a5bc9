"""Where a loss scaler's tensors live, and whether the run spans processes.

A scaler is told the device type of its gradients (``"cpu"``, ``"cuda"``, ...) or picks ``"cuda"`` when it is
available. The type is checked once, when the scaler is built, so that a typo or a missing accelerator fails there
rather than at the first step. Under DDP (a process group of more than one rank) every rank must take the same skip
decision, so the scaler asks :func:`distributed` at each check: a group may be set up after the scaler is built.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_mp.arguments.checks import caller

__all__ = ["checked_device_type", "default_device", "distributed"]


def default_device() -> str:
    """``"cuda"`` where it is available, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def distributed() -> bool:
    """Whether a process group of more than one rank is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def checked_device_type(device: Any) -> str:
    """The device type of ``device`` (a string or a ``torch.device``).

    Raises:
        ValueError: if ``device`` names no device type, or one not available on this machine.

    """
    try:
        device_type = torch.device(device).type
    except (RuntimeError, TypeError):
        raise ValueError(
            f"{caller()}(device={device!r}) is not allowed: device must be a device type such as 'cpu' or 'cuda'."
        ) from None
    backend = getattr(torch, device_type, None)
    available = device_type == "cpu" or (backend is not None and getattr(backend, "is_available", lambda: False)())
    if not available:
        raise ValueError(
            f"{caller()}(device={device!r}) is not available on this machine; use device='cpu', or leave device=None"
            f" to pick {default_device()!r}."
        )
    return device_type
