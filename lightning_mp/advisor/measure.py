"""The advisor's measuring run: a few training batches in fp32 on a copy of the model, with every layer's values.

:func:`advise` runs ``batches`` training batches in fp32 on a deep copy of the model (the model itself, its
buffers, gradients, the random number generators and the batches are left as they were) and records, for every
module that is a leaf or holds parameters of its own:

- the largest absolute activation, over the floating inputs and outputs of its forward;
- the largest absolute gradient, over the gradients of its outputs and of its own parameters;
- the share of its output activations, and of its gradients, that fp16 would flush to zero (nonzero and below
  ``2**-24``) or only keep as subnormals (from ``2**-24`` to below ``2**-14``);
- whether any activation or gradient would overflow fp16 (above ``65504``).

Forward hooks record activations and tensor hooks their gradients, reduced on the device as they arrive. The table
then goes to the advisor's rules (:mod:`~lightning_mp.advisor.advice`), which recommend the precision, the
``keep_fp32`` layers and the ``init_scale``.

The measuring run itself, the copy and the batches, is the one both advisors share
(:mod:`lightning_mp.measuring.trial_batches`), which also runs a LightningModule with manual optimization.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    >>> data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,))), batch_size=8)
    >>> advice = advise(model, data, batches=2, loss_fn=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]))
    >>> advice.keep_fp32, advice.precision in ("bf16-mixed", "32-true")  # bf16 only where the CPU runs it natively
    ((), True)

"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn

from lightning_mp.advisor.advice import (
    FP16_MAX,
    FP16_SMALLEST_NORMAL,
    FP16_SMALLEST_SUBNORMAL,
    Advice,
    LayerReport,
    at_risk_in_fp16,
    recommend,
)
from lightning_mp.arguments.checks import arguments_of
from lightning_mp.measuring.trial_batches import LossFunction, measuring_copy, run_batches
from lightning_mp.plugin.hardware import DeviceCapabilities


class _Tally:
    """Running statistics of one module.

    Values are reduced on their device as they arrive, so recording neither synchronises with the host nor keeps an
    activation alive; the report reads the few numbers back at the end.
    """

    def __init__(self, name: str, module: nn.Module) -> None:
        self.name = name
        self.type_name = type(module).__name__
        self.largest: dict[str, Tensor] = {}  # "activation" or "gradient" -> 0-dim max magnitude
        self.counts: dict[str, Tensor] = {}  # "activation" or "gradient" -> [flushed to zero, subnormal]
        self.totals = {"activation": 0, "gradient": 0}

    def add(self, kind: Literal["input", "activation", "gradient"], tensor: Tensor) -> None:
        if not tensor.is_floating_point() or tensor.numel() == 0:
            return
        magnitude = tensor.detach().abs().float()
        key = "gradient" if kind == "gradient" else "activation"
        largest = magnitude.max()
        self.largest[key] = torch.maximum(self.largest[key], largest) if key in self.largest else largest
        if kind == "input":
            return  # inputs count towards the range only: their shares belong to the layer that produced them
        counts = torch.stack(
            [
                ((magnitude > 0) & (magnitude < FP16_SMALLEST_SUBNORMAL)).sum(),
                ((magnitude >= FP16_SMALLEST_SUBNORMAL) & (magnitude < FP16_SMALLEST_NORMAL)).sum(),
            ]
        ).double()
        self.counts[key] = self.counts[key] + counts if key in self.counts else counts
        self.totals[key] += magnitude.numel()

    def report(self) -> LayerReport:
        def share(key: str, index: int) -> float:
            return float(self.counts[key][index]) / self.totals[key] if self.totals[key] else 0.0

        max_activation = float(self.largest["activation"]) if "activation" in self.largest else 0.0
        max_gradient = float(self.largest["gradient"]) if "gradient" in self.largest else 0.0
        activation_zero_share = share("activation", 0)
        return LayerReport(
            name=self.name,
            type_name=self.type_name,
            max_activation=max_activation,
            max_gradient=max_gradient,
            activation_zero_share=activation_zero_share,
            activation_subnormal_share=share("activation", 1),
            gradient_zero_share=share("gradient", 0),
            gradient_subnormal_share=share("gradient", 1),
            overflows_fp16=max(max_activation, max_gradient) > FP16_MAX,
            # The root cannot be named in keep_fp32.
            keep_fp32=at_risk_in_fp16(max_activation, activation_zero_share) and bool(self.name),
        )


def _recorded_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Leaves, and modules with parameters of their own (MultiheadAttention uses its weights directly)."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if not any(True for _ in module.children()) or any(True for _ in module.parameters(recurse=False))
    ]


def advise(
    model: nn.Module,
    dataloader: Iterable,
    batches: int = 8,
    loss_fn: LossFunction | None = None,
    capabilities: DeviceCapabilities | None = None,
) -> Advice:
    """Measure ``batches`` batches in fp32 and recommend a precision, ``keep_fp32`` layers and an ``init_scale``.

    The measurement runs on a deep copy of ``model`` cast to fp32 and in train mode, so it costs one more copy of the
    weights in memory. The model, its buffers and gradients, the global random state and the data loader's own
    generators are as they were afterwards.

    Args:
        model: a ``LightningModule`` (its ``training_step`` gives the loss) or any ``nn.Module`` with ``loss_fn``.
        dataloader: yields training batches, as ``training_step`` receives them.
        batches: how many batches to measure; at least 1.
        loss_fn: ``loss_fn(model, batch) -> loss``; required for a plain ``nn.Module``. A LightningModule with
            manual optimization needs none: its ``training_step`` runs on the copy (see the module docstring).
        capabilities: the hardware to advise for; None detects the device the model is on.

    Returns:
        The :class:`Advice`: a table (``advice.layers``, ``advice.to_markdown()``) and the recommendation.

    Raises:
        TypeError: if ``loss_fn`` is not callable or does not return a tensor, or ``capabilities`` is of another type.
        ValueError: if an argument is invalid, or the data loader yields no batch.

    """
    if capabilities is not None and not isinstance(capabilities, DeviceCapabilities):
        raise TypeError(
            f"advise(capabilities={capabilities!r}) is not allowed: it must be None (detect) or a DeviceCapabilities."
        )
    with arguments_of("advise"):
        work, batches = measuring_copy(model, dataloader, batches, loss_fn)
    device = next((p.device for p in work.parameters()), torch.device("cpu"))
    tallies = {module: _Tally(name, module) for name, module in _recorded_modules(work)}

    def record_forward(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        tally = tallies[module]
        apply_to_collection(args, Tensor, lambda t: tally.add("input", t))

        def record_output(tensor: Tensor) -> None:
            tally.add("activation", tensor)
            if tensor.requires_grad:
                tensor.register_hook(lambda grad: tally.add("gradient", grad))

        apply_to_collection(output, Tensor, record_output)

    for module in tallies:
        module.register_forward_hook(record_forward)

    def record_parameter_gradients() -> None:
        for module, tally in tallies.items():
            for parameter in module.parameters(recurse=False):
                if parameter.grad is not None:
                    tally.add("gradient", parameter.grad)

    with arguments_of("advise"):
        seen = run_batches(work, dataloader, batches, loss_fn, after_backward=record_parameter_gradients)
    layers = tuple(tally.report() for tally in tallies.values() if tally.totals["activation"])
    return recommend(layers, seen, capabilities or DeviceCapabilities.detect(device.type))


__all__ = ["advise"]
