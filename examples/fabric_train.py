"""Train a small regressor with Lightning Fabric and lightning_mp's MixedPrecision: ``python examples/fabric_train.py``.

The loop is Fabric's own: ``fabric.backward`` scales the loss, ``fabric.clip_gradients`` clips true gradients,
``optimizer.step()`` is skipped when a gradient is inf or NaN, the counters go to ``fabric.log_dict``, and
``fabric.save`` stores the plugin beside the model and the optimizer so that a resumed run continues at the same
loss scale. ``--inject-at 3`` plants an inf gradient at step 3 to show a skipped step and the scale backing off.

Options: ``--precision 16-mixed|bf16-mixed|32-true``, ``--opt-level O1|O2``, ``--steps N``, ``--inject-at 3,7``,
``--checkpoint PATH`` (saved at the end; loaded first when it exists), ``--logs DIR`` (CSV logs).
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger
from torch import nn

from lightning_mp import MixedPrecision


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.LayerNorm(32), nn.Linear(32, 1))


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="16-mixed", choices=("16-mixed", "bf16-mixed", "32-true"))
    parser.add_argument("--opt-level", default="O1", choices=("O0", "O1", "O2"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--inject-at", default="", help="comma-separated steps that get an inf gradient")
    parser.add_argument("--checkpoint", type=Path, default=None)
    parser.add_argument("--logs", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the example; return the final counters and losses (the test reads them)."""
    args = parse(argv)
    inject_at = {int(step) for step in args.inject_at.split(",") if step}
    warnings.filterwarnings("ignore", message="lightning_mp: (fp16|this CPU)")
    torch.manual_seed(0)
    plugin = MixedPrecision(args.precision, opt_level=args.opt_level, init_scale=2.0**10, growth_interval=5)
    loggers = [CSVLogger(args.logs, name="fabric_train")] if args.logs else []
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin], loggers=loggers)

    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "precision": plugin, "step": 0}
    if args.checkpoint is not None and args.checkpoint.exists():
        fabric.load(args.checkpoint, state)

    generator = torch.Generator().manual_seed(1)
    features = torch.randn(256, 8, generator=generator)
    targets = features @ torch.randn(8, 1, generator=generator)
    losses: list[float] = []
    first_step = state["step"]
    for step in range(first_step, first_step + args.steps):
        batch = torch.randint(0, len(features), (32,), generator=generator)
        loss = nn.functional.mse_loss(model(features[batch]), targets[batch])
        fabric.backward(loss)
        if step in inject_at:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        fabric.clip_gradients(model, optimizer, max_norm=1.0)  # clips nothing on a step that will be skipped
        optimizer.step()
        optimizer.zero_grad()
        # Reading the stats applies this step's scale update; they are host-side floats: no device sync.
        fabric.log_dict({"loss": loss.item(), **plugin.stats.as_dict()}, step=step)
        losses.append(loss.item())
    state["step"] = first_step + args.steps
    if args.checkpoint is not None:
        fabric.save(args.checkpoint, state)
    if loggers:
        fabric.logger.finalize("success")
    stats = plugin.stats
    fabric.print(
        f"{args.precision} {args.opt_level}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, scale {stats.loss_scale:g},"
        f" skipped {stats.skipped_steps} of {stats.optimizer_steps} steps"
    )
    return {"losses": losses, "stats": stats.as_dict()}


if __name__ == "__main__":
    main()
