"""The precision advisor: find the layers that fp16 would break before a run does, and say what to do about it.

fp16 represents magnitudes from ``2**-24`` (its smallest subnormal) to ``65504``. Normal numbers start at ``2**-14``;
below that only a few mantissa bits are left, and below ``2**-24`` a value becomes zero. bf16 has fp32's range and
none of these limits, but three fewer mantissa bits than fp16. Whether a model trains in fp16 depends on where its
values fall, layer by layer, and that can be measured in fp32 before any half-precision step.

:func:`advise` runs ``batches`` training batches in fp32 on a deep copy of the model (the model itself, its
buffers, gradients, the random number generators and the batches are left as they were) and records, for every
module that is a leaf or holds parameters of its own:

- the largest absolute activation, over the floating inputs and outputs of its forward;
- the largest absolute gradient, over the gradients of its outputs and of its own parameters;
- the share of its output activations, and of its gradients, that fp16 would flush to zero (nonzero and below
  ``2**-24``) or only keep as subnormals (from ``2**-24`` to below ``2**-14``);
- whether any activation or gradient would overflow fp16 (above ``65504``).

From the table it recommends:

- ``keep_fp32``: the layers whose activations come within a factor :data:`ACTIVATION_HEADROOM` of fp16's maximum,
  on their inputs or outputs (so that both the layer that produces a huge value and the one that consumes it stay
  fp32), or whose output activations underflow to zero more than :data:`UNDERFLOW_LIMIT` of the time. Loss scaling
  cannot help activations: it only scales gradients;
- ``init_scale``: the largest power of two that keeps the largest gradient outside the kept layers a factor
  :data:`GRADIENT_HEADROOM` below 65504, so the first steps neither overflow nor waste range;
- the precision, for the hardware (:func:`recommend_precision`, a pure function of the device's capabilities):
  bf16 where the device multiplies it natively (bf16 has fp32's range, so the layers at risk need nothing); fp16
  with the ``keep_fp32`` layers and ``init_scale`` above on a GPU without fast bf16; and fp32 on a CPU that emulates
  both half types, where either would be slower than fp32. It never recommends emulated bf16. The advice also says
  what it would recommend on a GPU (:attr:`Advice.on_gpu`), so that a measurement on a laptop serves the cluster.

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

import copy
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from lightning.fabric import Fabric
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import LightningModule
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mp.arguments.checks import check_choice, check_number
from lightning_mp.plugin.hardware import AMPERE, DeviceCapabilities
from lightning_mp.scaling.rules import SCALER_DEFAULTS

FP16_MAX = 65504.0
FP16_SMALLEST_SUBNORMAL = 2.0**-24
FP16_SMALLEST_NORMAL = 2.0**-14
ACTIVATION_HEADROOM = 4.0
"""A layer whose activations come within this factor of 65504 is kept in fp32: later batches can be larger."""
UNDERFLOW_LIMIT = 0.01
"""A layer whose output activations would flush to zero in fp16 more often than this is kept in fp32."""
GRADIENT_HEADROOM = 64.0
"""``init_scale`` keeps the largest gradient this factor below 65504."""
MIN_INIT_SCALE, MAX_INIT_SCALE = 2.0**-24, 2.0**24

LossFunction = Callable[[nn.Module, Any], Tensor]
RecommendedPrecision = Literal["bf16-mixed", "16-mixed", "32-true"]


@dataclass(frozen=True)
class LayerReport:
    """What one module's values would do in fp16, measured in fp32.

    Attributes:
        name: qualified module name (``""`` for the root module).
        type_name: the module's class name.
        max_activation: largest absolute value among its floating inputs and outputs.
        max_gradient: largest absolute gradient of its outputs and own parameters (0 without gradients).
        activation_zero_share: share of output activations that are nonzero and below ``2**-24``.
        activation_subnormal_share: share of output activations in ``[2**-24, 2**-14)``.
        gradient_zero_share: the same as ``activation_zero_share`` for its gradients.
        gradient_subnormal_share: the same as ``activation_subnormal_share`` for its gradients.
        overflows_fp16: whether an activation or a gradient is above 65504.
        keep_fp32: whether the advisor recommends keeping it in fp32.

    """

    name: str
    type_name: str
    max_activation: float
    max_gradient: float
    activation_zero_share: float
    activation_subnormal_share: float
    gradient_zero_share: float
    gradient_subnormal_share: float
    overflows_fp16: bool
    keep_fp32: bool


@dataclass(frozen=True)
class Advice:
    """The advisor's table and recommendation.

    Attributes:
        layers: one :class:`LayerReport` per recorded module, in the order they first ran.
        precision: the recommended ``MixedPrecision`` precision for the measured device.
        keep_fp32: qualified names of the modules to keep in fp32 when training in fp16.
        init_scale: the recommended first loss scale for fp16.
        batches: how many batches were measured.
        reason: why this precision.
        on_gpu: what the advisor would recommend on a GPU, with and without native bf16.

    """

    layers: tuple[LayerReport, ...]
    precision: RecommendedPrecision
    keep_fp32: tuple[str, ...]
    init_scale: float
    batches: int
    reason: str
    on_gpu: str = ""

    def plugin_kwargs(self, precision: RecommendedPrecision | None = None) -> dict[str, Any]:
        """Keyword arguments for :class:`~lightning_mp.MixedPrecision` that apply this advice.

        Args:
            precision: override the recommended precision, for example ``"16-mixed"`` on hardware without bf16.

        Example:
            >>> advice = Advice((), "bf16-mixed", ("blowup",), 256.0, 1, "")
            >>> advice.plugin_kwargs("16-mixed")
            {'precision': '16-mixed', 'keep_fp32': ['blowup'], 'init_scale': 256.0}

        """
        if precision is not None:
            check_choice("Advice.plugin_kwargs", "precision", precision, ("bf16-mixed", "16-mixed", "32-true", None))
        chosen = self.precision if precision is None else precision
        if chosen == "32-true":
            return {"precision": "32-true"}
        kwargs: dict[str, Any] = {"precision": chosen, "keep_fp32": list(self.keep_fp32)}
        if chosen == "16-mixed":
            kwargs["init_scale"] = self.init_scale
        return kwargs

    def to_markdown(self) -> str:
        """The table and the recommendation as Markdown, as written to TensorBoard under ``precision/advice``."""
        header = (
            "| layer | type | max abs activation | max abs gradient | act. flushed to 0 | act. subnormal"
            " | grad. flushed to 0 | grad. subnormal | fp16 overflow | keep fp32 |"
        )
        rows = [header, "|" + "---|" * 10]
        for layer in self.layers:
            rows.append(
                f"| {layer.name or '(root)'} | {layer.type_name}"
                f" | {layer.max_activation:.3g} | {layer.max_gradient:.3g}"
                f" | {layer.activation_zero_share:.2%} | {layer.activation_subnormal_share:.2%}"
                f" | {layer.gradient_zero_share:.2%} | {layer.gradient_subnormal_share:.2%}"
                f" | {'yes' if layer.overflows_fp16 else 'no'} | {'**yes**' if layer.keep_fp32 else 'no'} |"
            )
        return "\n".join([*self._recommendation(), "", *rows])

    def _recommendation(self) -> list[str]:
        return [
            f"**Recommended precision:** `{self.precision}` ({self.reason}).",
            f"**For fp16:** `MixedPrecision('16-mixed', keep_fp32={list(self.keep_fp32)!r},"
            f" init_scale={self.init_scale:g})`.",
            *([f"**On a GPU:** {self.on_gpu}."] if self.on_gpu else []),
            f"Measured in fp32 over {self.batches} batch{'es' if self.batches != 1 else ''}.",
        ]

    def __str__(self) -> str:
        width = max([len(layer.name) for layer in self.layers] + [6])
        lines = [
            *(line.replace("**", "").replace("`", "") for line in self._recommendation()),
            "",
            f"{'layer':<{width}}  {'max |act|':>10}  {'max |grad|':>10}  {'act->0':>7}  {'grad->0':>7}  overflow  keep",
        ]
        for layer in self.layers:
            lines.append(
                f"{layer.name or '(root)':<{width}}  {layer.max_activation:>10.3g}  {layer.max_gradient:>10.3g}"
                f"  {layer.activation_zero_share:>7.2%}  {layer.gradient_zero_share:>7.2%}"
                f"  {'yes' if layer.overflows_fp16 else 'no':>8}  {'fp32' if layer.keep_fp32 else '-'}"
            )
        return "\n".join(lines)


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
        at_risk = max_activation > FP16_MAX / ACTIVATION_HEADROOM or activation_zero_share > UNDERFLOW_LIMIT
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
            keep_fp32=at_risk and bool(self.name),  # the root cannot be named in keep_fp32
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


def recommend_precision(
    capabilities: DeviceCapabilities, keep_fp32: Sequence[str], init_scale: float
) -> tuple[RecommendedPrecision, str, str]:
    """The precision to recommend on a device, why, and what a GPU would get: a pure function.

    Args:
        capabilities: the device's (see :meth:`~lightning_mp.plugin.hardware.DeviceCapabilities.detect`).
        keep_fp32: the layers at risk in fp16.
        init_scale: the recommended first fp16 loss scale.

    Returns:
        ``(precision, reason, on_gpu)``.

    Example:
        >>> recommend_precision(DeviceCapabilities("cpu", native_bf16=False), (), 1024.0)[0]
        '32-true'

    """
    device = capabilities.describe()
    at_risk = f"{len(keep_fp32)} layer(s) leave fp16's range" if keep_fp32 else "nothing leaves fp16's range"
    fp16 = f"'16-mixed' with keep_fp32={list(keep_fp32)!r}, init_scale={init_scale:g}"
    ampere = ".".join(map(str, AMPERE))
    on_gpu = f"'bf16-mixed' on a GPU of compute capability {ampere} or higher, {fp16} on an older one"
    precision: RecommendedPrecision
    if capabilities.native_bf16:
        precision, reason = "bf16-mixed", f"{at_risk}; {device} runs bf16 natively, and bf16 has fp32's range"
    elif capabilities.device_type in ("cuda", "mps"):
        precision, reason = "16-mixed", f"{at_risk}; {device} has no fast bf16, so fp16 with the settings below"
    else:
        precision = "32-true"
        reason = f"{at_risk}; {device} emulates bf16 and fp16, and both are slower than fp32 there"
    return precision, reason, on_gpu


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
    batches = check_number("advise", "batches", batches, at_least=1, integer=True)
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
    generators = _loader_generators(dataloader)
    generator_states = [generator.get_state() for generator in generators]
    cuda_devices = [device.index or 0] if device.type == "cuda" else []
    seen = 0
    try:
        with torch.random.fork_rng(devices=cuda_devices), warnings.catch_warnings():
            # A LightningModule's self.log() warns without a Trainer; the copy has none on purpose.
            warnings.filterwarnings("ignore", message=r".*self\.log\(\)")
            for batch_idx, batch in enumerate(dataloader):
                if batch_idx == batches:
                    break
                work.zero_grad(set_to_none=True)
                # A copy: a model that writes into its input (ELU(inplace=True) first) must not change the data.
                own_batch = apply_to_collection(move_data_to_device(batch, device), Tensor, torch.clone)
                loss = _training_loss(work, own_batch, batch_idx, loss_fn)
                if loss is not None:
                    loss.backward()
                for module, tally in tallies.items():
                    for parameter in module.parameters(recurse=False):
                        if parameter.grad is not None:
                            tally.add("gradient", parameter.grad)
                seen += 1
    finally:
        for generator, state in zip(generators, generator_states, strict=True):
            generator.set_state(state)
    if seen == 0:
        raise ValueError("advise(dataloader=...) is not allowed: the data loader yielded no batch.")
    return _recommend(list(tallies.values()), seen, capabilities or DeviceCapabilities.detect(device.type))


def _recommend(tallies: list[_Tally], batches: int, capabilities: DeviceCapabilities) -> Advice:
    layers = tuple(tally.report() for tally in tallies if tally.totals["activation"])
    keep = tuple(layer.name for layer in layers if layer.keep_fp32)
    largest_gradient = max((layer.max_gradient for layer in layers if not layer.keep_fp32), default=0.0)
    if largest_gradient > 0:
        exponent = math.floor(math.log2(FP16_MAX / GRADIENT_HEADROOM / largest_gradient))
        init_scale = min(max(2.0**exponent, MIN_INIT_SCALE), MAX_INIT_SCALE)
    else:
        init_scale = SCALER_DEFAULTS.init_scale
    precision, reason, on_gpu = recommend_precision(capabilities, keep, init_scale)
    return Advice(layers, precision, keep, init_scale, batches, reason, on_gpu)


__all__ = [
    "ACTIVATION_HEADROOM",
    "GRADIENT_HEADROOM",
    "UNDERFLOW_LIMIT",
    "Advice",
    "DeviceCapabilities",
    "LayerReport",
    "advise",
    "recommend_precision",
]
