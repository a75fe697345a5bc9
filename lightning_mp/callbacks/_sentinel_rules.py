"""The precision sentinel's rules: pure functions from measured facts to findings, with no torch or Lightning in them.

Each rule takes what :class:`~lightning_mp.callbacks.PrecisionSentinel` measured on its sampled steps and returns a
:class:`Finding` (a kind, a message that names the layers and the numbers, and the fix) or None. The callback warns
once per kind; the tests drive these functions directly as well as through real runs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

FP16_MAX = 65504.0


@dataclass(frozen=True)
class Finding:
    """One silent precision failure: ``kind`` is what the sentinel warns about once; ``message`` says it and the fix."""

    kind: str
    message: str


@dataclass(frozen=True)
class RunFacts:
    """How the run is configured, as far as precision goes.

    Attributes:
        model_device: device type the parameters live on (``"cpu"``, ``"cuda"``, ...).
        autocast_device: device type the precision plugin runs autocast for; None if it runs none.
        half_dtypes: names of the half dtypes seen in the run (``"float16"``, ``"bfloat16"``): in the plugin's
            setting, in the parameters and in the sampled layer outputs.
        plugin_mixed: whether the plugin claims to run mixed precision with autocast (``"16-mixed"``/``"bf16-mixed"``).
        scaler_active: whether a loss scaler multiplies the loss.
        outputs_seen: whether any layer output was sampled yet.

    """

    model_device: str
    autocast_device: str | None
    half_dtypes: frozenset[str]
    plugin_mixed: bool
    scaler_active: bool
    outputs_seen: bool


def misconfigurations(facts: RunFacts) -> list[Finding]:
    """The configuration mistakes that make mixed precision silently do nothing, or silently do harm.

    Example:
        >>> facts = RunFacts("cpu", "cuda", frozenset(), plugin_mixed=True, scaler_active=False, outputs_seen=True)
        >>> [finding.kind for finding in misconfigurations(facts)]
        ['autocast_device']

    """
    findings = []
    if facts.autocast_device is not None and facts.autocast_device != facts.model_device:
        findings.append(
            Finding(
                "autocast_device",
                f"autocast runs for device {facts.autocast_device!r} but the model runs on {facts.model_device!r}, so"
                " no layer runs in half precision: the run is plain fp32 with mixed-precision overheads. Fix: leave"
                " the plugin's `device` unset so that it follows the Trainer, or move the model to"
                f" {facts.autocast_device!r}.",
            )
        )
    elif facts.plugin_mixed and facts.outputs_seen and not facts.half_dtypes:
        findings.append(
            Finding(
                "autocast_device",
                f"the precision plugin runs mixed precision, but no layer of the model (on {facts.model_device!r})"
                " produced a half-precision output: autocast is not active where the model runs. Fix: run the"
                " forward pass inside `training_step` (not in a hook outside it), and check that autocast's device"
                " type matches the model's device.",
            )
        )
    if facts.scaler_active and "bfloat16" in facts.half_dtypes and "float16" not in facts.half_dtypes:
        findings.append(
            Finding(
                "scaler_in_bf16",
                "a loss scaler is active but the model computes in bf16, which has fp32's range: scaling the loss"
                " buys nothing, and every skipped step is lost work. Fix: use precision='bf16-mixed' (no scaler),"
                " or remove the inner `torch.autocast(dtype=torch.bfloat16)`.",
            )
        )
    if "float16" in facts.half_dtypes and not facts.scaler_active:
        findings.append(
            Finding(
                "fp16_without_scaling",
                "the model computes in fp16 but no loss scaler is active: gradients below fp16's smallest subnormal"
                " (about 6e-8) silently become zero. Fix: use MixedPrecision('16-mixed') with its dynamic loss scale"
                " (opt levels O1 and O2 scale by default; pass loss_scale='dynamic' with O3), or use bf16.",
            )
        )
    return findings


def stale_update_finding(stale_share_by_layer: Mapping[str, float], threshold: float) -> Finding | None:
    """Layers where at least ``threshold`` of the weights that should have moved did not move.

    Example:
        >>> stale_update_finding({"head": 0.9, "body": 0.01}, threshold=0.25).kind
        'stale_updates'

    """
    stale = {layer: share for layer, share in stale_share_by_layer.items() if share >= threshold}
    if not stale:
        return None
    worst = _worst(stale, reverse=True)
    return Finding(
        "stale_updates",
        f"optimizer updates are lost to rounding: in {worst}, that share of the weights with a non-zero update did"
        " not change, because the update was below half an ulp of the stored weight. The run looks healthy but"
        " those weights do not learn. Fix: keep fp32 master weights (opt_level 'O1' or 'O2' instead of 'O3', no"
        " `model.to(torch.bfloat16)`), or raise the learning rate.",
    )


def underflow_finding(
    zero_share: float, baseline_zero_share: float, growth: float, scale: float, ceiling: float | None
) -> Finding | None:
    """Gradients flushing to zero more and more while the loss scale cannot rise any further.

    Example:
        >>> underflow_finding(0.6, 0.1, growth=0.2, scale=1.0, ceiling=1.0).kind
        'underflow'
        >>> underflow_finding(0.6, 0.1, growth=0.2, scale=1.0, ceiling=2.0) is None
        True

    """
    if ceiling is None or scale < ceiling or zero_share - baseline_zero_share < growth:
        return None
    return Finding(
        "underflow",
        f"the share of gradient elements that are exactly zero grew from {baseline_zero_share:.1%} to"
        f" {zero_share:.1%} while the loss scale sits at its ceiling ({scale:g}): gradients are underflowing fp16"
        " and the scaler cannot help. Fix: raise `max_scale`, use bf16 ('bf16-mixed'), or keep the layers with"
        " tiny gradients in fp32 (`keep_fp32=`).",
    )


def overflow_risk_finding(headroom_by_layer: Mapping[str, float], threshold_log2: float) -> Finding | None:
    """Layers whose largest activation is within ``2 ** threshold_log2`` of fp16's largest value.

    Example:
        >>> overflow_risk_finding({"big": 0.5, "small": 12.0}, threshold_log2=2.0).message.split(":")[0]
        'activations are close to overflowing fp16 in big (0.5 doublings left)'

    """
    close = {layer: headroom for layer, headroom in headroom_by_layer.items() if headroom < threshold_log2}
    if not close:
        return None
    shown = ", ".join(f"{layer} ({headroom:.1f} doublings left)" for layer, headroom in _first(close, reverse=False))
    return Finding(
        "overflow_risk",
        f"activations are close to overflowing fp16 in {shown}: a little growth and they become inf, and every step"
        f" is skipped. Headroom is log2({FP16_MAX:g} / max |activation|). Fix: keep those layers in fp32"
        " (`keep_fp32=`), normalise their inputs, or use bf16.",
    )


def headroom_log2(largest_magnitude: float) -> float:
    """``log2(65504 / largest_magnitude)``: doublings left before fp16 overflows; inf for an all-zero output."""
    if largest_magnitude <= 0:
        return math.inf
    if not math.isfinite(largest_magnitude):
        return -math.inf
    return math.log2(FP16_MAX / largest_magnitude)


def _first(values: Mapping[str, float], reverse: bool, limit: int = 5) -> list[tuple[str, float]]:
    return sorted(values.items(), key=lambda item: item[1], reverse=reverse)[:limit]


def _worst(values: Mapping[str, float], reverse: bool) -> str:
    return ", ".join(f"{layer} ({share:.0%})" for layer, share in _first(values, reverse=reverse))
