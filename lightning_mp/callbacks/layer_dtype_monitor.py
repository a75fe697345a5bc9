"""Shows, layer by layer, which precision each part of the model really runs in.

Under mixed precision the dtype of a layer is not one thing. Its parameters may be fp32 (opt level O1, where
autocast casts on the fly) or half (O2, which keeps an fp32 master beside each half parameter for the optimizer's
math; O3; lean); its output follows autocast's op lists, so a ``Linear`` returns bf16 while a loss or a normalisation
may return fp32; its gradients follow the weights backward ran through. A layer forced to fp32, or one that silently
runs in half when it should not, is visible only by looking. This callback looks.

On a sampled step it attaches a forward hook to every leaf module (a module without children), records the dtype of
the output the module returns inside the autocast region of ``training_step``, and right after backward reads the
dtype of each parameter's gradient (fp32 under O1; half under O2, O3 and lean, whose parameters are half). The
parameter column shows the dtype each parameter computes in during the forward, with the master kept for the
optimizer where there is one: an O2 row reads ``bfloat16 (float32 master)`` beside half outputs and half gradients,
and so does a row of FSDP's mixed precision, which computes with half copies of its fp32 shards. A module
with children that also holds parameters of its own, such as ``nn.MultiheadAttention`` with its input projection,
gets a row too, so that every parameter appears in the table. A module whose weights are used without calling it
(``MultiheadAttention.out_proj``) shows "not called". The hooks are removed at the end of that batch, so the steps
in between cost nothing. The first table is written at the first training step.

It logs a Markdown table under ``precision/layer_dtypes`` (TensorBoard text) with one row per leaf module, and a
scalar ``precision/layers/<dtype>`` per output dtype, the number of those modules whose output has that dtype (for
example ``precision/layers/bfloat16``). A dtype seen on an earlier sample and absent now is logged as 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_mp.measuring.logging_steps import (
    log_scalars,
    log_text,
    logging_step,
    require_logger,
    validate_positive_int,
)
from lightning_mp.measuring.monitors import TelemetryCallback

_NONE = "-"
MasterDtype = Callable[[torch.Tensor], "torch.dtype | None"]
"""The dtype of the master the opt level keeps beside a parameter, or None (:meth:`PrecisionPolicy.master_dtype`)."""


@dataclass
class _LayerRecord:
    """What one module was seen doing on a sampled step."""

    name: str
    type_name: str
    module: torch.nn.Module
    called: bool = False
    output_dtypes: list[torch.dtype] = field(default_factory=list)
    grad_dtypes: list[torch.dtype] | None = None
    compute_dtypes: list[torch.dtype] | None = None
    """The dtypes of the module's own parameters during its first forward (FSDP's unsharded half copies)."""


class LayerDtypeMonitor(TelemetryCallback):
    r"""Log a per-layer table of parameter, output and gradient dtypes, and counts of layers per output dtype.

    **Logged metrics** (on the first training step, then every ``every_n_steps`` steps):

    - ``precision/layer_dtypes`` (TensorBoard text): a Markdown table with, per leaf module (and per module that
      holds parameters of its own), its qualified name, its type, the dtype of its parameters, the dtype of its
      output under autocast and the dtype of its parameters' gradients.
    - ``precision/layers/<dtype>``: the number of those modules whose output has that dtype.

    It works with any precision plugin, Lightning's included, and samples on rank zero only (every rank holds the
    same model). Loggers other than TensorBoard get the counts only.

    Args:
        every_n_steps: sample the dtypes every this many training steps (counted like ``log_every_n_steps``).

    Raises:
        ValueError: If ``every_n_steps`` is not an integer >= 1.
        MisconfigurationException: If the ``Trainer`` has no logger.

    Example::

        from lightning import Trainer
        from lightning_mp import MixedPrecision
        from lightning_mp.callbacks import LayerDtypeMonitor

        trainer = Trainer(plugins=[MixedPrecision("bf16-mixed")], callbacks=[LayerDtypeMonitor(every_n_steps=500)])

    """

    def __init__(self, every_n_steps: int = 1000) -> None:
        self.every_n_steps = validate_positive_int("every_n_steps", every_n_steps)
        self._records: list[_LayerRecord] = []
        self._handles: list[RemovableHandle] = []
        self._dtypes_seen: set[str] = set()
        self._last_sampled_step: int | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        require_logger(trainer, type(self).__name__)
        # A callback reused for a second fit starts sampling afresh, at that fit's first step.
        self._last_sampled_step = None
        self._dtypes_seen = set()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = logging_step(trainer)
        if not trainer.is_global_zero or step % self.every_n_steps != 0 or step == self._last_sampled_step:
            return
        self._last_sampled_step = step
        self._records = []
        for name, module in pl_module.named_modules():
            is_leaf = next(module.children(), None) is None
            if not is_leaf and next(module.parameters(recurse=False), None) is None:
                continue
            record = _LayerRecord(name=name or type(pl_module).__name__, type_name=type(module).__name__, module=module)
            self._records.append(record)
            self._handles.append(module.register_forward_hook(_output_dtype_recorder(record)))

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for record in self._records:
            record.grad_dtypes = _gradient_dtypes(record.module)

    @override
    def batch_ended(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_idx: int) -> None:
        if not self._records:
            return
        self._remove_hooks()
        records, self._records = self._records, []
        step = logging_step(trainer, finished_batch=batch_idx)
        log_text(trainer, "precision/layer_dtypes", _markdown_table(records, _master_dtype_of(trainer)), step)

        counts = dict.fromkeys(self._dtypes_seen, 0)
        for record in records:
            for dtype_name in dict.fromkeys(_dtype_name(dtype) for dtype in record.output_dtypes):
                counts[dtype_name] = counts.get(dtype_name, 0) + 1
        self._dtypes_seen.update(counts)
        log_scalars(trainer, {f"precision/layers/{name}": count for name, count in counts.items()}, step=step)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._remove_hooks()
        self._records = []

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove_hooks()
        self._records = []

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _output_dtype_recorder(record: _LayerRecord) -> Any:
    def hook(module: torch.nn.Module, inputs: Any, output: Any) -> None:
        if not record.called:
            record.compute_dtypes = [p.dtype for p in module.parameters(recurse=False)]
        record.called = True
        for dtype in _tensor_dtypes(output):
            if dtype not in record.output_dtypes:
                record.output_dtypes.append(dtype)

    return hook


def _tensor_dtypes(output: Any) -> list[torch.dtype]:
    """Dtypes of the tensors in a module's output, which may be a tensor, a sequence or a mapping of them."""
    if isinstance(output, torch.Tensor):
        return [output.dtype]
    if isinstance(output, (list, tuple)):
        return [dtype for item in output for dtype in _tensor_dtypes(item)]
    if isinstance(output, dict):
        return [dtype for item in output.values() for dtype in _tensor_dtypes(item)]
    return []


def _gradient_dtypes(module: torch.nn.Module) -> list[torch.dtype]:
    """The dtypes of the module's own parameters' gradients.

    Under FSDP a rank holds no elements of some parameters (an empty shard, whose gradient is None there); the ranks
    that hold them get gradients in the parameter's dtype, which FSDP casts them back to after the reduction.
    """
    return [
        p.grad.dtype if p.grad is not None else p.dtype
        for p in module.parameters(recurse=False)
        if p.grad is not None or (p.requires_grad and p.numel() == 0)
    ]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_cell(dtypes: list[torch.dtype]) -> str:
    return ", ".join(dict.fromkeys(_dtype_name(dtype) for dtype in dtypes)) or _NONE


def _parameter_cell(
    parameters: list[torch.nn.Parameter], computed: list[torch.dtype] | None, master_dtype: MasterDtype
) -> str:
    """The dtype each of a module's parameters computes in, with the dtype of the master kept for the optimizer.

    The master is the copy the opt level keeps beside a parameter (O2's), or the stored parameter itself where the
    forward computed with a copy in another dtype (FSDP's mixed precision gathers half copies of its fp32 shards).
    """
    if computed is None or len(computed) != len(parameters):
        computed = [parameter.dtype for parameter in parameters]
    cells = []
    for parameter, dtype in zip(parameters, computed, strict=True):
        master = master_dtype(parameter) or (parameter.dtype if parameter.dtype != dtype else None)
        cells.append(_dtype_name(dtype) + (f" ({_dtype_name(master)} master)" if master else ""))
    return ", ".join(dict.fromkeys(cells)) or _NONE


def _markdown_table(records: list[_LayerRecord], master_dtype: MasterDtype) -> str:
    lines = ["| module | type | parameters | output | gradients |", "|---|---|---|---|---|"]
    for record in records:
        parameters = list(record.module.parameters(recurse=False))
        grads = record.grad_dtypes if record.grad_dtypes is not None else _gradient_dtypes(record.module)
        output = _dtype_cell(record.output_dtypes) if record.called else "not called"
        cell = _parameter_cell(parameters, record.compute_dtypes, master_dtype)
        lines.append(f"| `{record.name}` | {record.type_name} | {cell} | {output} | {_dtype_cell(grads)} |")
    return "\n".join(lines)


def _master_dtype_of(trainer: pl.Trainer) -> MasterDtype:
    """The run's opt level's ``master_dtype`` (under :class:`~lightning_mp.MixedPrecision`), else no masters."""
    policy = getattr(trainer.precision_plugin, "policy", None)
    return getattr(policy, "master_dtype", _no_master)


def _no_master(parameter: torch.Tensor) -> None:
    return None
