"""The real TensorBoard server serves what the monitors write: the user's view, end to end."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_mp import MixedPrecision
from lightning_mp.callbacks import GradientHealthMonitor, LayerDtypeMonitor, LossScaleMonitor, PrecisionSentinel
from tests.ddp_scripts.launch import free_port
from tests.helpers import TinyRegressor, loader, make_trainer

SERVER_WAIT_S = 60.0


def get_json(url: str) -> object:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


def poll(url: str, ready: Callable[[Any], bool], deadline: float) -> Any:
    """GET ``url`` until ``ready(answer)`` holds or the deadline passes; return the last answer."""
    answer: Any = None
    while time.monotonic() < deadline:
        try:
            answer = get_json(url)
            if ready(answer):
                return answer
        except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
            pass
        time.sleep(0.5)
    return answer


@pytest.mark.slow
def test_tensorboard_server_lists_the_precision_tags(tmp_path: Path):
    """A user who opens TensorBoard on the run finds precision/loss_scale among its scalars, the overflow text and the
    sentinel's heatmaps among its images."""
    logger = TensorBoardLogger(tmp_path)
    trainer = make_trainer(
        MixedPrecision("16-mixed", init_scale=2.0**8),
        callbacks=[
            LossScaleMonitor(),
            GradientHealthMonitor(),
            LayerDtypeMonitor(),
            PrecisionSentinel(every_n_steps=1),
        ],
        logger=logger,
        log_every_n_steps=1,
        max_steps=3,
    )
    # The inf at step 1 gives the run an overflow entry.
    with pytest.warns(RuntimeWarning, match="first.weight"):
        trainer.fit(TinyRegressor(inject_at=(1,)), loader(batch_size=4))
    run = Path(logger.log_dir).relative_to(tmp_path).as_posix()

    port = free_port()
    server_log = tmp_path / "tensorboard.log"
    # A file, not a pipe: an unread pipe that fills up would stall the server.
    with server_log.open("wb") as server_stderr:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tensorboard.main",
                "--logdir",
                str(tmp_path),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--load_fast",
                "false",
            ],
            stdout=subprocess.DEVNULL,
            stderr=server_stderr,
        )
    try:
        base = f"http://127.0.0.1:{port}/data/plugin"
        deadline = time.monotonic() + SERVER_WAIT_S
        scalar_tags = poll(
            f"{base}/scalars/tags", lambda answer: "precision/loss_scale" in answer.get(run, {}), deadline
        )
        # add_text(tag) is stored under "<tag>/text_summary".
        text_tags = poll(
            f"{base}/text/tags", lambda answer: "precision/overflow/text_summary" in answer.get(run, []), deadline
        )
        image_tags = poll(f"{base}/images/tags", lambda answer: len(answer.get(run, {})) >= 3, deadline)
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    server_errors = server_log.read_text(errors="replace")[-2000:]
    assert scalar_tags is not None, f"TensorBoard never answered on port {port}: {server_errors}"
    expected_scalars = {"precision/loss_scale", "precision/skipped_steps_total", "precision/grad_norm"}
    assert expected_scalars <= set(scalar_tags.get(run, {}))
    assert {"precision/overflow/text_summary", "precision/layer_dtypes/text_summary"} <= set(text_tags.get(run, []))
    assert set(image_tags.get(run, {})) == {
        "precision_sentinel/activation_headroom_log2",
        "precision_sentinel/grad_underflow_share",
        "precision_sentinel/stale_update_share",
    }
