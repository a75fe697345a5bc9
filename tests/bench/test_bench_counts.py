"""`python -m lightning_mp.bench --counts`: the table of host syncs and ops per iteration covers every optimizer."""

from __future__ import annotations

import pytest

from lightning_mp.bench.counts import OPTIMIZERS, PRECISIONS, SHOWN_CONTESTANTS, counts_table

# Slow: the counts table runs every precision and optimizer: the fast loop leaves the module out.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rows() -> dict[tuple[str, str], dict[str, int]]:
    table = counts_table(PRECISIONS, tuple(OPTIMIZERS), vocab_size=8, d_model=8, seq_len=4, batch_size=1)
    parsed = {}
    for line in table.splitlines()[2:]:
        precision, optimizer, *cells = (cell.strip() for cell in line.strip("|").split("|"))
        parsed[precision, optimizer] = {
            name: int(cell.split("/")[0]) for name, cell in zip(SHOWN_CONTESTANTS, cells, strict=True)
        }
    return parsed


def test_counts_table_has_a_row_per_precision_and_optimizer_implementation(rows) -> None:
    """fp16, bf16 and fp32 each get fused, foreach and single-tensor Adam, AdamW and SGD, against the torch loop
    and Lightning's built-in plugin."""
    implementations = {
        f"{kind} {name}" for kind in ("fused", "foreach", "single-tensor") for name in ("Adam", "AdamW", "SGD")
    }
    assert set(OPTIMIZERS) == implementations
    assert set(rows) == {(precision, optimizer) for precision in PRECISIONS for optimizer in implementations}


def test_fused_optimizers_sync_no_more_than_lightning_in_every_precision(rows) -> None:
    """With a fused optimizer, lightning_mp's iteration makes no more host syncs than Lightning's built-in plugin."""
    for (precision, optimizer), syncs in rows.items():
        if optimizer.startswith("fused"):
            assert syncs["lightning_mp"] <= syncs["Lightning"], (precision, optimizer, syncs)
