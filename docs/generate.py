"""Regenerate the documentation's figures from a real run's TensorBoard events: ``python docs/generate.py``.

It trains the demo (``python -m lightning_mp.demo``: fp16, a planted loss spike at step 50) into a temporary log
directory, reads the event files back with TensorBoard's ``EventAccumulator`` and writes, under ``docs/_static/``:

- ``demo-loss-scale.png``: the loss scale, the skipped steps and the training loss, by step, as the
  ``LossScaleMonitor`` logged them;
- ``demo-sentinel-headroom.png``: the ``PrecisionSentinel``'s per-layer heatmap of fp16 activation headroom, the image
  the run wrote to TensorBoard, saved as it is.

Nothing is drawn by hand and nothing is downloaded; on a CPU the run takes about a minute.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from tensorboard.backend.event_processing import event_accumulator

ROOT = Path(__file__).resolve().parents[1]
STATIC = Path(__file__).resolve().parent / "_static"
SCALARS = {
    "precision/loss_scale": ("loss scale", True),
    "precision/skipped_steps_total": ("skipped steps", False),
}
HEATMAP = "precision_sentinel/activation_headroom_log2"


def read_events(log_dir: Path) -> event_accumulator.EventAccumulator:
    """Every scalar and image event under ``log_dir``, loaded in full."""
    guidance = {event_accumulator.SCALARS: 0, event_accumulator.IMAGES: 0}
    accumulator = event_accumulator.EventAccumulator(str(log_dir), size_guidance=guidance)
    accumulator.Reload()
    return accumulator


def loss_tag(scalar_tags: list[str]) -> str | None:
    """The training loss's tag, whatever the model named it."""
    return next((tag for tag in sorted(scalar_tags) if "loss" in tag and "train" in tag), None)


def plot_scalars(events: event_accumulator.EventAccumulator, out: Path) -> None:
    """The loss scale, the skipped steps and the training loss, one panel each, sharing the step axis."""
    tags = events.Tags()["scalars"]
    panels = dict(SCALARS)
    loss = loss_tag(tags)
    if loss is not None:
        panels[loss] = ("training loss", False)
    figure, axes = plt.subplots(len(panels), 1, figsize=(7, 1.9 * len(panels)), sharex=True)
    for axis, (tag, (label, log_scale)) in zip(axes, panels.items(), strict=True):
        points = events.Scalars(tag)
        axis.plot([point.step for point in points], [point.value for point in points], drawstyle="steps-post")
        axis.set_ylabel(label)
        if log_scale:
            axis.set_yscale("log", base=2)
        axis.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    axes[0].set_title("python -m lightning_mp.demo: fp16, a loss spike planted at step 50")
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)


def save_heatmap(events: event_accumulator.EventAccumulator, out: Path) -> bool:
    """The last sentinel heatmap the run wrote, as the PNG TensorBoard stores; False where the run wrote none."""
    if HEATMAP not in events.Tags()["images"]:
        return False
    out.write_bytes(events.Images(HEATMAP)[-1].encoded_image_string)
    return True


def main() -> int:
    """Run the demo into a temporary directory and write the figures into ``docs/_static``."""
    sys.path.insert(0, str(ROOT))
    from lightning_mp import demo

    STATIC.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as log_dir:
        demo.main(["--accelerator", "cpu", "--log-dir", log_dir])
        events = read_events(next(Path(log_dir).rglob("events.out.tfevents.*")).parent)
        plot_scalars(events, STATIC / "demo-loss-scale.png")
        wrote_heatmap = save_heatmap(events, STATIC / "demo-sentinel-headroom.png")
    print(f"wrote {STATIC / 'demo-loss-scale.png'}" + (", demo-sentinel-headroom.png" if wrote_heatmap else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
