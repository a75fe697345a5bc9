"""AdvisorCallback: advice at the start of fit, in TensorBoard under precision/advice, without changing the run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecision
from lightning_mp.callbacks import AdvisorCallback
from tests.helpers import fit, make_trainer, read_events, texts


class Planted(LightningModule):
    """stem -> blowup (outputs ~1e5, beyond fp16) -> LayerNorm -> dropout -> head; records the batches it saw."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(8, 16)
        self.blowup = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.dropout = nn.Dropout(0.3)
        self.head = nn.Linear(16, 4)
        with torch.no_grad():
            self.blowup.weight.mul_(3e5)
        self.seen: list[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.dropout(torch.relu(self.norm(self.blowup(torch.relu(self.stem(x)))))))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        features, target = batch
        self.seen.append(features)
        loss = F.cross_entropy(self(features), target)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
        data = TensorDataset(x, (x[:, 0] > 0).long())
        return DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1))


def fit_new_planted(
    callbacks: list, logger: TensorBoardLogger | bool = False, plugin: MixedPrecision | None = None
) -> Planted:
    """A fresh :class:`Planted` fitted for 3 steps, logging every step, with ``callbacks``; the trained model."""
    model = Planted()
    fit(model, plugin, logger=logger, max_steps=3, log_every_n_steps=1, callbacks=callbacks)
    return model


def advice_texts(log_dir: str | Path) -> list[str]:
    return list(texts(read_events(log_dir), "precision/advice").values())


def test_callback_writes_the_advice_table_to_tensorboard(tmp_path: Path) -> None:
    """With a TensorBoardLogger the advice appears once under precision/advice, naming the overflowing layer."""
    logger = TensorBoardLogger(tmp_path)
    callback = AdvisorCallback(batches=2)
    fit_new_planted([callback], logger=logger)
    texts = advice_texts(logger.log_dir)
    assert len(texts) == 1
    assert "| blowup | Linear |" in texts[0] and "keep_fp32=['blowup', 'norm']" in texts[0]
    assert callback.advice is not None and callback.advice.keep_fp32 == ("blowup", "norm")
    assert callback.advice.batches == 2


def test_callback_does_not_change_the_run() -> None:
    """Weights, batch order and dropout masks are identical with and without the advisor."""
    plain = fit_new_planted([])
    advised = fit_new_planted([AdvisorCallback(batches=3)])
    assert all(torch.equal(a, b) for a, b in zip(plain.seen, advised.seen, strict=True))
    for (name, a), b in zip(plain.state_dict().items(), advised.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_callback_warns_when_fp16_training_leaves_risky_layers_in_fp16() -> None:
    """Training in fp16 without keep_fp32 for the flagged layers warns with the keep_fp32 and init_scale to use."""
    with pytest.warns(UserWarning, match=r"layers \['blowup', 'norm'\] leave fp16's range.*init_scale=1024"):
        fit_new_planted([AdvisorCallback(batches=2)], plugin=MixedPrecision("16-mixed"))


@pytest.mark.filterwarnings("error:lightning_mp. layers")
def test_callback_is_quiet_when_keep_fp32_covers_the_risky_layers() -> None:
    """No warning when the plugin's keep_fp32 (by name and by regex here) already covers the flagged layers."""
    callback = AdvisorCallback(batches=2)
    fit_new_planted([callback], plugin=MixedPrecision("16-mixed", opt_level="O2", keep_fp32=["blowup", "re:no.*"]))
    assert callback.advice is not None


def test_callback_works_without_a_logger() -> None:
    """With logger=False the advice is still computed and kept on the callback."""
    callback = AdvisorCallback(batches=1)
    fit_new_planted([callback])
    assert callback.advice is not None and callback.advice.batches == 1


@pytest.mark.parametrize("batches", [0, -1, 2.5, True])
def test_bad_batches_raise_value_error(batches: object) -> None:
    """batches must be an integer >= 1; the error names it and the value."""
    with pytest.raises(ValueError, match=rf"`batches` must be an integer >= 1, got {batches!r}"):
        AdvisorCallback(batches=batches)  # type: ignore[arg-type]


class ManualPlanted(Planted):
    """Planted with manual optimization: training_step calls self.optimizers() and self.manual_backward()."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        features, target = batch
        self.seen.append(features)
        self.manual_backward(F.cross_entropy(self(features), target))
        optimizer.step()


def test_callback_works_with_manual_optimization() -> None:
    """A manual-optimization module fits with the advisor, gets advice, and trains exactly as without it."""
    plain = ManualPlanted()
    make_trainer(None, max_steps=3).fit(plain)
    advised = ManualPlanted()
    callback = AdvisorCallback(batches=2)
    trainer = make_trainer(None, max_steps=3, callbacks=[callback])
    trainer.fit(advised)
    assert trainer.global_step == 3
    assert callback.advice is not None and callback.advice.keep_fp32 == ("blowup", "norm")
    for (name, a), b in zip(plain.state_dict().items(), advised.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_a_loss_fn_that_is_not_callable_is_refused_early() -> None:
    """AdvisorCallback(loss_fn=5) fails in __init__ with a TypeError naming the argument and the value."""
    with pytest.raises(
        TypeError, match=r"AdvisorCallback\(loss_fn=5\) is not allowed: loss_fn must be None or a callable"
    ):
        AdvisorCallback(loss_fn=5)  # type: ignore[arg-type]
