"""torch.compile under autocast: compiled backward passes that run, as in eager, outside autocast.

The plugin runs every forward under ``torch.autocast`` and every backward outside it, as torch's AMP recipe says.
In eager mode autograd replays each op's backward in the dtype the forward chose, so a ``keep_fp32`` region
differentiates in fp32. AOT autograd (``torch.compile`` with ``aot_eager`` or inductor) instead traces the
backward of a compiled region under the autocast state of its forward by default, so the backward of a region
where autocast was switched off (``keep_fp32``, or a ``with torch.autocast(enabled=False)`` block in user code)
runs its matrix products in fp16 and can overflow where eager does not.

:func:`backward_outside_autocast` tells AOT autograd, for the regions compiled inside it, that their backward runs
outside autocast: the compiled backward then computes what eager computes.

Private torch names used:

- ``torch._functorch.config.backward_pass_autocast``: the only switch for how AOT autograd traces the backward
  under autocast; its "off" value matches eager semantics. Without it, keep_fp32 regions lose fp32 in compiled
  backward passes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator

import torch._functorch.config as functorch_config


@contextlib.contextmanager
def backward_outside_autocast() -> Generator[None, None, None]:
    """Compile the regions first run inside this block with their backward traced outside autocast."""
    with functorch_config.patch(backward_pass_autocast="off"):
        yield


__all__ = ["backward_outside_autocast"]
