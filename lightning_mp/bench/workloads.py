"""What the benchmark trains: the Markov-text model sized for the CPU, and three GPU-sized workloads.

``markov`` (the default on the CPU) trains :class:`~lightning_mp.tasks.TinyTransformerLM` on seeded Markov text;
its size is chosen for the hardware (:func:`auto_size`): a smaller one on CPUs without AVX512-BF16 or AMX, where
bf16 matrix products are emulated and about a hundred times slower than fp32, so that a full run still finishes in
a few minutes.

The GPU-sized workloads (the default on CUDA) measure work of the size users train:

- ``lm-200m``: a GPT-like LM of 219M parameters (d_model 1024, 12 layers, vocab 32768, seq 1024, batch 8)
  with fused AdamW;
- ``resnet50``: ResNet-50 in ``channels_last`` on 224x224 images (batch 64; ``--batch-size 256`` for the large
  batch) with foreach AdamW;
- ``lm-small``: a launch-bound LM (d_model 256, 2 layers, seq 128, batch 16) with fused AdamW, where the host's
  work per step, not the matrix products, decides the speed;
- ``lm-1b``: a GPT-like LM of 1.04B parameters (d_model 2048, 18 layers, vocab 32768, seq 2048, batch 4) with fused
  AdamW, the size at which FP8 matmuls pay off; not among the defaults (the GPU proof's FP8 part trains it). Its
  tiny shape keeps every linear layer's dimensions multiples of 16, so that the FP8 mode converts layers there too.

Each has a ``tiny`` shape of the same code, which the CPU runs by default, so the whole path is exercised without a
GPU. Their data is one random batch made on the device once and repeated (:class:`RepeatedBatch`): no loading and
no host-to-device copy, so a step's time is the training step's alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal

import lightning as L
import torch
from torch import Tensor, nn
from torch.nn import functional
from typing_extensions import override

from lightning_mp.bench.models import GPTLike, ResNet, resnet50
from lightning_mp.plugin.hardware import cpu_has_native_bf16
from lightning_mp.tasks import MarkovTextDataModule, TinyTransformerLM

OptimizerKind = Literal["fused", "foreach", "single-tensor"]
OPTIMIZER_KINDS: tuple[OptimizerKind, ...] = ("fused", "foreach", "single-tensor")
MARKOV = "markov"
GPU_WORKLOADS = ("lm-200m", "resnet50", "lm-small")
QUIET_TRAINER: dict[str, Any] = {
    "logger": False,
    "limit_val_batches": 0,
    "num_sanity_val_steps": 0,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}
"""The Trainer arguments of every benchmark run: train only, and log, validate, save and print nothing."""


@dataclass(frozen=True)
class ModelSize:
    """The Markov-text transformer's shape and the batch it trains on."""

    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    batch_size: int
    vocab_size: int = 64

    def describe(self) -> str:
        """The size in words, for the report's header."""
        return (
            f"vocab={self.vocab_size}, d_model={self.d_model}, layers={self.n_layers}, heads={self.n_heads},"
            f" seq_len={self.seq_len}, batch={self.batch_size}"
        )


SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(d_model=32, n_layers=1, n_heads=2, seq_len=16, batch_size=8),
    "small": ModelSize(d_model=64, n_layers=2, n_heads=4, seq_len=32, batch_size=16),
    "demo": ModelSize(d_model=128, n_layers=2, n_heads=4, seq_len=64, batch_size=32),
    "medium": ModelSize(d_model=256, n_layers=2, n_heads=4, seq_len=128, batch_size=8, vocab_size=1024),
    "large": ModelSize(d_model=512, n_layers=4, n_heads=8, seq_len=128, batch_size=16),
}
"""The Markov-text model's sizes, by the name ``--size`` takes."""


def auto_size(accelerator: str) -> str:
    """The Markov-text size for ``--size auto``: large where bf16 is native, small on a CPU that emulates it."""
    if accelerator == "gpu":
        return "large"
    return "large" if cpu_has_native_bf16() else "small"


def markov_task(size: ModelSize, steps: int, seed: int) -> tuple[MarkovTextDataModule, TinyTransformerLM]:
    """The data and the freshly initialised Markov-text model of ``size``, for ``steps`` training batches."""
    data = MarkovTextDataModule(
        seq_len=size.seq_len,
        batch_size=size.batch_size,
        train_sequences=size.batch_size * steps,
        vocab_size=size.vocab_size,
        seed=seed,
    )
    model = TinyTransformerLM(
        vocab_size=size.vocab_size,
        d_model=size.d_model,
        n_heads=size.n_heads,
        n_layers=size.n_layers,
        seq_len=size.seq_len,
        warmup_steps=2,
    )
    return data, model


@dataclass(frozen=True)
class LanguageModelShape:
    """A :class:`~lightning_mp.bench.models.GPTLike` model and its batch of token sequences."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    batch_size: int
    unit: str = "tokens"

    def build(self) -> nn.Module:
        """A freshly initialised GPT-like model."""
        return GPTLike(self.vocab_size, self.d_model, self.n_layers, self.n_heads, self.seq_len)

    def batch(self, device: torch.device, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """Random tokens: inputs ``(batch, seq)`` and the next tokens as targets."""
        shape = (self.batch_size, self.seq_len + 1)
        tokens = torch.randint(self.vocab_size, shape, generator=generator, device=device)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def units_per_step(self) -> int:
        """Tokens per step."""
        return self.batch_size * self.seq_len

    def describe(self) -> str:
        """The shape in words."""
        return (
            f"vocab={self.vocab_size}, d_model={self.d_model}, layers={self.n_layers}, heads={self.n_heads},"
            f" seq_len={self.seq_len}, batch={self.batch_size}"
        )


@dataclass(frozen=True)
class ImageModelShape:
    """A ResNet and its batch of ``channels_last`` images."""

    image_size: int
    batch_size: int
    num_classes: int
    blocks: tuple[int, ...] = (3, 4, 6, 3)
    base_width: int = 64
    unit: str = "images"

    def build(self) -> nn.Module:
        """ResNet-50 (torchvision's where installed) at the full shape, the same code scaled down otherwise."""
        if self.blocks == (3, 4, 6, 3) and self.base_width == 64:
            network = resnet50(self.num_classes)
        else:
            network = ResNet(self.blocks, self.base_width, self.num_classes)
        # Module.to documents memory_format, but its type stubs leave it out.
        return network.to(memory_format=torch.channels_last)  # type: ignore[call-overload]

    def batch(self, device: torch.device, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """Random images ``(batch, 3, size, size)`` in ``channels_last`` and random labels."""
        shape = (self.batch_size, 3, self.image_size, self.image_size)
        images = torch.randn(shape, generator=generator, device=device).contiguous(memory_format=torch.channels_last)
        return images, torch.randint(self.num_classes, (self.batch_size,), generator=generator, device=device)

    def units_per_step(self) -> int:
        """Images per step."""
        return self.batch_size

    def describe(self) -> str:
        """The shape in words."""
        return (
            f"blocks={self.blocks}, base width={self.base_width}, {self.image_size}x{self.image_size} images,"
            f" {self.num_classes} classes, batch={self.batch_size}, channels_last"
        )


@dataclass(frozen=True)
class TimeBudgets:
    """What the targets let a setup add to a step, in percent of its reference's step time."""

    monitors_percent: float = 3.0
    """The package's monitors, over the same setup without them."""
    builtin_gap_percent: float = 2.0
    """O1, over Lightning's built-in plugin at the same precision."""


Shape = LanguageModelShape | ImageModelShape
"""A GPU workload's size: it builds the network and one batch, and says how much work a step is."""


@dataclass(frozen=True)
class Workload:
    """A GPU-sized workload: its full shape, the tiny shape the CPU runs, its default optimizer and its targets."""

    name: str
    description: str
    full: Shape
    tiny: Shape
    optimizer: OptimizerKind
    budgets: TimeBudgets = TimeBudgets()


WORKLOADS: dict[str, Workload] = {
    workload.name: workload
    for workload in (
        Workload(
            "lm-200m",
            "GPT-like LM",
            LanguageModelShape(vocab_size=32768, d_model=1024, n_layers=12, n_heads=16, seq_len=1024, batch_size=8),
            LanguageModelShape(vocab_size=64, d_model=16, n_layers=2, n_heads=2, seq_len=8, batch_size=2),
            "fused",
        ),
        Workload(
            "resnet50",
            "ResNet-50",
            ImageModelShape(image_size=224, batch_size=64, num_classes=1000),
            ImageModelShape(image_size=32, batch_size=2, num_classes=10, blocks=(1, 1), base_width=4),
            "foreach",
        ),
        Workload(
            "lm-small",
            "launch-bound LM",
            LanguageModelShape(vocab_size=32768, d_model=256, n_layers=2, n_heads=4, seq_len=128, batch_size=16),
            LanguageModelShape(vocab_size=64, d_model=16, n_layers=1, n_heads=2, seq_len=8, batch_size=2),
            "fused",
            # Every host call shows in a launch-bound step, so the targets leave more room.
            TimeBudgets(monitors_percent=10.0, builtin_gap_percent=3.0),
        ),
        Workload(
            "lm-1b",
            "GPT-like LM, 1B",
            LanguageModelShape(vocab_size=32768, d_model=2048, n_layers=18, n_heads=16, seq_len=2048, batch_size=4),
            LanguageModelShape(vocab_size=64, d_model=32, n_layers=2, n_heads=2, seq_len=16, batch_size=2),
            "fused",
        ),
    )
}
"""The GPU-sized workloads, by the name ``--workload`` takes."""


def workload_shape(name: str, size: Literal["full", "tiny"], batch_size: int | None = None) -> Shape:
    """The shape of workload ``name`` at ``size``, with its batch size replaced where ``batch_size`` is given."""
    shape = WORKLOADS[name].full if size == "full" else WORKLOADS[name].tiny
    return shape if batch_size is None else replace(shape, batch_size=batch_size)


def make_optimizer(kind: OptimizerKind, parameters: Any, lr: float = 1e-4) -> torch.optim.Optimizer:
    """AdamW with weight decay 0.01 in torch's ``kind`` of implementation (``foreach=False`` for single-tensor)."""
    if kind == "fused":
        return torch.optim.AdamW(parameters, lr=lr, weight_decay=0.01, fused=True)
    return torch.optim.AdamW(parameters, lr=lr, weight_decay=0.01, foreach=kind == "foreach")


class WorkloadModule(L.LightningModule):
    """Train ``network`` with cross-entropy on ``(inputs, targets)`` batches and AdamW of ``optimizer`` kind.

    Args:
        network: maps inputs to logits, the class dimension last.
        optimizer: ``"fused"``, ``"foreach"`` or ``"single-tensor"`` AdamW.

    """

    def __init__(self, network: nn.Module, optimizer: OptimizerKind) -> None:
        super().__init__()
        self.network = network
        self.optimizer_kind = optimizer

    def forward(self, inputs: Tensor) -> Tensor:
        """The network's logits."""
        logits: Tensor = self.network(inputs)
        return logits

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        logits = self(inputs)
        loss = functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        self.log("train_loss", loss)
        return loss

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.optimizer_kind, self.parameters())


class RepeatedBatch:
    """One random batch, made on ``device`` at the first iteration, yielded ``steps`` times.

    The data then costs nothing: no loading, no host-to-device copy (Lightning's move to the device is a no-op),
    so a step's time is the training step's alone, as in a training loop whose data loading keeps up.
    """

    def __init__(self, shape: Shape, steps: int, device: torch.device, seed: int) -> None:
        self.shape = shape
        self.steps = steps
        self.device = device
        self.seed = seed

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        generator = torch.Generator(device=self.device).manual_seed(self.seed)
        batch = self.shape.batch(self.device, generator)
        for _ in range(self.steps):
            yield batch
