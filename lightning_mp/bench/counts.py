"""Host syncs and compute ops of one training iteration (``--counts``), for the step engine against its peers.

Four contestants run the same iteration (forward under autocast, scaled backward, optimizer step, scale update,
``zero_grad``) on the same model and batch:

* ``torch loop``: the hand-written ``torch.amp`` recipe (a ``torch.amp.GradScaler`` in fp16, nothing in bf16/fp32);
* ``Lightning``: Lightning's built-in plugin (``MixedPrecision`` with a GradScaler in fp16, ``Precision`` in fp32),
  driven through its ``optimizer_step`` hook as the Trainer drives it;
* ``lightning_mp``: this project's plugin, driven the same way;
* ``LossScaler``: this project's scaler used by hand, exactly like the torch loop.

Two warm-up iterations create the optimizer state and the scaler's preallocated tensors; the third is counted with
:func:`lightning_mp.bench.counting.count_syncs_and_ops`. Counts are deterministic: they do not depend on the machine.

The table (:func:`counts_table`) covers each of torch's three implementations of Adam, AdamW and SGD with momentum
(``fused=True``, ``foreach=True`` and single-tensor ``foreach=False``) in fp16, bf16 and fp32. On the CPU the
foreach and single-tensor optimizers read their step counters on the host (the same reads for every contestant);
the difference between the contestants is what their mixed precision adds.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision as LightningMixedPrecision
from lightning.pytorch.plugins.precision import Precision as LightningPrecision
from torch import nn

from lightning_mp.bench.counting import StepCounts, count_syncs_and_ops
from lightning_mp.plugin import MixedPrecision
from lightning_mp.scaler import LossScaler
from lightning_mp.tasks import TinyTransformerLM

PrecisionName = Literal["16-mixed", "bf16-mixed", "32-true"]
PRECISIONS: tuple[PrecisionName, ...] = ("16-mixed", "bf16-mixed", "32-true")
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "fused Adam": lambda params: torch.optim.Adam(params, lr=1e-3, fused=True),
    "fused AdamW": lambda params: torch.optim.AdamW(params, lr=1e-3, fused=True),
    "fused SGD": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9, fused=True),
    "foreach Adam": lambda params: torch.optim.Adam(params, lr=1e-3, foreach=True),
    "foreach AdamW": lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=True),
    "foreach SGD": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=True),
    "single-tensor Adam": lambda params: torch.optim.Adam(params, lr=1e-3, foreach=False),
    "single-tensor AdamW": lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=False),
    "single-tensor SGD": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=False),
}
"""Each implementation of Adam, AdamW and SGD with momentum, by the name the table gives it."""
CONTESTANTS = ("torch loop", "Lightning", "lightning_mp", "LossScaler")
SHOWN_CONTESTANTS = ("torch loop", "Lightning", "lightning_mp")
"""The contestants the table shows: the recipes users compare with, and the plugin."""
_HALF = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}
_WARMUP_ITERATIONS = 2


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    logits = model(inputs)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def _by_hand(scaler: torch.amp.GradScaler | None, precision: PrecisionName) -> Callable[..., None]:
    def iteration(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any) -> None:
        dtype = _HALF.get(precision)
        autocast = torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()
        with autocast:
            loss = _loss(model, batch)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad(set_to_none=True)

    return iteration


def _through_hooks(plugin: Any) -> Callable[..., None]:
    def iteration(model: L.LightningModule, optimizer: torch.optim.Optimizer, batch: Any) -> None:
        def closure() -> torch.Tensor:
            with plugin.forward_context():
                loss = _loss(model, batch)
            loss = plugin.pre_backward(loss, model)
            loss.backward()
            return loss

        plugin.optimizer_step(optimizer, model=model, closure=closure)
        optimizer.zero_grad(set_to_none=True)

    return iteration


def _attached(model: L.LightningModule) -> None:
    """Give the module a Trainer, so that the plugins' hooks (``on_before_optimizer_step``) can run."""
    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    trainer.strategy.connect(model)
    model.trainer = trainer


def _contestant(name: str, precision: PrecisionName, model: L.LightningModule, optimizer: Any) -> Callable[..., None]:
    if name == "torch loop":
        return _by_hand(torch.amp.GradScaler("cpu") if precision == "16-mixed" else None, precision)
    if name == "LossScaler":
        return _by_hand(LossScaler("cpu", mode="dynamic" if precision == "16-mixed" else "check"), precision)
    _attached(model)
    if name == "Lightning":
        if precision == "32-true":
            return _through_hooks(LightningPrecision())
        scaler = torch.amp.GradScaler("cpu") if precision == "16-mixed" else None
        return _through_hooks(LightningMixedPrecision(precision, "cpu", scaler))
    plugin = MixedPrecision(precision, device="cpu")
    plugin.setup_for_device("cpu")
    plugin.convert_module(model)
    plugin.connect(model, [optimizer], [])
    return _through_hooks(plugin)


def count_iteration(
    precision: PrecisionName,
    optimizer_name: str,
    make_model: Callable[[], L.LightningModule],
    batch: tuple[torch.Tensor, torch.Tensor],
    contestants: tuple[str, ...] = CONTESTANTS,
) -> dict[str, StepCounts]:
    """Syncs and ops of one steady-state iteration, per contestant.

    Args:
        precision: ``"16-mixed"``, ``"bf16-mixed"`` or ``"32-true"``.
        optimizer_name: a key of :data:`OPTIMIZERS`.
        make_model: builds a fresh model (the same one for every contestant).
        batch: ``(inputs, targets)`` for the model.
        contestants: which of :data:`CONTESTANTS` to run.

    Returns:
        The counts of the third iteration, by contestant.

    """
    results: dict[str, StepCounts] = {}
    for name in contestants:
        torch.manual_seed(0)
        model = make_model()
        optimizer = OPTIMIZERS[optimizer_name](model.parameters())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            iteration = _contestant(name, precision, model, optimizer)
            for _ in range(_WARMUP_ITERATIONS):
                iteration(model, optimizer, batch)
            with count_syncs_and_ops() as counts:
                iteration(model, optimizer, batch)
        results[name] = counts
    return results


def tiny_language_model(
    vocab_size: int = 16, d_model: int = 16, seq_len: int = 8, batch_size: int = 2
) -> tuple[Callable[[], L.LightningModule], tuple[torch.Tensor, torch.Tensor]]:
    """A small :class:`~lightning_mp.tasks.TinyTransformerLM` factory and one batch for it."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=generator)

    def make_model() -> L.LightningModule:
        return TinyTransformerLM(vocab_size=vocab_size, d_model=d_model, n_heads=2, n_layers=2, seq_len=seq_len)

    return make_model, (tokens[:, :-1], tokens[:, 1:])


def counts_table(
    precisions: tuple[PrecisionName, ...] = PRECISIONS,
    optimizers: tuple[str, ...] = tuple(OPTIMIZERS),
    **model_size: int,
) -> str:
    """A Markdown table of syncs and compute ops per iteration, per precision, optimizer and contestant."""
    make_model, batch = tiny_language_model(**model_size)
    shown = SHOWN_CONTESTANTS
    header = "| precision | optimizer | " + " | ".join(f"{name}: syncs / ops" for name in shown) + " |"
    lines = [header, "|---|---|" + "---|" * len(shown)]
    for precision in precisions:
        for optimizer_name in optimizers:
            counts = count_iteration(precision, optimizer_name, make_model, batch, contestants=shown)
            cells = " | ".join(f"{counts[name].syncs} / {counts[name].compute_ops}" for name in shown)
            lines.append(f"| {precision} | {optimizer_name} | {cells} |")
    return "\n".join(lines)


def counts_report(quick: bool) -> str:
    """The ``--counts`` report: the table of :func:`counts_table` under a line saying what was counted.

    ``quick`` counts only fp16 with fused Adam, on a smaller model.
    """
    if quick:
        table = counts_table(("16-mixed",), ("fused Adam",), vocab_size=8, d_model=8, seq_len=4, batch_size=1)
    else:
        table = counts_table(PRECISIONS, tuple(OPTIMIZERS))
    return (
        "Host syncs / compute ops per training iteration (TinyTransformerLM, 2 layers, steady state, counted on the"
        f" CPU with lightning_mp.bench.counting):\n\n{table}"
    )
