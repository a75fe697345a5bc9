"""The recipes that run through Fabric, and a plugin moved between a Trainer and Fabric either way."""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_mp import MixedPrecision
from tests.recipes.common import (
    Level,
    Outcome,
    Weights,
    audit_of,
    batches,
    duplicated_parameters,
    make_audited_trainer,
    mlp,
    plugin_of,
    recipe_loader,
    snapshot,
    stats_of,
)
from tests.recipes.trainer_recipes import (
    Regressor,
)


def ended_fabric_run(plugin: MixedPrecision | None, initial: Weights, model: Any, optimizer: Any) -> Outcome:
    """The outcome of a Fabric run, read before the plugin is torn down (Fabric tears no plugin down itself)."""
    stats = stats_of(plugin)
    if plugin is not None:
        plugin.teardown()
    return Outcome(initial, snapshot(model), stats, duplicated_parameters([optimizer], model))


def fabric_loop(
    plugin: MixedPrecision | None, plant_inf_at: int | None = None, accumulate: int = 2, steps: int = 4
) -> Outcome:
    """Fabric's own loop: ``fabric.backward`` under ``no_backward_sync`` for ``accumulate`` micro-batches, then
    ``fabric.clip_gradients`` by norm, ``optimizer.step()`` and ``optimizer.zero_grad()``; ``plugin.teardown()`` at the
    end, as the README asks."""
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin] if plugin is not None else None)
    model = mlp()
    initial = snapshot(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    for index, (x, y) in enumerate(batches(steps * accumulate, seed=2)):
        stepping = (index + 1) % accumulate == 0
        with fabric.no_backward_sync(model, enabled=not stepping):
            fabric.backward(nn.functional.mse_loss(model(x).float(), y) / accumulate)
        if index // accumulate == plant_inf_at:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        if stepping:
            fabric.clip_gradients(model, optimizer, max_norm=0.3)
            optimizer.step()
            optimizer.zero_grad()
    return ended_fabric_run(plugin, initial, model, optimizer)


def fabric_discarded_backward(level: Level | None) -> Outcome:
    """Fabric: ``fabric.backward`` of another loss, ``optimizer.zero_grad()``, ``fabric.backward``,
    ``optimizer.step()``: the step must see the second backward's gradients only."""
    plugin = plugin_of(level)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin] if plugin is not None else None)
    model = mlp()
    initial = snapshot(model)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for x, y in batches(4, seed=3):
        fabric.backward(nn.functional.mse_loss(model(x.flip(0)).float(), 3.0 * y))
        optimizer.zero_grad()
        fabric.backward(nn.functional.mse_loss(model(x).float(), y))
        optimizer.step()
        optimizer.zero_grad()
    return ended_fabric_run(plugin, initial, model, optimizer)


def fabric(level: Level | None) -> Outcome:
    """Fabric's backward / clip_gradients / step loop with ``no_backward_sync`` accumulation."""
    return fabric_loop(plugin_of(level))


def trainer_then_fabric(level: Level | None) -> Outcome:
    """A plugin that trained under a Trainer (with a skipped step) then drives a Fabric loop: the loop must equal a
    fresh plugin's."""
    plugin = plugin_of(level)
    make_audited_trainer(plugin, max_steps=4).fit(Regressor(plant_inf_at=1), recipe_loader(4))
    outcome = fabric_loop(plugin)
    outcome.must_equal = fabric_loop(plugin_of(level))
    return outcome


def fabric_then_trainer(level: Level | None) -> Outcome:
    """A plugin that drove a Fabric loop (with a skipped step) then trains under a Trainer: the fit must equal a fresh
    plugin's."""

    def fit_fresh_regressor(plugin: MixedPrecision | None) -> Outcome:
        model = Regressor()
        initial = snapshot(model)
        trainer = make_audited_trainer(plugin, max_steps=6)
        trainer.fit(model, recipe_loader(8))
        return Outcome(initial, snapshot(model), stats_of(plugin), audit_of(trainer))

    plugin = plugin_of(level)
    fabric_loop(plugin, plant_inf_at=1 if level is not None else None)
    outcome = fit_fresh_regressor(plugin)
    outcome.must_equal = fit_fresh_regressor(plugin_of(level))
    return outcome
