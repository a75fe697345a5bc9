"""The advisors' measuring run: a few training batches on a copy of the model, leaving everything else as it was.

Both advisors (:func:`lightning_mp.advise` and :func:`lightning_mp.fp8.advisor.advise_fp8`) measure the same way and
differ only in what their hooks record. :func:`measuring_copy` checks the arguments they share and makes the copy
they measure: a deep copy of the model, in fp32 and in train mode, so the user's model, its buffers and gradients
are never touched. :func:`run_batches` then trains that copy on up to ``batches`` batches without stepping: each
batch is moved to the copy's device and cloned (a model that writes into its input, ``ELU(inplace=True)`` first,
must not change the data), its loss computed and back-propagated, so that forward hooks see every activation and
tensor hooks every gradient. The global random streams and the data loader's own generators are restored after, so
the caller's training draws what it would have drawn without the advice.

The loss is ``loss_fn(model, batch)`` where one is given, else the LightningModule's own ``training_step``. A
LightningModule with manual optimization (``automatic_optimization = False``) calls ``self.optimizers()`` and
``self.manual_backward()`` in its ``training_step``; the copy has no Trainer, so it is set up in a single-device
:class:`~lightning.fabric.Fabric` (Lightning's documented way to run a LightningModule without a Trainer) with the
optimizers of the copy's own ``configure_optimizers()``. The copy's steps change only the copy.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import LightningModule
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mp.arguments.checks import caller, check_number

LossFunction = Callable[[nn.Module, Any], Tensor]
"""``loss_fn(model, batch) -> loss``: how an advisor gets a loss from a plain ``nn.Module``."""


def measuring_copy(
    model: nn.Module, dataloader: Iterable[Any], batches: int, loss_fn: LossFunction | None
) -> tuple[nn.Module, int]:
    """Check the arguments every advisor takes, and return the copy it measures and the number of batches.

    Returns:
        A deep copy of ``model`` in fp32 and train mode (set up for its manual optimization where it has one), and
        ``batches`` as a Python int.

    Raises:
        TypeError: if ``loss_fn`` is not callable.
        ValueError: if ``model`` is not an ``nn.Module``, ``dataloader`` is not iterable, ``batches`` is below 1, or a
            plain ``nn.Module`` comes without ``loss_fn``; the message names the caller, the argument and its value.

    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"{caller()}(model={type(model).__name__}) is not allowed: model must be an nn.Module.")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(
            f"{caller()}(loss_fn={loss_fn!r}) is not allowed: loss_fn must be None or a callable"
            " loss_fn(model, batch) -> loss tensor."
        )
    if not isinstance(dataloader, Iterable):
        raise ValueError(
            f"{caller()}(dataloader={dataloader!r}) is not allowed: dataloader must be an iterable of batches."
        )
    batches = check_number("batches", batches, at_least=1, integer=True)
    if loss_fn is None and not isinstance(model, LightningModule):
        raise ValueError(
            f"{caller()}(model={type(model).__name__}, loss_fn=None) is not allowed: a plain nn.Module needs"
            " loss_fn=lambda model, batch: loss; a LightningModule's training_step is used otherwise."
        )
    work = copy.deepcopy(model).float().train()
    if loss_fn is None and isinstance(work, LightningModule) and not work.automatic_optimization:
        attach_manual_optimization(work)
    return work, batches


def training_loss(model: nn.Module, batch: Any, batch_idx: int, loss_fn: LossFunction | None) -> Tensor | None:
    """The loss to back-propagate; None when a manual-optimization ``training_step`` ran its own backward."""
    if loss_fn is not None:
        loss = loss_fn(model, batch)
        if not isinstance(loss, Tensor):
            raise TypeError(f"{caller()}(loss_fn=...) must return a loss tensor, got {type(loss).__name__}.")
        return loss
    assert isinstance(model, LightningModule)
    output = model.training_step(batch, batch_idx)
    if not model.automatic_optimization:
        return None
    returned = output.get("loss") if isinstance(output, dict) else output
    if not isinstance(returned, Tensor):
        raise ValueError(
            f"{caller()}(...) needs a loss: {type(model).__name__}.training_step returned {type(output).__name__}."
            " Return the loss (or a dict with 'loss'), or pass loss_fn=lambda model, batch: ..."
        )
    return returned


def loader_generators(dataloader: Iterable) -> list[torch.Generator]:
    """The random generators a DataLoader's sampler draws from, to restore after peeking at it."""
    candidates = [
        getattr(dataloader, "generator", None),
        getattr(getattr(dataloader, "sampler", None), "generator", None),
    ]
    return [generator for generator in candidates if isinstance(generator, torch.Generator)]


def attach_manual_optimization(model: LightningModule) -> None:
    """Give a manual-optimization copy what its ``training_step`` calls: ``optimizers()`` and ``manual_backward``.

    The copy is set up in a single-device fp32 Fabric with the optimizers of its own ``configure_optimizers()``,
    which hold the copy's parameters, so stepping them leaves the user's model and optimizers untouched.
    """
    try:
        configured = model.configure_optimizers()
    except Exception as error:  # e.g. it reads self.trainer, which the copy has not
        raise ValueError(
            f"{caller()}(model={type(model).__name__}) uses manual optimization, and its configure_optimizers() failed"
            f" on the advisor's copy, which has no Trainer ({type(error).__name__}: {error}). Pass"
            " loss_fn=lambda model, batch: loss instead."
        ) from error
    optimizers: list[Optimizer] = []
    apply_to_collection(configured, Optimizer, optimizers.append)
    if not optimizers:
        raise ValueError(
            f"{caller()}(model={type(model).__name__}) uses manual optimization, but its configure_optimizers()"
            " returned no optimizer to give its training_step. Pass loss_fn=lambda model, batch: loss instead."
        )
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    devices = [device.index or 0] if device.type == "cuda" else 1
    fabric = Fabric(accelerator=device.type, devices=devices, precision="32-true", loggers=[])
    fabric.setup(model, *optimizers, move_to_device=False)


def run_batches(
    work: nn.Module,
    dataloader: Iterable[Any],
    batches: int,
    loss_fn: LossFunction | None,
    after_backward: Callable[[], None] | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> int:
    """Train ``work`` (:func:`measuring_copy`'s copy) on up to ``batches`` batches without stepping; the number it ran.

    Each batch's loss is computed (under ``autocast_dtype`` where given) and back-propagated, then ``after_backward``
    runs (module docstring).

    Raises:
        ValueError: when the loader yields no batch, naming the caller
            (:func:`~lightning_mp.arguments.checks.arguments_of`).

    """
    device = next((p.device for p in work.parameters()), torch.device("cpu"))
    generators = loader_generators(dataloader)
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
                    loss = training_loss(work, own_batch, batch_idx, loss_fn)
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


__all__ = ["LossFunction", "attach_manual_optimization", "measuring_copy", "run_batches", "training_loss"]
