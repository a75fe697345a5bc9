"""The advisor callback: the precision advisor's verdict, logged before training starts.

It runs the precision advisor (:func:`lightning_mp.advisor.advise`) once, at the start of training, on the first
``batches`` batches of the training data loader, before any optimizer step.

It measures in fp32 on a deep copy of the model, so the run itself is unchanged: same weights, same random state,
same order of batches. The advisor's table and recommendation are

- kept as :attr:`AdvisorCallback.advice`;
- written as TensorBoard text under ``precision/advice`` when the trainer has a ``TensorBoardLogger``;
- printed on rank zero.

When the run trains in fp16 with :class:`~lightning_mp.MixedPrecision` and the advisor finds layers that leave fp16's
range which ``keep_fp32`` does not cover, it warns, naming them, the ``keep_fp32`` and the ``init_scale`` to pass.
Apply the advice on the next run: the plugin is already set up when training starts.

A module with manual optimization is measured through its own ``training_step`` (see :mod:`lightning_mp.advisor`):
the copy gets its own optimizers, so the run's optimizers, step counters and scaler are untouched.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_mp.advisor import Advice, LossFunction, advise
from lightning_mp.measuring.logging_steps import log_text, logging_step, validate_positive_int
from lightning_mp.overrides import Fp32Overrides

ADVICE_TAG = "precision/advice"


class AdvisorCallback(Callback):
    """Measure the model's fp16 risks at the start of fit and log the advisor's table and recommendation.

    Args:
        batches: training batches to measure; at least 1.
        loss_fn: ``loss_fn(model, batch) -> loss``; by default the LightningModule's ``training_step`` gives it.

    Raises:
        ValueError: if ``batches`` is not an integer >= 1.
        TypeError: if ``loss_fn`` is neither None nor callable.

    Example:
        >>> import tempfile
        >>> from lightning import Trainer
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> from lightning.pytorch.loggers import TensorBoardLogger
        >>> from lightning_mp import MixedPrecision
        >>> logs = tempfile.TemporaryDirectory()  # a throwaway log directory for this example
        >>> advisor = AdvisorCallback(batches=2)
        >>> trainer = Trainer(
        ...     accelerator="cpu", max_steps=1, callbacks=[advisor], logger=TensorBoardLogger(logs.name),
        ...     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        ... )
        >>> trainer.fit(BoringModel())
        >>> MixedPrecision(**advisor.advice.plugin_kwargs("16-mixed"))  # for the next fp16 run
        MixedPrecision(precision='16-mixed', opt_level='O1')
        >>> logs.cleanup()

    """

    def __init__(self, batches: int = 8, loss_fn: LossFunction | None = None) -> None:
        self.batches = validate_positive_int("batches", batches)
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(
                f"AdvisorCallback(loss_fn={loss_fn!r}) is not allowed: loss_fn must be None or a callable"
                " loss_fn(model, batch) -> loss tensor."
            )
        self.loss_fn = loss_fn
        self.advice: Advice | None = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Run the advisor on rank zero, before the first training batch."""
        if not trainer.is_global_zero:
            return
        dataloader = trainer.train_dataloader
        if dataloader is None:
            raise MisconfigurationException("AdvisorCallback needs a training data loader to measure.")
        self.advice = advise(pl_module, dataloader, batches=self.batches, loss_fn=self.loss_fn)
        rank_zero_info(f"lightning_mp precision advisor:\n{self.advice}")
        log_text(trainer, ADVICE_TAG, self.advice.to_markdown(), step=logging_step(trainer))
        self._warn_if_at_risk(trainer, pl_module, self.advice)

    @staticmethod
    def _warn_if_at_risk(trainer: pl.Trainer, pl_module: pl.LightningModule, advice: Advice) -> None:
        from lightning_mp.plugin import MixedPrecision

        plugin = trainer.precision_plugin
        if not isinstance(plugin, MixedPrecision) or plugin.half_dtype is not torch.float16 or not advice.keep_fp32:
            return
        covered = Fp32Overrides(plugin.keep_fp32).match(pl_module, warn=False)
        uncovered = [
            name
            for name in advice.keep_fp32
            if not any(name == kept or name.startswith(kept + ".") or kept == "" for kept in covered)
        ]
        if uncovered:
            rank_zero_warn(
                f"lightning_mp: layers {uncovered} leave fp16's range and this run trains them in fp16, so steps may"
                f" be skipped. Use precision='bf16-mixed', or MixedPrecision(**advice.plugin_kwargs('16-mixed')),"
                f" that is keep_fp32={list(advice.keep_fp32)!r}, init_scale={advice.init_scale:g}."
            )


__all__ = ["AdvisorCallback"]
