"""The recipes that run through the Trainer: automatic and manual optimization, accumulation, clipping, schedulers,
Lightning's callbacks, tied weights, checkpoints and a plugin fitted twice."""

from __future__ import annotations

import csv
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    EMAWeightAveraging,
    LearningRateMonitor,
    ModelSummary,
    StochasticWeightAveraging,
)
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from typing_extensions import override

from tests.recipes.common import (
    BATCH,
    FEATURES,
    HIDDEN,
    Level,
    Outcome,
    Weights,
    audit_of,
    batch_for_step,
    make_audited_trainer,
    mlp,
    plugin_of,
    recipe_loader,
    snapshot,
    stats_of,
)

# --------------------------------------------------------------------------------------------------------- modules


class Regressor(L.LightningModule):
    """The MLP under automatic optimization, with the settings the recipes turn.

    Args:
        optimizer: ``"sgd"`` (momentum 0.9) or ``"adamw"``.
        lr: the learning rate.
        scheduler: None, ``"step"`` (halves every 2 steps) or ``"epoch"`` (halves every epoch).
        skip_at: a global step whose ``training_step`` returns None (Lightning skips it), for fp32's planted inf.
        plant_inf_at: a global step whose first gradient gets an inf after backward.
        step_every: with N > 1, the ``optimizer_step`` override that steps every N batches and runs the closure
            alone on the others.
        data_by_step: train on :func:`batch_for_step` of the global step instead of the loader's batch.
        trainable_only: give the optimizer only the parameters that require gradients (``BackboneFinetuning``).

    """

    def __init__(
        self,
        optimizer: str = "sgd",
        lr: float = 0.05,
        scheduler: str | None = None,
        skip_at: int | None = None,
        plant_inf_at: int | None = None,
        step_every: int = 1,
        data_by_step: bool = False,
        trainable_only: bool = False,
    ) -> None:
        super().__init__()
        net = mlp()
        self.backbone, self.head = net[0], net[1]
        self.optimizer_name, self.lr, self.scheduler = optimizer, lr, scheduler
        self.skip_at, self.plant_inf_at = skip_at, plant_inf_at
        self.step_every, self.data_by_step, self.trainable_only = step_every, data_by_step, trainable_only

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        if self.global_step == self.skip_at:
            return None
        return self.loss(batch_for_step(self.global_step) if self.data_by_step else batch)

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.loss(batch)

    @override
    def on_after_backward(self) -> None:
        if self.global_step == self.plant_inf_at:
            self.backbone[0].weight.grad[0, 0] = float("inf")

    @override
    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        if (batch_idx + 1) % self.step_every == 0:
            optimizer.step(closure=optimizer_closure)
        else:
            optimizer_closure()

    @override
    def configure_optimizers(self) -> Any:
        parameters = [p for p in self.parameters() if p.requires_grad or not self.trainable_only]
        if self.optimizer_name == "adamw":
            optimizer: torch.optim.Optimizer = torch.optim.AdamW(parameters, lr=self.lr)
        else:
            optimizer = torch.optim.SGD(parameters, lr=self.lr, momentum=0.9)
        if self.scheduler is None:
            return optimizer
        step_size = 2 if self.scheduler == "step" else 1
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=step_size, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": self.scheduler}}


def fit_regressor(
    level: Level | None,
    trainer_options: dict[str, Any],
    data: int = 8,
    validation: dict[str, int] | None = None,
    **model_options: Any,
) -> Outcome:
    """Fit a :class:`Regressor` built with ``model_options`` on ``data`` batches, by a Trainer with
    ``trainer_options``; ``validation`` (the Trainer's validation options) adds a validation loader."""
    model = Regressor(**model_options)
    initial = snapshot(model)
    plugin = plugin_of(level)
    trainer = make_audited_trainer(plugin, **trainer_options, **(validation or {}))
    trainer.fit(model, recipe_loader(data), recipe_loader(2, seed=7) if validation is not None else None)
    return Outcome(initial, snapshot(model), stats_of(plugin), audit_of(trainer))


# --------------------------------------------------------------------------------------------------------- recipes


def automatic(level: Level | None) -> Outcome:
    """Automatic optimization with SGD and momentum."""
    return fit_regressor(level, {"max_steps": 6})


def automatic_adamw(level: Level | None) -> Outcome:
    """Automatic optimization with AdamW."""
    return fit_regressor(level, {"max_steps": 6}, optimizer="adamw", lr=0.01)


def planted_inf(level: Level | None) -> Outcome:
    """An inf planted in the gradient of step 2: every level skips that step (fp32 returns None from that step)."""
    if level is None:
        return fit_regressor(level, {"max_steps": 6}, optimizer="adamw", lr=0.01, skip_at=2)
    return fit_regressor(level, {"max_steps": 6}, optimizer="adamw", lr=0.01, plant_inf_at=2)


def accumulate_grad_batches(level: Level | None) -> Outcome:
    """Lightning's gradient accumulation: 3 steps of 2 batches each."""
    return fit_regressor(level, {"max_steps": 3, "accumulate_grad_batches": 2})


def step_every_n(level: Level | None) -> Outcome:
    """``optimizer_step`` overridden to step every 2nd batch and run ``optimizer_closure()`` alone on the others."""
    return fit_regressor(level, {"max_epochs": 1}, step_every=2)


def clip_norm(level: Level | None) -> Outcome:
    """``gradient_clip_val`` by norm, below the gradients' norm so that every step is clipped."""
    return fit_regressor(level, {"max_steps": 6, "gradient_clip_val": 0.3, "gradient_clip_algorithm": "norm"})


def clip_value(level: Level | None) -> Outcome:
    """``gradient_clip_val`` by value, below the largest gradients so that every step clips some."""
    return fit_regressor(level, {"max_steps": 6, "gradient_clip_val": 0.05, "gradient_clip_algorithm": "value"})


def step_scheduler(level: Level | None) -> Outcome:
    """A ``StepLR`` with ``interval="step"`` (halving every 2 steps), watched by ``LearningRateMonitor`` and
    ``ModelSummary``: the monitor must log the schedule's rates, one per step."""
    with tempfile.TemporaryDirectory() as folder:
        logger = CSVLogger(folder)
        callbacks = [LearningRateMonitor(logging_interval="step"), ModelSummary(max_depth=2)]
        options = {"max_steps": 6, "logger": logger, "log_every_n_steps": 1, "callbacks": callbacks}
        outcome = fit_regressor(level, {**options, "enable_model_summary": True}, scheduler="step")
        with open(Path(logger.log_dir) / "metrics.csv") as metrics:
            rates = [float(row["lr-SGD"]) for row in csv.DictReader(metrics) if row.get("lr-SGD")]
    if rates != [0.05, 0.05, 0.025, 0.025, 0.0125, 0.0125]:
        outcome.broken.append(f"LearningRateMonitor logged {rates}")
    return outcome


def epoch_scheduler(level: Level | None) -> Outcome:
    """A ``StepLR`` with ``interval="epoch"`` over 3 epochs."""
    return fit_regressor(level, {"max_epochs": 3}, data=2, scheduler="epoch")


def backbone_finetuning(validation: dict[str, int] | None) -> Callable[[Level | None], Outcome]:
    """``BackboneFinetuning`` unfreezing the backbone at epoch 1 of 3, with ``validation`` the Trainer's val options
    (None: no validation loop)."""

    def recipe(level: Level | None) -> Outcome:
        callback = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.5)
        return fit_regressor(
            level, {"max_epochs": 3, "callbacks": [callback]}, data=2, trainable_only=True, validation=validation
        )

    return recipe


class RecordedWeightAveraging(StochasticWeightAveraging):
    """``StochasticWeightAveraging`` that keeps an fp32 copy of the parameters it takes into the average (what the
    model shows, which under O2 may differ from its ``state_dict``, always the fp32 masters)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.samples: list[Weights] = []

    def update_parameters(self, average_model: Any, model: Any, n_averaged: torch.Tensor, avg_fn: Any) -> None:  # type: ignore[override]
        self.samples.append({name: value.detach().float().clone() for name, value in model.named_parameters()})
        super().update_parameters(average_model, model, n_averaged, avg_fn)


def stochastic_weight_averaging(level: Level | None) -> Outcome:
    """``StochasticWeightAveraging`` from the first of 3 epochs (its first sample is the initial weights); the model
    ends with the average. Where the level keeps fp32 weights, the first sample must be the fp32 initial weights."""
    callback = RecordedWeightAveraging(swa_lrs=0.02, swa_epoch_start=1, annealing_epochs=1)
    outcome = fit_regressor(level, {"max_epochs": 3, "callbacks": [callback]}, data=2)
    first = callback.samples[0]
    if (level is None or level.fp32_weights) and any(not torch.equal(v, outcome.initial[k]) for k, v in first.items()):
        outcome.broken.append("SWA's first sample (at the first epoch's start) is not the fp32 initial weights")
    return outcome


def ema_weight_averaging(level: Level | None) -> Outcome:
    """``EMAWeightAveraging`` over 2 epochs with a validation (the average swapped in and out) between them."""
    callback = EMAWeightAveraging(decay=0.5)
    return fit_regressor(level, {"max_epochs": 2, "callbacks": [callback]}, data=3, validation={"limit_val_batches": 1})


class ManualRecipeRegressor(Regressor):
    """The regressor under manual optimization: ``zero_grad``, ``manual_backward``, ``step``.

    Args:
        discard: None, or a first backward whose gradients the zero_grad throws away before the real one: of
            ``"another loss"``, or of ``"an inf loss"`` (its gradients non-finite).
        zero_grad: how: ``"optimizer"`` (``optimizer.zero_grad()``), ``"optimizer to zero"``
            (``optimizer.zero_grad(set_to_none=False)``) or ``"module"`` (``self.zero_grad()``).

    """

    def __init__(self, discard: str | None = None, zero_grad: str = "optimizer") -> None:
        super().__init__()
        self.automatic_optimization = False
        self.discard, self.zero_grad_by = discard, zero_grad

    @override
    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        x, y = batch
        if self.discard is not None:
            other = self.loss((x.flip(0), 3.0 * y))
            self.manual_backward(other * float("inf") if self.discard == "an inf loss" else other)
        if self.zero_grad_by == "module":
            self.zero_grad()
        else:
            optimizer.zero_grad(set_to_none=self.zero_grad_by == "optimizer")
        self.manual_backward(self.loss(batch))
        optimizer.step()


def manual(level: Level | None) -> Outcome:
    """Manual optimization: ``zero_grad``, ``manual_backward``, ``step``."""
    return fit_module(level, ManualRecipeRegressor(), {"max_steps": 6})


def manual_discarded_backward(discard: str, zero_grad: str) -> Callable[[Level | None], Outcome]:
    """Manual optimization: ``manual_backward`` of ``discard``; ``zero_grad`` by ``zero_grad``; ``manual_backward``;
    ``step``: the step must see the second backward's gradients only (and take no inf from the first)."""

    def recipe(level: Level | None) -> Outcome:
        return fit_module(level, ManualRecipeRegressor(discard, zero_grad), {"max_steps": 6})

    return recipe


def fit_module(level: Level | None, model: L.LightningModule, limits: dict[str, int], data: int = 8) -> Outcome:
    """Fit ``model`` on :func:`recipe_loader` and collect its outcome."""
    initial = snapshot(model)
    plugin = plugin_of(level)
    trainer = make_audited_trainer(plugin, **limits)
    trainer.fit(model, recipe_loader(data))
    return Outcome(initial, snapshot(model), stats_of(plugin), audit_of(trainer))


class ToggledRegressor(Regressor):
    """Manual optimization with one optimizer for the backbone and one for the head, each toggled for its own step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    @override
    def training_step(self, batch: Any, batch_idx: int) -> None:
        for optimizer in self.optimizers():
            self.toggle_optimizer(optimizer)
            self.manual_backward(self.loss(batch))
            optimizer.step()
            optimizer.zero_grad()
            self.untoggle_optimizer(optimizer)

    @override
    def configure_optimizers(self) -> Any:
        return (
            torch.optim.SGD(self.backbone.parameters(), lr=0.05, momentum=0.9),
            torch.optim.SGD(self.head.parameters(), lr=0.05, momentum=0.9),
        )


def toggle_two_optimizers(level: Level | None) -> Outcome:
    """Manual optimization with ``toggle_optimizer`` and two optimizers, each stepping its part of the model."""
    return fit_module(level, ToggledRegressor(), {"max_steps": 8})


class GAN(L.LightningModule):
    """Lightning's GAN recipe, tiny: a generator and a discriminator, each with its optimizer, toggled in turn."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(4, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, FEATURES))
        self.discriminator = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))

    @override
    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, _ = batch
        noise = torch.randn(real.shape[0], 4, generator=torch.Generator().manual_seed(batch_idx))
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        judge = nn.functional.binary_cross_entropy_with_logits
        g_optimizer, d_optimizer = self.optimizers()

        self.toggle_optimizer(g_optimizer)
        g_loss = judge(self.discriminator(self.generator(noise)).float(), ones)
        self.manual_backward(g_loss)
        g_optimizer.step()
        g_optimizer.zero_grad()
        self.untoggle_optimizer(g_optimizer)

        self.toggle_optimizer(d_optimizer)
        fake = self.generator(noise).detach()
        d_loss = (judge(self.discriminator(real).float(), ones) + judge(self.discriminator(fake).float(), zeros)) / 2
        self.manual_backward(d_loss)
        d_optimizer.step()
        d_optimizer.zero_grad()
        self.untoggle_optimizer(d_optimizer)

    @override
    def configure_optimizers(self) -> Any:
        return (
            torch.optim.SGD(self.generator.parameters(), lr=0.1, momentum=0.9),
            torch.optim.SGD(self.discriminator.parameters(), lr=0.1, momentum=0.9),
        )


def gan(level: Level | None) -> Outcome:
    """A GAN's two optimizers under manual optimization."""
    return fit_module(level, GAN(), {"max_steps": 12})


class TiedLanguageModel(L.LightningModule):
    """An embedding, a hidden layer and an output layer that shares the embedding's weight (GPT-2's ``lm_head``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(HIDDEN, HIDDEN)
        self.hidden = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.head.weight = self.embed.weight

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(batch_idx)
        tokens = torch.randint(0, HIDDEN, (BATCH, 4), generator=generator)
        logits = self.head(torch.relu(self.hidden(self.embed(tokens))))
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.roll(1, dims=1).flatten())

    @override
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


def tied_weights(keep_fp32: list[str] | None) -> Callable[[Level | None], Outcome]:
    """An embedding tied to its output layer, with ``keep_fp32`` naming one side (or none) at every level."""

    def recipe(level: Level | None) -> Outcome:
        model = TiedLanguageModel()
        initial = snapshot(model)
        plugin = level.plugin(keep_fp32=keep_fp32) if level is not None else None
        trainer = make_audited_trainer(plugin, max_steps=6)
        trainer.fit(model, recipe_loader(6))
        broken = [] if model.head.weight is model.embed.weight else ["the tie split: head.weight is not embed.weight"]
        return Outcome(initial, snapshot(model), stats_of(plugin), audit_of(trainer), broken=broken)

    return recipe


class SaveAt(L.Callback):
    """Saves a checkpoint at the end of the batch that makes global step ``step``, as ``ModelCheckpoint`` would."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    @override
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def checkpoint_resume(level: Level | None) -> Outcome:
    """A run resumed mid-epoch from a checkpoint of its step 3, by a new process's objects (model, plugin, Trainer),
    must reproduce the uninterrupted run of 6 steps bit for bit."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "step3.ckpt"
        model = Regressor(data_by_step=True)
        initial = snapshot(model)
        plugin = plugin_of(level)
        trainer = make_audited_trainer(plugin, callbacks=[SaveAt(3, path)], max_steps=6)
        trainer.fit(model, recipe_loader(8))
        uninterrupted = Outcome(initial, snapshot(model), stats_of(plugin))

        resumed_model, resumed_plugin = Regressor(data_by_step=True), plugin_of(level)
        resumed_trainer = make_audited_trainer(resumed_plugin, max_steps=6)
        resumed_trainer.fit(resumed_model, recipe_loader(8), ckpt_path=path)
    return Outcome(
        initial,
        snapshot(resumed_model),
        stats_of(resumed_plugin),
        audit_of(trainer) + audit_of(resumed_trainer),
        must_equal=uninterrupted,
    )


def fit_twice(level: Level | None) -> Outcome:
    """One plugin in two Trainers, one ``fit`` after the other on the same model: the second fit must equal the same
    with a fresh plugin (the first fit plants an inf, so that a carried-over scale or counter would show)."""

    def two_fits(reuse: bool) -> tuple[Outcome, Regressor]:
        model = Regressor(plant_inf_at=1) if level is not None else Regressor(skip_at=1)
        initial = snapshot(model)
        plugin = plugin_of(level)
        make_audited_trainer(plugin, max_steps=4).fit(model, recipe_loader(4))
        model.plant_inf_at = model.skip_at = None
        second_plugin = plugin if reuse else plugin_of(level)
        trainer = make_audited_trainer(second_plugin, max_steps=4)
        trainer.fit(model, recipe_loader(4, seed=1))
        return Outcome(initial, snapshot(model), stats_of(second_plugin), audit_of(trainer)), model

    reused, _ = two_fits(reuse=True)
    reused.must_equal, _ = two_fits(reuse=False)
    return reused
