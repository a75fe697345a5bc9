"""What the package does differently on older torch releases, in one place.

The package supports every torch release from its declared floor (``pyproject.toml``) up. Where a release inside that
range lacks something the package uses, the package keeps working with a clear, one-time warning instead of raising
the floor for everyone. Each degradation, and the releases it applies to:

- **torch < 2.12: ``keep_fp32`` regions split a compiled graph.** Dynamo learned to trace
  ``torch.set_autocast_enabled`` in 2.12. Before that, each ``keep_fp32`` region (:mod:`lightning_mp.overrides`) and
  the plugin's autocast inside a model compiled after ``fabric.setup`` (:mod:`lightning_mp.plugin.compile`) cause a
  graph
  break: dynamo runs the flag toggle eagerly and compiles the code on either side as separate graphs. The numbers are
  those of eager mode (the region still runs in fp32); only the speed-up of one whole graph is lost. The first such
  break warns once, naming the fix (a newer torch).
- **torch < 2.9: no switch for the autocast state of compiled backward passes.** AOT autograd's
  ``backward_pass_autocast`` setting (:mod:`lightning_mp.plugin.compile`) appeared in 2.9; before, the plugin leaves
  AOT autograd's default. ``keep_fp32`` regions still differentiate in fp32 there: the same torch releases cannot
  compile their autocast toggles (above), so the regions run, forward and backward, eagerly.
- **torch >= 2.15: a model compiled after ``fabric.setup`` splits its graph once, at the backward switch.** torch
  2.15 keeps AOT autograd's ``backward_pass_autocast`` setting in a ``ContextVar``, and dynamo cannot trace its
  ``set()``. Where Fabric's wrapper already split the graph, dynamo compiles the plugin's switch
  (:class:`lightning_mp.plugin.compile.backward_outside_autocast`) as a frame of its own and breaks there; the
  switch then
  runs eagerly and the compiled backward computes what eager computes. ``torch.compile`` before ``fabric.setup``, and
  the Trainer, are unaffected.
- **torch < 2.12: Adagrad's fused kernel is CPU-only and outside torch's fused-step protocol.** In bf16 and fp32 a
  foreach or single-tensor Adagrad is handed to that kernel on the CPU only (:mod:`lightning_mp.scaling.fused_steps`);
  on CUDA, and for an Adagrad built with ``fused=True`` (which does not declare ``_step_supports_amp_scaling``
  there), the step is decided on the host: one sync per step, as torch's own GradScaler makes.

- **Some torch releases: fused SGD on the CPU does not update fp16 and bf16 parameters.** The CPU kernel of
  ``SGD(fused=True)`` skips every full vectorised block of a half-precision parameter (8 to 32 elements, by the CPU's
  vector width), so a parameter of that size or more keeps its values, or all but its last few, while the step
  counts as taken (pytorch issue 191763, fixed upstream by PR 192545; reported on 2.12.1 and 2.13.0, seen here on
  2.13.0). fp32 parameters, the CUDA kernel and fused Adam, AdamW and Adagrad are unaffected. Which releases carry
  it is decided on the running torch by a probe, not by a version list (:func:`fused_sgd_updates_half`): one fused
  step of a 32-element half parameter, once per device type and dtype. Where it fails, the loss scaler keeps half
  parameters off the fused kernel (:mod:`lightning_mp.scaling.fused_steps`: a foreach or single-tensor SGD then
  steps as the user built it, and its skip is decided on the host, one sync per step), and O3 refuses a user's own
  ``SGD(fused=True)`` over half parameters at setup (:mod:`lightning_mp.policies.o3`).

Private names: :mod:`lightning_mp._private_names` lists them, with the reason for each.
"""

from __future__ import annotations

import functools

import torch
import torch._functorch.config
from lightning.fabric.utilities.rank_zero import rank_zero_warn

TORCH_RELEASE = tuple(int(part) for part in torch.__version__.split(".")[:2])
"""torch's (major, minor) release: "2.11.0+cu130" gives (2, 11), and a development build of 2.12 counts as 2.12."""

DYNAMO_TRACES_AUTOCAST_FLAGS = TORCH_RELEASE >= (2, 12)
"""Whether torch.compile traces ``torch.set_autocast_enabled`` without a graph break."""

AOT_BACKWARD_SWITCH_BREAKS_GRAPHS = TORCH_RELEASE >= (2, 15)
"""Whether dynamo splits a graph where it traces a change of ``backward_pass_autocast`` (a ``ContextVar`` there)."""

FUSED_ADAGRAD_TAKES_FOUND_INF = getattr(
    torch.optim.Adagrad([torch.zeros(1, requires_grad=True)], fused=True), "_step_supports_amp_scaling", False
)
"""Whether torch's fused Adagrad declares the fused-step protocol (it does from 2.12, on the CPU and CUDA)."""

AOT_BACKWARD_AUTOCAST_CONFIGURABLE = hasattr(torch._functorch.config, "backward_pass_autocast")
"""Whether AOT autograd can be told to trace a compiled backward outside autocast (``backward_pass_autocast``)."""

FUSED_SGD_PROBE_NUMEL = 32
"""Elements of the probe's parameter: at least one full vector block on every CPU (8 to 32 half elements)."""


@functools.cache
def fused_sgd_updates_half(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch's fused SGD kernel updates every element of a ``dtype`` parameter on ``device_type``.

    Takes one fused SGD step of a :data:`FUSED_SGD_PROBE_NUMEL`-element parameter of ones with a gradient of ones,
    the first time it is asked for a device type and dtype, and remembers the answer. False also where torch has no
    fused SGD kernel for them.

    .. warning:: On an accelerator the first call reads the probe's result: one host sync per process.
    """
    try:
        parameter = torch.ones(FUSED_SGD_PROBE_NUMEL, dtype=dtype, device=device_type)
        parameter.grad = torch.ones_like(parameter)
        torch.optim.SGD([parameter], lr=0.5, fused=True).step()
        return bool((parameter != 1).all())
    except Exception:  # no such device here, or no fused SGD kernel for it or for the dtype
        return False


_warned_autocast_flags_break_graphs = False


@torch.compiler.disable  # runs eagerly, where it can remember that it has warned
def _warn_autocast_flags_break_graphs() -> None:
    global _warned_autocast_flags_break_graphs
    if _warned_autocast_flags_break_graphs:
        return
    _warned_autocast_flags_break_graphs = True
    rank_zero_warn(
        f"torch {torch.__version__} cannot compile `torch.set_autocast_enabled`: every `keep_fp32` region, and the"
        " plugin's autocast in a model compiled after `fabric.setup`, splits the compiled graph there. Training is"
        " correct (those regions run eagerly, in fp32) but slower than one whole graph; torch>=2.12 compiles them"
        " without a break."
    )


def note_autocast_flag_toggle() -> None:
    """Warn once if torch.compile is tracing a toggle of autocast's flag that this torch cannot trace.

    Call right before ``torch.set_autocast_enabled``. On torch>=2.12, or outside torch.compile, it does nothing.
    """
    if not DYNAMO_TRACES_AUTOCAST_FLAGS and torch.compiler.is_compiling():
        _warn_autocast_flags_break_graphs()


__all__ = [
    "AOT_BACKWARD_AUTOCAST_CONFIGURABLE",
    "DYNAMO_TRACES_AUTOCAST_FLAGS",
    "FUSED_SGD_PROBE_NUMEL",
    "TORCH_RELEASE",
    "fused_sgd_updates_half",
    "note_autocast_flag_toggle",
]
