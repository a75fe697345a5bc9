"""The plugin in bf16 and fp32 with every form of Adam, AdamW, SGD and Adagrad: non-finite steps are skipped on the
device (no host sync), under the Trainer and under Fabric, and checkpoints resume exactly, in both directions.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision as LightningMixedPrecision
from torch import nn

from lightning_mp import MixedPrecision
from lightning_mp._compat import FUSED_ADAGRAD_TAKES_FOUND_INF
from lightning_mp.counting import count_syncs_and_ops
from tests.helpers import (
    OPTIMIZER_FORMS,
    BatchCostRecorder,
    TinyRegressor,
    assert_within_rounding,
    loader,
    make_trainer,
)

CHECKED = ("bf16-mixed", "32-true")


def _finite(model: nn.Module) -> bool:
    return all(torch.isfinite(parameter).all() for parameter in model.parameters())


def _steady_syncs(name: str) -> int:
    """Syncs per steady step: none, but for torch<2.12's fused Adagrad, decided on the host (lightning_mp._compat)."""
    return 1 if name == "fused Adagrad" and not FUSED_ADAGRAD_TAKES_FOUND_INF else 0


@pytest.mark.parametrize("name", list(OPTIMIZER_FORMS))
@pytest.mark.parametrize("precision", CHECKED)
def test_trainer_skips_every_nonfinite_step_without_a_sync(precision, name):
    """No NaN reaches the weights, two injected steps are skipped, and the steady steps make no host sync."""
    recorder = BatchCostRecorder()
    model = TinyRegressor(inject_at=(2, 4), optimizer=name)
    plugin = MixedPrecision(precision)
    make_trainer(plugin, max_steps=6, callbacks=[recorder.opener(), recorder.closer()]).fit(model, loader())
    assert _finite(model)
    assert (plugin.stats.skipped_steps, plugin.stats.optimizer_steps) == (2, 6)
    steady = [_steady_syncs(name)] * 4
    assert [counts.syncs for counts in recorder.per_batch[2:]] == steady, [c.sync_ops for c in recorder.per_batch]


@pytest.mark.parametrize("name", list(OPTIMIZER_FORMS))
@pytest.mark.parametrize("precision", CHECKED)
def test_fabric_skips_every_nonfinite_step_without_a_sync(precision, name):
    """Under Fabric too no NaN reaches the weights, the injected steps count as skipped, and steady steps never sync."""
    plugin = MixedPrecision(precision)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    model, optimizer = fabric.setup(module, OPTIMIZER_FORMS[name](module.parameters(), lr=0.01))
    syncs = []
    for step, (x, y) in enumerate(loader()):
        with count_syncs_and_ops() as counts:
            fabric.backward(nn.functional.mse_loss(model(x).float(), y))
            if step in (2, 4):
                module[0].weight.grad[0, 0] = float("nan")
            optimizer.step()
            optimizer.zero_grad()
        syncs.append(counts.syncs)
    # SGD's first momentum step is decided on the host; the host's view of the next step's flag is made once, at the
    # scale update that Fabric applies in the following backward.
    assert syncs[3:] == [_steady_syncs(name)] * 5
    assert _finite(model)
    assert (plugin.stats.skipped_steps, plugin.stats.optimizer_steps) == (2, 8)


def test_a_step_scheduler_is_held_back_on_a_step_skipped_on_the_device():
    """An interval='step' scheduler does not advance on a skipped step of a foreach AdamW (decided on the device)."""
    model = TinyRegressor(inject_at=(1, 2), optimizer="foreach AdamW", scheduler=True)
    make_trainer(MixedPrecision("bf16-mixed"), max_steps=5).fit(model, loader())
    assert model.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 * 0.5**3)


def test_resume_continues_exactly_and_checkpoints_cross_with_lightnings_bf16(tmp_path: Path):
    """A mid-run checkpoint resumes to the straight run's weights; Lightning's bf16 resumes from ours (within rounding
    of our run) and ours from its, the step counts continuing.

    The checkpoint is taken at an epoch boundary (a plain DataLoader restarts from its first batch on resume).
    """
    torch.manual_seed(4)
    initial = TinyRegressor(inject_at=(3,), optimizer="foreach AdamW")
    straight, resumed, theirs = copy.deepcopy(initial), copy.deepcopy(initial), copy.deepcopy(initial)
    checkpoints = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=8, save_top_k=-1)
    plugin = MixedPrecision("bf16-mixed")
    make_trainer(plugin, max_steps=16, callbacks=[checkpoints], enable_checkpointing=True).fit(straight, loader())
    resumed_plugin = MixedPrecision("bf16-mixed")
    make_trainer(resumed_plugin, max_steps=16).fit(resumed, loader(), ckpt_path=tmp_path / "step=8.ckpt")
    assert resumed_plugin.stats == plugin.stats and plugin.stats.skipped_steps == 1
    for a, b in zip(resumed.parameters(), straight.parameters(), strict=True):
        assert torch.equal(a, b)
    builtin = LightningMixedPrecision("bf16-mixed", device="cpu")
    make_trainer(builtin, max_steps=16).fit(theirs, loader(), ckpt_path=tmp_path / "step=8.ckpt")
    for a, b in zip(theirs.parameters(), straight.parameters(), strict=True):
        assert_within_rounding(a, b)
    lightning_checkpoint = tmp_path / "lightning.ckpt"
    theirs.trainer.save_checkpoint(lightning_checkpoint)
    back = copy.deepcopy(initial)
    make_trainer(MixedPrecision("bf16-mixed"), max_steps=17).fit(back, loader(), ckpt_path=lightning_checkpoint)
    optimizer = back.trainer.optimizers[0]
    assert optimizer.param_groups[0]["foreach"] is True  # the user's configuration, as saved
    assert [optimizer.state[p]["step"].item() for p in back.parameters()] == [16.0] * 4  # 15 applied, then one


def test_skip_nonfinite_is_validated_and_refused_for_fp16():
    """skip_nonfinite must be a bool, and fp16 refuses False (its overflows must be skipped), naming the argument."""
    with pytest.raises(ValueError, match=r"skip_nonfinite='no'\) is not allowed"):
        MixedPrecision("bf16-mixed", skip_nonfinite="no")
    with pytest.raises(ValueError, match=r"\(precision='16-mixed', skip_nonfinite=False\) is not allowed"):
        MixedPrecision("16-mixed", skip_nonfinite=False)


def test_skip_nonfinite_false_lets_a_nan_step_through_like_lightning():
    """With skip_nonfinite=False a NaN step reaches the weights and nothing counts as skipped, as in Lightning."""
    model = TinyRegressor(inject_at=(1,), optimizer="foreach AdamW")
    plugin = MixedPrecision("bf16-mixed", skip_nonfinite=False)
    make_trainer(plugin, max_steps=3).fit(model, loader())
    assert not _finite(model) and plugin.stats.skipped_steps == 0
