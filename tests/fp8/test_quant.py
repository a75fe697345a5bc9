"""The FP8 cast statistics against plain torch float8 casts, and against torchao's own recipes and error measure."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("torchao")

from torchao.float8.config import Float8LinearConfig
from torchao.float8.float8_utils import compute_error

from lightning_mp.fp8.quant import (
    MAX_SQNR_DB,
    RECIPES,
    STAT_NAMES,
    OperandCast,
    cast_stats,
    casts_of_config,
    fp8_round_trip,
    recipe_casts,
)


def stats_of(tensor: torch.Tensor, cast: OperandCast) -> dict[str, float]:
    return dict(zip(STAT_NAMES, cast_stats(tensor, cast).tolist(), strict=True))


def tensorwise_reference(tensor: torch.Tensor, dtype: torch.dtype) -> dict[str, float]:
    """Per-tensor scaling written out with plain torch casts, independently of the package."""
    largest = torch.finfo(dtype).max
    amax = tensor.abs().max().item()
    scale = largest / amax
    restored = (tensor * scale).to(dtype).float() / scale
    nonzero = tensor != 0
    noise = (tensor - restored).pow(2).sum().item()
    return {
        "amax": amax,
        "scale": scale,
        "underflow_share": ((restored == 0) & nonzero).sum().item() / nonzero.sum().item(),
        "saturated_share": 0.0,
        "sqnr_db": 10 * math.log10(tensor.pow(2).sum().item() / noise),
    }


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_recipes_match_torchao(recipe):
    """Each recipe's casts (granularity, FP8 dtype, power-of-two scales) are those torchao's config applies."""
    assert casts_of_config(Float8LinearConfig.from_recipe_name(recipe)) == RECIPES[recipe]


def test_tensorwise_recipe_casts_gradients_to_e5m2_and_rowwise_to_e4m3():
    """tensorwise gives the output gradient e5m2's range; the rowwise recipes keep e4m3 with power-of-two scales."""
    assert RECIPES["tensorwise"].grad_output.dtype == torch.float8_e5m2
    assert RECIPES["tensorwise"].input.dtype == torch.float8_e4m3fn
    assert all(
        cast.dtype == torch.float8_e4m3fn and cast.power_of_two_scale for cast in vars(RECIPES["rowwise"]).values()
    )


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_tensorwise_stats_match_a_plain_torch_reference(dtype):
    """amax, scale, underflow share and SQNR equal a per-tensor cast written with plain torch float8 casts."""
    torch.manual_seed(0)
    tensor = torch.randn(64, 32) * torch.logspace(-11, 0, 32)  # columns down to 1e-11: some flush to zero
    measured = stats_of(tensor, OperandCast("tensorwise", dtype))
    expected = tensorwise_reference(tensor, dtype)
    assert expected["underflow_share"] > 0
    for name in STAT_NAMES:
        assert measured[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-7), name


def test_rowwise_scales_each_row_with_a_power_of_two():
    """Rowwise casts give each row its own power-of-two scale: a row a million times smaller loses nothing more."""
    torch.manual_seed(0)
    tensor = torch.randn(2, 64)
    tensor[1] *= 1e-6
    cast = RECIPES["rowwise"].input
    _, restored, scale = fp8_round_trip(tensor, cast)
    assert torch.equal(scale, torch.exp2(torch.floor(torch.log2(448 / tensor.abs().amax(-1, keepdim=True)))))
    row_errors = [compute_error(tensor[row], restored[row]).item() for row in range(2)]
    assert row_errors[1] == pytest.approx(row_errors[0], abs=3.0)
    assert stats_of(tensor, cast)["underflow_share"] == 0
    assert stats_of(tensor, RECIPES["tensorwise"].input)["underflow_share"] > 0.4


def test_sqnr_is_torchaos_compute_error():
    """The SQNR is torchao's own error measure on the tensor read back from FP8."""
    torch.manual_seed(1)
    tensor = torch.randn(32, 48)
    for cast in (RECIPES["tensorwise"].grad_output, RECIPES["rowwise"].weight):
        _, restored, _ = fp8_round_trip(tensor, cast)
        assert stats_of(tensor, cast)["sqnr_db"] == pytest.approx(compute_error(tensor, restored).item(), rel=1e-4)


def test_an_exact_cast_reports_the_sqnr_cap_and_an_empty_tensor_nan():
    """Powers of two cast exactly (SQNR at its cap); an all-zero tensor has nothing to lose; empty gives NaN."""
    assert stats_of(torch.tensor([1.0, 2.0, 4.0]), RECIPES["tensorwise"].input)["sqnr_db"] == MAX_SQNR_DB
    zeros = stats_of(torch.zeros(4, 16), RECIPES["rowwise"].input)
    assert zeros["sqnr_db"] == MAX_SQNR_DB and zeros["underflow_share"] == 0
    assert all(math.isnan(value) for value in stats_of(torch.zeros(0), RECIPES["tensorwise"].input).values())


def test_bad_casts_and_recipes_are_refused_by_name():
    """An unknown granularity, a non-FP8 dtype or an unknown recipe is refused with what is allowed."""
    with pytest.raises(ValueError, match=r"granularity='blockwise'.*'tensorwise' or 'rowwise'"):
        OperandCast("blockwise", torch.float8_e4m3fn)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"dtype=torch.bfloat16.*float8_e4m3fn"):
        OperandCast("tensorwise", torch.bfloat16)
    with pytest.raises(ValueError, match=r"recipe='delayed'.*'tensorwise', 'rowwise', 'rowwise_with_gw_hp'"):
        recipe_casts("delayed")
