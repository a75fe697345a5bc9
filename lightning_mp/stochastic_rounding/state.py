"""The rounding's random numbers and their place in a checkpoint: the seed, the generators, the saved state.

Stochastic rounding draws its random numbers from a ``torch.Generator`` per device, seeded from
``torch.initial_seed()``. Under ``torch.distributed`` rank 0's seed is broadcast (:func:`shared_seed`), so that
every rank rounds alike. The seed and each generator's state are saved in the optimizer's own ``state_dict`` under
:data:`STATE_KEY`, so a resumed run draws the same numbers as an uninterrupted one; :func:`check_rounding_state`
checks a saved state when it is loaded, before anything changes. Kahan compensation buffers live in each
parameter's optimizer state under :data:`COMPENSATION_KEY`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

STATE_KEY = "stochastic_rounding"
"""Key of the rounding's state (generator states, seed, settings) in the optimizer's ``state_dict``."""
COMPENSATION_KEY = "kahan_compensation"
"""Key of the Kahan compensation buffer in a parameter's optimizer state."""


def check_rounding_state(field: str, state: Any) -> dict[str, Any]:
    """Check a saved rounding state at load time: what :meth:`.StochasticRoundingStep.rounding_state` returns.

    A generator saved for the CPU is tried on a scratch generator, so that a damaged one fails here, not at the
    first step.

    Args:
        field: where ``state`` was found, for the error message.
        state: the saved rounding state.

    Returns:
        the state, with the seed as a Python ``int``.

    Raises:
        ValueError: naming the field, its value and what is allowed.

    """
    expected = "a dict with 'seed' (an integer in [0, 2**64)), 'kahan' (a bool) and 'generators' (a dict)"
    if not isinstance(state, dict) or not {"seed", "generators"} <= state.keys():
        raise ValueError(f"The checkpoint's {field} holds {state!r}; expected {expected}.")
    seed = state["seed"]
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 64:
        raise ValueError(f"The checkpoint's {field}['seed'] holds {seed!r}; expected an integer in [0, 2**64).")
    kahan = state.get("kahan", False)
    if not isinstance(kahan, bool):
        raise ValueError(f"The checkpoint's {field}['kahan'] holds {kahan!r}; expected True or False.")
    generators = state["generators"]
    if not isinstance(generators, dict):
        raise ValueError(
            f"The checkpoint's {field}['generators'] holds {generators!r}; expected a dict from a device name to"
            " the generator's state (a uint8 tensor)."
        )
    for name, value in generators.items():
        where = f"{field}['generators'][{name!r}]"
        try:
            device = torch.device(name)
        except (RuntimeError, TypeError):
            raise ValueError(f"The checkpoint's {where} names no device; expected a name such as 'cpu'.") from None
        if not isinstance(value, Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
            raise ValueError(
                f"The checkpoint's {where} holds {value!r}; expected a generator state (a 1-d uint8 tensor)."
            )
        if device.type == "cpu":
            try:
                torch.Generator().set_state(value)
            except RuntimeError as error:
                raise ValueError(
                    f"The checkpoint's {where} is not a CPU generator state ({value.numel()} bytes): {error}"
                ) from None
    return {**state, "seed": seed, "kahan": kahan}


def shared_seed() -> int:
    """``torch.initial_seed()``, or under ``torch.distributed`` rank 0's: broadcast and read on the host, one sync."""
    seed = torch.initial_seed() % (1 << 63)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        backend_device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        shared = torch.tensor([seed], dtype=torch.int64, device=backend_device)
        dist.broadcast(shared, src=0)
        seed = int(shared.item())
    return seed


__all__ = ["COMPENSATION_KEY", "STATE_KEY", "check_rounding_state", "shared_seed"]
