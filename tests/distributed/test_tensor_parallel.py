"""MixedPrecision and its monitors under tensor parallelism (Lightning's ModelParallelStrategy) on 2 CPU processes.

The tests read what ``ddp_scripts/tensor_parallel_train.py`` wrote: the same model trained under DDP and under
tensor parallelism (column- and row-parallel layers beside a LayerNorm and a Linear that both ranks hold whole), with
the gradient-health monitor and the sentinel logging to TensorBoard.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.ddp_scripts.launch import reports, run
from tests.helpers import read_events, scalars, texts

TENSOR_PARALLEL_SCRIPT = Path(__file__).parents[1] / "ddp_scripts" / "tensor_parallel_train.py"
INJECT_AT = (2, 5)
GRADIENT_TAGS = ("precision/grad_norm", "precision/grad_zero_fraction")
SENTINEL_TAGS = ("precision_sentinel/total_grad_underflow_share", "precision_sentinel/max_stale_update_share")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """fp32 and fp16 O1, each under DDP and under tensor parallelism, with the monitors logging every step."""
    out = tmp_path_factory.mktemp("tensor-parallel")
    run(["--out", str(out), "--cases", "32-true:O0,16-mixed:O1"], timeout=60, script=TENSOR_PARALLEL_SCRIPT)
    return out, reports(out, tag="tp_")


def _events(out: Path, case: str) -> dict[str, Any]:
    return {strategy: read_events(out / "tb" / f"{case.replace(':', '-')}-{strategy}") for strategy in ("ddp", "tp")}


def _histogram_sizes(events: Any) -> dict[int, float]:
    """The number of elements in each logged gradient-magnitude histogram, by step."""
    return {event.step: event.histogram_value.num for event in events.Histograms("precision/grad_log2_magnitude")}


@pytest.mark.slow
def test_tensor_parallel_telemetry_counts_replicated_tensors_once(trained):
    """Under tensor parallelism the logged gradient norm, zero fraction, histogram size and the sentinel's underflow
    and stale-update shares are those of the same fp32 run under DDP: a tensor both ranks hold counts once."""
    out, _ = trained
    events = _events(out, "32-true:O0")
    for tag in (*GRADIENT_TAGS, *SENTINEL_TAGS):
        ddp, tensor_parallel = (scalars(events[strategy], tag) for strategy in ("ddp", "tp"))
        assert len(tensor_parallel) == (8 if tag in GRADIENT_TAGS else 5), tag
        assert tensor_parallel == pytest.approx(ddp, rel=1e-5), tag
    # Some gradient elements are zero and one tensor's updates are all stale: the shares above are not trivial.
    assert min(scalars(events["tp"], "precision/grad_zero_fraction").values()) > 0
    assert min(scalars(events["tp"], "precision_sentinel/max_stale_update_share").values()) > 0
    assert _histogram_sizes(events["tp"]) == _histogram_sizes(events["ddp"])


@pytest.mark.slow
def test_tensor_parallel_fp16_skips_an_inf_on_one_rank_with_both_ranks_as_ddp_does(trained):
    """fp16 under tensor parallelism: an inf in rank 1's part of a column-parallel weight is skipped by both ranks at
    the steps DDP skips, with DDP's scales; each step's loss is that of DDP's two ranks together, the monitors
    report DDP's gradients on the steps that were not skipped, and the overflow reports name the parameter as DDP's
    do, with its whole shape."""
    out, ranks = trained
    for rank in ranks:
        ddp, tensor_parallel = rank["16-mixed:O1"]["ddp"], rank["16-mixed:O1"]["tp"]
        assert tensor_parallel["steps"] == ddp["steps"]
        assert [step - 1 for step, _, skipped in tensor_parallel["steps"] if skipped] == list(INJECT_AT)
        assert tensor_parallel["stats"] == ddp["stats"]
    ddp_losses = [rank["16-mixed:O1"]["ddp"]["losses"] for rank in ranks]
    whole_batch_losses = [(first + second) / 2 for first, second in zip(*ddp_losses, strict=True)]
    assert ranks[0]["16-mixed:O1"]["tp"]["losses"] == pytest.approx(whole_batch_losses, rel=1e-3)
    events = _events(out, "16-mixed:O1")
    assert texts(events["tp"], "precision/overflow") == texts(events["ddp"], "precision/overflow")
    for tag in (*GRADIENT_TAGS, "precision/grad_headroom_log2", *SENTINEL_TAGS):
        tensor_parallel = {step: value for step, value in scalars(events["tp"], tag).items() if step not in INJECT_AT}
        ddp = scalars(events["ddp"], tag)
        # fp16 rounds the row-parallel layer's partial sums before adding them: the norms agree to fp16's precision.
        assert tensor_parallel == pytest.approx({step: ddp[step] for step in tensor_parallel}, rel=1e-3), tag
