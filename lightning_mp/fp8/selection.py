"""Which linear layers run in FP8: pure rules over the model's linear layers, and the one-line setup summary.

Every ``nn.Linear`` of the model (subclasses included, in ``named_modules`` order) is either chosen for FP8 or kept
in bf16 with a reason. The rules, in the order they are asked (the first that applies gives the reason):

1. ``excluded``: an ``exclude`` pattern matches the layer or a module above it (a module type, a qualified name,
   or a ``"re:"`` regular expression matched against the whole qualified name), as ``keep_fp32`` matches.
2. ``first linear`` / ``last linear``: with ``keep_first_last`` (the default), the first and the last linear layer
   stay bf16. They see the rawest inputs (embeddings) and make the outputs the loss reads directly (the head), where
   FP8's 3 mantissa bits cost the most and their matmuls are a small share of the work.
3. ``dims not divisible by 16``: FP8 matmul kernels (``torch._scaled_mm``) need both the input and the output
   features to be multiples of 16.
4. ``fell back``: the layer returned to bf16 during the run (:func:`lightning_mp.fp8.convert.restore_linear`), and
   stays there after a resume.

A model that is itself one ``nn.Linear`` is kept (it is its own first and last layer, and torchao would replace it
rather than convert it in place).

The rules read only module types, names and shapes, so :func:`select_fp8_layers` needs no torchao and no device;
:func:`summary_line` writes the setup log line, for example::

    FP8 (tensorwise): 4 of 6 linear layers, 2.1M of 2.4M linear parameters; bf16: embed_proj (first linear),
    lm_head (last linear)
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from torch import nn

from lightning_mp.fp8.settings import REGEX_PREFIX, ExcludePattern, FP8Settings

__all__ = ["Fp8Selection", "KeptReason", "select_fp8_layers", "summary_line"]

KeptReason = str
FP8_DIM_MULTIPLE = 16
"""``torch._scaled_mm`` needs the inner and outer dimensions of FP8 operands to be multiples of 16."""


@dataclass(frozen=True)
class Fp8Selection:
    """The outcome of the rules: the FP8 layers, the kept ones with their reasons, and parameter counts.

    Attributes:
        fp8: qualified names of the linear layers that run in FP8, in ``named_modules`` order.
        kept: qualified name -> reason, for every linear layer that stays bf16.
        fp8_parameters: parameters (weight and bias elements) of the FP8 layers.
        linear_parameters: parameters of all linear layers.

    """

    fp8: tuple[str, ...]
    kept: dict[str, KeptReason] = field(default_factory=dict)
    fp8_parameters: int = 0
    linear_parameters: int = 0


def _matches(pattern: ExcludePattern, name: str, module: nn.Module) -> bool:
    if isinstance(pattern, type):
        return isinstance(module, pattern)
    if pattern.startswith(REGEX_PREFIX):
        return re.fullmatch(pattern[len(REGEX_PREFIX) :], name) is not None
    return name == pattern


def _excluded_roots(model: nn.Module, patterns: Sequence[ExcludePattern]) -> list[str]:
    """Qualified names of the modules an ``exclude`` pattern matches: each keeps its whole subtree in bf16."""
    return [
        name for name, module in model.named_modules() if any(_matches(pattern, name, module) for pattern in patterns)
    ]


def _under(name: str, roots: Collection[str]) -> bool:
    return any(root == "" or name == root or name.startswith(root + ".") for root in roots)


def _parameter_count(layer: nn.Linear) -> int:
    return sum(parameter.numel() for parameter in layer.parameters(recurse=False))


def select_fp8_layers(model: nn.Module, settings: FP8Settings, fell_back: Collection[str] = ()) -> Fp8Selection:
    """Apply the rules (module docstring) to every linear layer of ``model``.

    Args:
        model: the model; names are relative to it.
        settings: the FP8 settings (``keep_first_last``, ``exclude``).
        fell_back: layers that returned to bf16 earlier in the run (a resumed checkpoint's).

    Example:
        >>> model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 10), nn.Linear(10, 4))
        >>> selection = select_fp8_layers(model, FP8Settings())
        >>> selection.fp8, selection.kept
        (('2',), {'0': 'first linear', '3': 'dims not divisible by 16', '4': 'last linear'})

    """
    linears = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    excluded = _excluded_roots(model, settings.exclude or ())
    ends = {linears[0][0]: "first linear", linears[-1][0]: "last linear"} if linears else {}
    fp8: list[str] = []
    kept: dict[str, KeptReason] = {}
    fp8_parameters = 0
    for name, layer in linears:
        if name == "":
            kept[name] = "the model itself"
        elif _under(name, excluded):
            kept[name] = "excluded"
        elif settings.keep_first_last and name in ends:
            kept[name] = ends[name]
        elif layer.in_features % FP8_DIM_MULTIPLE or layer.out_features % FP8_DIM_MULTIPLE:
            kept[name] = f"dims not divisible by {FP8_DIM_MULTIPLE}"
        elif name in fell_back:
            kept[name] = "fell back"
        else:
            fp8.append(name)
            fp8_parameters += _parameter_count(layer)
    return Fp8Selection(
        fp8=tuple(fp8),
        kept=kept,
        fp8_parameters=fp8_parameters,
        linear_parameters=sum(_parameter_count(layer) for _, layer in linears),
    )


def _count(number: int) -> str:
    for threshold, suffix in ((10**9, "B"), (10**6, "M"), (10**3, "K")):
        if number >= threshold:
            return f"{number / threshold:.1f}{suffix}"
    return str(number)


def summary_line(selection: Fp8Selection, recipe: str, shown: int = 8) -> str:
    """One line: how many layers and parameters run FP8, and which stay bf16 and why (the first ``shown`` of them).

    Example:
        >>> print(summary_line(Fp8Selection(("b",), {"a": "first linear", "c": "excluded"}, 1056, 1600), "rowwise"))
        FP8 (rowwise): 1 of 3 linear layers, 1.1K of 1.6K linear parameters; bf16: a (first linear), c (excluded)

    """
    total = len(selection.fp8) + len(selection.kept)
    line = (
        f"FP8 ({recipe}): {len(selection.fp8)} of {total} linear layers, {_count(selection.fp8_parameters)} of"
        f" {_count(selection.linear_parameters)} linear parameters"
    )
    if not selection.kept:
        return line + "; bf16: none"
    listed = [f"{name or '<model>'} ({reason})" for name, reason in list(selection.kept.items())[:shown]]
    more = len(selection.kept) - len(listed)
    return line + "; bf16: " + ", ".join(listed) + (f" and {more} more" if more else "")
