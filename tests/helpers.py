"""The tests' shared helpers: the tiny models, one Trainer builder and one fit, one TensorBoard event reader and three
recorders.

Import them with ``from tests.helpers import ...`` (pytest's configuration puts the repository root on ``sys.path``
under every import mode; ``tests/ddp_scripts/launch.py`` puts it on the subprocesses' ``PYTHONPATH``).

The models are tiny on purpose: half precision is slow on CPUs without AVX512, and the whole suite runs on 2 cores.
The peak-memory measure of the sharded runs (:func:`peak_step_bytes`, :class:`ProfiledSteps`) is the exception: it
trains a wider model, so that weights, gradients and optimizer states outweigh the activations.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import gc
import hashlib
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.strategies import FSDPStrategy as FabricFSDPStrategy
from lightning.pytorch.strategies import FSDPStrategy
from tensorboard.backend.event_processing import event_accumulator
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_mp.bench.counting import StepCounts, count_syncs_and_ops
from lightning_mp.scaling.sharded import is_sharded, local_shard

FEATURES = 8
"""Input features of :class:`TinyRegressor` and of :func:`regression_data`."""

_FORMS = (("fused", {"fused": True}), ("foreach", {"foreach": True}), ("single-tensor", {"foreach": False}))
OPTIMIZER_FORMS: dict[str, Any] = {
    f"{form} {name}": functools.partial(cls, **extra, **flags)
    for name, cls, extra in (
        ("Adam", torch.optim.Adam, {}),
        ("AdamW", torch.optim.AdamW, {}),
        ("SGD", torch.optim.SGD, {"momentum": 0.9}),
        ("Adagrad", torch.optim.Adagrad, {}),
    )
    for form, flags in _FORMS
}
"""``"<form> <optimizer>"`` -> ``factory(params, lr=...)``: the four torch optimizers with a fused kernel, each form."""


def assert_within_rounding(actual: torch.Tensor, expected: torch.Tensor, ulps: int = 4) -> None:
    """Assert that ``actual`` is ``expected`` up to ``ulps`` float32 roundings of the tensor's largest magnitude."""
    tolerance = ulps * torch.finfo(expected.dtype).eps * max(expected.abs().max().item(), 1e-6)
    torch.testing.assert_close(actual, expected, rtol=0.0, atol=tolerance)


def make_trainer(plugin: Any = None, **kwargs: Any) -> L.Trainer:
    """A single-CPU Trainer of 8 steps without logger, checkpoints, progress bar or summary, unless overridden."""
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "max_steps": 8,
    }
    options.update(kwargs)
    if plugin is not None:
        options["plugins"] = [plugin]
    return L.Trainer(**options)


def fit(
    model: L.LightningModule,
    plugin: Any = None,
    data: Any = None,
    *,
    ckpt_path: str | Path | None = None,
    **trainer_kwargs: Any,
) -> L.Trainer:
    """Fit ``model`` on ``data`` (its own loaders when None) with :func:`make_trainer`'s Trainer, resuming from
    ``ckpt_path`` when given; that Trainer."""
    trainer = make_trainer(plugin, **trainer_kwargs)
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return trainer


def hook_count(model: nn.Module) -> int:
    """The forward and forward-pre hooks on ``model`` and all its submodules."""
    return sum(len(module._forward_hooks) + len(module._forward_pre_hooks) for module in model.modules())


def regression_data(n: int = 64, features: int = FEATURES, seed: int = 0) -> TensorDataset:
    """A seeded linear regression problem with a little noise."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=generator)
    y = x @ torch.randn(features, 1, generator=generator) + 0.1 * torch.randn(n, 1, generator=generator)
    return TensorDataset(x, y)


def loader(n: int = 64, batch_size: int = 8, seed: int = 0) -> DataLoader:
    """A deterministic loader over :func:`regression_data`."""
    return DataLoader(regression_data(n, seed=seed), batch_size=batch_size, shuffle=False)


class TinyRegressor(L.LightningModule):
    """Two linear layers; optionally an inf gradient injected into ``first.weight`` at chosen global steps.

    Args:
        lr: the learning rate.
        inject_at: global steps whose ``first.weight`` gradient gets an inf after backward (an overflow).
        optimizer: ``"sgd"`` (with momentum), ``"adam"``, ``"fused-adam"`` or a key of :data:`OPTIMIZER_FORMS`.
        scheduler: add a ``StepLR`` that steps every batch.
        hidden: the width of the hidden layer.

    """

    def __init__(
        self,
        lr: float = 0.05,
        inject_at: tuple[int, ...] = (),
        optimizer: str = "sgd",
        scheduler: bool = False,
        hidden: int = 16,
    ) -> None:
        super().__init__()
        self.first = nn.Linear(FEATURES, hidden)
        self.second = nn.Linear(hidden, 1)
        self.lr = lr
        self.inject_at = set(inject_at)
        self.optimizer_name = optimizer
        self.use_scheduler = scheduler
        self.seen_grad_scales: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def on_after_backward(self) -> None:
        if self.global_step in self.inject_at:
            self.first.weight.grad[0, 0] = float("inf")

    def configure_optimizers(self) -> Any:
        if self.optimizer_name in OPTIMIZER_FORMS:
            optimizer = OPTIMIZER_FORMS[self.optimizer_name](self.parameters(), lr=self.lr)
        elif self.optimizer_name in ("adam", "fused-adam"):
            optimizer = torch.optim.Adam(self.parameters(), lr=self.lr, fused=self.optimizer_name == "fused-adam")
        else:
            optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        if not self.use_scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class ManualRegressor(TinyRegressor):
    """The tiny regressor with manual optimization: manual_backward, clipping by norm, opt.step(); the loss, scale and
    skip flag of every batch recorded (the inf planted after backward at ``inject_at``, by ``on_after_backward``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.losses: list[float] = []
        self.steps: list[tuple[float, bool]] = []

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        x, y = batch
        loss = nn.functional.mse_loss(self(x).float(), y)
        optimizer.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        optimizer.step()
        self.losses.append(loss.item())
        return loss

    @override
    def on_train_batch_end(self, *args: Any) -> None:
        stats = self.trainer.precision_plugin.stats  # type: ignore[attr-defined]
        self.steps.append((stats.loss_scale, stats.last_step_skipped))


class TinyLanguageModel(L.LightningModule):
    """Embedding, two small Transformer layers and a head: about 30 parameter tensors, like a real LM's layout."""

    def __init__(self, vocab: int = 32, width: int = 16, optimizer: str = "adamw") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        self.optimizer_name = optimizer

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        logits = self.head(self.body(self.embed(tokens)))
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.01)
        return torch.optim.AdamW(self.parameters(), lr=1e-3, foreach=True)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 32, (64, 8), generator=generator)
        return DataLoader(TensorDataset(tokens, tokens.roll(1, dims=1)), batch_size=4)


def wrap_on_cpu(module: nn.Module, strategy: FSDPStrategy | FabricFSDPStrategy, **kwargs: Any) -> nn.Module:
    """``module`` wrapped in FSDP1 as ``strategy`` would wrap it, ``device_id`` the CPU (unless already wrapped)."""
    if any(isinstance(child, FullyShardedDataParallel) for child in module.modules()):
        return module
    return FullyShardedDataParallel(
        module,
        device_id=torch.device("cpu"),
        mixed_precision=strategy.mixed_precision_config,
        sharding_strategy=strategy.sharding_strategy,
        **kwargs,
    )


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy for the Trainer, on the CPU (gloo), where Lightning runs it on GPUs only.

    Lightning's connector refuses ``strategy="fsdp"`` and an exact ``FSDPStrategy`` with ``accelerator="cpu"``, and the
    strategy wraps the model with ``device_id`` None there, which torch's FSDP1 refuses without an accelerator. This
    subclass passes the connector and wraps the model with ``device_id`` the CPU before Lightning's own setup, which
    then takes it as a model the user wrapped. Everything else (the type check on the precision plugin, its hooks,
    clipping, checkpoints) is Lightning's.
    """

    def _setup_model(self, model: nn.Module) -> nn.Module:
        return super()._setup_model(wrap_on_cpu(model, self, **self.kwargs))


class CPUFabricFSDPStrategy(FabricFSDPStrategy):
    """Fabric's FSDPStrategy on the CPU (gloo), for the reasons given in :class:`CPUFSDPStrategy`."""

    def setup_module(self, module: nn.Module) -> nn.Module:
        return super().setup_module(wrap_on_cpu(module, self, **self._fsdp_kwargs))


class BatchCostRecorder(L.Callback):
    """Count host syncs and dispatched ops from the start to the end of every training batch.

    Put it first and last in ``callbacks`` (the same instance twice is not allowed, so pass ``opener`` and
    ``closer``): the callbacks in between, and the whole step, are inside the counted region.
    """

    def __init__(self) -> None:
        self.per_batch: list[StepCounts] = []
        self._region: contextlib.ExitStack | None = None

    def opener(self) -> L.Callback:
        recorder = self

        class _Open(L.Callback):
            def on_train_batch_start(self, *args: Any) -> None:
                recorder._region = contextlib.ExitStack()
                recorder.per_batch.append(recorder._region.enter_context(count_syncs_and_ops()))

        return _Open()

    def closer(self) -> L.Callback:
        recorder = self

        class _Close(L.Callback):
            def on_train_batch_end(self, *args: Any) -> None:
                assert recorder._region is not None
                recorder._region.close()
                recorder._region = None

        return _Close()


def parameter_checksum(module: nn.Module) -> str:
    """A SHA-256 of ``module``'s state dict (names and bytes, each DTensor gathered whole): equal on ranks that hold
    the same weights."""
    digest = hashlib.sha256()
    for name, parameter in sorted(module.state_dict().items()):
        digest.update(name.encode())
        whole = parameter.full_tensor() if isinstance(parameter, DTensor) else parameter
        digest.update(whole.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class PluginStateAtStart(L.Callback):
    """The precision plugin's state dict when a (resumed) fit starts."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.state = trainer.precision_plugin.state_dict()  # type: ignore[attr-defined]


class StepRecorder(L.Callback):
    """The step, the plugin's loss scale and its skip flag after every batch."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, float, bool]] = []

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        stats = trainer.precision_plugin.stats  # type: ignore[attr-defined]
        self.steps.append((trainer.global_step, stats.loss_scale, stats.last_step_skipped))


def read_events(log_dir: str | Path) -> event_accumulator.EventAccumulator:
    """Every scalar, tensor (text), histogram and image event under ``log_dir``, loaded in full (no sampling)."""
    accumulator = event_accumulator.EventAccumulator(
        str(log_dir),
        size_guidance={
            event_accumulator.SCALARS: 0,
            event_accumulator.TENSORS: 0,
            event_accumulator.HISTOGRAMS: 0,
            event_accumulator.IMAGES: 0,
        },
    )
    accumulator.Reload()
    return accumulator


def scalars(events: event_accumulator.EventAccumulator, tag: str) -> dict[int, float]:
    """The values logged under the scalar ``tag``, by step; empty when the tag was never logged."""
    if tag not in events.Tags()["scalars"]:
        return {}
    return {event.step: event.value for event in events.Scalars(tag)}


def texts(events: event_accumulator.EventAccumulator, tag: str) -> dict[int, str]:
    """The strings logged with ``SummaryWriter.add_text(tag, ...)``, by step; empty when the tag was never logged."""
    text_tag = f"{tag}/text_summary"
    if text_tag not in events.Tags()["tensors"]:
        return {}
    return {event.step: event.tensor_proto.string_val[0].decode() for event in events.Tensors(text_tag)}


MEASURED_STEP = "lightning_mp.measured_step"
"""The profiler's label of a training batch in the peak-memory runs (:class:`ProfiledSteps`)."""


def held_tensor_bytes(trainer: L.Trainer, pl_module: L.LightningModule) -> int:
    """The bytes of this rank's parameters, gradients and optimizer states (their local shards under FSDP and FSDP2)."""
    tensors = [*pl_module.parameters()]
    tensors += [parameter.grad for parameter in pl_module.parameters() if parameter.grad is not None]
    tensors += [
        value
        for optimizer in trainer.optimizers
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]
    return sum(local_shard(tensor).numel() * tensor.element_size() for tensor in tensors)


class ProfiledSteps(L.Callback):
    """Marks each training batch (forward, backward, optimizer step) in the profiler's trace as ``MEASURED_STEP``
    and counts the bytes held when it starts."""

    def __init__(self) -> None:
        self.open_step: torch.profiler.record_function | None = None
        self.held_at_start: list[int] = []

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.held_at_start.append(held_tensor_bytes(trainer, pl_module))
        self.open_step = torch.profiler.record_function(MEASURED_STEP)
        self.open_step.__enter__()

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        assert self.open_step is not None
        self.open_step.__exit__(None, None, None)
        self.open_step = None


def peak_step_bytes(events: list[Any], held_at_start: list[int] | None = None) -> int:
    """The most tensor bytes alive on this rank at any moment of a training step, from the profiler's raw events.

    Each ``[memory]`` event is one allocation (positive ``nbytes``) or free (negative) of the CPU allocator, the
    ``untyped_storage().resize_(0)`` by which FSDP and FSDP2 free their gathered parameters among them; frees of blocks
    allocated before the profiler started are not reported. With the profiler started before the model is built, the
    running sum in time order is the bytes alive of everything the fit made: the model, DDP's buckets, gradients,
    Adam's states, activations. A step's peak is the sum where the step starts plus the most it rises inside the step
    (gathered parameters, unsharded gradients, communication buffers, activations, the optimizer's temporaries). The
    steps after the first (which creates Adam's states) are the same; the smallest of their peaks is reported.

    The profiler records only the threads it was started in and those torch starts from them (autograd's); gloo
    releases some buffers of the sharded collectives in its own worker threads, so under FSDP and FSDP2 those frees
    are missing and the sum drifts up by a gathered layer now and then, most often during the setup. A missed free
    only raises the sum, so the rise inside a step is still an upper bound, but the level it starts from is not the
    sharded run's: pass ``held_at_start`` (the parameter, gradient and optimizer-state bytes counted from the tensors
    at each step's start, :class:`ProfiledSteps`) to start from those instead. DDP's sum does not drift, so it needs
    none.
    """
    windows = [(event.start_ns(), event.end_ns()) for event in events if event.name() == MEASURED_STEP]
    changes = sorted(
        (event.start_ns(), event.nbytes())
        for event in events
        if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU
    )
    alive = list(itertools.accumulate(change for _, change in changes))
    times = [time for time, _ in changes]
    peaks = []
    for index, (start, end) in enumerate(windows[1:], start=1):
        first, last = bisect.bisect_left(times, start), bisect.bisect_right(times, end)
        level = alive[first - 1] if first else 0
        rise = max([level, *alive[first:last]]) - level
        peaks.append((level if held_at_start is None else held_at_start[index]) + rise)
    return min(peaks)


def profiled_peak_bytes(fit: Callable[[ProfiledSteps], None], sharded: bool) -> int:
    """The peak tensor bytes of this rank in a training step of ``fit(steps)``, which must pass ``steps`` to its
    Trainer's callbacks; ``sharded`` (FSDP, FSDP2) starts each step from the bytes its tensors hold."""
    steps = ProfiledSteps()
    gc.collect()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True, record_shapes=False
    ) as profiler:
        fit(steps)
    events = profiler.profiler.kineto_results.events()
    return peak_step_bytes(events, steps.held_at_start if sharded else None)


RANK_ONE_FIRST_ROW = 8
"""The first row of rank 1's part of a 16-row weight split by rows over 2 ranks (FSDP2's shards, a column-parallel
layer): the 2-process scripts plant their inf there."""


def plant_inf_in_rank_ones_part(grad: torch.Tensor) -> None:
    """Put an inf at the start of rank 1's part of a 16-row gradient: its local shard's first element where it is
    split over the ranks, else row :data:`RANK_ONE_FIRST_ROW` of the whole gradient (DDP, called on rank 1 only)."""
    if is_sharded(grad):
        local_shard(grad)[0, 0] = float("inf")
    else:
        grad[RANK_ONE_FIRST_ROW, 0] = float("inf")
