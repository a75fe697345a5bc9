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

import functools
from collections.abc import Callable

from tests.recipes.common import (
    FP16_INIT_SCALE,
    LEVELS,
    Level,
    Outcome,
    relative_change_errors,
)
from tests.recipes.fabric_recipes import (
    fabric,
    fabric_discarded_backward,
    fabric_then_trainer,
    trainer_then_fabric,
)
from tests.recipes.trainer_recipes import (
    accumulate_grad_batches,
    automatic,
    automatic_adamw,
    backbone_finetuning,
    checkpoint_resume,
    clip_norm,
    clip_value,
    ema_weight_averaging,
    epoch_scheduler,
    fit_twice,
    gan,
    manual,
    manual_discarded_backward,
    planted_inf,
    step_every_n,
    step_scheduler,
    stochastic_weight_averaging,
    tied_weights,
    toggle_two_optimizers,
)

__all__ = [
    "ADAM_RECIPES",
    "FP16_INIT_SCALE",
    "LEVELS",
    "RECIPES",
    "Level",
    "Outcome",
    "fp32_reference",
    "relative_change_errors",
]

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
