"""The plugin in bf16 and fp32 with every form of Adam, AdamW, SGD and Adagrad: non-finite steps are skipped on the
device (no host sync), under the Trainer and under Fabric, and checkpoints resume exactly, in both directions. At
every opt level, every step taken with any of them moves every weight.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision as LightningMixedPrecision
from torch import nn

from lightning_mp import MixedPrecision
from lightning_mp._compat import FUSED_ADAGRAD_TAKES_FOUND_INF, fused_sgd_updates_half
from lightning_mp.bench.counting import count_syncs_and_ops
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


@pytest.mark.slow
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


@pytest.mark.slow
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


def _fused_sgd_moves_every_element(dtype: torch.dtype) -> bool:
    """Whether one step of torch's own fused SGD on the CPU changes every element of a 1000-element ``dtype`` weight."""
    weight = torch.ones(1000, dtype=dtype)
    weight.grad = torch.ones_like(weight)
    torch.optim.SGD([weight], lr=0.5, fused=True).step()
    return bool((weight != 1).all())


LEVELS = [
    pytest.param("32-true", "O0", {}, id="O0"),
    *(
        pytest.param(precision, level, {}, id=f"{level}-{precision}")
        for level in ("O1", "O2", "O3")
        for precision in ("16-mixed", "bf16-mixed")
    ),
    pytest.param("16-mixed", "O3", {"loss_scale": 128.0}, id="O3-16-mixed-static-scale"),
    pytest.param("bf16-mixed", "lean", {}, id="lean-bf16-mixed"),
    pytest.param("bf16-mixed", "lean-kahan", {}, id="lean-kahan-bf16-mixed"),
]


@pytest.mark.filterwarnings(
    "ignore:.*opt_level='O3'", "ignore:.*which is 0 in", "ignore:.*fp16 \\('16-mixed'\\) on the CPU", "ignore:.*bf16"
)
@pytest.mark.parametrize(("precision", "opt_level", "settings"), LEVELS)
def test_every_step_taken_moves_every_weight_with_every_optimizer_form(precision, opt_level, settings):
    """Two Fabric steps of each form of Adam, AdamW, SGD and Adagrad (lean: Adagrad refused) change every weight
    tensor at each step that the stats count as taken.

    Every weight has a multiple of 32 elements, so a kernel that skips its full vector blocks (torch's CPU fused SGD
    over half weights in some releases) would leave it whole; the second step is the first that momentum SGD hands to
    a fused kernel. Where that kernel is wrong, O3 refuses a user's own ``SGD(fused=True)``, naming the argument.
    """
    plugin = MixedPrecision(precision, opt_level=opt_level, **settings)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    names = [name for name in OPTIMIZER_FORMS if not (opt_level.startswith("lean") and "Adagrad" in name)]
    runs = {}
    for name in names:
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32))
        runs[name] = fabric.setup(module, OPTIMIZER_FORMS[name](module.parameters(), lr=0.05))
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 8, generator=generator), torch.randn(16, 32, generator=generator)
    unmoved: list[tuple[int, str, str]] = []
    refused: set[str] = set()
    for step in range(2):
        for name, (model, optimizer) in runs.items():
            before = [parameter.detach().clone() for parameter in model.parameters()]
            fabric.backward(nn.functional.mse_loss(model(x).float(), y))
            try:
                optimizer.step()
            except ValueError as error:
                # Refused only at O3, only a user's fused SGD over half weights, and only where torch's kernel is wrong.
                assert (opt_level, name) == ("O3", "fused SGD"), error
                assert re.search(r"SGD\(fused=True\) is not allowed .* Build the SGD with fused=False", str(error))
                assert not _fused_sgd_moves_every_element(plugin.half_dtype)
                refused.add(name)
                continue
            finally:
                optimizer.zero_grad()
            parameters = model.named_parameters()
            unmoved += [
                (step, name, key) for (key, p), old in zip(parameters, before, strict=True) if torch.equal(p, old)
            ]
    assert unmoved == []
    taken = 2 * (len(runs) - len(refused))
    assert (plugin.stats.optimizer_steps, plugin.stats.skipped_steps) == (taken, 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_fused_sgd_probe_tells_what_torchs_kernel_does_to_half_weights(dtype):
    """lightning_mp._compat's probe of torch's CPU fused SGD agrees with a step of a large half weight."""
    assert fused_sgd_updates_half("cpu", dtype) == _fused_sgd_moves_every_element(dtype)
