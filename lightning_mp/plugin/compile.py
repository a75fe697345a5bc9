"""torch.compile under autocast: compiled backward passes that run, as in eager, outside autocast.

The plugin runs every forward under ``torch.autocast`` and every backward outside it, as torch's AMP recipe says.
In eager mode autograd replays each op's backward in the dtype the forward chose, so a ``keep_fp32`` region
differentiates in fp32. AOT autograd (``torch.compile`` with ``aot_eager`` or inductor) instead traces the
backward of a compiled region under the autocast state of its forward by default, so the backward of a region
where autocast was switched off (``keep_fp32``, or a ``with torch.autocast(enabled=False)`` block in user code)
runs its matrix products in fp16 and can overflow where eager does not.

:func:`backward_outside_autocast` tells AOT autograd, for the regions compiled inside it, that their backward runs
outside autocast: the compiled backward then computes what eager computes.

A compiled model that holds the plugin's autocast itself (``torch.compile(model)`` after ``fabric.setup``, whose
forward enters the plugin's forward context) cannot use ``torch.autocast`` there: dynamo restores the flag toggles
of the ``keep_fp32`` hooks (:mod:`lightning_mp.overrides`) in the wrong order once a traced ``torch.autocast``
block has exited, and fails with "Global autocast state changed while dynamo tracing". :func:`autocast_by_flags`
turns autocast on and off with the same flag setters as those hooks, which dynamo traces and restores in order
(from torch 2.12; before, it splits the graph there: :mod:`lightning_mp._compat`).

Private names: :mod:`lightning_mp._private_names` lists them, with the reason for each.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from types import TracebackType

import torch
import torch._functorch.config as functorch_config

from lightning_mp._compat import AOT_BACKWARD_AUTOCAST_CONFIGURABLE, note_autocast_flag_toggle


class backward_outside_autocast:  # a class, not a generator: it runs on every forward, and this costs least
    """Compile the regions first run inside this block with their backward traced outside autocast.

    AOT autograd reads the setting only while it compiles, which happens inside the first forward of a compiled
    region (and of any recompilation); outside the block the user's own setting holds.
    """

    def __enter__(self) -> None:
        if AOT_BACKWARD_AUTOCAST_CONFIGURABLE:
            self._previous = functorch_config.backward_pass_autocast
            functorch_config.backward_pass_autocast = "off"

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if AOT_BACKWARD_AUTOCAST_CONFIGURABLE:
            functorch_config.backward_pass_autocast = self._previous


@contextlib.contextmanager
def autocast_by_flags(device_type: str, dtype: torch.dtype) -> Generator[None, None, None]:
    """Autocast to ``dtype`` on ``device_type`` (without its cache), set and restored with autocast's flag setters.

    For code that dynamo traces only: eager code uses ``torch.autocast``, which also keeps the nesting count.
    """
    was_enabled = torch.is_autocast_enabled(device_type)
    previous_dtype = torch.get_autocast_dtype(device_type)
    torch.set_autocast_dtype(device_type, dtype)
    note_autocast_flag_toggle()
    torch.set_autocast_enabled(device_type, True)
    try:
        yield
    finally:
        torch.set_autocast_enabled(device_type, was_enabled)
        torch.set_autocast_dtype(device_type, previous_dtype)


__all__ = ["autocast_by_flags", "backward_outside_autocast"]
