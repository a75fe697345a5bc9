"""Which linear layers run in FP8: pure rules over the model's linear layers, and the one-line setup summary.

Every linear layer of the model (:func:`linear_layers`: each ``nn.Linear``, subclasses included, and each of
transformers' ``Conv1D``, a linear layer that stores its weight transposed; in ``named_modules`` order) is either
chosen for FP8 or kept in bf16 with a reason. The rules, in the order they are asked (the first that applies gives
the reason):

1. ``excluded``: an ``exclude`` pattern matches the layer or a module above it (a module type, a qualified name,
   or a ``"re:"`` regular expression matched against the whole qualified name), as ``keep_fp32`` matches.
2. ``first linear`` / ``last linear``: with ``keep_first_last`` (the default), the input-side and the output-side
   linear layer stay bf16. They see the rawest inputs (embeddings) and make the outputs the loss reads directly (the
   head), where FP8's 3 mantissa bits cost the most and their matmuls are a small share of the work. They are found
   by what they do in the forward, not where they are registered (litgpt registers ``lm_head`` before the blocks),
   and without running the model: the output head is the linear layer that emits a vocabulary (:func:`end_layers`:
   its weight is an embedding's, as GPT-2 ties them, or it has as many outputs as an embedding has rows and sits
   outside the repeated blocks), else the last one registered; the input side is the first other one. A model with
   no embedding that registers its head before its body is the one case this reads wrong: name the layers in
   ``exclude`` there, with ``keep_first_last=False``.
3. ``dims not divisible by 16``: FP8 matmul kernels (``torch._scaled_mm``) need both the input and the output
   features to be multiples of 16.
4. ``fell back``: the layer returned to bf16 during the run (:func:`lightning_mp.fp8.convert.restore_linear`), and
   stays there after a resume.

transformers' ``Conv1D`` layers (GPT-2 and its family) follow the same rules and run FP8 with their weight as it is
stored (:mod:`lightning_mp.fp8.transposed`), except under ``fsdp_float8_all_gather``, which gathers ``nn.Linear``
weights only: there they stay bf16 with that reason (:data:`CONV1D_REASON`).

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
from typing import cast

from torch import Tensor, nn

from lightning_mp.fp8.settings import REGEX_PREFIX, ExcludePattern, FP8Settings
from lightning_mp.fp8.transposed import Float8TransposedLinear, is_conv1d

__all__ = [
    "CONV1D_REASON",
    "Fp8Selection",
    "KeptReason",
    "end_layers",
    "features",
    "is_transposed_linear",
    "linear_layers",
    "matmul_weight",
    "select_fp8_layers",
    "summary_line",
]

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


def _parameter_count(layer: nn.Module) -> int:
    return sum(parameter.numel() for parameter in layer.parameters(recurse=False))


KEEP_FP32_REASON = "keep_fp32"
"""The reason of a layer that ``keep_fp32`` keeps: it computes in fp32, and the setup line lists it apart."""
CONV1D_REASON = (
    "transformers Conv1D under fsdp_float8_all_gather: FSDP2's float8 all-gather takes nn.Linear weights only"
)


def is_transposed_linear(module: nn.Module) -> bool:
    """Whether ``module`` computes ``x @ weight + bias`` with an ``(in, out)`` weight: a ``Conv1D``, or its FP8 form."""
    return is_conv1d(module) or isinstance(module, Float8TransposedLinear)


def linear_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every linear layer of ``model`` with its qualified name, in ``named_modules`` order (module docstring)."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) or is_transposed_linear(module)
    ]


def features(layer: nn.Module) -> tuple[int, int]:
    """A linear layer's ``(in_features, out_features)``, whichever way it stores its weight."""
    if isinstance(layer, nn.Linear):
        return layer.in_features, layer.out_features
    weight = cast(Tensor, layer.weight)
    return weight.shape[0], weight.shape[1]


def matmul_weight(layer: nn.Module) -> Tensor:
    """A linear layer's weight as ``nn.Linear`` holds it, ``(out, in)``: a transposed layer's ``weight.t()``."""
    weight = cast(Tensor, layer.weight)
    return weight.t() if is_transposed_linear(layer) else weight


def end_layers(model: nn.Module, linears: Sequence[tuple[str, nn.Module]]) -> dict[str, KeptReason]:
    """The input-side and output-side linear layers of ``model``, as ``name -> "first linear" | "last linear"``.

    ``linears`` are the model's linear layers (:func:`linear_layers`). The output head is the last registered of the
    first kind that exists among: the linear layers whose weight is an embedding's weight (a tied head); those whose
    ``out_features`` is an embedding's ``num_embeddings`` (a vocabulary) outside every ``nn.ModuleList`` (the
    repeated blocks, where an MLP may happen to be as wide as the vocabulary); those anywhere; every linear layer.
    The input side is the first registered linear layer other than the head.

    Example:
        >>> class HeadFirst(nn.Module):  # as litgpt registers its GPT
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lm_head = nn.Linear(32, 128)
        ...         self.wte = nn.Embedding(128, 32)
        ...         self.h = nn.ModuleList(nn.Sequential(nn.Linear(32, 128), nn.Linear(128, 32)) for _ in range(2))
        >>> model = HeadFirst()
        >>> end_layers(model, linear_layers(model))
        {'h.0.0': 'first linear', 'lm_head': 'last linear'}

    """
    if not linears:
        return {}
    embeddings = [module for module in model.modules() if isinstance(module, nn.Embedding)]
    vocabularies = {embedding.num_embeddings for embedding in embeddings}
    repeated = [name for name, module in model.named_modules() if isinstance(module, nn.ModuleList)]
    tied = [name for name, layer in linears if any(layer.weight is embedding.weight for embedding in embeddings)]
    vocabulary_sized = [name for name, layer in linears if features(layer)[1] in vocabularies]
    outside_blocks = [name for name in vocabulary_sized if not _under(name, repeated)]
    last = (tied or outside_blocks or vocabulary_sized or [linears[-1][0]])[-1]
    first = next((name for name, _ in linears if name != last), None)
    return {**({first: "first linear"} if first is not None else {}), last: "last linear"}


def select_fp8_layers(
    model: nn.Module,
    settings: FP8Settings,
    fell_back: Collection[str] = (),
    keep_fp32: Sequence[ExcludePattern] = (),
) -> Fp8Selection:
    """Apply the rules (module docstring) to every linear layer of ``model``.

    Args:
        model: the model; names are relative to it.
        settings: the FP8 settings (``keep_first_last``, ``exclude``).
        fell_back: layers that returned to bf16 earlier in the run (a resumed checkpoint's).
        keep_fp32: the plugin's ``keep_fp32`` patterns: their layers compute in fp32 and are listed as such.

    Example:
        >>> model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 10), nn.Linear(10, 4))
        >>> selection = select_fp8_layers(model, FP8Settings())
        >>> selection.fp8, selection.kept
        (('2',), {'0': 'first linear', '3': 'dims not divisible by 16', '4': 'last linear'})

    """
    linears = linear_layers(model)
    excluded = _excluded_roots(model, settings.exclude or ())
    in_fp32 = _excluded_roots(model, keep_fp32)
    ends = end_layers(model, linears)
    fp8: list[str] = []
    kept: dict[str, KeptReason] = {}
    fp8_parameters = 0
    for name, layer in linears:
        if name == "":
            kept[name] = "the model itself"
        elif _under(name, in_fp32):
            kept[name] = KEEP_FP32_REASON
        elif _under(name, excluded):
            kept[name] = "excluded"
        elif settings.keep_first_last and name in ends:
            kept[name] = ends[name]
        elif any(size % FP8_DIM_MULTIPLE for size in features(layer)):
            kept[name] = f"dims not divisible by {FP8_DIM_MULTIPLE}"
        elif settings.fsdp_float8_all_gather and is_transposed_linear(layer):
            kept[name] = CONV1D_REASON
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
    in_fp32 = [name for name, reason in selection.kept.items() if reason == KEEP_FP32_REASON]
    in_bf16 = {name: reason for name, reason in selection.kept.items() if reason != KEEP_FP32_REASON}
    if not in_bf16:
        line += "; bf16: none"
    else:
        listed = [f"{name or '<model>'} ({reason})" for name, reason in list(in_bf16.items())[:shown]]
        more = len(in_bf16) - len(listed)
        line += "; bf16: " + ", ".join(listed) + (f" and {more} more" if more else "")
    if in_fp32:
        line += (
            "; fp32 (keep_fp32): "
            + ", ".join(in_fp32[:shown])
            + (f" and {len(in_fp32) - shown} more" if len(in_fp32) > shown else "")
        )
    return line


LOW_FP8_SHARE = 0.5
"""Below this share of the linear parameters in FP8, the FP8 mode warns that fewer layers run FP8 than asked."""


def shortfall_warning(selection: Fp8Selection, recipe: str, shown: int = 6) -> str | None:
    """A warning when FP8 was asked for and no layer, or under half the linear parameters, will run it; else None.

    Example:
        >>> selection = Fp8Selection((), {"a": "first linear", "b": "dims not divisible by 16"}, 0, 100)
        >>> print(shortfall_warning(selection, "tensorwise"))  # doctest: +ELLIPSIS
        lightning_mp: fp8='tensorwise' was asked for, but no linear layer runs FP8 (0 of 100 linear parameters)...

    """
    if selection.fp8 and selection.fp8_parameters >= LOW_FP8_SHARE * selection.linear_parameters:
        return None
    listed = ", ".join(f"{name or '<model>'} ({reason})" for name, reason in list(selection.kept.items())[:shown])
    more = len(selection.kept) - min(shown, len(selection.kept))
    share = f"only {len(selection.fp8)} linear layer(s) run FP8" if selection.fp8 else "no linear layer runs FP8"
    return (
        f"lightning_mp: fp8={recipe!r} was asked for, but {share} ({_count(selection.fp8_parameters)} of"
        f" {_count(selection.linear_parameters)} linear parameters). Kept in bf16: {listed or 'none'}"
        + (f" and {more} more" if more else "")
        + ". FP8 takes linear layers (nn.Linear, transformers' Conv1D) whose dimensions are multiples of 16; the first"
        " and last stay bf16 unless"
        " FP8Settings(keep_first_last=False)."
    )
