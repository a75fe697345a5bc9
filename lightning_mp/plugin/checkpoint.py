"""The plugin's checkpoint entry: what it saves, how it loads, and the entries of other plugins it resumes from.

Lightning saves a precision plugin's ``state_dict()`` under the plugin's class name. This plugin's entry holds:

* ``scaler``: the loss scaler's state (scale, trackers, counters, skip streaks), ``precision`` (the mixed precision,
  never the ``-true`` name Lightning is shown), ``opt_level``, ``policy`` (the opt level's own state) and ``fp8``
  (the FP8 layers that fell back), each checked by :func:`check_plugin_state` before anything changes;
* at the top level, torch's five ``GradScaler`` keys (:data:`TORCH_SCALER_KEYS`), so that Lightning's own
  ``MixedPrecision`` resumes from it; after a bf16 or fp32 run, which has no fp16 scale, they describe a fresh fp16
  scaler.

It loads from its own entry, from torch's five keys alone (Lightning's own plugin), and from another form's entry
(:data:`PLUGIN_ENTRY_KEYS`: ``MixedPrecision`` under DDP, ``FSDPMixedPrecision`` under FSDP, Lightning's
``FSDPPrecision``), so a run moved between DDP and FSDP resumes at the scale it had; Lightning itself restores the
legacy ``native_amp_scaling_state`` key. An fp16 scaler resumed from a bf16 or fp32 checkpoint keeps the counters
and starts from ``init_scale``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from lightning.pytorch.plugins.precision import Precision
from typing_extensions import override

from lightning_mp.engine.base import StepEngine
from lightning_mp.plugin.claims import RunClaim
from lightning_mp.plugin.run import Run
from lightning_mp.policies import POLICIES
from lightning_mp.settings import PRECISIONS, PluginSettings

TORCH_SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
"""The keys of ``torch.amp.GradScaler.state_dict()``: Lightning's own plugin loads exactly these."""
PLUGIN_ENTRY_KEYS = ("MixedPrecision", "FSDPMixedPrecision", "FSDPPrecision")
"""The checkpoint entries that hold a loss scaler's state: this plugin's two forms', and Lightning's FSDPPrecision's."""
LEGACY_ENTRY_KEY = "native_amp_scaling_state"
"""The entry older Lightning checkpoints keep the scaler's state in; Lightning restores it itself."""


class CheckpointEntry(Precision):
    """The checkpoint hooks of :class:`~lightning_mp.MixedPrecision`: its entry, loaded before or during a run."""

    settings: PluginSettings
    _run: Run | None
    _engine: StepEngine | None
    _state_before_setup: dict[str, Any] | None
    _claim: RunClaim
    _start_new_run: Callable[[], None]

    @override
    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (scale, trackers, counters), the precision and the opt level's own state.

        The top level also holds torch's five ``GradScaler`` keys, so Lightning's own ``MixedPrecision`` (which reads
        this entry under the same class name) resumes from it (:mod:`lightning_mp.plugin.checkpoint`).
        """
        if self._engine is not None:
            self._engine.apply_pending_update()
        if self._run is None:
            return dict(self._state_before_setup or {})
        return run_state(self._run, self.settings.scaler.init_scale)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from this plugin's state, or from torch's five-key GradScaler dict (Lightning's own plugin).

        Loaded between two runs (after a ``teardown``), the state is the next run's: that run starts from it instead
        of from a new plugin's state.

        Raises:
            ValueError: if the state is malformed (a damaged checkpoint), naming the field, its value and what is
                allowed; checked when it is loaded, before anything changes.

        """
        check_plugin_state(state_dict)
        if self._claim.ended:
            # Loaded between two runs: it is the next run's state, which starts as a new plugin would.
            self._start_new_run()
        if self._run is None:
            self._state_before_setup = dict(state_dict)
            return
        load_run_state(self._run, state_dict)
        if self._engine is not None:
            self._engine.state_loaded()

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore from another form's entry where this form's is missing; warn when there is no scaler state at all.

        Lightning itself then loads this plugin's entry, or the legacy ``native_amp_scaling_state`` key; another
        form's entry (:data:`~lightning_mp.plugin.checkpoint.PLUGIN_ENTRY_KEYS`) is loaded here, so a run moved
        between DDP and FSDP resumes at the scale it had.
        """
        if type(self).__qualname__ in checkpoint or LEGACY_ENTRY_KEY in checkpoint:
            return
        entry = next((key for key in PLUGIN_ENTRY_KEYS if key in checkpoint), None)
        if entry is None:
            warn_missing_scaler_state(self._run, stacklevel=3)
        else:
            self.load_state_dict(checkpoint[entry])


def run_state(run: Run, init_scale: float) -> dict[str, Any]:
    """The entry for ``run`` (module docstring); ``init_scale`` fills torch's keys where nothing is scaled."""
    scaler_state = run.loss_scaler.state_dict()
    torch_state = {key: scaler_state[key] for key in TORCH_SCALER_KEYS if key in scaler_state}
    if not run.loss_scaler.scales_loss:
        torch_state.update(scale=float(init_scale), _growth_tracker=0)
    return {
        **torch_state,
        "scaler": scaler_state,
        "precision": run.setup.precision,
        "opt_level": run.policy.opt_level,
        "policy": run.policy.state_dict(),
        **({"fp8": run.fp8.state_dict()} if run.fp8 is not None else {}),
    }


def load_run_state(run: Run, state_dict: dict[str, Any]) -> None:
    """Restore ``run`` from this plugin's entry or from torch's five keys, checked by :func:`check_plugin_state`."""
    if "scaler" in state_dict:
        scaler_state, saved_precision = state_dict["scaler"], state_dict.get("precision")
    elif "scale" in state_dict:
        scaler_state, saved_precision = state_dict, "16-mixed"
    else:
        scaler_state, saved_precision = {}, None
    if saved_precision == "bf16-mixed" and run.setup.precision == "16-mixed":
        warnings.warn(
            "lightning_mp: resuming an fp16 run from a checkpoint written in bf16. Models trained in bf16 often"
            " have activations beyond fp16's range (65504) and overflow in fp16; consider staying in bf16.",
            UserWarning,
            stacklevel=3,
        )
    scaler = run.loss_scaler
    if not scaler_state:
        warn_missing_scaler_state(run, stacklevel=4)
    elif scaler.scales_loss and scaler_state.get("mode") == "check":
        # A bf16 or fp32 checkpoint has no meaningful fp16 scale: keep the counters, start from init_scale.
        scaler.load_state_dict({**scaler_state, "scale": scaler.get_scale()})
    else:
        scaler.load_state_dict(scaler_state)
    run.policy.load_state_dict(state_dict.get("policy", {}))
    if run.fp8 is not None:
        run.fp8.load_state_dict(state_dict.get("fp8", {}))


def warn_missing_scaler_state(run: Run | None, stacklevel: int) -> None:
    """Warn that a resumed run starts from ``init_scale`` again; nothing before setup, nor where nothing is scaled."""
    if run is not None and run.loss_scaler.scales_loss:
        warnings.warn(
            "lightning_mp: the checkpoint holds no loss-scaler state, so the loss scale starts again from"
            f" init_scale={run.loss_scaler.get_scale():g} instead of the scale the run had reached.",
            UserWarning,
            stacklevel=stacklevel,
        )


def check_plugin_state(state_dict: Any) -> None:
    """Raise unless ``state_dict`` has the shape of the plugin's entry (or of torch's GradScaler dict).

    The values inside ``'scaler'`` and ``'policy'`` are checked by the scaler and the opt level that load them.

    Raises:
        ValueError: naming the field, its value and what is allowed.

    """
    if not isinstance(state_dict, dict):
        raise ValueError(
            f"The checkpoint's MixedPrecision state holds {state_dict!r}; expected a dict, as"
            " MixedPrecision.state_dict() returns (or torch's GradScaler.state_dict()). The checkpoint is damaged."
        )
    for key, allowed in (("scaler", "the loss scaler's state"), ("policy", "the opt level's state"), ("fp8", "FP8's")):
        if key in state_dict and not isinstance(state_dict[key], dict):
            raise ValueError(
                f"The checkpoint's MixedPrecision state has {key!r}={state_dict[key]!r}; expected a dict ({allowed})."
            )
    precision = state_dict.get("precision", "auto")
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(
            f"The checkpoint's MixedPrecision state has 'precision'={precision!r}; expected one of {list(PRECISIONS)}."
        )
    opt_level = state_dict.get("opt_level", "O1")
    if not isinstance(opt_level, str) or opt_level not in POLICIES:
        raise ValueError(
            f"The checkpoint's MixedPrecision state has 'opt_level'={opt_level!r}; expected one of {list(POLICIES)}."
        )


__all__ = [
    "LEGACY_ENTRY_KEY",
    "PLUGIN_ENTRY_KEYS",
    "TORCH_SCALER_KEYS",
    "CheckpointEntry",
    "check_plugin_state",
    "load_run_state",
    "run_state",
    "warn_missing_scaler_state",
]
