"""The plugin in the form Lightning's ``FSDPStrategy`` (torch FSDP1) accepts, for the Trainer and for Fabric.

Lightning's ``FSDPStrategy`` refuses every precision plugin that is not its ``FSDPPrecision`` (the Trainer's and
Fabric's are two classes). :class:`FSDPMixedPrecision` is :class:`~lightning_mp.MixedPrecision` and both of them, built
from the same arguments::

    trainer = Trainer(accelerator="gpu", devices=2, strategy="fsdp", plugins=[FSDPMixedPrecision("16-mixed")])
    fabric = Fabric(accelerator="gpu", devices=2, strategy="fsdp", plugins=[FSDPMixedPrecision("bf16-mixed")])

Everything else is the plugin's own step engine and loss scaler: autocast, hysteresis, bounds and the collapse
error, skipped-step accounting in bf16, the scheduler held back on a skipped step, telemetry and checkpoints.

How the opt levels map onto FSDP's own mixed precision (:attr:`FSDPMixedPrecision.mixed_precision_config`, which
the strategy hands to ``FullyShardedDataParallel(mixed_precision=...)``):

* ``O1`` (and fp32, ``O0``): FSDP keeps, gathers, reduces and stores everything in fp32 (parameter, reduce and buffer
  dtypes fp32), and autocast casts per op, exactly as under DDP. ``keep_fp32`` modules run outside autocast.
* ``O2``: FSDP's fp32 shards are the master weights, and it gathers half copies of them for the forward and
  backward passes (``param_dtype`` half); the gradients are reduce-scattered in fp32 (``reduce_dtype``), as DDP
  reduces O2's fp32 master gradients, so a sum over ranks cannot overflow fp16 and the run matches DDP's; buffers
  stay fp32. That is O2's design (half weights for compute, fp32 masters for the step) done by FSDP itself, so the
  package's own O2 copies are not made. The inputs are not cast to half (``cast_root_forward_inputs=False``): the
  Trainer sends the whole batch, targets included, through the root's forward, and autocast casts each op's inputs.
  Normalisation layers stay fp32 where FSDP wraps them in units of their own (with an ``auto_wrap_policy``, FSDP's
  default); ``keep_fp32`` is refused with O2, since FSDP gathers every weight of a unit in one dtype (use O1).
* ``O3``, ``lean`` and ``lean-kahan`` keep half weights with no fp32 master. FSDP shards fp32 masters already (the
  memory those levels save is divided by the number of ranks), and ``O2`` gives the half compute: they are refused
  when the plugin is built, naming ``O2`` as the alternative.

The loss scaler is sharding-aware: each rank checks the gradients it holds, its shards, for inf/NaN (a rank whose
shard of a parameter is empty checks nothing for it), and one all-reduce (max) of the inf flags per optimizer step
makes every rank take the same decision, as torch's ``ShardedGradScaler`` does. Clipping by norm under the Trainer
goes through the root module's ``FullyShardedDataParallel.clip_grad_norm_``, which reduces the norm over all shards
(Fabric's strategy does the same itself).

A plain :class:`~lightning_mp.MixedPrecision` under ``strategy="fsdp"`` is refused by Lightning itself, before any
hook of the plugin runs: ``TypeError: The FSDP strategy can only work with the FSDPPrecision plugin``. Pass
``FSDPMixedPrecision`` with the same arguments instead.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any

import torch
from lightning.fabric.plugins.precision import FSDPPrecision as FabricFSDPPrecision
from lightning.pytorch.plugins.precision import FSDPPrecision
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mp.plugin import MixedPrecision, attached_trainer
from lightning_mp.policies import PrecisionPolicy
from lightning_mp.policies.fsdp_o2 import FSDPO2Policy

FSDP_OPT_LEVELS = ("O0", "O1", "O2")
"""The opt levels FSDP runs; the others keep half weights without fp32 masters, which FSDP shards itself."""


# Lightning's FSDPPrecision types ``scaler`` as torch's ShardedGradScaler and ``optimizer_step`` with a required model;
# MixedPrecision's (a read-only LossScaler view, the model optional) come first and serve both.
class FSDPMixedPrecision(MixedPrecision, FSDPPrecision, FabricFSDPPrecision):  # type: ignore[misc]
    """:class:`~lightning_mp.MixedPrecision` for Lightning's ``FSDPStrategy``, under the Trainer and under Fabric.

    Takes exactly the arguments of :class:`~lightning_mp.MixedPrecision`, with the same meaning and checks.

    Raises:
        ValueError: for an opt level FSDP cannot run (``O3``, ``lean``, ``lean-kahan``), or ``keep_fp32`` with
            ``O2``; the message names the combination and the alternative. Otherwise as
            :class:`~lightning_mp.MixedPrecision`.

    Example::

        trainer = Trainer(accelerator="gpu", devices=2, strategy="fsdp", plugins=[FSDPMixedPrecision("16-mixed")])

    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.opt_level not in FSDP_OPT_LEVELS:
            raise ValueError(
                f"FSDPMixedPrecision(opt_level={self.opt_level!r}) is not allowed: {self.opt_level} keeps the model's"
                " weights in half with no fp32 master, while FSDP keeps fp32 shards as the masters and gathers from"
                " them. Use opt_level='O2', where FSDP gathers half copies of its fp32 shards (the same half compute),"
                f" or 'O1'. Allowed: {list(FSDP_OPT_LEVELS)}."
            )
        if self.opt_level == "O2" and self.keep_fp32:
            raise ValueError(
                f"FSDPMixedPrecision(opt_level='O2', keep_fp32={self.keep_fp32!r}) is not allowed: under O2 FSDP"
                " gathers every weight of a unit in the half dtype, so those modules would compute on half-rounded"
                " weights. Use opt_level='O1' (fp32 weights, autocast; keep_fp32 modules run in fp32), or O2 without"
                " keep_fp32."
            )
        self._root_module: nn.Module | None = None
        """Under the Trainer, the LightningModule, whose Trainer's strategy holds the root FSDP module."""

    @property
    @override
    def mixed_precision_config(self) -> TorchMixedPrecision:
        """FSDP's mixed-precision policy for this plugin's precision and opt level (module docstring).

        Raises:
            RuntimeError: for ``precision="auto"`` before setup, when the precision is not known yet.

        """
        if self.precision == "auto":
            raise RuntimeError(
                "FSDPMixedPrecision(precision='auto') resolves its precision when the strategy sets the model up;"
                " mixed_precision_config is known from then on."
            )
        half_dtype = self.half_dtype
        if self.opt_level == "O2" and half_dtype is not None:
            # The inputs stay as given (the Trainer's batch holds the targets too): autocast casts each op's inputs.
            return TorchMixedPrecision(
                param_dtype=half_dtype,
                reduce_dtype=torch.float32,
                buffer_dtype=torch.float32,
                cast_root_forward_inputs=False,
            )
        return TorchMixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32, buffer_dtype=torch.float32)

    @override
    def _build_policy(self, opt_level: str) -> PrecisionPolicy:
        if opt_level == "O2":
            return FSDPO2Policy(self.half_dtype, keep_fp32=self.keep_fp32)
        return super()._build_policy(opt_level)

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """As :meth:`MixedPrecision.convert_module`; under the Trainer, remember the module to find FSDP's root."""
        self._root_module = module if attached_trainer(module) is not None else None
        return super().convert_module(module)

    @override
    def tensor_init_context(self) -> AbstractContextManager:
        """Create tensors in fp32: FSDP's shards of them are the master weights."""
        return contextlib.nullcontext()

    @override
    def module_init_context(self) -> AbstractContextManager:
        """Create modules in fp32: FSDP's shards of their weights are the master weights."""
        return contextlib.nullcontext()

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Clip by the norm over every rank's shards, with the root module's ``clip_grad_norm_`` (Trainer).

        Raises:
            RuntimeError: when the Trainer's model is not wrapped in ``FullyShardedDataParallel`` at its root.

        """
        trainer = attached_trainer(self._root_module)
        root = trainer.strategy.model if trainer is not None else None
        if not isinstance(root, FullyShardedDataParallel):
            raise RuntimeError(
                "FSDPMixedPrecision clips by norm over all shards through the root FullyShardedDataParallel module,"
                f" but the Trainer's model is {type(root).__name__}. Use gradient_clip_algorithm='value', or let"
                " the FSDPStrategy wrap the model."
            )
        root.clip_grad_norm_(clip_val)

    @override
    def teardown(self) -> None:
        """As :meth:`MixedPrecision.teardown`, and forget the module."""
        self._root_module = None
        super().teardown()


__all__ = ["FSDP_OPT_LEVELS", "FSDPMixedPrecision"]
