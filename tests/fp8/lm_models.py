"""Language models shaped as the FP8 mode's real clients build them, built here (transformers and litgpt are no
dependencies): GPT-2's layout with transformers' ``Conv1D`` projections, and litgpt's GPT, which registers ``lm_head``
before the embedding and the blocks. Both learn to predict the next token of counting sequences."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from tests.fp8.plugin_models import LossRecorder

VOCAB, WIDTH, CONTEXT = 128, 32, 8


class Conv1D(nn.Module):
    """transformers' ``Conv1D``, rebuilt: ``x @ weight + bias`` with a weight of shape ``(in, out)``."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = (*x.shape[:-1], self.nf)
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).reshape(size_out)


class Gpt2Block(nn.Module):
    """GPT-2's block: ``attn.c_attn``, ``attn.c_proj``, ``mlp.c_fc``, ``mlp.c_proj``, all Conv1D."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.ModuleDict({"c_attn": Conv1D(3 * width, width), "c_proj": Conv1D(width, width)})
        self.mlp = nn.ModuleDict({"c_fc": Conv1D(4 * width, width), "c_proj": Conv1D(width, 4 * width)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        query, key, value = self.attn.c_attn(self.ln_1(x)).split(x.shape[-1], dim=-1)
        x = x + self.attn.c_proj(F.scaled_dot_product_attention(query, key, value, is_causal=True))
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x))))


class Gpt2Shaped(nn.Module):
    """GPT-2's layout: token and position embeddings, Conv1D blocks, a final norm and a head tied to ``wte``."""

    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
        self.h = nn.ModuleList(Gpt2Block() for _ in range(blocks))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[-1], device=tokens.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class LitBlock(nn.Module):
    """litgpt's block: ``attn.qkv``, ``attn.proj``, ``mlp.fc``, ``mlp.proj``, all nn.Linear."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.norm_1, self.norm_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.ModuleDict({"qkv": nn.Linear(width, 3 * width), "proj": nn.Linear(width, width)})
        self.mlp = nn.ModuleDict({"fc": nn.Linear(width, 4 * width), "proj": nn.Linear(4 * width, width)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        query, key, value = self.attn.qkv(self.norm_1(x)).split(x.shape[-1], dim=-1)
        x = x + self.attn.proj(F.scaled_dot_product_attention(query, key, value, is_causal=True))
        return x + self.mlp.proj(F.gelu(self.mlp.fc(self.norm_2(x))))


class HeadFirstGpt(nn.Module):
    """litgpt's GPT: ``lm_head`` registered first, then ``transformer.wte``, the blocks ``transformer.h`` and
    ``transformer.ln_f``."""

    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(VOCAB, WIDTH),
                "h": nn.ModuleList(LitBlock() for _ in range(blocks)),
                "ln_f": nn.LayerNorm(WIDTH),
            }
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(tokens)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


class TinyLm(LossRecorder):
    """Trains ``network`` (seeded) on next-token prediction with AdamW; records every training loss."""

    def __init__(self, network: type[nn.Module] = Gpt2Shaped, lr: float = 3e-3, seed: int = 0) -> None:
        super().__init__(lr, seed)
        self.network = network()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.network(tokens)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self(tokens[:, :-1]).float()
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        return loss


def counting_loader(n: int = 1024, batch_size: int = 16, seed: int = 0) -> DataLoader:
    """Sequences of ``CONTEXT + 1`` tokens counting by 1, 2 or 3 from a random start, modulo the vocabulary."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=generator)
    step = torch.randint(1, 4, (n, 1), generator=generator)
    tokens = (start + step * torch.arange(CONTEXT + 1)) % VOCAB
    return DataLoader(TensorDataset(tokens), batch_size=batch_size)
