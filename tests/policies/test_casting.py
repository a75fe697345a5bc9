"""The in-place cast to half that O3 and lean share: its hooks cast what they must, and cost little per forward."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_mp.overrides import Fp32Overrides
from lightning_mp.policies.casting import convert_to_half


def layers() -> nn.Sequential:
    """Four blocks of a Linear and a LayerNorm: eight modules that get hooks."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)) for _ in range(4)])


def to_lean_half(model: nn.Module) -> nn.Module:
    """``model`` cast to bf16 as lean casts it: norms stay fp32 in regions of their own."""
    convert_to_half(model, torch.bfloat16, Fp32Overrides(), keep_normalization_fp32=True, float_outputs=False)
    return model


class Recorder(nn.Module):
    """A module with a weight of its own that records the dtypes of the tensors it was called with."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2))
        self.seen: list[torch.dtype] = []

    def forward(self, x: Tensor, extras: dict[str, Tensor], scale: float = 1.0, *, bias: Tensor | None = None) -> Any:
        self.seen = [x.dtype, extras["y"].dtype, *([] if bias is None else [bias.dtype])]
        return x * self.weight * scale


def test_floating_inputs_in_arguments_collections_and_keywords_take_the_weights_dtype() -> None:
    """fp32 and fp64 tensors reach a bf16 module as bf16, in positional, nested and keyword arguments alike."""
    model = Recorder()
    convert_to_half(model, torch.bfloat16, Fp32Overrides())
    output = model(torch.randn(3, 2), {"y": torch.randn(3, dtype=torch.float64)}, 2.0, bias=torch.ones(2))
    assert model.seen == [torch.bfloat16, torch.bfloat16, torch.bfloat16]
    assert output.dtype == torch.float32  # the root's outputs come back in fp32


def test_an_embedding_takes_its_indices_untouched() -> None:
    """An embedding's input is indices, not a floating tensor: it trains in bf16 without a hook of its own."""
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))
    convert_to_half(model, torch.bfloat16, Fp32Overrides(), float_outputs=False)
    assert not model[0]._forward_pre_hooks and model[1]._forward_pre_hooks
    assert model(torch.tensor([[1, 2, 3]])).dtype == torch.bfloat16


def test_converting_again_attaches_each_hook_once_and_again_after_removal() -> None:
    """Converting a converted model adds no hook; once teardown removed the hooks, converting attaches them again."""
    model = Recorder()
    handles: list = []
    convert_to_half(model, torch.bfloat16, Fp32Overrides(), handles=handles)
    convert_to_half(model, torch.bfloat16, Fp32Overrides(), handles=handles)
    assert len(handles) == 2 and len(model._forward_pre_hooks) == len(model._forward_hooks) == 1
    for handle in handles:
        handle.remove()
    convert_to_half(model, torch.bfloat16, Fp32Overrides())
    assert len(model._forward_pre_hooks) == len(model._forward_hooks) == 1
    output = model(torch.randn(3, 2), {"y": torch.randn(3)})
    assert model.seen == [torch.bfloat16, torch.bfloat16] and output.dtype == torch.float32
