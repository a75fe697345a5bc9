"""Per-layer FP8 telemetry for torchao's float8 training, free between logging steps, with an opt-in bf16 fallback.

What each FP8 cast loses, layer by layer, and a way back to bf16 for the layers that cannot take FP8.

**What it measures.** On a logging step (every ``every_n_steps`` steps, at the steps Lightning's
``log_every_n_steps=every_n_steps`` logs), for every FP8 layer in the model (torchao's ``Float8Linear``, and the FP8
form of transformers' ``Conv1D``, :mod:`lightning_mp.fp8.transposed`) and each of its three matmul operands (the
input, the weight and the gradient of the output), it replays the cast torchao makes (the recipe's granularity, FP8
dtype and scale rounding, read from the layer's own ``config``) with :func:`lightning_mp.fp8.quant.cast_stats`: the
amax, the scale, the share of non-zero elements that underflow to zero in FP8, the share that saturate, and the SQNR
in dB. A forward hook per layer takes the input and the weight;
a gradient hook on the layer's output takes the output gradient. Both are attached at the start of the logging
step's batch and removed at its end.

**What it logs.** Per layer and operand, the scalars ``fp8_monitor/<layer>/<operand>/<stat>``; per sample the
summaries ``fp8_monitor/max_underflow_share`` and ``fp8_monitor/min_sqnr_db``; the worst layers as a Markdown table
(TensorBoard text ``fp8_monitor/worst_layers``, and :attr:`FP8Monitor.worst_layers`); and every
``heatmap_every_n_samples`` samples, and at the end of training, two heatmaps like the precision sentinel's (one row
per layer and operand, logging steps across): ``fp8_monitor/heatmap/underflow_share`` and
``fp8_monitor/heatmap/sqnr_db``.

**Which layer is worst, and fallback.** The rules live in :mod:`lightning_mp.fp8.telemetry_rules`:
:func:`rank_layers` orders the layers, worst first, and :func:`fallback_decisions` applies the opt-in
``fallback=FallbackRule(...)``: a layer that crosses the rule's limits for ``patience`` logging steps in a row is
handed to ``fallback_fn(model, layer_name, reason)``, which returns it to bf16 for the rest of the run. Under DDP or
FSDP every rank samples and rank zero's statistics are broadcast before the read (one collective), so every rank
decides the same. The layers fallen back are kept in the callback's state and applied again after a resume.

**Cost.** A step that does not log attaches no hook, runs no op and reads nothing. A logging step runs about twenty
ops per operand, on the device, and its values join the one device-to-host transfer the monitors share per batch
(:mod:`lightning_mp.measuring.host_reads`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_mp.fp8.convert import fallback_layer, is_fp8_linear
from lightning_mp.fp8.host import Fp8Host, fp8_host
from lightning_mp.fp8.quant import OPERANDS, STAT_NAMES, Operand, cast_stats, casts_of_config
from lightning_mp.fp8.selection import matmul_weight
from lightning_mp.fp8.telemetry_rules import FallbackRule, fallback_decisions, rank_layers
from lightning_mp.measuring.heatmaps import HeatmapStyle
from lightning_mp.measuring.logging_steps import (
    log_scalars,
    log_text,
    logging_step,
    require_logger,
    validate_positive_int,
)
from lightning_mp.measuring.monitors import HeatmapQuantities, SampledMonitor

HEATMAPS: HeatmapQuantities = {
    "fp8_monitor/heatmap/underflow_share": (
        "underflow_share",
        HeatmapStyle("FP8 underflow share (non-zero values cast to 0)", "share of elements", "viridis", 0, 1),
    ),
    "fp8_monitor/heatmap/sqnr_db": ("sqnr_db", HeatmapStyle("FP8 quantisation SQNR", "dB", "RdYlGn", 0, 40)),
}


class FallbackFunction(Protocol):
    """Returns one FP8 layer of ``model`` to bf16: ``lightning_mp.fp8.convert.fallback_layer`` has this signature."""

    def __call__(self, model: nn.Module, name: str, reason: str) -> Any:
        """Return the layer ``name`` of ``model`` to bf16, logging ``reason``."""


def is_float8_linear(module: nn.Module) -> bool:
    """Whether ``module`` is a linear layer in FP8: torchao's ``Float8Linear``, or a ``Conv1D``'s FP8 form.

    False while torchao is not imported (nothing can be converted before); it imports nothing.
    """
    return is_fp8_linear(module)


@dataclass
class _Sample:
    step: int
    stats: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)


class FP8Monitor(SampledMonitor[_Sample]):
    r"""Log, per FP8 layer and operand, what torchao's FP8 casts lose; name the worst layers; optionally fall back.

    Needs a logger; the heatmaps need a :class:`~lightning.pytorch.loggers.TensorBoardLogger` and matplotlib. Works
    with any precision plugin whose model holds torchao ``Float8Linear`` layers (this package's FP8 mode, or
    ``torchao.float8.convert_to_float8_training`` called by hand).

    .. warning:: A logging step synchronises the host once, in the transfer the monitors share. Other steps never do.
        Under ``torch.compile``, the hooks of a logging step make the compiled model run with hooks that step.

    Args:
        every_n_steps: measure at the steps ``log_every_n_steps=every_n_steps`` logs at.
        worst_k: how many of the worst layers to name.
        log_heatmaps: write the heatmaps to TensorBoard loggers.
        heatmap_every_n_samples: redraw the heatmaps every this many samples (and at the end of training).
        fallback: the rule that returns a layer to bf16; None (the default) takes the rule of the plugin's
            ``FP8Settings(fallback=True, fallback_...=...)`` (:meth:`FallbackRule.from_settings`), and never falls back
            where the settings do not ask for it.
        fallback_fn: what returns one layer to bf16, ``fallback_fn(model, name, reason)``; None returns them through
            the plugin (``MixedPrecision.fallback_layers``: all of a step's layers at once, agreed by every rank in one
            collective, kept in its checkpoint), or this package's ``lightning_mp.fp8.convert.fallback_layer``
            without it.

    Raises:
        ValueError: if an argument is outside its range; the message names the argument, the value and what is
            allowed.
        TypeError: if ``fallback`` is not a :class:`FallbackRule` or ``fallback_fn`` is not callable.

    Example::

        from lightning import Trainer
        from lightning_mp import MixedPrecision
        from lightning_mp.fp8.telemetry import FallbackRule, FP8Monitor

        trainer = Trainer(
            plugins=[MixedPrecision("bf16-mixed", fp8="tensorwise")],
            callbacks=[FP8Monitor(every_n_steps=50, fallback=FallbackRule(max_underflow=0.01))],
        )

    """

    heatmap_quantities = HEATMAPS

    def __init__(
        self,
        every_n_steps: int = 50,
        worst_k: int = 3,
        log_heatmaps: bool = True,
        heatmap_every_n_samples: int = 5,
        fallback: FallbackRule | None = None,
        fallback_fn: FallbackFunction | None = None,
    ) -> None:
        super().__init__(every_n_steps, log_heatmaps, heatmap_every_n_samples)
        self.worst_k = validate_positive_int("worst_k", worst_k)
        if fallback is not None and not isinstance(fallback, FallbackRule):
            raise TypeError(f"FP8Monitor(fallback={fallback!r}) is not allowed: pass a FallbackRule(...) or None.")
        if fallback_fn is not None and not callable(fallback_fn):
            raise TypeError(
                f"FP8Monitor(fallback_fn={fallback_fn!r}) is not allowed: pass a callable fn(model, name, reason)"
                " or None."
            )
        self.fallback = fallback
        self.fallback_fn = fallback_fn
        self.rule: FallbackRule | None = fallback
        """The rule this fit falls back by: ``fallback``, else the plugin's settings' (at setup), else None."""
        self._plugin: Fp8Host | None = None
        """The run's plugin where it returns layers to bf16 itself (``fallback_layers``), for one collective a step."""
        self.worst_layers: list[str] = []
        """The worst layers of the latest sample, worst first (:func:`rank_layers`)."""
        self.fell_back: dict[str, str] = {}
        """``layer -> reason`` for every layer returned to bf16, in order."""
        self._streaks: dict[str, int] = {}
        self._sampled_step: int | None = None
        self._recorded: dict[tuple[str, Operand], torch.Tensor] = {}

    # ------------------------------------------------------------------------------------------------ hooks

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        require_logger(trainer, type(self).__name__)
        super().setup(trainer, pl_module, stage)
        host = fp8_host(trainer.precision_plugin)
        self.rule = self.fallback
        if self.rule is None and host is not None and host.fp8_settings is not None and host.fp8_settings.fallback:
            self.rule = FallbackRule.from_settings(host.fp8_settings)
        self._plugin = host if self.fallback_fn is None else None
        if self.rule is not None and self.fallback_fn is None and self._plugin is None:
            self.fallback_fn = fallback_layer
        self.worst_layers, self._sampled_step = [], None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not any(is_float8_linear(module) for module in pl_module.modules()):
            rank_zero_warn(
                "FP8Monitor has nothing to watch: the model has no FP8 layer (torchao Float8Linear). Pass"
                " MixedPrecision('bf16-mixed', fp8='tensorwise') (or another recipe), and see its setup line for the"
                " layers kept in bf16 and why."
            )
        # After a resume: the layers that fell back before stay in bf16.
        waiting = {
            name: reason
            for name, reason in self.fell_back.items()
            if _has_submodule(pl_module, name) and is_float8_linear(pl_module.get_submodule(name))
        }
        if self._plugin is not None and self.rule is not None:
            self._plugin.fallback_layers(pl_module, waiting)  # on every rank: one collective
        elif self.fallback_fn is not None:
            for name, reason in waiting.items():
                self.fallback_fn(pl_module, name, reason)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = logging_step(trainer)
        # One sample per logging step: with gradient accumulation, its first micro-batch.
        self._sampling = (step + 1) % self.every_n_steps == 0 and step != self._sampled_step
        self._sampling = self._sampling and (trainer.is_global_zero or self._decides_on_every_rank(trainer))
        if not self._sampling:
            return
        self._sampled_step = step
        for name, module in pl_module.named_modules():
            if is_float8_linear(module):
                self.watch(module, self._recorder(name))

    @override
    def sample_ended(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_idx: int) -> None:
        self._sampling = False
        recorded, self._recorded = self._recorded, {}
        if not recorded:
            self.submit(trainer)
            return
        keys = list(recorded)
        values = torch.stack([recorded[key] for key in keys])
        if self._decides_on_every_rank(trainer) and self._plugin is None:
            # Without the plugin's one agreement, every rank decides on rank 0's statistics.
            torch.distributed.broadcast(values, src=0)
        step = logging_step(trainer, finished_batch=batch_idx)

        def consume(host: list[float]) -> None:
            sample = _Sample(step)
            width = len(STAT_NAMES)
            for index, (layer, operand) in enumerate(keys):
                row = host[index * width : (index + 1) * width]
                sample.stats.setdefault(layer, {})[operand] = dict(zip(STAT_NAMES, row, strict=True))
            self._record(trainer, pl_module, sample)

        self.submit(trainer, values, consume)

    @override
    def stop_sampling(self) -> None:
        super().stop_sampling()
        self._recorded = {}

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"fell_back": dict(self.fell_back), "streaks": dict(self._streaks)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.fell_back = dict(state_dict.get("fell_back", {}))
        self._streaks = dict(state_dict.get("streaks", {}))

    # ------------------------------------------------------------------------------------------------ rules

    def _record(self, trainer: pl.Trainer, pl_module: pl.LightningModule, sample: _Sample) -> None:
        self.keep_sample(sample)
        ranked = rank_layers(sample.stats)
        self.worst_layers = ranked[: self.worst_k]
        log_scalars(trainer, _scalars(sample), step=sample.step)
        log_text(trainer, "fp8_monitor/worst_layers", _worst_table(sample, self.worst_layers), sample.step)
        if self.rule is not None:
            self._streaks, decisions = fallback_decisions(self._streaks, sample.stats, self.rule)
            if self._plugin is not None:
                # Every rank, every sample, even with nothing to ask: the plugin agrees in one collective.
                fell = self._plugin.fallback_layers(pl_module, dict(decisions))
            else:
                assert self.fallback_fn is not None
                fell = dict(decisions)
                for layer, reason in decisions:
                    self.fallback_fn(pl_module, layer, reason)
            for layer, reason in fell.items():
                self.fell_back[layer] = reason
                rank_zero_info(f"FP8Monitor: layer {layer!r} goes back to bf16: {reason}.")
                log_text(trainer, "fp8_monitor/fallback", f"`{layer}` goes back to bf16: {reason}.", sample.step)
        self.draw_if_due(trainer)

    # ------------------------------------------------------------------------------------------------ plumbing

    def _decides_on_every_rank(self, trainer: pl.Trainer) -> bool:
        return self.rule is not None and trainer.world_size > 1 and torch.distributed.is_initialized()

    def _recorder(self, layer: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            casts = casts_of_config(module.config)
            with torch.no_grad():
                if (layer, "input") not in self._recorded and args and isinstance(args[0], torch.Tensor):
                    inputs = args[0]
                    # Float8Linear casts its input to CUDA autocast's dtype before scaling it, as F.linear would.
                    if torch.is_autocast_enabled("cuda"):
                        inputs = inputs.to(torch.get_autocast_dtype("cuda"))
                    self._recorded[layer, "input"] = cast_stats(inputs, casts.input)
                if (layer, "weight") not in self._recorded:
                    self._recorded[layer, "weight"] = cast_stats(matmul_weight(module), casts.weight)
            if (
                isinstance(output, torch.Tensor)
                and output.requires_grad
                and (layer, "grad_output") not in self._recorded
            ):

                def record_gradient(gradient: torch.Tensor) -> None:
                    if (layer, "grad_output") not in self._recorded:
                        with torch.no_grad():
                            self._recorded[layer, "grad_output"] = cast_stats(gradient, casts.grad_output)

                output.register_hook(record_gradient)

        return hook

    @override
    def heatmap_rows(self, quantity: str) -> dict[str, list[float]]:
        rows = dict.fromkeys(
            (layer, operand)
            for sample in self.samples
            for layer, operands in sample.stats.items()
            for operand in operands
        )
        return {
            f"{layer} [{operand}]": [
                sample.stats.get(layer, {}).get(operand, {}).get(quantity, math.nan) for sample in self.samples
            ]
            for layer, operand in rows
        }


def _scalars(sample: _Sample) -> dict[str, float]:
    scalars = {
        f"fp8_monitor/{layer}/{operand}/{stat}": value
        for layer, operands in sample.stats.items()
        for operand, stats in operands.items()
        for stat, value in stats.items()
    }
    every = [stats for operands in sample.stats.values() for stats in operands.values()]
    scalars["fp8_monitor/max_underflow_share"] = max(s["underflow_share"] for s in every)
    scalars["fp8_monitor/min_sqnr_db"] = min(s["sqnr_db"] for s in every)
    return scalars


def _worst_table(sample: _Sample, worst: Sequence[str]) -> str:
    rows = ["| layer | operand | amax | scale | underflow | saturated | SQNR (dB) |", "|---|---|---|---|---|---|---|"]
    for layer in worst:
        for operand in OPERANDS:
            stats = sample.stats[layer].get(operand)
            if stats is None:
                continue
            rows.append(
                f"| {layer} | {operand} | {stats['amax']:.3g} | {stats['scale']:.3g} | {stats['underflow_share']:.2%}"
                f" | {stats['saturated_share']:.2%} | {stats['sqnr_db']:.1f} |"
            )
    return f"Worst FP8 layers at step {sample.step}, worst first:\n\n" + "\n".join(rows)


def _has_submodule(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


__all__ = ["FP8Monitor", "FallbackFunction", "FallbackRule", "fallback_decisions", "is_float8_linear", "rank_layers"]
