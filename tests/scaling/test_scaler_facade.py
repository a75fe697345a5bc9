"""The LossScaler facade answers torch's public GradScaler calls as torch's GradScaler does, without its internals."""

from __future__ import annotations

import pickle

import pytest
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import nn

from lightning_mp import LossScaler
from lightning_mp.scaling.steps import Phase

SETTINGS = {"init_scale": 128.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2}


def _both() -> tuple[torch.amp.GradScaler, LossScaler]:
    return torch.amp.GradScaler("cpu", **SETTINGS), LossScaler("cpu", **SETTINGS)


def test_the_settings_read_back_as_set_like_torchs():
    """Each getter returns the constructor's value, then the setter's, exactly as torch's GradScaler does."""
    theirs, ours = _both()
    assert isinstance(ours, torch.amp.GradScaler) and ours.is_enabled()
    for scaler in (theirs, ours):
        scaler.set_growth_factor(3.0)
        scaler.set_backoff_factor(0.25)
        scaler.set_growth_interval(7)
    for getter in ("get_growth_factor", "get_backoff_factor", "get_growth_interval", "get_scale"):
        assert getattr(ours, getter)() == getattr(theirs, getter)(), getter


def test_scaling_a_list_or_a_tuple_of_losses_scales_each_like_torchs():
    """scale() of a list, a tuple or a generator of tensors multiplies each by the scale, keeping the container."""
    losses = [torch.tensor(1.5), torch.tensor(-2.0)]
    theirs, ours = _both()
    for container in (list, tuple):
        expected, got = theirs.scale(container(losses)), ours.scale(container(losses))
        assert type(got) is container and [t.item() for t in got] == [t.item() for t in expected]
    assert [t.item() for t in ours.scale(iter(losses))] == [192.0, -256.0]
    with pytest.raises(ValueError, match="outputs must be a Tensor or an iterable of Tensors"):
        ours.scale([1.0])


def test_pickling_in_the_middle_of_an_iteration_is_refused_like_torchs():
    """A scaler pickled between unscale_ and update raises, as torch's does; after update it pickles."""
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    theirs, ours = _both()
    for scaler in (theirs, ours):
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        scaler.unscale_(optimizer)
        with pytest.raises(AssertionError, match="only be pickled at the beginning of an iteration"):
            pickle.dumps(scaler)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    assert pickle.loads(pickle.dumps(ours)).get_scale() == theirs.get_scale()


def test_an_unscale_through_a_lightning_optimizer_is_the_unscale_of_the_optimizer_it_wraps():
    """A wrapper that shares its optimizer's param_groups is that optimizer: after ``unscale_(wrapper)`` the wrapped
    optimizer counts as unscaled, and its step does not divide the gradients again."""
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    wrapper = LightningOptimizer(optimizer)
    scaler = LossScaler("cpu", **SETTINGS)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(wrapper)
    unscaled = model.weight.grad.clone()
    assert scaler.step_phase(optimizer) is Phase.UNSCALED and scaler.step_phase(wrapper) is Phase.UNSCALED
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    assert torch.equal(model.weight.grad, unscaled) and scaler.optimizer_steps == 1
