"""The FP8 advisor: before a run, estimate each recipe's FP8 error per linear layer and say which to keep in bf16.

FP8 matmuls scale each operand by its own amax at every step (:mod:`lightning_mp.fp8.quant`), so a whole tensor
scaled up or down costs nothing; what costs is *spread* within what one scale covers. e4m3 spans about 2**18 from its
smallest subnormal to its largest value (448), e5m2 about 2**32: values more than that below the amax of their
tensor (tensorwise) or row (rowwise) flush to zero, and values between lose mantissa bits. A layer with one feature
far larger than the rest (attention outputs, the last layers of LLMs) keeps its SQNR, dominated by the outlier, while
its small values vanish; rowwise scaling confines the damage to the rows the outlier is in.

:func:`advise_fp8` runs ``batches`` training batches on a deep copy of the model under bf16 autocast (the model, its
gradients, the random generators and the data loader's generators are left as they were) and, for every
linear layer whose dimensions FP8 matmuls take (both divisible by 16; ``nn.Linear`` and transformers' ``Conv1D``,
as the FP8 mode converts them), replays each recipe's casts of its three
operands (the input as bf16 autocast gives it to the matmul, the weight, the output gradient) with
:func:`~lightning_mp.fp8.quant.cast_stats`. It keeps the worst value of each statistic over the batches, on the
device, and reads them all back once at the end.

A layer is recommended to stay in bf16 under a recipe when, on any operand, more than ``max_underflow`` of its
non-zero values flush to zero, or its SQNR falls below ``min_sqnr_db`` (the limits of the FP8 monitor's fallback,
:class:`~lightning_mp.fp8.telemetry.FallbackRule`, which this reuses). Layers FP8 would not take anyway are listed
with the reason and left out of the measurement: dimensions not divisible by 16, and (with ``keep_first_last``, the
FP8 mode's default) the first and the last linear layer. The recommended recipe is the one that keeps the most linear
parameters in FP8; ties go to the faster recipe, in the order ``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp``.

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    >>> data = [(torch.randn(16, 16), torch.randn(16, 16)) for _ in range(2)]
    >>> advice = advise_fp8(model, data, batches=2, loss_fn=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
    >>> advice.recipe, advice.exclude["tensorwise"]
    ('tensorwise', ())
    >>> advice.argument()
    "MixedPrecision('bf16-mixed', fp8=FP8Settings(recipe='tensorwise'))"

"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_mp.arguments.checks import arguments_of, check_choice, check_flag
from lightning_mp.fp8.quant import RECIPES, STAT_NAMES, Operand, cast_stats, recipe_casts
from lightning_mp.fp8.selection import end_layers, features, linear_layers, matmul_weight
from lightning_mp.fp8.telemetry_rules import FallbackRule
from lightning_mp.measuring.trial_batches import LossFunction, measuring_copy, run_batches

MAX_UNDERFLOW = 0.01
"""A layer whose FP8 casts flush more than this share of an operand's non-zero values to zero stays in bf16."""
MIN_SQNR_DB = 20.0
"""A layer whose FP8 casts leave an operand below this SQNR stays in bf16 (e4m3 keeps about 30 dB, e5m2 about 25)."""
FP8_DIM_MULTIPLE = 16
"""FP8 matmul kernels need a linear layer's input and output features to be multiples of this."""
SPEED_ORDER = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
"""The recipes from the fastest (torchao's Llama3-8B numbers: +25% and +10% tokens/s over bf16) to the slowest."""

_WORST_IS_LARGEST = (True, False, True, True, False)
"""For each of :data:`~lightning_mp.fp8.quant.STAT_NAMES`, whether the worst of two batches is the larger value."""


@dataclass(frozen=True)
class LayerEstimate:
    """What each recipe's FP8 casts would do to one linear layer, the worst over the measured batches.

    Attributes:
        name: the layer's qualified name.
        in_features: its input features.
        out_features: its output features.
        not_measured: why FP8 would not take the layer anyway (``""`` when it was measured).
        stats: ``recipe -> operand -> stat name -> value`` (empty when not measured).
        keep_bf16: ``recipe -> reason`` for the recipes under which the layer should stay in bf16.

    """

    name: str
    in_features: int
    out_features: int
    not_measured: str
    stats: Mapping[str, Mapping[str, Mapping[str, float]]]
    keep_bf16: Mapping[str, str]

    @property
    def parameters(self) -> int:
        """The layer's weight elements, which the recommendation counts."""
        return self.in_features * self.out_features


@dataclass(frozen=True)
class FP8Advice:
    """The FP8 advisor's table and recommendation.

    Attributes:
        layers: one :class:`LayerEstimate` per linear layer, in ``named_modules`` order.
        recipe: the recommended recipe.
        exclude: ``recipe -> layers to keep in bf16`` under it.
        keep_first_last: whether the first and last linear layers were left to the FP8 mode's default (bf16).
        batches: how many batches were measured.
        reason: why this recipe.

    """

    layers: tuple[LayerEstimate, ...]
    recipe: str
    exclude: Mapping[str, tuple[str, ...]]
    keep_first_last: bool
    batches: int
    reason: str
    convertible: bool = True
    """Whether any layer would run FP8: where none would, the advice is to train without ``fp8``."""

    def settings_kwargs(self, recipe: str | None = None) -> dict[str, Any]:
        """Keyword arguments for the FP8 settings (``FP8Settings(**kwargs)``) that apply this advice.

        Args:
            recipe: another measured recipe than the recommended one.

        Raises:
            ValueError: if ``recipe`` was not measured.

        """
        chosen = self._chosen(recipe)
        kwargs: dict[str, Any] = {"recipe": chosen}
        if self.exclude[chosen]:
            kwargs["exclude"] = list(self.exclude[chosen])
        if not self.keep_first_last:
            kwargs["keep_first_last"] = False
        return kwargs

    def argument(self, recipe: str | None = None) -> str:
        """The plugin with this advice, ready to paste: ``MixedPrecision('bf16-mixed', fp8=FP8Settings(...))``.

        Where no layer would run FP8 (:attr:`convertible` is False), it is ``MixedPrecision('bf16-mixed')``.
        """
        if not self.convertible and recipe is None:
            return "MixedPrecision('bf16-mixed')"
        settings = ", ".join(f"{key}={value!r}" for key, value in self.settings_kwargs(recipe).items())
        return f"MixedPrecision('bf16-mixed', fp8=FP8Settings({settings}))"

    def to_markdown(self) -> str:
        """The recommendation and the table as Markdown: the worst SQNR and underflow per recipe, per layer."""
        recipes = list(self.exclude)
        header = "| layer | shape | " + " | ".join(f"{r}: min SQNR / max underflow | {r}: keep" for r in recipes) + " |"
        rows = [header, "|---|---|" + "---|---|" * len(recipes)]
        for layer in self.layers:
            cells = [f"{layer.name} | {layer.in_features}x{layer.out_features}"]
            for recipe in recipes:
                if layer.not_measured:
                    cells.append(f"- | bf16 ({layer.not_measured})")
                    continue
                sqnr, underflow = _worst(layer.stats[recipe])
                keep = f"**bf16** ({layer.keep_bf16[recipe]})" if recipe in layer.keep_bf16 else "fp8"
                cells.append(f"{sqnr:.1f} dB / {underflow:.2%} | {keep}")
            rows.append("| " + " | ".join(cells) + " |")
        return "\n".join([*self._recommendation(), "", *rows])

    def __str__(self) -> str:
        recipes = list(self.exclude)
        width = max([len(layer.name) for layer in self.layers] + [5])
        lines = [*(line.replace("**", "").replace("`", "") for line in self._recommendation()), ""]
        lines.append(f"{'layer':<{width}}  " + "  ".join(f"{recipe:>28}" for recipe in recipes))
        for layer in self.layers:
            cells = []
            for recipe in recipes:
                if layer.not_measured:
                    cells.append(f"{'bf16: ' + layer.not_measured:>28}")
                    continue
                sqnr, underflow = _worst(layer.stats[recipe])
                verdict = "bf16" if recipe in layer.keep_bf16 else "fp8"
                cells.append(f"{f'{sqnr:.1f} dB {underflow:.2%} -> {verdict}':>28}")
            lines.append(f"{layer.name:<{width}}  " + "  ".join(cells))
        return "\n".join(lines)

    def _chosen(self, recipe: str | None) -> str:
        if recipe is None:
            return self.recipe
        with arguments_of(type(self).__name__):
            check_choice("recipe", recipe, list(self.exclude))
        return recipe

    def _recommendation(self) -> list[str]:
        return [
            f"**Recommended:** `{self.argument()}` ({self.reason}).",
            *(
                f"**With {recipe}:** keep in bf16 {list(layers) or 'no layer'}."
                for recipe, layers in self.exclude.items()
            ),
            f"Measured under bf16 autocast over {self.batches} batch{'es' if self.batches != 1 else ''}.",
        ]


def _worst(operands: Mapping[str, Mapping[str, float]]) -> tuple[float, float]:
    """The lowest SQNR and the largest underflow share over a layer's operands."""
    sqnr = min((stats["sqnr_db"] for stats in operands.values()), default=math.nan)
    underflow = max((stats["underflow_share"] for stats in operands.values()), default=math.nan)
    return sqnr, underflow


def _unmeasured_reasons(
    model: nn.Module, linears: Sequence[tuple[str, nn.Module]], keep_first_last: bool
) -> dict[str, str]:
    """Why FP8 would not take some layers anyway, as the FP8 mode's layer selection decides."""
    ends = end_layers(model, linears) if keep_first_last else {}
    reasons = {}
    for name, layer in linears:
        if name in ends:
            reasons[name] = ends[name]
        elif any(size % FP8_DIM_MULTIPLE for size in features(layer)):
            reasons[name] = f"dims not divisible by {FP8_DIM_MULTIPLE}"
    return reasons


def advise_fp8(
    model: nn.Module,
    dataloader: Iterable,
    batches: int = 4,
    loss_fn: LossFunction | None = None,
    recipes: Sequence[str] = SPEED_ORDER,
    max_underflow: float = MAX_UNDERFLOW,
    min_sqnr_db: float = MIN_SQNR_DB,
    keep_first_last: bool = True,
) -> FP8Advice:
    """Measure ``batches`` batches under bf16 autocast and recommend an FP8 recipe and the layers to keep in bf16.

    The measurement runs on a deep copy of ``model`` in train mode (one more copy of the weights in memory); the model,
    its gradients, the global random state and the data loader's own generators are as they were afterwards. It
    needs only torch: torchao is not imported.

    Args:
        model: a ``LightningModule`` (its ``training_step`` gives the loss) or any ``nn.Module`` with ``loss_fn``.
        dataloader: yields training batches, as ``training_step`` receives them.
        batches: how many batches to measure; at least 1.
        loss_fn: ``loss_fn(model, batch) -> loss``; required for a plain ``nn.Module``.
        recipes: the recipes to compare, among ``"tensorwise"``, ``"rowwise"`` and ``"rowwise_with_gw_hp"``.
        max_underflow: keep a layer in bf16 when more than this share of an operand's non-zero values flush to
            zero, in [0, 1].
        min_sqnr_db: keep a layer in bf16 when an operand's SQNR falls below this, in dB.
        keep_first_last: leave the first and the last linear layer to the FP8 mode's default (bf16) and do not
            measure them; False measures them too, for ``FP8Settings(keep_first_last=False)``.

    Returns:
        The :class:`FP8Advice`: the table (``advice.layers``, ``advice.to_markdown()``, ``str(advice)``) and the
        ready-to-paste argument (``advice.argument()``).

    Raises:
        TypeError: if ``loss_fn`` is not callable or does not return a tensor.
        ValueError: if an argument is invalid, or the data loader yields no batch; the message names the argument,
            the value and what is allowed.

    """
    if isinstance(recipes, str) or not recipes:
        raise ValueError(
            f"advise_fp8(recipes={recipes!r}) is not allowed: pass a non-empty list of recipe names from"
            f" {list(RECIPES)}."
        )
    with arguments_of("advise_fp8"):
        for recipe in recipes:
            check_choice("recipes", recipe, list(RECIPES))
        rule = FallbackRule(max_underflow=max_underflow, min_sqnr_db=min_sqnr_db, patience=1)
        keep_first_last = check_flag("keep_first_last", keep_first_last)
        work, batches = measuring_copy(model, dataloader, batches, loss_fn)
    device = next((p.device for p in work.parameters()), torch.device("cpu"))
    linears = linear_layers(work)
    unmeasured = _unmeasured_reasons(work, linears, keep_first_last)
    worst: dict[tuple[str, str, str], Tensor] = {}
    worst_is_largest = torch.tensor(_WORST_IS_LARGEST, device=device)

    def record(layer: str, operand: Operand, tensor: Tensor) -> None:
        with torch.no_grad():
            for recipe in recipes:
                stats = cast_stats(tensor, recipe_casts(recipe).of(operand))
                key = (layer, recipe, operand)
                if key in worst:
                    previous = worst[key]
                    stats = torch.where(
                        worst_is_largest, torch.maximum(previous, stats), torch.minimum(previous, stats)
                    )
                worst[key] = stats

    def recorder(layer: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if not args or not isinstance(args[0], Tensor):
                return
            # The matmul under bf16 autocast reads the input in bf16; the weight is scaled from its fp32 master.
            record(layer, "input", args[0].detach().to(torch.bfloat16))
            record(layer, "weight", matmul_weight(module).detach())
            if isinstance(output, Tensor) and output.requires_grad:
                output.register_hook(lambda gradient: record(layer, "grad_output", gradient))

        return hook

    for name, module in linears:
        if name not in unmeasured:
            module.register_forward_hook(recorder(name))
    with arguments_of("advise_fp8"):
        seen = run_batches(work, dataloader, batches, loss_fn, autocast_dtype=torch.bfloat16)
    keys = list(worst)
    host = torch.stack([worst[key] for key in keys]).tolist() if keys else []
    measured: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for (layer, recipe, operand), values in zip(keys, host, strict=True):
        measured.setdefault(layer, {}).setdefault(recipe, {})[operand] = dict(zip(STAT_NAMES, values, strict=True))
    return _recommend(linears, unmeasured, measured, list(recipes), rule, keep_first_last, seen)


def _recommend(
    linears: Sequence[tuple[str, nn.Module]],
    unmeasured: Mapping[str, str],
    measured: Mapping[str, Mapping[str, Mapping[str, Mapping[str, float]]]],
    recipes: list[str],
    rule: FallbackRule,
    keep_first_last: bool,
    batches: int,
) -> FP8Advice:
    layers = []
    for name, module in linears:
        stats = measured.get(name, {})
        keep = {}
        for recipe in recipes:
            reason = rule.violation(stats[recipe]) if recipe in stats else None
            if reason is not None:
                keep[recipe] = reason
        # A measured layer whose forward never ran (unused) is reported as such, not as safe.
        not_measured = unmeasured.get(name, "" if stats else "not called")
        layers.append(LayerEstimate(name, *features(module), not_measured, stats, keep))
    exclude = {recipe: tuple(layer.name for layer in layers if recipe in layer.keep_bf16) for recipe in recipes}
    fp8_parameters = {
        recipe: sum(layer.parameters for layer in layers if not layer.not_measured and recipe not in layer.keep_bf16)
        for recipe in recipes
    }
    order = sorted(recipes, key=lambda recipe: (-fp8_parameters[recipe], SPEED_ORDER.index(recipe)))
    best = order[0]
    tied = [recipe for recipe in order if fp8_parameters[recipe] == fp8_parameters[best]]
    total = sum(layer.parameters for layer in layers)
    if fp8_parameters[best] == 0:
        reason = (
            f"no linear layer of this model can run FP8 ({len(unmeasured)} of {len(layers)} kept for their type, dims"
            " or place, the others for their FP8 error): train in bf16 without fp8"
        )
        return FP8Advice(tuple(layers), best, exclude, keep_first_last, batches, reason, convertible=False)
    reason = (
        f"it keeps {fp8_parameters[best]} of {total} linear parameters in FP8"
        + (f", {len(exclude[best])} layer(s) in bf16 for their FP8 error" if exclude[best] else "")
        + (f"; the fastest of {tied}, which keep as many" if len(tied) > 1 else "")
    )
    return FP8Advice(tuple(layers), best, exclude, keep_first_last, batches, reason)


__all__ = [
    "FP8_DIM_MULTIPLE",
    "MAX_UNDERFLOW",
    "MIN_SQNR_DB",
    "SPEED_ORDER",
    "FP8Advice",
    "LayerEstimate",
    "advise_fp8",
]
