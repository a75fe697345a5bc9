"""Which linear layers run FP8: the pure rules, and the setup line that reports them."""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

from lightning_mp.fp8 import FP8Settings
from lightning_mp.fp8.selection import CONV1D_REASON, select_fp8_layers, shortfall_warning, summary_line
from tests.fp8.lm_models import Conv1D, Gpt2Shaped, HeadFirstGpt

CONV1D_NAMES = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def _model() -> nn.Module:
    return nn.Sequential(
        OrderedDict(
            embed=nn.Linear(16, 64),
            block=nn.Sequential(OrderedDict(attn=nn.Linear(64, 64), mlp=nn.Linear(64, 64), odd=nn.Linear(64, 40))),
            proj=nn.Linear(40, 64),
            norm=nn.LayerNorm(64),
            head=nn.Linear(64, 8),
        )
    )


def test_first_and_last_linear_and_odd_dims_stay_bf16_by_default():
    """By default the first and last linear layers and layers with dims not divisible by 16 stay bf16, with reasons."""
    selection = select_fp8_layers(_model(), FP8Settings())
    assert selection.fp8 == ("block.attn", "block.mlp")
    assert selection.kept == {
        "embed": "first linear",
        "block.odd": "dims not divisible by 16",
        "proj": "dims not divisible by 16",
        "head": "last linear",
    }
    assert selection.fp8_parameters == 2 * (64 * 64 + 64)


def test_keep_first_last_false_lets_the_ends_run_fp8():
    """keep_first_last=False puts the first and last linear in FP8 when their dims allow."""
    selection = select_fp8_layers(_model(), FP8Settings(keep_first_last=False))
    assert selection.fp8 == ("embed", "block.attn", "block.mlp")
    assert selection.kept["head"] == "dims not divisible by 16"


def test_exclude_by_name_regex_and_type_keeps_whole_subtrees():
    """exclude takes qualified names (their whole subtree), 're:' patterns on the full name, and module types."""
    by_name = select_fp8_layers(_model(), FP8Settings(exclude=["block"]))
    assert by_name.fp8 == () and by_name.kept["block.attn"] == "excluded"
    by_regex = select_fp8_layers(_model(), FP8Settings(exclude=["re:.*attn"]))
    assert by_regex.fp8 == ("block.mlp",)

    class Special(nn.Linear):
        pass

    model = _model()
    model.block.mlp = Special(64, 64)
    by_type = select_fp8_layers(model, FP8Settings(exclude=[Special]))
    assert by_type.fp8 == ("block.attn",) and by_type.kept["block.mlp"] == "excluded"


def test_layers_that_fell_back_stay_bf16():
    """A layer that fell back in the run (or in the run a checkpoint came from) is not converted again."""
    selection = select_fp8_layers(_model(), FP8Settings(), fell_back={"block.attn"})
    assert selection.fp8 == ("block.mlp",) and selection.kept["block.attn"] == "fell back"


def test_a_model_that_is_one_linear_is_kept():
    """A bare nn.Linear model has nothing to convert in place: it stays bf16."""
    selection = select_fp8_layers(nn.Linear(64, 64), FP8Settings(keep_first_last=False))
    assert selection.fp8 == () and selection.kept == {"": "the model itself"}


def test_summary_line_says_counts_and_why_each_layer_stays_bf16():
    """The setup line gives FP8 layers and parameters out of the total, and each bf16 layer with its reason."""
    line = summary_line(select_fp8_layers(_model(), FP8Settings()), "rowwise")
    assert line.startswith("FP8 (rowwise): 2 of 6 linear layers, 8.3K of ")
    assert "embed (first linear)" in line and "head (last linear)" in line and "proj (dims not divisible by 16)" in line
    assert "and 1 more" in summary_line(select_fp8_layers(_model(), FP8Settings()), "rowwise", shown=3)


def test_a_head_first_model_keeps_the_input_side_projection_and_the_head() -> None:
    """keep_first_last keeps the output head and the first projection after the embedding of a model registered
    head-first (litgpt's GPT), even where an MLP is as wide as the vocabulary, and converts the rest."""
    selection = select_fp8_layers(HeadFirstGpt(), FP8Settings())
    assert selection.kept == {"lm_head": "last linear", "transformer.h.0.attn.qkv": "first linear"}
    assert selection.fp8[0] == "transformer.h.0.attn.proj" and "transformer.h.1.mlp.fc" in selection.fp8
    assert len(selection.fp8) == 7


def test_gpt2s_conv1d_projections_run_fp8_with_the_first_one_and_the_tied_head_kept() -> None:
    """GPT-2's Conv1D projections are linear layers to FP8: every one runs FP8 but the first (c_attn of block 0),
    and the head tied to the token embedding stays bf16; the setup line counts them."""
    model = Gpt2Shaped()
    selection = select_fp8_layers(model, FP8Settings())
    projections = [f"h.{block}.{name}" for block in (0, 1) for name in CONV1D_NAMES]
    assert selection.fp8 == tuple(projections[1:])
    assert selection.kept == {"h.0.attn.c_attn": "first linear", "lm_head": "last linear"}
    conv1d_parameters = sum(p.numel() for m in model.modules() if isinstance(m, Conv1D) for p in m.parameters())
    assert selection.linear_parameters == conv1d_parameters + model.lm_head.weight.numel()
    assert shortfall_warning(selection, "tensorwise") is None


def test_under_fsdp_float8_all_gather_gpt2s_conv1d_projections_are_named_with_the_reason() -> None:
    """FSDP2's float8 all-gather takes nn.Linear weights only: there the Conv1D projections stay bf16, each named
    with that reason, and the warning says no layer runs FP8."""
    selection = select_fp8_layers(Gpt2Shaped(), FP8Settings(fsdp_float8_all_gather=True))
    assert selection.fp8 == ()
    assert selection.kept["h.1.attn.c_attn"] == CONV1D_REASON
    warning = shortfall_warning(selection, "tensorwise")
    assert warning is not None and "h.0.attn.c_proj (transformers Conv1D under fsdp_float8_all_gather" in warning


def test_keep_fp32_layers_are_listed_apart_in_the_setup_line() -> None:
    """A keep_fp32 layer computes in fp32: the setup line lists it under its own heading, not as bf16."""
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 4))
    selection = select_fp8_layers(model, FP8Settings(), keep_fp32=["2"])
    line = summary_line(selection, "tensorwise")
    assert line.endswith("; bf16: 0 (first linear), 3 (last linear); fp32 (keep_fp32): 2")
    assert shortfall_warning(selection, "tensorwise") is not None  # 1 of 4 layers, under half the parameters
