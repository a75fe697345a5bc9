"""One run's evaluation in ``eval_precision``: the models it evaluates and the weights of the evaluation in progress.

The Trainer calls the plugin's ``val_step_context``, ``test_step_context`` and ``predict_step_context`` around each
evaluation step, but nothing at the start or the end of an evaluation loop. So :class:`Evaluation` makes the
weights (:class:`~lightning_mp.policies.evaluation.EvalWeights`) at the first evaluation step after training last
changed them, keeps them across the loop's steps, and drops them when training takes its next step, when the run
ends (the teardown that closes ``fit``, ``validate``, ``test`` and ``predict``), or when a ``plugin.evaluation()``
block ends. Fabric has no evaluation steps of its own: ``with plugin.evaluation():`` is one evaluation run there,
its weights made when the block opens and dropped when it closes.

While an evaluation step or block is open, :attr:`Evaluation.active` is true and the plugin's forward context runs
autocast as the evaluation precision says (:class:`~lightning_mp.policies.evaluation.EvalMode`) instead of as
training does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any

from torch import nn

from lightning_mp.arguments.checks import caller
from lightning_mp.policies.base import PrecisionPolicy
from lightning_mp.policies.casting import HALF_DTYPES
from lightning_mp.policies.evaluation import EvalMode, EvalWeights

__all__ = ["Evaluation", "refuse_swapped_weights_when_sharded"]


class Evaluation:
    """The models one run evaluates, and the weights of the evaluation run in progress (module docstring).

    Args:
        policy: the run's opt level, whose masters are the most precise copy of its parameters.

    """

    def __init__(self, policy: PrecisionPolicy) -> None:
        self.policy = policy
        self.modules: list[nn.Module] = []
        """The models set up with the plugin: the LightningModule, or each model given to ``fabric.setup``."""
        self.weights: EvalWeights | None = None
        """The weights of the evaluation run in progress; None between evaluation runs and where none are needed."""
        self.active = False
        """Whether an evaluation step or block is open: the forward context then runs the evaluation's autocast."""

    def __getstate__(self) -> dict[str, Any]:
        """Pickle (and deep-copy) no model and no weights: a copy of the plugin keeps no tie to a running loop."""
        return {**self.__dict__, "modules": [], "weights": None, "active": False}

    def track(self, module: nn.Module) -> None:
        """Evaluate ``module`` too (each model the plugin converts)."""
        if not any(known is module for known in self.modules):
            self.modules.append(module)

    @contextlib.contextmanager
    def step(self, mode: EvalMode) -> Generator[None, None, None]:
        """One evaluation step in ``mode``: the run's weights swapped in (made at its first step), ``active`` set."""
        if self.active or mode.as_training:
            yield
            return
        if self.weights is None and mode.weight_dtype is not None:
            self.weights = EvalWeights(self.modules, mode.weight_dtype, self.policy.keep_fp32, self.policy.master_param)
        swapped = self.weights.swapped_in() if self.weights is not None else contextlib.nullcontext()
        self.active = True
        try:
            with swapped:
                yield
        finally:
            self.active = False

    @contextlib.contextmanager
    def block(self, mode: EvalMode) -> Generator[None, None, None]:
        """A whole evaluation run in ``mode`` (``plugin.evaluation()``): its weights are dropped when it closes."""
        outermost = not self.active
        try:
            with self.step(mode):
                yield
        finally:
            if outermost:
                self.drop()

    def drop(self) -> None:
        """Free the evaluation run's weights: training is about to change its own, or the run ended."""
        self.weights = None

    def teardown(self) -> None:
        """Forget the models and the weights: the run ended."""
        self.drop()
        self.modules = []


def refuse_swapped_weights_when_sharded(mode: EvalMode, policy_class: type[PrecisionPolicy]) -> None:
    """Refuse an evaluation precision that needs other weights than a sharded model computes with.

    A sharded model gathers its parameters from shards for each forward, so evaluation cannot point them at other
    tensors. Autocast in another type over fp32 weights, or none, needs no other weights and is allowed.

    Raises:
        ValueError: naming ``eval_precision``, the opt level and what is allowed instead.

    """
    if mode.as_training or (mode.weight_dtype not in HALF_DTYPES and not policy_class.computes_with_half_weights):
        return
    raise ValueError(
        f"{caller()}(opt_level={policy_class.opt_level!r}, eval_precision={mode.precision!r}) is not allowed on a"
        " sharded model: its parameters are gathered from shards for each forward, so evaluation cannot compute with"
        " other weights. Evaluate in the training precision (eval_precision=None), or at O1 in another autocast"
        " ('16-mixed', 'bf16-mixed') or in '32-true'."
    )
