"""Which linear layers run FP8: the pure rules, and the setup line that reports them."""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

from lightning_mp.fp8 import FP8Settings
from lightning_mp.fp8.selection import select_fp8_layers, summary_line


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
