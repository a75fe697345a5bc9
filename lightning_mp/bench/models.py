"""The networks of the GPU-sized workloads: a GPT-like language model and ResNet-50, written compactly.

:class:`GPTLike` is a decoder-only transformer: token and learned position embeddings, ``n_layers`` pre-norm
blocks (causal self-attention through :func:`torch.nn.functional.scaled_dot_product_attention`, which picks the
flash or memory-efficient kernel where it can, then a 4x GELU MLP), a final LayerNorm and an untied head. With
d_model 1024, 12 layers and a 32768-token vocabulary it has 219M parameters: 12 x 12.6M in the blocks,
33.6M in each of the embedding and the head.

:class:`ResNet` is the bottleneck ResNet (v1.5: the stride sits on the 3x3 convolution) with BatchNorm after
every convolution; :func:`resnet50` builds ResNet-50 (25.6M parameters), torchvision's own where torchvision is
installed, so that figures compare with what users train.
"""

from __future__ import annotations

import importlib
import importlib.util

from torch import Tensor, nn
from torch.nn import functional


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention over ``(batch, seq, d_model)``, one fused projection for q, k and v."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(
                f"CausalSelfAttention(d_model={d_model}, n_heads={n_heads}): d_model must divide by n_heads"
            )
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.projection = nn.Linear(d_model, d_model)

    def forward(self, hidden: Tensor) -> Tensor:
        """Attend each position to itself and the positions before it."""
        batch, seq, d_model = hidden.shape
        q, k, v = self.qkv(hidden).view(batch, seq, 3, self.n_heads, d_model // self.n_heads).permute(2, 0, 3, 1, 4)
        attended = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.projection(attended.transpose(1, 2).reshape(batch, seq, d_model))


class Block(nn.Module):
    """A pre-norm transformer block: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(d_model)
        self.attention = CausalSelfAttention(d_model, n_heads)
        self.mlp_norm = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, hidden: Tensor) -> Tensor:
        """The block's output, the same shape as its input."""
        hidden = hidden + self.attention(self.attention_norm(hidden))
        return hidden + self.mlp(self.mlp_norm(hidden))


class GPTLike(nn.Module):
    """A decoder-only language model: logits ``(batch, seq, vocab_size)`` for tokens ``(batch, seq)``.

    Example:
        >>> import torch
        >>> model = GPTLike(vocab_size=16, d_model=8, n_layers=1, n_heads=2, seq_len=4)
        >>> model(torch.zeros(2, 4, dtype=torch.long)).shape
        torch.Size([2, 4, 16])

    """

    def __init__(self, vocab_size: int, d_model: int, n_layers: int, n_heads: int, seq_len: int) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(seq_len, d_model)
        self.blocks = nn.Sequential(*(Block(d_model, n_heads) for _ in range(n_layers)))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, tokens: Tensor) -> Tensor:
        """Next-token logits at every position."""
        positions = self.position_embedding.weight[: tokens.shape[1]]
        return self.head(self.norm(self.blocks(self.token_embedding(tokens) + positions)))


class Bottleneck(nn.Module):
    """1x1 down to ``width``, 3x3 at ``stride``, 1x1 up to ``4 x width``, each with BatchNorm; ReLU after the sum."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int) -> None:
        super().__init__()
        out_channels = width * self.expansion
        self.residual = nn.Sequential(
            nn.Conv2d(in_channels, width, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, out_channels, 1, bias=False),
            nn.BatchNorm2d(out_channels),
        )
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, images: Tensor) -> Tensor:
        """The block's output: half the resolution where ``stride`` is 2."""
        return functional.relu(self.residual(images) + self.shortcut(images))


class ResNet(nn.Module):
    """A bottleneck ResNet: logits ``(batch, num_classes)`` for images ``(batch, 3, height, width)``.

    Args:
        blocks: bottleneck blocks per stage; ``(3, 4, 6, 3)`` is ResNet-50.
        base_width: the first stage's width; each later stage doubles it.
        num_classes: the classifier's outputs.

    Example:
        >>> import torch
        >>> ResNet(blocks=(1, 1), base_width=4, num_classes=10)(torch.zeros(2, 3, 32, 32)).shape
        torch.Size([2, 10])

    """

    def __init__(self, blocks: tuple[int, ...] = (3, 4, 6, 3), base_width: int = 64, num_classes: int = 1000) -> None:
        super().__init__()
        layers: list[nn.Module] = [
            nn.Conv2d(3, base_width, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(base_width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        ]
        channels = base_width
        for stage, count in enumerate(blocks):
            width = base_width * 2**stage
            for index in range(count):
                layers.append(Bottleneck(channels, width, stride=2 if stage > 0 and index == 0 else 1))
                channels = width * Bottleneck.expansion
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(channels, num_classes)

    def forward(self, images: Tensor) -> Tensor:
        """Class logits, after global average pooling."""
        return self.classifier(self.features(images).mean(dim=(2, 3)))


def resnet50(num_classes: int = 1000) -> nn.Module:
    """ResNet-50: torchvision's where torchvision is installed, else :class:`ResNet` with the same layers."""
    if importlib.util.find_spec("torchvision") is not None:
        model: nn.Module = importlib.import_module("torchvision.models").resnet50(num_classes=num_classes)
        return model
    return ResNet((3, 4, 6, 3), 64, num_classes)
