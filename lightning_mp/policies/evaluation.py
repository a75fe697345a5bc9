"""Evaluation in another precision than training: which weights it computes with, and how they are swapped in.

``MixedPrecision(eval_precision=...)`` runs validation, test and predict in one of six precisions while training runs
in its own. :func:`eval_mode` turns the name into what evaluation does:

=================================  ==================================  =============
``eval_precision``                 weights evaluation computes with    autocast
=================================  ==================================  =============
None, or training's own precision  the weights as training holds them  as training
``"16-mixed"``, ``"bf16-mixed"``   fp32                                fp16, bf16
``"32-true"``                      fp32                                off
``"16-true"``, ``"bf16-true"``     fp16, bf16                          off
=================================  ==================================  =============

(``"auto"`` is what ``precision="auto"`` chooses for the device.)

:class:`EvalWeights` makes the weights of one evaluation run, once, from the most precise copy training has: O2's
fp32 master where there is one, else the parameter itself. A tensor already in the wanted dtype is used as it is, so
O2's fp32 masters serve a ``"32-true"`` or ``"-mixed"`` evaluation without a copy, and O2's, O3's and lean's half
weights serve a ``"-true"`` evaluation in their dtype. Like O2, a ``"-true"`` evaluation keeps normalisation layers
and ``keep_fp32`` modules in fp32: they compute in fp32 and hand their output back in the half type
(:class:`~lightning_mp.overrides.Fp32Region`), and a module with half weights casts its floating inputs to their dtype
(:class:`~lightning_mp.policies.casting.MatchParameterDtype`). Batch norms' running statistics stay as they are.

Around each evaluation step, :meth:`EvalWeights.swapped_in` points each parameter and buffer at its evaluation tensor
(``tensor.data``, so every parameter stays the object the model, the optimizer and the user hold), attaches those
hooks, and on the way out, raised or not, points every tensor back and removes the hooks. Evaluation therefore
changes nothing of training: the training tensors are never written, and gradients, optimizer states, masters, the
loss scaler and the random number generators are not touched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_mp.overrides import Fp32Overrides, Fp32Region, has_fp32_region, has_hooks
from lightning_mp.policies.casting import HALF_DTYPES, MatchParameterDtype, is_normalization, keep_tied_weights_together

__all__ = ["EVAL_HALF_DTYPES", "EvalMode", "EvalWeights", "eval_mode"]

EVAL_HALF_DTYPES = {
    "16-mixed": torch.float16,
    "bf16-mixed": torch.bfloat16,
    "16-true": torch.float16,
    "bf16-true": torch.bfloat16,
}
"""The half dtype of each evaluation precision that has one."""


@dataclass(frozen=True)
class EvalMode:
    """What an evaluation step computes with (module docstring's table)."""

    precision: str
    """The evaluation precision, resolved (``"auto"`` chosen, None made training's)."""
    as_training: bool
    """Whether evaluation runs as training does: nothing is swapped and the forward context is training's."""
    weight_dtype: torch.dtype | None = None
    """The dtype of the weights evaluation computes with; None where it is as training."""
    autocast_dtype: torch.dtype | None = None
    """The dtype autocast runs in during evaluation; None for no autocast (or as training)."""


def eval_mode(
    eval_precision: str | None, training_precisions: Iterable[str], auto_choice: Callable[[], str]
) -> EvalMode:
    """What evaluation in ``eval_precision`` computes with, for a run that trains in ``training_precisions``.

    Args:
        eval_precision: the setting: None, ``"auto"``, or one of the six precision names.
        training_precisions: the names training's precision goes by (``"bf16-mixed"``, and ``"bf16-true"`` where the
            level keeps half weights with no masters); evaluation in one of them runs as training.
        auto_choice: what ``precision="auto"`` chooses on the run's device.

    Example:
        >>> eval_mode("bf16-true", ["16-mixed"], lambda: "bf16-mixed")
        EvalMode(precision='bf16-true', as_training=False, weight_dtype=torch.bfloat16, autocast_dtype=None)

    """
    training = list(training_precisions)
    precision = auto_choice() if eval_precision == "auto" else eval_precision
    if precision is None or precision in training:
        return EvalMode(training[0] if precision is None else precision, as_training=True)
    half = EVAL_HALF_DTYPES.get(precision)
    if precision.endswith("-true"):
        return EvalMode(precision, False, weight_dtype=half or torch.float32)
    return EvalMode(precision, False, weight_dtype=torch.float32, autocast_dtype=half)


class EvalWeights:
    """The parameters and buffers one evaluation run computes with, made once; swapped in around each step.

    Args:
        modules: the models the run evaluates.
        dtype: the dtype of the weights evaluation computes with (:attr:`EvalMode.weight_dtype`).
        keep_fp32: the plugin's ``keep_fp32`` patterns; their modules keep their weights under a half ``dtype``.
        master_of: the most precise copy training keeps of a parameter (O2: its fp32 master; else itself).

    """

    def __init__(
        self,
        modules: Iterable[nn.Module],
        dtype: torch.dtype,
        keep_fp32: Iterable[type | str],
        master_of: Callable[[Tensor], Tensor],
    ) -> None:
        self.dtype = dtype
        self.swaps: list[tuple[Tensor, Tensor]] = []
        """``(tensor of the model, tensor evaluation computes with)``, one per tensor whose dtype changes."""
        self.copied_bytes = 0
        """The bytes of the copies made for this run (tensors used as they are cost none)."""
        self._half_modules: list[tuple[nn.Module, str]] = []
        self._fp32_modules: list[nn.Module] = []
        seen: set[int] = set()
        with torch.no_grad():
            for module in modules:
                self._plan(module, list(keep_fp32), master_of, seen)

    def _plan(
        self, module: nn.Module, keep_fp32: list[type | str], master_of: Callable[[Tensor], Tensor], seen: set[int]
    ) -> None:
        half = self.dtype in HALF_DTYPES
        kept: set[nn.Module] = set()
        if half:
            overrides = keep_tied_weights_together(module, Fp32Overrides(keep_fp32))
            kept = overrides.kept_modules(module)
        for child in module.modules():
            tensors = [
                *(p for p in child.parameters(recurse=False) if not isinstance(p, nn.UninitializedParameter)),
                *(b for b in child.buffers(recurse=False) if not isinstance(b, nn.UninitializedBuffer)),
            ]
            floating = [t for t in tensors if t.is_floating_point() and t.dtype != torch.float64]
            if half and (
                child in kept or (is_normalization(child) and all(t.dtype == torch.float32 for t in floating))
            ):
                if child not in kept and floating:
                    self._fp32_modules.append(child)
                continue
            for tensor in floating:
                if id(tensor) not in seen and tensor.dtype != self.dtype:
                    seen.add(id(tensor))
                    self.swaps.append((tensor, self._evaluation_tensor(tensor, master_of)))
            weight = next((n for n, p in child.named_parameters(recurse=False) if p.is_floating_point()), None)
            if half and weight is not None and type(child) is not nn.Embedding:
                self._half_modules.append((child, weight))

    def _evaluation_tensor(self, tensor: Tensor, master_of: Callable[[Tensor], Tensor]) -> Tensor:
        source = master_of(tensor).detach() if isinstance(tensor, nn.Parameter) else tensor.detach()
        if source.dtype == self.dtype:
            return source
        self.copied_bytes += source.numel() * self.dtype.itemsize
        return source.to(self.dtype)

    @contextlib.contextmanager
    def swapped_in(self) -> Generator[None, None, None]:
        """Point every tensor at its evaluation tensor and attach the hooks; undo both on the way out."""
        originals = [tensor.data for tensor, _ in self.swaps]
        handles: list[RemovableHandle] = []
        try:
            for tensor, evaluation in self.swaps:
                tensor.data = evaluation
            for module, weight in self._half_modules:
                if not has_hooks(module, MatchParameterDtype):
                    handles.append(module.register_forward_pre_hook(MatchParameterDtype(weight), with_kwargs=True))
            for module in self._fp32_modules:
                if not has_fp32_region(module):
                    handles += Fp32Region(restore_output_dtype=True).attach(module)
            yield
        finally:
            for handle in handles:
                handle.remove()
            for (tensor, _), original in zip(self.swaps, originals, strict=True):
                tensor.data = original
