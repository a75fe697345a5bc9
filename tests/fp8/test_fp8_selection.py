"""Which linear layers run FP8: the pure rules, and the setup line that reports them."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from lightning_mp.fp8 import FP8Settings
from lightning_mp.fp8.selection import CONV1D_REASON, select_fp8_layers, shortfall_warning, summary_line


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


class Conv1D(nn.Module):
    """transformers' Conv1D, rebuilt: ``x @ weight + bias`` with a weight of shape ``(in, out)``."""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.nf = out_features
        self.weight = nn.Parameter(torch.randn(in_features, out_features) * 0.02)
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).reshape(*x.shape[:-1], self.nf)


class Gpt2Shaped(nn.Module):
    """GPT-2's layout: embeddings, blocks of Conv1D projections (c_attn, c_proj, c_fc, c_proj), a linear head."""

    def __init__(self, vocab: int = 128, width: int = 32, blocks: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.h = nn.ModuleList(
            nn.ModuleDict(
                {
                    "c_attn": Conv1D(3 * width, width),
                    "attn_proj": Conv1D(width, width),
                    "c_fc": Conv1D(4 * width, width),
                    "mlp_proj": Conv1D(width, 4 * width),
                }
            )
            for _ in range(blocks)
        )
        self.lm_head = nn.Linear(width, vocab, bias=False)


class HeadFirst(nn.Module):
    """litgpt's GPT layout: ``lm_head`` registered before the embedding and the blocks."""

    def __init__(self, vocab: int = 128, width: int = 32) -> None:
        super().__init__()
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.wte = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"qkv": nn.Linear(width, 3 * width), "proj": nn.Linear(width, width)}) for _ in range(2)
        )


def test_a_head_first_model_keeps_the_input_side_projection_and_the_head() -> None:
    """keep_first_last keeps the output head (the layer that emits the vocabulary) and the first projection after
    the embedding, wherever the model registers them, and converts the rest."""
    selection = select_fp8_layers(HeadFirst(), FP8Settings())
    assert selection.kept == {"lm_head": "last linear", "blocks.0.qkv": "first linear"}
    assert selection.fp8 == ("blocks.0.proj", "blocks.1.qkv", "blocks.1.proj")


def test_gpt2s_conv1d_projections_are_named_with_their_reason_and_the_shortfall_is_warned() -> None:
    """GPT-2's Conv1D projections are listed as kept (torchao converts nn.Linear only), counted among the linear
    parameters, and the warning says that no layer runs FP8, naming them."""
    model = Gpt2Shaped()
    selection = select_fp8_layers(model, FP8Settings())
    assert selection.fp8 == ()
    assert selection.kept["h.0.c_attn"] == CONV1D_REASON and selection.kept["lm_head"] == "last linear"
    conv_parameters = sum(p.numel() for name, p in model.named_parameters() if name.startswith("h."))
    assert selection.linear_parameters == conv_parameters + model.lm_head.weight.numel()
    warning = shortfall_warning(selection, "tensorwise")
    assert (
        warning is not None and "no linear layer runs FP8" in warning and "h.0.c_attn (transformers Conv1D" in warning
    )


def test_keep_fp32_layers_are_listed_apart_in_the_setup_line() -> None:
    """A keep_fp32 layer computes in fp32: the setup line lists it under its own heading, not as bf16."""
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 4))
    selection = select_fp8_layers(model, FP8Settings(), keep_fp32=["2"])
    line = summary_line(selection, "tensorwise")
    assert line.endswith("; bf16: 0 (first linear), 3 (last linear); fp32 (keep_fp32): 2")
    assert shortfall_warning(selection, "tensorwise") is not None  # 1 of 4 layers, under half the parameters
