"""The main job, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def test_demo_runs_and_writes_tensorboard_events(tmp_path: Path):
    """`python -m lightning_mp.demo --max-steps 20` exits 0, prints its summary and writes event files."""
    result = subprocess.run(
        [sys.executable, "-m", "lightning_mp.demo", "--max-steps", "20", "--log-dir", str(tmp_path / "logs")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "lightning_mp demo summary" in result.stdout
    assert "optimizer steps: 20" in result.stdout
    assert f"tensorboard --logdir {tmp_path / 'logs'}" in result.stdout
    assert "precision/loss_scale" in result.stdout and "precision/layer_dtypes" in result.stdout
    events = list((tmp_path / "logs").rglob("events.out.tfevents.*"))
    assert events
    accumulator = EventAccumulator(str(events[0].parent), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    assert "precision/loss_scale" in accumulator.Tags()["scalars"]
    assert "precision/layer_dtypes/text_summary" in accumulator.Tags()["tensors"]


def test_demo_rejects_a_bad_flag(tmp_path: Path):
    """A bad flag value is refused with a message naming it."""
    result = subprocess.run(
        [sys.executable, "-m", "lightning_mp.demo", "--max-steps", "0"], capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode != 0 and "--max-steps" in result.stderr
