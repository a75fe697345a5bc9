"""The demo, run as a user runs it: fp16 loss scaling at work, and a summary that matches the TensorBoard logs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lightning_mp import demo
from tests.helpers import read_events

# Slow: runs the demo as a user runs it: the fast loop leaves the module out.
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]


def run_demo(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    assert demo.main(argv) == 0
    return capsys.readouterr().out


def test_demo_shows_scale_growth_and_a_caught_overflow_and_lists_only_logged_tags(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The fp16 demo grows the scale, skips the planted overflow, and every tag its summary lists is in the logs."""
    log_dir = tmp_path / "logs"
    argv = ["--max-steps", "24", "--growth-interval", "4", "--spike-at-step", "12", "--log-dir", str(log_dir)]
    out = run_demo([*argv, "--accelerator", "cpu"], capsys)
    assert "lightning_mp demo summary" in out
    assert "precision       : 16-mixed" in out
    assert "optimizer steps : 24" in out
    assert re.search(r"skipped steps   : 1 .*planted at step 12", out)
    growths = int(re.search(r"doubled (\d+) times", out).group(1))  # type: ignore[union-attr]
    assert growths >= 3 and "halved once" in out
    assert f"tensorboard --logdir {log_dir}" in out
    assert "try next        : python -m lightning_mp.demo --precision auto (" in out
    listed = re.findall(r"^    (\S+)  ", out, flags=re.MULTILINE)
    events = list(log_dir.rglob("events.out.tfevents.*"))
    accumulator = read_events(events[0].parent)
    tags = accumulator.Tags()
    written = {*tags["scalars"], *tags["tensors"], *tags["histograms"], *tags["images"]}
    assert listed and set(listed) <= written
    assert "precision_sentinel/activation_headroom_log2" in listed  # the sentinel is on by default
    assert {"precision/loss_scale", "precision/overflow/text_summary", "precision/layer_dtypes/text_summary"} <= set(
        listed
    )
    scale = [event.value for event in accumulator.Scalars("precision/loss_scale")]
    assert max(scale) > scale[0]
    assert accumulator.Scalars("precision/scale_backoffs_total")[-1].value == 1
    skipped = [event.value for event in accumulator.Scalars("precision/skipped_steps_total")]
    assert skipped[-1] == 1


def test_demo_rejects_a_bad_flag(capsys: pytest.CaptureFixture) -> None:
    """A bad flag value is refused with a message naming it."""
    with pytest.raises(SystemExit):
        demo.parse_args(["--max-steps", "0"])
    assert "--max-steps" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo.parse_args(["--init-scale", "inf"])
    assert "--init-scale must be a finite number > 0, got inf" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo.parse_args(["--growth-interval", "0"])
    assert "--growth-interval must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo.parse_args(["--opt-level", "O0"])
    assert "--opt-level O0 is the fp32 baseline" in capsys.readouterr().err
