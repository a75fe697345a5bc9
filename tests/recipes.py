"""Lightning's documented training recipes, each runnable at any opt level or in plain fp32, for ``test_recipes.py``.

Every recipe is a function of a :class:`Level` (or None, for plain fp32 with no plugin at all) that trains a tiny
model from the same seed on the same in-process data and returns an :class:`Outcome`: the weights before and after,
the plugin's counters, and what the run must also satisfy (the parameters an optimizer held twice, a run it must
reproduce bit for bit, invariants such as "the tie held"). The test module compares each opt level's outcome with the
fp32 one of the same recipe.

How close is close enough is stated per level in :data:`LEVELS`, as a relative error of the trained change: for each
tensor, ``|w - w_fp32| / |w_fp32 - w_initial|`` (Frobenius norms). Measuring the change rather than the weights keeps
the bound meaningful over a handful of steps, where the weights barely leave their initial values. The bounds are
multiples of the half type's machine epsilon (``2**-10`` for fp16, ``2**-7`` for bf16), because rounding to half is
what separates a correct mixed-precision run from fp32; each is about twice the worst error measured over all the
recipes, and every defect this matrix was built to catch is off by 0.9 or more:

- O0 (the plugin's fp32 baseline) runs fp32's own operations: 1e-5 (summation order only).
- O1 and O2 compute in half but step fp32 weights: 32 epsilons (worst measured 12.5 in fp16, 16.6 in bf16; bf16's
  rounded outputs cancel against the targets in the loss's residual).
- O3 steps half weights rounded to nearest: 64 epsilons (torch's own half SGD measures 14 in fp16 and 11 in bf16, the
  plugin's O3 AdamW 30 in bf16). With Adam in fp16 it is not compared (only that every tensor trained): the second
  moments underflow, and torch's own fp16 AdamW ends 5x off fp32 on these tasks.
- lean and lean-kahan step bf16 weights with stochastic rounding, about one bf16 gap of noise per step: 64 epsilons
  (worst measured 44 and 27, both in the GAN's generator, whose gradients are the smallest).

fp16 runs start from a loss scale of ``2**8``, which these tasks' gradients never overflow, so every step is taken and
the comparison with fp32 is step for step; :func:`planted_inf` then plants one inf that every level must skip.

The recipes (:data:`RECIPES`) are the ones Lightning documents: automatic optimization (SGD, AdamW),
``accumulate_grad_batches``, stepping every N batches by overriding ``optimizer_step``, manual optimization (a
backward discarded by each kind of ``zero_grad``, one whose discarded gradients are inf, ``toggle_optimizer`` with two
optimizers, a GAN), norm and value clipping, step and epoch schedulers, ``BackboneFinetuning`` with and without an
evaluation before its first epoch, ``StochasticWeightAveraging``, ``EMAWeightAveraging``, checkpoint and resume
mid-epoch, ``fit`` twice with one plugin, a plugin moved between a Trainer and Fabric both ways, tied weights with and
without ``keep_fp32`` on either side, and Fabric's own loop (``no_backward_sync`` accumulation, a discarded backward).
"""

from __future__ import annotations

import csv
import functools
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    EMAWeightAveraging,
    LearningRateMonitor,
    ModelSummary,
    StochasticWeightAveraging,
)
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_mp import MixedPrecision
from lightning_mp.scaling.stats import PrecisionStats
from tests import helpers

FEATURES = 8
HIDDEN = 16
BATCH = 8
FP16_INIT_SCALE = 2.0**8
"""The fp16 runs' first loss scale: these tasks' gradients never overflow it, so no step is skipped."""

Weights = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Level:
    """One precision and opt level of the matrix, with the bound its runs must meet against fp32.

    Attributes:
        precision: the plugin's precision.
        opt_level: the plugin's opt level.
        epsilons: the bound on each tensor's relative error of the trained change, in epsilons of ``dtype``.
        why: the reason for that bound.
        compares_adam: whether the bound holds with Adam too (else a recipe with Adam checks only that every
            tensor trained).

    """

    precision: str
    opt_level: str
    epsilons: float
    why: str
    compares_adam: bool = True

    @property
    def id(self) -> str:
        """The test id: ``fp16-O2``, ``bf16-lean``, ``fp32-O0``."""
        short = {"16-mixed": "fp16", "bf16-mixed": "bf16", "32-true": "fp32"}[self.precision]
        return f"{short}-{self.opt_level}"

    @property
    def dtype(self) -> torch.dtype:
        """The half type the level computes in (fp32 for the fp32 baseline)."""
        return {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(self.precision, torch.float32)

    @property
    def tolerance(self) -> float:
        """The bound on ``|w - w_fp32| / |w_fp32 - w_initial|`` for every tensor (with SGD; see ``compares_adam``)."""
        if self.precision == "32-true":
            return 1e-5
        return self.epsilons * torch.finfo(self.dtype).eps

    @property
    def fp32_weights(self) -> bool:
        """Whether the model keeps fp32 weights between steps (O0, O1, O2's masters), as against half ones."""
        return self.opt_level in ("O0", "O1", "O2")

    def plugin(self, **kwargs: Any) -> MixedPrecision:
        """A fresh plugin at this level (fp16 from a loss scale no gradient of these tasks overflows)."""
        if self.precision == "16-mixed":
            kwargs.setdefault("init_scale", FP16_INIT_SCALE)
        return MixedPrecision(self.precision, opt_level=self.opt_level, **kwargs)


_ROUNDS_HALF = "computes in half, steps fp32 weights: only the half activations and gradients round"
_ROUNDS_WEIGHTS = "steps half weights, rounding each weight to nearest at every step"
_ROUNDS_STOCHASTICALLY = "steps bf16 weights with stochastic rounding: unbiased, about one bf16 gap of noise per step"
LEVELS: tuple[Level, ...] = (
    Level("32-true", "O0", 0, "the plugin's fp32 baseline runs fp32's own operations: only summation order differs"),
    Level("16-mixed", "O1", 32, _ROUNDS_HALF),
    Level("16-mixed", "O2", 32, _ROUNDS_HALF),
    Level(
        "16-mixed",
        "O3",
        64,
        _ROUNDS_WEIGHTS + "; with Adam not compared: fp16 second moments underflow (g**2 < 6e-8 is 0)",
        compares_adam=False,
    ),
    Level("bf16-mixed", "O1", 32, _ROUNDS_HALF),
    Level("bf16-mixed", "O2", 32, _ROUNDS_HALF),
    Level("bf16-mixed", "O3", 64, _ROUNDS_WEIGHTS),
    Level("bf16-mixed", "lean", 64, _ROUNDS_STOCHASTICALLY),
    Level("bf16-mixed", "lean-kahan", 64, _ROUNDS_STOCHASTICALLY + ", carrying each rounding error to the next step"),
)
"""The matrix's levels: every opt level at every precision it runs at (O0 is fp32 only, lean bf16 only)."""


@dataclass
class Outcome:
    """What one run of a recipe produced, and what it must also satisfy.

    Attributes:
        initial: the trained model's weights before training (fp32 copies, by name).
        final: its weights after training (fp32 copies, by name).
        stats: the plugin's counters at the end (None without a plugin).
        duplicated: parameters an optimizer held twice, found at any step (must be empty).
        must_equal: a run this one must reproduce bit for bit (an uninterrupted run, a fresh plugin's).
        broken: invariants of the recipe that did not hold (must be empty).

    """

    initial: Weights
    final: Weights
    stats: PrecisionStats | None = None
    duplicated: list[str] = field(default_factory=list)
    must_equal: Outcome | None = None
    broken: list[str] = field(default_factory=list)


def snapshot(module: nn.Module) -> Weights:
    """fp32 copies of every floating tensor of ``module``'s state dict, by name."""
    return {
        name: value.detach().float().clone() for name, value in module.state_dict().items() if value.is_floating_point()
    }


def relative_change_errors(outcome: Outcome, reference: Outcome) -> dict[str, float]:
    """Each tensor's ``|w - w_fp32| / |w_fp32 - w_initial|``: the error of the trained change, relative to fp32's."""
    errors = {}
    for name, expected in reference.final.items():
        change = (expected - reference.initial[name]).norm().item()
        errors[name] = (outcome.final[name] - expected).norm().item() / max(change, 1e-12)
    return errors


# ----------------------------------------------------------------------------------------------------------- data


def batches(count: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` seeded regression batches: a smooth nonlinear target of 8 features, with a little noise."""
    generator = torch.Generator().manual_seed(seed)
    weights = torch.randn(FEATURES, 1, generator=generator)
    made = []
    for _ in range(count):
        x = torch.randn(BATCH, FEATURES, generator=generator)
        made.append((x, torch.tanh(x @ weights) + 0.1 * torch.randn(BATCH, 1, generator=generator)))
    return made


def loader(count: int, seed: int = 0) -> DataLoader:
    """A loader of :func:`batches`, in order."""
    pairs = batches(count, seed)
    x, y = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


def batch_for_step(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of global step ``step``, not the loader's: a resumed run sees what an uninterrupted one saw."""
    return batches(1, seed=1000 + step)[0]


def mlp() -> nn.Sequential:
    """The 3-layer MLP every recipe trains (seeded), as ``backbone`` (two layers) and ``head``."""
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU())
    return nn.Sequential(backbone, nn.Linear(HIDDEN, 1))


def make_trainer(plugin: MixedPrecision | None, callbacks: list[L.Callback] | None = None, **kwargs: Any) -> L.Trainer:
    """The suite's quiet single-CPU Trainer (:func:`tests.helpers.make_trainer`) with ``plugin`` (plain fp32 without
    one), an :class:`OptimizerAudit`, no sanity check and no step limit unless given."""
    options: dict[str, Any] = {"max_steps": -1, "num_sanity_val_steps": 0, **kwargs}
    return helpers.make_trainer(plugin, callbacks=[OptimizerAudit(), *(callbacks or [])], **options)


class OptimizerAudit(L.Callback):
    """Records, before every optimizer step, the parameters any optimizer holds more than once."""

    def __init__(self) -> None:
        self.duplicated: list[str] = []

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.duplicated += duplicated_parameters(trainer.optimizers, pl_module)


def duplicated_parameters(optimizers: list[Any], module: nn.Module) -> list[str]:
    """The tensors an optimizer of ``optimizers`` holds more than once, named by the module where it can."""
    names = {id(parameter): name for name, parameter in module.named_parameters(remove_duplicate=False)}
    found = []
    for optimizer in optimizers:
        seen: set[int] = set()
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                if id(parameter) in seen:
                    found.append(names.get(id(parameter), f"a {tuple(parameter.shape)} tensor"))
                seen.add(id(parameter))
    return found


def audit_of(trainer: L.Trainer) -> list[str]:
    """What the trainer's :class:`OptimizerAudit` found."""
    return next(callback.duplicated for callback in trainer.callbacks if isinstance(callback, OptimizerAudit))


def stats_of(plugin: MixedPrecision | None) -> PrecisionStats | None:
    return plugin.stats if plugin is not None else None


def plugin_of(level: Level | None) -> MixedPrecision | None:
    return level.plugin() if level is not None else None


# --------------------------------------------------------------------------------------------------------- modules


class Regressor(L.LightningModule):
    """The MLP under automatic optimization, with the knobs the recipes turn.

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
    trainer = make_trainer(plugin, **trainer_options, **(validation or {}))
    trainer.fit(model, loader(data), loader(2, seed=7) if validation is not None else None)
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
    """Fit ``model`` on :func:`loader` and collect its outcome."""
    initial = snapshot(model)
    plugin = plugin_of(level)
    trainer = make_trainer(plugin, **limits)
    trainer.fit(model, loader(data))
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
        trainer = make_trainer(plugin, max_steps=6)
        trainer.fit(model, loader(6))
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
        trainer = make_trainer(plugin, callbacks=[SaveAt(3, path)], max_steps=6)
        trainer.fit(model, loader(8))
        uninterrupted = Outcome(initial, snapshot(model), stats_of(plugin))

        resumed_model, resumed_plugin = Regressor(data_by_step=True), plugin_of(level)
        resumed_trainer = make_trainer(resumed_plugin, max_steps=6)
        resumed_trainer.fit(resumed_model, loader(8), ckpt_path=path)
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
        make_trainer(plugin, max_steps=4).fit(model, loader(4))
        model.plant_inf_at = model.skip_at = None
        second_plugin = plugin if reuse else plugin_of(level)
        trainer = make_trainer(second_plugin, max_steps=4)
        trainer.fit(model, loader(4, seed=1))
        return Outcome(initial, snapshot(model), stats_of(second_plugin), audit_of(trainer)), model

    reused, _ = two_fits(reuse=True)
    reused.must_equal, _ = two_fits(reuse=False)
    return reused


def fabric_loop(
    plugin: MixedPrecision | None, plant_inf_at: int | None = None, accumulate: int = 2, steps: int = 4
) -> Outcome:
    """Fabric's own loop: ``fabric.backward`` under ``no_backward_sync`` for ``accumulate`` micro-batches, then
    ``fabric.clip_gradients`` by norm, ``optimizer.step()`` and ``optimizer.zero_grad()``; ``plugin.teardown()`` at the
    end, as the README asks."""
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin] if plugin is not None else None)
    model = mlp()
    initial = snapshot(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    for index, (x, y) in enumerate(batches(steps * accumulate, seed=2)):
        stepping = (index + 1) % accumulate == 0
        with fabric.no_backward_sync(model, enabled=not stepping):
            fabric.backward(nn.functional.mse_loss(model(x).float(), y) / accumulate)
        if index // accumulate == plant_inf_at:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        if stepping:
            fabric.clip_gradients(model, optimizer, max_norm=0.3)
            optimizer.step()
            optimizer.zero_grad()
    stats = stats_of(plugin)
    if plugin is not None:
        plugin.teardown()
    return Outcome(initial, snapshot(model), stats, duplicated_parameters([optimizer], model))


def fabric_discarded_backward(level: Level | None) -> Outcome:
    """Fabric: ``fabric.backward`` of another loss, ``optimizer.zero_grad()``, ``fabric.backward``,
    ``optimizer.step()``: the step must see the second backward's gradients only."""
    plugin = plugin_of(level)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin] if plugin is not None else None)
    model = mlp()
    initial = snapshot(model)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for x, y in batches(4, seed=3):
        fabric.backward(nn.functional.mse_loss(model(x.flip(0)).float(), 3.0 * y))
        optimizer.zero_grad()
        fabric.backward(nn.functional.mse_loss(model(x).float(), y))
        optimizer.step()
        optimizer.zero_grad()
    stats = stats_of(plugin)
    if plugin is not None:
        plugin.teardown()
    return Outcome(initial, snapshot(model), stats, duplicated_parameters([optimizer], model))


def fabric(level: Level | None) -> Outcome:
    """Fabric's backward / clip_gradients / step loop with ``no_backward_sync`` accumulation."""
    return fabric_loop(plugin_of(level))


def trainer_then_fabric(level: Level | None) -> Outcome:
    """A plugin that trained under a Trainer (with a skipped step) then drives a Fabric loop: the loop must equal a
    fresh plugin's."""
    plugin = plugin_of(level)
    make_trainer(plugin, max_steps=4).fit(Regressor(plant_inf_at=1), loader(4))
    outcome = fabric_loop(plugin)
    outcome.must_equal = fabric_loop(plugin_of(level))
    return outcome


def fabric_then_trainer(level: Level | None) -> Outcome:
    """A plugin that drove a Fabric loop (with a skipped step) then trains under a Trainer: the fit must equal a fresh
    plugin's."""

    def fit_fresh_regressor(plugin: MixedPrecision | None) -> Outcome:
        model = Regressor()
        initial = snapshot(model)
        trainer = make_trainer(plugin, max_steps=6)
        trainer.fit(model, loader(8))
        return Outcome(initial, snapshot(model), stats_of(plugin), audit_of(trainer))

    plugin = plugin_of(level)
    fabric_loop(plugin, plant_inf_at=1 if level is not None else None)
    outcome = fit_fresh_regressor(plugin)
    outcome.must_equal = fit_fresh_regressor(plugin_of(level))
    return outcome


RECIPES: dict[str, Callable[[Level | None], Outcome]] = {
    "automatic": automatic,
    "automatic_adamw": automatic_adamw,
    "planted_inf": planted_inf,
    "accumulate_grad_batches": accumulate_grad_batches,
    "step_every_n": step_every_n,
    "manual": manual,
    "manual_discarded_backward": manual_discarded_backward("another loss", "optimizer"),
    "manual_discarded_backward_set_to_zero": manual_discarded_backward("another loss", "optimizer to zero"),
    "manual_module_zero_grad_after_backward": manual_discarded_backward("another loss", "module"),
    "manual_discarded_inf": manual_discarded_backward("an inf loss", "optimizer"),
    "toggle_two_optimizers": toggle_two_optimizers,
    "gan": gan,
    "clip_norm": clip_norm,
    "clip_value": clip_value,
    "step_scheduler": step_scheduler,
    "epoch_scheduler": epoch_scheduler,
    "backbone_finetuning_validation": backbone_finetuning({"limit_val_batches": 1, "num_sanity_val_steps": 1}),
    "backbone_finetuning_no_sanity_check": backbone_finetuning({"limit_val_batches": 1, "num_sanity_val_steps": 0}),
    "backbone_finetuning_no_validation": backbone_finetuning(None),
    "stochastic_weight_averaging": stochastic_weight_averaging,
    "ema_weight_averaging": ema_weight_averaging,
    "checkpoint_resume_mid_epoch": checkpoint_resume,
    "fit_twice": fit_twice,
    "trainer_then_fabric": trainer_then_fabric,
    "fabric_then_trainer": fabric_then_trainer,
    "tied_weights": tied_weights(None),
    "tied_weights_keep_embedding": tied_weights(["embed"]),
    "tied_weights_keep_head": tied_weights(["head"]),
    "fabric_no_backward_sync": fabric,
    "fabric_discarded_backward": fabric_discarded_backward,
}
"""Every recipe by name; each takes a :class:`Level` (None: plain fp32, no plugin)."""


ADAM_RECIPES = frozenset({"automatic_adamw", "planted_inf"})
"""The recipes that train with AdamW (the others use SGD with momentum)."""


@functools.cache
def fp32_reference(recipe: str) -> Outcome:
    """The recipe in plain fp32 (no plugin), run once per test session."""
    return RECIPES[recipe](None)


def half_parameters_skipped_by_fused_sgd() -> bool:
    """Whether this torch's fused SGD on the CPU leaves a half-precision parameter of 16 elements unchanged (it skips
    the vectorised blocks in some releases: pytorch issue 191763, fixed by PR 192545)."""
    parameter = nn.Parameter(torch.ones(16, dtype=torch.float16))
    parameter.grad = torch.ones_like(parameter)
    torch.optim.SGD([parameter], lr=0.5, fused=True).step()
    return bool((parameter == 1).all())
