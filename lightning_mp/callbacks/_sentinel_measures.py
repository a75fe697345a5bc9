"""What the precision sentinel measures on a sampled step: on the device during the step, then per layer on the host.

:class:`~lightning_mp.callbacks.PrecisionSentinel` decides when to sample and what to warn about; this module holds
its measurements, from tensors to one :class:`Sample` of per-layer numbers:

1. **Activations.** A forward hook on each layer (:func:`measured_layers`) takes :func:`largest_magnitude` of the
   layer's first floating output (:func:`first_floating_tensor`), kept on the device. The host
   turns it into the headroom ``log2(65504 / max |output|)``.
2. **Before the optimizer step.** :func:`take_snapshot` keeps, for the tensors one optimizer is about to step
   (:func:`stepped_parameters`), a copy of each weight and the sign of each gradient, with batched
   ``torch._foreach_*`` ops; and :func:`skipped_steps` says how many steps the plugin has skipped so far, for a
   skipped step to count no stale update.
3. **After the step.** :func:`update_counts` subtracts the kept weights from the new ones and counts, per tensor, the
   elements with a non-zero gradient and those of them whose weight moved: one vector for the whole model, which
   joins the one device-to-host transfer the monitors share.
4. **On the host.** :func:`per_layer_shares` adds the per-tensor counts up per layer (:func:`layer_of` the tensor's
   name, from :func:`parameter_names`) into the gradient underflow share (elements whose gradient is exactly zero)
   and the stale-update share (elements with a gradient whose weight did not move); :func:`summary_scalars` gives the
   three numbers logged per sample.

:func:`run_facts` reads from the precision plugin how the run is configured (autocast, loss scaling), for the rules
on misconfiguration.

Private names: :mod:`lightning_mp._private_names` lists them, with the reason for each.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch.optim import Optimizer

from lightning_mp.callbacks._sentinel_rules import RunFacts
from lightning_mp.plugin import MixedPrecision
from lightning_mp.scaling.sharded import local_shard

HALF_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
"""The half dtypes the sentinel recognises, by the names its rules use."""

ALL_LAYERS = "(all layers)"
"""The key of a sample's whole-model underflow share, beside the per-layer ones."""


@dataclass
class Sample:
    """What one sampled step measured, per layer, on the host."""

    step: int
    headroom: dict[str, float] = field(default_factory=dict)
    underflow: dict[str, float] = field(default_factory=dict)
    stale: dict[str, float] = field(default_factory=dict)


@dataclass
class Snapshot:
    """The weights and gradient signs of the tensors one optimizer is about to step, kept on the device.

    ``weights`` are the tensors the step writes in the optimizer's precision: each parameter's master where the opt
    level keeps one beside it (O2's fp32 masters, whose small updates its half parameters round away), else the
    parameter itself.
    """

    parameters: list[torch.Tensor]
    weights: list[torch.Tensor]
    weights_before: list[torch.Tensor]
    grad_signs: list[torch.Tensor]


def measured_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """The layers whose outputs are measured: the leaf modules and every module with parameters of its own."""
    for name, module in model.named_modules():
        is_leaf = next(module.children(), None) is None
        if is_leaf or next(module.parameters(recurse=False), None) is not None:
            yield name or "model", module


def largest_magnitude(tensor: torch.Tensor) -> torch.Tensor:
    """``max |tensor|`` in fp32, as a device tensor, outside autograd."""
    with torch.no_grad():
        return torch.linalg.vector_norm(tensor, ord=math.inf, dtype=torch.float32)


def stepped_parameters(optimizer: Optimizer, already: set[int], every_rank_counts: bool) -> list[torch.Tensor]:
    """The tensors ``optimizer`` is about to step with a learning rate other than zero, leaving out ids in ``already``.

    With ``every_rank_counts`` (FSDP, tensor parallelism) the list holds the same tensors, in the same order, on every
    rank, whatever its shards hold, so that the per-tensor counts can be summed over the ranks; otherwise it holds only
    the tensors with a dense, non-empty gradient.
    """
    stepped = [p for group in optimizer.param_groups if not is_zero(group.get("lr", 1.0)) for p in group["params"]]
    if every_rank_counts:
        return [p for p in stepped if id(p) not in already]
    return [
        p
        for p in stepped
        if p.grad is not None and not p.grad.is_sparse and p.grad.numel() > 0 and id(p) not in already
    ]


def take_snapshot(parameters: list[torch.Tensor], weights: list[torch.Tensor] | None = None) -> Snapshot:
    """A copy of the local part of each weight and of the sign of each gradient (zeros where a tensor has none).

    ``weights`` are the tensors the step writes (the parameters' masters where the opt level keeps them); None takes
    the parameters.
    """
    weights = parameters if weights is None else weights
    with torch.no_grad():
        grads = [local_shard(p.grad) if p.grad is not None else torch.zeros_like(local_shard(p)) for p in parameters]
        # x - 0.0 is x (-0.0 included): a copy of a whole list in one op, where allocating each destination for
        # a copy would cost one op per tensor.
        grad_signs = list(torch._foreach_sub(grads, 0.0))
        torch._foreach_sign_(grad_signs)
        weights_before = list(torch._foreach_sub([local_shard(w) for w in weights], 0.0))
    return Snapshot(parameters, weights, weights_before, grad_signs)


def update_counts(snapshots: list[Snapshot]) -> torch.Tensor:
    """Per stepped tensor: elements with a non-zero gradient, then those of them whose weight moved; one vector."""
    with torch.no_grad():
        parameters = [local_shard(w) for snapshot in snapshots for w in snapshot.weights]
        before = [w for snapshot in snapshots for w in snapshot.weights_before]
        grad_signs = [s for snapshot in snapshots for s in snapshot.grad_signs]
        moved = torch._foreach_sub(parameters, before)
        # The update's sign, not the update, is multiplied: an update that overflowed to inf, times a zero gradient
        # sign, must count 0, where inf * 0 would be NaN and count 1.
        torch._foreach_sign_(moved)
        torch._foreach_mul_(moved, grad_signs)
        with_gradient = torch._foreach_norm(grad_signs, 0)
        with_gradient_and_moved = torch._foreach_norm(moved, 0)
        return torch.stack([*with_gradient, *with_gradient_and_moved]).float()


def per_layer_shares(
    sample: Sample, layers: list[str], sizes: list[int], counts: list[float], skipped: bool | None
) -> None:
    """Fill the underflow and stale shares per layer from the per-tensor counts; a skipped step gives no stale share.

    ``skipped`` is None where the plugin does not say; a step on which no element moved is then taken as skipped.
    """
    tensors = len(layers)
    with_gradient, moved = counts[:tensors], counts[tensors : 2 * tensors]
    if skipped is None:
        skipped = sum(moved) == 0
    totals: dict[str, list[float]] = {}
    for layer, size, active, changed in zip(layers, sizes, with_gradient, moved, strict=True):
        total = totals.setdefault(layer, [0.0, 0.0, 0.0])
        total[0] += size
        total[1] += active
        total[2] += changed
    for layer, (elements, active, changed) in totals.items():
        sample.underflow[layer] = 1.0 - active / elements
        if not skipped and active > 0:
            sample.stale[layer] = (active - changed) / active
    sample.underflow[ALL_LAYERS] = 1.0 - sum(with_gradient) / sum(sizes)


def summary_scalars(sample: Sample) -> dict[str, float]:
    scalars = {}
    finite_headroom = [value for value in sample.headroom.values() if math.isfinite(value)]
    if finite_headroom:
        scalars["precision_sentinel/min_activation_headroom_log2"] = min(finite_headroom)
    if ALL_LAYERS in sample.underflow:
        scalars["precision_sentinel/total_grad_underflow_share"] = sample.underflow[ALL_LAYERS]
    if sample.stale:
        scalars["precision_sentinel/max_stale_update_share"] = max(sample.stale.values())
    return scalars


def parameter_names(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[int, str]:
    """``id(tensor) -> name`` for the stepped tensors, named as the model names them (the policy may add names)."""
    policy = getattr(trainer.precision_plugin, "policy", None)
    names = {id(parameter): name for name, parameter in pl_module.named_parameters()}
    if policy is not None:
        names.update(policy.parameter_names(pl_module))
    return names


def layer_of(parameter_name: str) -> str:
    return parameter_name.rsplit(".", 1)[0] if "." in parameter_name else parameter_name


def first_floating_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.is_floating_point() else None
    if isinstance(output, (list, tuple)):
        for item in output:
            found = first_floating_tensor(item)
            if found is not None:
                return found
    return None


def run_facts(plugin: Any, model_device: str, half_dtypes: frozenset[str], outputs_seen: bool) -> RunFacts:
    """How the run is configured, as the rules of :mod:`~lightning_mp.callbacks._sentinel_rules` take it.

    :class:`~lightning_mp.MixedPrecision` says whether its policy runs autocast and whether it scales the loss; for
    another plugin the precision string (``"*-mixed"``), its ``device`` and its ``scaler`` say it.
    """
    precision = str(getattr(plugin, "precision", ""))
    autocast_device = getattr(plugin, "device", None) if precision.endswith("-mixed") else None
    plugin_mixed = precision.endswith("-mixed")
    if isinstance(plugin, MixedPrecision):
        uses_autocast = plugin.policy is not None and plugin.policy.uses_autocast and plugin.half_dtype is not None
        plugin_mixed = uses_autocast
        autocast_device = plugin.device if uses_autocast else None
        scaler_active = plugin.scaler is not None
    else:
        scaler = getattr(plugin, "scaler", None)
        scaler_active = scaler is not None and (not hasattr(scaler, "is_enabled") or scaler.is_enabled())
    return RunFacts(
        model_device=model_device,
        autocast_device=autocast_device if isinstance(autocast_device, str) else None,
        half_dtypes=half_dtypes,
        plugin_mixed=plugin_mixed,
        scaler_active=scaler_active,
        outputs_seen=outputs_seen,
    )


def skipped_steps(plugin: Any) -> int | None:
    """How many steps :class:`~lightning_mp.MixedPrecision` has skipped; None under a plugin that does not say."""
    return plugin.stats.skipped_steps if isinstance(plugin, MixedPrecision) else None


def is_zero(learning_rate: object) -> bool:
    # A tensor learning rate is not read: that would synchronise. Treat it as non-zero.
    return isinstance(learning_rate, (int, float)) and learning_rate == 0
