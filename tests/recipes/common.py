"""What every recipe shares: the levels and their bounds, the outcome of a run, the data, the MLP, the audited
Trainer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
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
        """Whether the model's own weights are fp32 (O0, O1), as against half ones (O2's, whose fp32 masters stay out
        of sight, O3's and lean's): a callback that samples them (SWA) samples half values at the others."""
        return self.opt_level in ("O0", "O1")

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
    Level("bf16-mixed", "lean-exact", 32, _ROUNDS_HALF),
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


def recipe_loader(count: int, seed: int = 0) -> DataLoader:
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


def make_audited_trainer(
    plugin: MixedPrecision | None, callbacks: list[L.Callback] | None = None, **kwargs: Any
) -> L.Trainer:
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
