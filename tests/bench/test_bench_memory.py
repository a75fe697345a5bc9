"""`python -m lightning_mp.bench --memory`: peak tensor bytes of one training step, split by category.

The byte counts come from the profiler's memory timeline and do not depend on the machine, so they are asserted
exactly where the arithmetic is known: AdamW keeps 8 bytes per parameter and a 4-byte step counter per tensor.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_mp.bench.cli import main, parse_args
from lightning_mp.bench.memory import (
    MEMORY_CONFIGURATIONS,
    TIMELINE_COLUMNS,
    MemoryBreakdown,
    breakdown_from_timeline,
    export_timeline,
    measure_memory,
    memory_report,
    memory_table,
)
from lightning_mp.bench.workloads import SIZES, ModelSize
from lightning_mp.tasks import TinyTransformerLM

# Slow: the memory benchmark's profiled runs: the fast loop leaves the module out.
pytestmark = pytest.mark.slow

SMALL = ModelSize(d_model=32, n_layers=1, n_heads=2, seq_len=16, batch_size=8, vocab_size=128)


@pytest.fixture(scope="module")
def measured() -> dict[str, MemoryBreakdown]:
    return {name: measure_memory(name, SMALL) for name in ("fp32", "lightning-bf16", "O1-bf16", "O2-bf16")}


def parameter_tensors(size: ModelSize) -> int:
    model = TinyTransformerLM(
        vocab_size=size.vocab_size, d_model=size.d_model, n_heads=size.n_heads, n_layers=size.n_layers
    )
    return len(list(model.parameters()))


INF_FLAG_BYTES = 4
"""The float32 inf flag that the plugin hands to the fused kernel in bf16, so that it skips without a host sync."""


def test_o2_keeps_less_than_fp32_between_steps(measured: dict[str, MemoryBreakdown]) -> None:
    """fp32 and O1 keep 4 B of weight, 4 of gradient and 8 of AdamW state per parameter; O2 about 14 B.

    O2 keeps a half weight (2 B) beside each fp32 master (4 B) and frees the fp32 gradients after each step.
    """
    tensors = parameter_tensors(SMALL)
    for name in ("fp32", "O1-bf16"):
        flag = INF_FLAG_BYTES if name.startswith("O") else 0
        assert measured[name].persistent_bytes == 16 * measured[name].parameters + 4 * tensors + flag
    o2 = measured["O2-bf16"]
    assert o2.persistent_bytes < measured["fp32"].persistent_bytes
    assert 12 < o2.persistent_bytes_per_parameter <= 14.1


def test_o2_peak_is_below_o1_and_fp32(measured: dict[str, MemoryBreakdown]) -> None:
    """O2's half activations make its step's peak lower than O1's and fp32's; its half copies count as weights."""
    fp32, o1, o2 = measured["fp32"], measured["O1-bf16"], measured["O2-bf16"]
    assert o2.peak_bytes < o1.peak_bytes < fp32.peak_bytes
    assert o2.activations < o1.activations < fp32.activations
    assert fp32.weights == o1.weights - INF_FLAG_BYTES == 4 * fp32.parameters
    assert 4 * o2.parameters < o2.weights <= 6 * o2.parameters
    assert o2.optimizer_state == fp32.optimizer_state
    total = o2.weights + o2.gradients + o2.optimizer_state + o2.activations + o2.other
    assert total == o2.peak_bytes


def test_issue_targets_hold_on_the_small_model_too(measured: dict[str, MemoryBreakdown]) -> None:
    """O2 peaks at most 0.98x O1 (half weights beside the masters cost 2 B/param); O1 at Lightning's bf16 + inf flag."""
    lightning, o1, o2 = measured["lightning-bf16"], measured["O1-bf16"], measured["O2-bf16"]
    assert o2.peak_bytes <= 0.98 * o1.peak_bytes
    # The flag kept between steps, and one more float32 scalar while the fused kernel runs.
    assert o1.peak_bytes <= lightning.peak_bytes + 2 * INF_FLAG_BYTES


def test_memory_table_has_one_row_per_configuration_and_ratios_to_fp32(measured: dict[str, MemoryBreakdown]) -> None:
    """The table lists each configuration with its peak, its ratio to fp32, its bytes per parameter kept between steps,
    and its weight and master bytes per parameter (O2: a bf16 weight and an fp32 master, 6)."""
    rows = [line.split("|") for line in memory_table(list(measured.values())).splitlines()[2:]]
    assert [row[1].strip() for row in rows] == ["fp32", "lightning-bf16", "O1-bf16", "O2-bf16"]
    assert rows[0][3].strip() == "1.000" and float(rows[3][3]) < 1
    assert float(rows[3][-3]) == pytest.approx(measured["O2-bf16"].persistent_bytes_per_parameter, abs=0.01)
    assert float(rows[3][-2]) == pytest.approx(6.0, abs=0.05)
    assert float(rows[0][-2]) == pytest.approx(4.0, abs=0.05)


def test_memory_flag_prints_and_writes_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--memory --size tiny --configs O2-bf16 --out FILE` prints the table and the targets and writes them."""
    out = tmp_path / "memory.md"
    assert main(["--memory", "--size", "tiny", "--configs", "O2-bf16", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| O2-bf16 |" in printed and re.search(r"O2-bf16 persistent state <= 16 B/param: 14\.\d\d -> met", printed)
    assert out.read_text() == printed.rstrip("\n") + "\n"


def test_memory_mode_defaults_to_the_medium_size_and_every_configuration() -> None:
    """--memory alone measures the medium model (about 2.1M parameters) in every configuration."""
    args = parse_args(["--memory", "--accelerator", "cpu"])
    assert args.size == "medium" and args.configs == list(MEMORY_CONFIGURATIONS)
    medium = SIZES["medium"]
    model = TinyTransformerLM(
        vocab_size=medium.vocab_size, d_model=medium.d_model, n_layers=medium.n_layers, seq_len=medium.seq_len
    )
    assert 2.0e6 < sum(p.numel() for p in model.parameters()) < 2.2e6


def test_lean_keeps_8_bytes_per_bf16_parameter_in_the_memory_benchmark() -> None:
    """--memory's lean-bf16 row: bf16 weight, gradient and two AdamW moments (8 B) per parameter; LayerNorms stay fp32
    (16 B), plus AdamW's 4-byte step counter per tensor: half of fp32's state."""
    lean = measure_memory("lean-bf16", SMALL)
    model = TinyTransformerLM(
        vocab_size=SMALL.vocab_size, d_model=SMALL.d_model, n_heads=SMALL.n_heads, n_layers=SMALL.n_layers
    )
    norm_parameters = sum(
        parameter.numel()
        for module in model.modules()
        if isinstance(module, nn.LayerNorm)
        for parameter in module.parameters()
    )
    tensors = parameter_tensors(SMALL)
    assert lean.persistent_bytes == 8 * lean.parameters + 8 * norm_parameters + 4 * tensors + INF_FLAG_BYTES
    assert lean.weights - INF_FLAG_BYTES == lean.gradients == 2 * lean.parameters + 2 * norm_parameters


def test_memory_report_counts_the_host_work_of_a_steady_step(measured: dict[str, MemoryBreakdown]) -> None:
    """--memory also counts each configuration's Python calls and compute ops per step, and checks O2's target."""
    assert all(result.python_calls > 0 and result.compute_ops > 0 for result in measured.values())
    text = memory_report(list(measured.values()), "small", SMALL)
    o2 = measured["O2-bf16"]
    assert f"| O2-bf16 | {o2.python_calls:,} | {o2.compute_ops:,} |" in text
    ratio = o2.python_calls / measured["O1-bf16"].python_calls
    assert f"O2-bf16 Python calls <= 1.10x O1-bf16: {ratio:.3f}x" in text


def test_the_exported_timeline_splits_a_step_by_category_without_a_warning() -> None:
    """torch's public timeline export, read back, holds one column per category: at the end of an AdamW step the
    parameters, their gradients and the two moments are where they belong, and its deprecation warning stays in."""
    model = nn.Linear(16, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    with torch.profiler.profile(profile_memory=True, record_shapes=True, with_stack=True) as profiler:
        model(torch.randn(4, 16)).sum().backward()
        optimizer.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        times, sizes = export_timeline(profiler, "cpu")
    assert len(times) == len(sizes) and {len(row) for row in sizes} == {len(TIMELINE_COLUMNS)}
    at_end = dict(zip(TIMELINE_COLUMNS, sizes[-1], strict=True))
    weight_bytes = 4 * (16 * 8 + 8)
    assert at_end["parameter"] == at_end["gradient"] == weight_bytes
    assert at_end["optimizer_state"] == 2 * weight_bytes + 2 * 4  # two moments, and a float32 step per tensor
    memory = breakdown_from_timeline((times, sizes), "fp32", 16 * 8 + 8)
    assert memory.persistent_bytes == 4 * weight_bytes + 8


def test_a_timeline_of_another_format_is_refused_naming_the_columns() -> None:
    """A torch whose export writes other columns gets a clear error instead of a wrong split."""
    with pytest.raises(ValueError, match=r"must have 9 sizes .*parameter, optimizer_state"):
        breakdown_from_timeline(([0, 1], [[0, 1, 2], [0, 3, 4]]), "fp32", 1)
