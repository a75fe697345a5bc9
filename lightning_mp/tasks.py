"""The reference tasks: a small transformer language model, and a tiny regressor for the documentation's examples.

The language model serves the demo, the benchmark and the parity checks; :func:`example_task` gives the regressor that
the documentation's examples train.

The text is generated in-process, so nothing is downloaded: a seeded Markov chain over ``vocab_size`` tokens in
which every token has ``branching`` possible successors with random probabilities. A model that has learned the
chain reaches the chain's entropy rate (at most ``log(branching)`` nats per token) instead of ``log(vocab_size)``,
so the loss shows clearly whether training works.
"""

from __future__ import annotations

import math

import lightning as L
import torch
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, TensorDataset
from typing_extensions import override


def markov_text(num_sequences: int, seq_len: int, vocab_size: int = 64, branching: int = 3, seed: int = 0) -> Tensor:
    """Generate ``num_sequences`` token sequences of length ``seq_len + 1`` from a seeded sparse Markov chain.

    Returns:
        A ``LongTensor`` of shape ``(num_sequences, seq_len + 1)``: inputs are ``[:, :-1]``, targets ``[:, 1:]``.

    Example:
        >>> markov_text(2, 8).shape
        torch.Size([2, 9])

    """
    generator = torch.Generator().manual_seed(seed)
    successors = torch.stack([torch.randperm(vocab_size, generator=generator)[:branching] for _ in range(vocab_size)])
    probabilities = torch.rand(vocab_size, branching, generator=generator) + 0.2
    probabilities /= probabilities.sum(dim=1, keepdim=True)
    tokens = torch.empty(num_sequences, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab_size, (num_sequences,), generator=generator)
    for position in range(1, seq_len + 1):
        previous = tokens[:, position - 1]
        choice = torch.multinomial(probabilities[previous], 1, generator=generator).squeeze(1)
        tokens[:, position] = successors[previous, choice]
    return tokens


class MarkovTextDataModule(L.LightningDataModule):
    """Train and validation splits of :func:`markov_text`.

    Args:
        seq_len: tokens per training example.
        batch_size: examples per batch.
        train_sequences: size of the training split; the validation split is a quarter of it.
        vocab_size: number of distinct tokens.
        seed: seed of the chain and of the sampled text.

    """

    def __init__(
        self, seq_len: int = 64, batch_size: int = 32, train_sequences: int = 2048, vocab_size: int = 64, seed: int = 0
    ) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.train_sequences = train_sequences
        self.vocab_size = vocab_size
        self.seed = seed
        self._train: Dataset[tuple[Tensor, ...]] | None = None
        self._val: Dataset[tuple[Tensor, ...]] | None = None

    @override
    def setup(self, stage: str) -> None:
        val_sequences = max(self.train_sequences // 4, self.batch_size)
        text = markov_text(self.train_sequences + val_sequences, self.seq_len, self.vocab_size, seed=self.seed)
        pairs = TensorDataset(text[:, :-1], text[:, 1:])
        self._train = torch.utils.data.Subset(pairs, range(self.train_sequences))
        self._val = torch.utils.data.Subset(pairs, range(self.train_sequences, len(pairs)))

    @override
    def train_dataloader(self) -> DataLoader:
        assert self._train is not None
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(self._train, batch_size=self.batch_size, shuffle=True, generator=generator, drop_last=True)

    @override
    def val_dataloader(self) -> DataLoader:
        assert self._val is not None
        return DataLoader(self._val, batch_size=self.batch_size)


class TinyTransformerLM(L.LightningModule):
    """A causal transformer language model: embeddings, pre-norm encoder layers with a causal mask, a linear head.

    Args:
        vocab_size: number of tokens.
        d_model: width of the residual stream.
        n_heads: attention heads per layer.
        n_layers: transformer layers.
        seq_len: the longest sequence (size of the learned position table).
        lr: AdamW learning rate; a linear warm-up over ``warmup_steps`` steps is scheduled per step.
        warmup_steps: steps of learning-rate warm-up.

    """

    def __init__(
        self,
        vocab_size: int = 64,
        d_model: int = 128,
        n_heads: int = 4,
        n_layers: int = 2,
        seq_len: int = 64,
        lr: float = 3e-3,
        warmup_steps: int = 20,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(seq_len, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, n_heads, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)
        self.loss_fn = nn.CrossEntropyLoss()

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits of shape ``(batch, seq, vocab)`` for tokens of shape ``(batch, seq)``."""
        seq = tokens.shape[1]
        positions = torch.arange(seq, device=tokens.device)
        hidden = self.token_embedding(tokens) + self.position_embedding(positions)
        causal = nn.Transformer.generate_square_subsequent_mask(seq, device=tokens.device)
        hidden = self.encoder(hidden, mask=causal, is_causal=True)
        return self.head(self.norm(hidden))

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        inputs, targets = batch
        logits = self(inputs)
        return self.loss_fn(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    @override
    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"], weight_decay=0.01)
        warmup = max(1, self.hparams["warmup_steps"])
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _Warmup(warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    @staticmethod
    def chance_loss(vocab_size: int = 64) -> float:
        """The loss of a model that has learned nothing: ``log(vocab_size)``."""
        return math.log(vocab_size)


class _Warmup:
    """Linear learning-rate warm-up factor; a class rather than a lambda so that schedulers stay picklable."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def __call__(self, step: int) -> float:
        return min(1.0, (step + 1) / self.steps)


class ExampleRegressor(L.LightningModule):
    """The documentation's example model: a linear body, a LayerNorm and a linear ``head``, trained with SGD.

    Its submodules are named as the examples name them (``keep_fp32=["head"]``, ``keep_fp32=[nn.LayerNorm]``).
    """

    def __init__(self, features: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.body = nn.Linear(features, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, 1)

    @override
    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.relu(self.norm(self.body(x))))

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x).float(), y))

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def example_task(
    samples: int = 64, batch_size: int = 8, seed: int = 0
) -> tuple[ExampleRegressor, torch.optim.Optimizer, DataLoader, Tensor]:
    """What the documentation's examples train: a tiny model, its optimizer, a loader of its data, and one batch.

    The data is a seeded linear regression with a little noise, made in-process.

    Example:
        >>> model, optimizer, loader, batch = example_task()
        >>> model(batch).shape
        torch.Size([8, 1])

    """
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 16, generator=generator)
    y = x @ torch.randn(16, 1, generator=generator) + 0.1 * torch.randn(samples, 1, generator=generator)
    torch.manual_seed(seed)
    model = ExampleRegressor()
    loader = DataLoader(TensorDataset(x, y), batch_size=batch_size)
    return model, model.configure_optimizers(), loader, x[:batch_size]
