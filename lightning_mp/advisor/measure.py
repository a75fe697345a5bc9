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

A LightningModule with manual optimization (``automatic_optimization = False``) calls ``self.optimizers()`` and
``self.manual_backward()`` in its ``training_step``; the deep copy has no Trainer, so the advisor sets the copy up
in a single-device :class:`~lightning.fabric.Fabric` (Lightning's documented way to run a LightningModule without
a Trainer) with the optimizers of the copy's own ``configure_optimizers()``. The copy's steps change only the copy.

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

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from lightning.fabric import Fabric
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import LightningModule
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mp.advisor.advice import (
    FP16_MAX,
    FP16_SMALLEST_NORMAL,
    FP16_SMALLEST_SUBNORMAL,
    Advice,
    LayerReport,
    at_risk_in_fp16,
    recommend,
)
from lightning_mp.arguments.checks import arguments_of, caller, check_number
from lightning_mp.plugin.hardware import DeviceCapabilities

LossFunction = Callable[[nn.Module, Any], Tensor]


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


def _training_loss(model: nn.Module, batch: Any, batch_idx: int, loss_fn: LossFunction | None) -> Tensor | None:
    """The loss to back-propagate; None when a manual-optimization ``training_step`` ran its own backward."""
    if loss_fn is not None:
        loss = loss_fn(model, batch)
        if not isinstance(loss, Tensor):
            raise TypeError(f"advise(loss_fn=...) must return a loss tensor, got {type(loss).__name__}.")
        return loss
    assert isinstance(model, LightningModule)
    output = model.training_step(batch, batch_idx)
    if not model.automatic_optimization:
        return None
    returned = output.get("loss") if isinstance(output, dict) else output
    if not isinstance(returned, Tensor):
        raise ValueError(
            f"advise(...) needs a loss: {type(model).__name__}.training_step returned {type(output).__name__}. Return"
            " the loss (or a dict with 'loss'), or pass loss_fn=lambda model, batch: ..."
        )
    return returned


def _loader_generators(dataloader: Iterable) -> list[torch.Generator]:
    """The random generators a DataLoader's sampler draws from, to restore after peeking at it."""
    candidates = [
        getattr(dataloader, "generator", None),
        getattr(getattr(dataloader, "sampler", None), "generator", None),
    ]
    return [generator for generator in candidates if isinstance(generator, torch.Generator)]


def _attach_manual_optimization(model: LightningModule) -> None:
    """Give a manual-optimization copy what its ``training_step`` calls: ``optimizers()`` and ``manual_backward``.

    The copy is set up in a single-device fp32 Fabric with the optimizers of its own ``configure_optimizers()``,
    which hold the copy's parameters, so stepping them leaves the user's model and optimizers untouched.
    """
    try:
        configured = model.configure_optimizers()
    except Exception as error:  # e.g. it reads self.trainer, which the copy has not
        raise ValueError(
            f"advise(model={type(model).__name__}) uses manual optimization, and its configure_optimizers() failed on"
            f" the advisor's copy, which has no Trainer ({type(error).__name__}: {error}). Pass"
            " loss_fn=lambda model, batch: loss instead."
        ) from error
    optimizers: list[Optimizer] = []
    apply_to_collection(configured, Optimizer, optimizers.append)
    if not optimizers:
        raise ValueError(
            f"advise(model={type(model).__name__}) uses manual optimization, but its configure_optimizers() returned"
            " no optimizer to give its training_step. Pass loss_fn=lambda model, batch: loss instead."
        )
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    devices = [device.index or 0] if device.type == "cuda" else 1
    fabric = Fabric(accelerator=device.type, devices=devices, precision="32-true", loggers=[])
    fabric.setup(model, *optimizers, move_to_device=False)


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
    if not isinstance(model, nn.Module):
        raise ValueError(f"advise(model={type(model).__name__}) is not allowed: model must be an nn.Module.")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(
            f"advise(loss_fn={loss_fn!r}) is not allowed: loss_fn must be None or a callable"
            " loss_fn(model, batch) -> loss tensor."
        )
    if capabilities is not None and not isinstance(capabilities, DeviceCapabilities):
        raise TypeError(
            f"advise(capabilities={capabilities!r}) is not allowed: it must be None (detect) or a DeviceCapabilities."
        )
    if not isinstance(dataloader, Iterable):
        raise ValueError(
            f"advise(dataloader={dataloader!r}) is not allowed: dataloader must be an iterable of batches."
        )
    with arguments_of("advise"):
        batches = check_number("batches", batches, at_least=1, integer=True)
    if loss_fn is None and not isinstance(model, LightningModule):
        raise ValueError(
            f"advise(model={type(model).__name__}, loss_fn=None) is not allowed: a plain nn.Module needs"
            " loss_fn=lambda model, batch: loss; a LightningModule's training_step is used otherwise."
        )
    work = copy.deepcopy(model).float().train()
    device = next((p.device for p in work.parameters()), torch.device("cpu"))
    if loss_fn is None and isinstance(work, LightningModule) and not work.automatic_optimization:
        _attach_manual_optimization(work)
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


def run_batches(
    work: nn.Module,
    dataloader: Iterable[Any],
    batches: int,
    loss_fn: LossFunction | None,
    after_backward: Callable[[], None] | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> int:
    """Train ``work`` (a copy the advisor owns) on up to ``batches`` batches without stepping; the number it ran.

    Each batch is moved to ``work``'s device and copied (a model that writes into its input, ``ELU(inplace=True)``
    first, must not change the data), its loss computed (under ``autocast_dtype`` where given) and back-propagated,
    then ``after_backward`` runs. The global random streams and the loader's own generators are restored after, so
    the caller's training draws what it would have drawn without the advice.

    Raises:
        ValueError: when the loader yields no batch, naming the caller
            (:func:`~lightning_mp.arguments.checks.arguments_of`).

    """
    device = next((p.device for p in work.parameters()), torch.device("cpu"))
    generators = _loader_generators(dataloader)
    generator_states = [generator.get_state() for generator in generators]
    cuda_devices = [device.index or 0] if device.type == "cuda" else []
    autocast = (
        torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
    )
    seen = 0
    try:
        with torch.random.fork_rng(devices=cuda_devices), warnings.catch_warnings():
            # A LightningModule's self.log() warns without a Trainer; the copy has none on purpose.
            warnings.filterwarnings("ignore", message=r".*self\.log\(\)")
            for batch_idx, batch in enumerate(dataloader):
                if batch_idx == batches:
                    break
                work.zero_grad(set_to_none=True)
                own_batch = apply_to_collection(move_data_to_device(batch, device), Tensor, torch.clone)
                with autocast:
                    loss = _training_loss(work, own_batch, batch_idx, loss_fn)
                if loss is not None:
                    loss.backward()
                if after_backward is not None:
                    after_backward()
                seen += 1
    finally:
        for generator, state in zip(generators, generator_states, strict=True):
            generator.set_state(state)
    if seen == 0:
        raise ValueError(f"{caller()}(dataloader=...) is not allowed: the data loader yielded no batch.")
    return seen


__all__ = ["LossFunction", "advise", "run_batches"]
