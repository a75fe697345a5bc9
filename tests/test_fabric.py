"""MixedPrecision under Lightning Fabric's own loop: real Fabric runs on the CPU, fp16 with a real loss scaler."""

from __future__ import annotations

import copy
import csv
import math
import pickle
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger
from torch import nn

from lightning_mp import MixedPrecision
from lightning_mp.bench.counting import count_syncs_and_ops
from lightning_mp.policies.o2 import HalfOverflowError
from tests.ddp_scripts.launch import clean_environment, finish, reports
from tests.helpers import TinyRegressor, loader, make_trainer

pytestmark = pytest.mark.filterwarnings("ignore:.*opt_level='O3'")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def setup(plugin: MixedPrecision, model: nn.Module | None = None, optimizer: str = "sgd", **fabric_kwargs: Any):
    """A CPU Fabric with ``plugin``, and the model and its optimizer set up by it."""
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin], **fabric_kwargs)
    model = model if model is not None else make_model()
    if optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    fabric_model, fabric_optimizer = fabric.setup(model, opt)
    return fabric, fabric_model, fabric_optimizer


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(8, 8, generator=generator), torch.randn(8, 1, generator=generator)


def train_step(fabric: Fabric, model: nn.Module, optimizer: Any, seed: int, inject: bool = False) -> torch.Tensor:
    x, y = batch(seed)
    loss = nn.functional.mse_loss(model(x), y)
    fabric.backward(loss)
    if inject:
        next(model.parameters()).grad.view(-1)[0] = float("inf")
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def test_forward_autocasts_and_backward_scales_the_loss() -> None:
    """Under Fabric the forward runs in fp16 and fabric.backward leaves gradients multiplied by the loss scale."""
    plugin = MixedPrecision("16-mixed", init_scale=2.0**10)
    reference = make_model()
    fabric, model, _ = setup(plugin, copy.deepcopy(reference))
    hidden_dtypes: list[torch.dtype] = []
    model.module[0].register_forward_hook(lambda module, args, output: hidden_dtypes.append(output.dtype))
    x, y = batch(0)
    output = model(x)
    fabric.backward(nn.functional.mse_loss(output, y))
    with torch.autocast("cpu", dtype=torch.float16):
        expected_output = reference(x)
    nn.functional.mse_loss(expected_output.float(), y).backward()
    assert hidden_dtypes == [torch.float16]
    assert output.dtype == torch.float32  # as Fabric's own mixed precision returns it
    for scaled, true in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(scaled.grad, true.grad * 2.0**10)


def test_nonfinite_step_is_skipped_without_touching_weights_or_moments() -> None:
    """An inf gradient makes optimizer.step() a no-op: weights and Adam moments unchanged, the scale halves."""
    plugin = MixedPrecision("16-mixed", init_scale=2.0**10)
    fabric, model, optimizer = setup(plugin, optimizer="adam")
    train_step(fabric, model, optimizer, seed=0)
    weights = [p.detach().clone() for p in model.parameters()]
    moments = copy.deepcopy(optimizer.state_dict()["state"])
    train_step(fabric, model, optimizer, seed=1, inject=True)
    for before, after in zip(weights, model.parameters(), strict=True):
        assert torch.equal(before, after)
    for index, state in optimizer.state_dict()["state"].items():
        assert torch.equal(state["exp_avg"], moments[index]["exp_avg"])
        assert torch.equal(state["step"], moments[index]["step"])
    stats = plugin.stats
    assert (stats.skipped_steps, stats.optimizer_steps, stats.last_step_skipped) == (1, 2, True)
    assert stats.loss_scale == 2.0**9


def test_clip_gradients_sees_true_gradients() -> None:
    """fabric.clip_gradients returns the norm of the unscaled gradients and clips those, not the scaled ones."""
    plugin = MixedPrecision("16-mixed", init_scale=2.0**12)
    reference = make_model()
    fabric, model, optimizer = setup(plugin, copy.deepcopy(reference))
    x, y = batch(0)
    fabric.backward(nn.functional.mse_loss(model(x), y))
    with torch.autocast("cpu", dtype=torch.float16):
        nn.functional.mse_loss(reference(x).float(), y).backward()
    true_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()]))
    max_norm = float(true_norm) / 2
    total_norm = fabric.clip_gradients(model, optimizer, max_norm=max_norm)
    torch.testing.assert_close(total_norm, true_norm)
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    torch.testing.assert_close(clipped, torch.tensor(max_norm), rtol=1e-3, atol=0)
    optimizer.step()  # already unscaled: step must not unscale a second time
    assert plugin.stats.skipped_steps == 0


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("given", ["fabric_optimizer", "torch_optimizer"])
def test_a_users_unscale_then_torch_clipping_then_step_equals_fabric_clip_gradients(opt_level: str, given: str) -> None:
    """plugin.scaler.unscale_(optimizer), torch's clip_grad_norm_ of the model's parameters, then optimizer.step():
    the gradients are unscaled once, clipped true, and the weights end as with fabric.clip_gradients."""

    def run(users_unscale: bool) -> list[torch.Tensor]:
        plugin = MixedPrecision("16-mixed", init_scale=2.0**8, opt_level=opt_level)  # type: ignore[arg-type]
        fabric, model, optimizer = setup(plugin)
        for seed in range(3):
            x, y = batch(seed)
            fabric.backward(nn.functional.mse_loss(model(x), y))
            if users_unscale:
                plugin.scaler.unscale_(optimizer if given == "fabric_optimizer" else optimizer.optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.1)
            else:
                fabric.clip_gradients(model, optimizer, max_norm=0.1)
            optimizer.step()
            optimizer.zero_grad()
        assert plugin.stats.skipped_steps == 0
        return [p.detach().clone() for p in model.parameters()]

    for actual, expected in zip(run(users_unscale=True), run(users_unscale=False), strict=True):
        assert actual.dtype == torch.float32 and torch.isfinite(actual).all()
        torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("given", ["fabric_optimizer", "torch_optimizer"])
def test_an_inf_found_by_a_users_unscale_skips_the_step(opt_level: str, given: str) -> None:
    """An inf gradient, then plugin.scaler.unscale_(optimizer) and optimizer.step(): skipped and counted, the weights
    and Adam's moments as they were."""
    plugin = MixedPrecision("16-mixed", init_scale=2.0**10, opt_level=opt_level)  # type: ignore[arg-type]
    fabric, model, optimizer = setup(plugin, optimizer="adam")
    train_step(fabric, model, optimizer, seed=0)
    weights = [value.clone() for value in model.state_dict().values()]
    moments = copy.deepcopy(optimizer.state_dict()["state"])
    x, y = batch(1)
    fabric.backward(nn.functional.mse_loss(model(x), y))
    next(model.parameters()).grad.view(-1)[0] = float("inf")
    plugin.scaler.unscale_(optimizer if given == "fabric_optimizer" else optimizer.optimizer)
    optimizer.step()
    for before, after in zip(weights, model.state_dict().values(), strict=True):
        assert torch.equal(before, after)
    for index, state in optimizer.state_dict()["state"].items():
        assert torch.equal(state["exp_avg"], moments[index]["exp_avg"])
    assert (plugin.stats.skipped_steps, plugin.stats.optimizer_steps) == (1, 2)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "32-true"])
@pytest.mark.parametrize("clip", [{"max_norm": 0.1}, {"clip_val": 0.01}])
def test_clipping_a_fused_optimizer_matches_the_foreach_one(precision: str, clip: dict[str, float]) -> None:
    """fabric.clip_gradients works with fused SGD: unscaled once, clipped, then stepped like foreach SGD."""
    runs = {}
    for kind in ("fused", "foreach"):
        plugin = MixedPrecision(precision, init_scale=2.0**12) if precision == "16-mixed" else MixedPrecision(precision)
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        module = make_model()
        sgd = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9, **{kind: True})
        model, optimizer = fabric.setup(module, sgd)
        norms = []
        for seed in range(3):
            x, y = batch(seed)
            fabric.backward(nn.functional.mse_loss(model(x), y))
            norms.append(fabric.clip_gradients(model, optimizer, **clip))
            optimizer.step()
            optimizer.zero_grad()
        assert plugin.stats.skipped_steps == 0
        runs[kind] = ([p.detach().clone() for p in model.parameters()], norms)
    for fused, foreach in zip(runs["fused"][0], runs["foreach"][0], strict=True):
        torch.testing.assert_close(fused, foreach)
    for fused_norm, foreach_norm in zip(runs["fused"][1], runs["foreach"][1], strict=True):
        torch.testing.assert_close(fused_norm, foreach_norm)
    untouched = make_model()
    assert not torch.equal(runs["fused"][0][0], next(untouched.parameters()))


def test_clipping_a_fused_optimizer_on_an_overflow_skips_the_step() -> None:
    """With fused Adam an inf gradient found at clipping time clips nothing, and the step leaves the weights."""
    plugin = MixedPrecision("16-mixed", init_scale=2.0**10)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    module = make_model()
    model, optimizer = fabric.setup(module, torch.optim.Adam(module.parameters(), lr=1e-2, fused=True))
    train_step(fabric, model, optimizer, seed=0)
    weights = [p.detach().clone() for p in model.parameters()]
    x, y = batch(1)
    fabric.backward(nn.functional.mse_loss(model(x), y))
    next(model.parameters()).grad.view(-1)[0] = float("inf")
    norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)
    optimizer.step()
    optimizer.zero_grad()
    assert float(norm) == 0.0
    assert all(torch.equal(before, after) for before, after in zip(weights, model.parameters(), strict=True))
    assert (plugin.stats.skipped_steps, plugin.stats.loss_scale) == (1, 2.0**9)


def test_keep_fp32_none_keeps_nothing_and_a_bad_value_names_a_valid_example() -> None:
    """keep_fp32=None (a config's null) means no fp32 region; keep_fp32=5 is refused with a usable example."""
    plugin = MixedPrecision("16-mixed", keep_fp32=None)
    fabric, model, optimizer = setup(plugin)
    train_step(fabric, model, optimizer, seed=0)
    assert plugin.keep_fp32 == [] and plugin.stats.optimizer_steps == 1
    with pytest.raises(ValueError, match=r"keep_fp32=5 is not allowed.*for example keep_fp32=\[nn.LayerNorm"):
        MixedPrecision("16-mixed", keep_fp32=5)  # type: ignore[arg-type]


def test_a_step_with_a_closure_returns_its_loss() -> None:
    """optimizer.step(closure) under Fabric runs the closure, steps, and returns the closure's loss, as torch does."""
    plugin = MixedPrecision("16-mixed")
    fabric, model, optimizer = setup(plugin)
    x, y = batch(0)
    losses = []

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        losses.append(loss.detach())
        return loss

    returned = [optimizer.step(closure) for _ in range(3)]
    assert [float(loss) for loss in returned] == [float(loss) for loss in losses]
    assert float(losses[-1]) < float(losses[0]) and plugin.stats.optimizer_steps == 3


def test_lbfgs_with_a_scaled_loss_raises_type_error() -> None:
    """LBFGS re-evaluates its closure, so its fp16 steps cannot be checked: a TypeError says what to use instead."""
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed")])
    module = make_model()
    model, optimizer = fabric.setup(module, torch.optim.LBFGS(module.parameters()))
    x, y = batch(0)

    def closure() -> torch.Tensor:
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        return loss

    with pytest.raises(TypeError, match="LBFGS"):
        optimizer.step(closure)


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
@pytest.mark.parametrize("fault", ["loss", "grad"])
def test_lbfgs_meeting_nan_keeps_the_weights_and_counts_a_skip(precision: str, fault: str) -> None:
    """As under the Trainer, an LBFGS step whose closure meets a NaN changes nothing and counts as a skipped step."""
    plugin = MixedPrecision(precision)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 1))
    model, optimizer = fabric.setup(module, torch.optim.LBFGS(module.parameters(), lr=0.1, max_iter=3))

    def lbfgs_step(seed: int, nan: bool) -> None:
        x, y = batch(seed)

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y) * (math.nan if nan and fault == "loss" else 1.0)
            fabric.backward(loss)
            if nan and fault == "grad":
                module[2].bias.grad[0] = math.nan
            return loss

        optimizer.step(closure)

    lbfgs_step(0, nan=False)
    weights, buffers = [[t.detach().clone() for t in ts] for ts in (module.parameters(), module.buffers())]
    optimizer_state = copy.deepcopy(optimizer.state_dict())
    lbfgs_step(1, nan=True)
    assert all(torch.equal(a, b) for a, b in zip(weights, module.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(buffers, module.buffers(), strict=True))
    torch.testing.assert_close(optimizer.state_dict(), optimizer_state)
    assert plugin.stats.last_step_skipped
    assert (plugin.stats.optimizer_steps, plugin.stats.skipped_steps) == (2, 1)
    lbfgs_step(2, nan=False)
    assert not all(torch.equal(a, b) for a, b in zip(weights, module.parameters(), strict=True))
    assert (plugin.stats.optimizer_steps, plugin.stats.skipped_steps) == (3, 1)


@pytest.mark.parametrize(
    ("precision", "opt_level", "weight_dtype"),
    [
        ("32-true", "O0", torch.float32),
        ("16-mixed", "O1", torch.float32),
        ("bf16-mixed", "O1", torch.float32),
        ("16-mixed", "O2", torch.float32),
    ],
)
def test_opt_levels_train_under_fabric(precision: str, opt_level: str, weight_dtype: torch.dtype) -> None:
    """Each opt level trains under Fabric: the loss falls, and the optimizer steps the model's fp32 weights."""
    plugin = MixedPrecision(precision, opt_level=opt_level, keep_fp32=["2"])
    fabric, model, optimizer = setup(plugin, optimizer="adam")
    losses = [train_step(fabric, model, optimizer, seed=step % 2) for step in range(12)]
    assert float(losses[-1]) < float(losses[0])
    assert model.module[0].weight.dtype == weight_dtype
    assert model.module[2].weight.dtype == torch.float32  # keep_fp32
    assert all(p.dtype == torch.float32 for group in optimizer.param_groups for p in group["params"])
    assert plugin.stats.optimizer_steps == 12


def test_o3_trains_half_weights_under_fabric() -> None:
    """O3 keeps pure fp16 weights under Fabric and still takes finite steps."""
    plugin = MixedPrecision("16-mixed", opt_level="O3")
    fabric, model, optimizer = setup(plugin)
    for step in range(3):
        train_step(fabric, model, optimizer, seed=step)
    assert all(p.dtype == torch.float16 and torch.isfinite(p).all() for p in model.parameters())
    assert plugin.stats.optimizer_steps == 3


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_save_and_load_resume_at_the_same_scale(tmp_path: Path, opt_level: str) -> None:
    """fabric.save and fabric.load with the plugin in the state: a fresh run continues at the same scale and weights."""

    def run(steps: range, checkpoint: Path | None = None, resume: Path | None = None) -> tuple[MixedPrecision, Any]:
        plugin = MixedPrecision("16-mixed", opt_level=opt_level, init_scale=2.0**8, growth_interval=2)
        fabric, model, optimizer = setup(plugin, optimizer="adam")
        state = {"model": model, "optimizer": optimizer, "precision": plugin}
        if resume is not None:
            fabric.load(resume, state)
        for step in steps:
            train_step(fabric, model, optimizer, seed=step, inject=step == 2)
        if checkpoint is not None:
            fabric.save(checkpoint, state)
        return plugin, model

    path = tmp_path / "checkpoint.pt"
    straight, straight_model = run(range(8))
    first, _ = run(range(5), checkpoint=path)
    saved_scale = first.stats.loss_scale
    resumed, resumed_model = run(range(5, 8), resume=path)
    assert saved_scale == 2.0**9  # 2 growths, 1 backoff
    assert resumed.stats == straight.stats
    for expected, actual in zip(straight_model.parameters(), resumed_model.parameters(), strict=True):
        assert expected.dtype == torch.float32 and torch.equal(expected, actual)


@pytest.mark.parametrize(
    ("state_keys", "warns"),
    [(("model", "optimizer"), True), (("model",), False), (("precision", "model", "optimizer"), False)],
)
def test_resuming_without_the_plugin_state_warns_that_the_scale_restarts(
    tmp_path: Path, state_keys: tuple[str, ...], warns: bool
) -> None:
    """fabric.load of model and optimizer without the plugin warns; with it, or loading weights only, it does not."""
    path = tmp_path / "checkpoint.pt"
    plugin = MixedPrecision("16-mixed", init_scale=2.0**8, growth_interval=1)
    fabric, model, optimizer = setup(plugin, optimizer="adam")
    for step in range(3):
        train_step(fabric, model, optimizer, seed=step)
    fabric.save(path, {"model": model, "optimizer": optimizer, "precision": plugin})
    resumed = MixedPrecision("16-mixed", init_scale=2.0**8, growth_interval=1)
    fabric, model, optimizer = setup(resumed, optimizer="adam")
    objects = {"model": model, "optimizer": optimizer, "precision": resumed}
    fabric.load(path, {key: objects[key] for key in state_keys}, strict=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_step(fabric, model, optimizer, seed=3)
        train_step(fabric, model, optimizer, seed=4)
    restarts = [w for w in caught if "starts again from init_scale=256" in str(w.message)]
    assert len(restarts) == (1 if warns else 0)
    assert resumed.stats.loss_scale == (2.0**13 if "precision" in state_keys else 2.0**10)


def test_one_scale_update_per_iteration_with_two_optimizers() -> None:
    """Two optimizers stepped after one backward both unscale by the scale the gradients were made under."""
    plugin = MixedPrecision("16-mixed", init_scale=2.0**4, growth_interval=1)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    reference = make_model()
    module = copy.deepcopy(reference)
    model = fabric.setup_module(module)
    first, second = fabric.setup_optimizers(
        torch.optim.SGD(module[0].parameters(), lr=1.0), torch.optim.SGD(module[2].parameters(), lr=1.0)
    )
    for step in range(3):
        x, y = batch(step)
        before = [p.detach().clone() for p in module.parameters()]
        fabric.backward(nn.functional.mse_loss(model(x), y))
        first.step()
        second.step()
        reference.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            nn.functional.mse_loss(reference(x).float(), y).backward()
        with torch.no_grad():
            for parameter in reference.parameters():
                parameter -= parameter.grad
        for old, new, expected in zip(before, module.parameters(), reference.parameters(), strict=True):
            assert not torch.equal(old, new)
            torch.testing.assert_close(new, expected)
        first.zero_grad()
        second.zero_grad()
    stats = plugin.stats
    # Steps are counted per optimizer (two per iteration); the scale grew once per iteration.
    assert (stats.optimizer_steps, stats.scale_growths, stats.loss_scale) == (6, 3, 2.0**7)


def test_gradient_accumulation_keeps_one_scale_until_the_step() -> None:
    """Several fabric.backward calls before one step use the same scale; the scale moves once, after the step."""
    plugin = MixedPrecision("16-mixed", init_scale=2.0**4, growth_interval=1)
    fabric, model, optimizer = setup(plugin)
    for micro in range(3):
        x, y = batch(micro)
        fabric.backward(nn.functional.mse_loss(model(x), y))
        assert plugin.scaler is not None and plugin.scaler.get_scale() == 2.0**4
    optimizer.step()
    assert plugin.stats.optimizer_steps == 1
    assert plugin.stats.loss_scale == 2.0**5


def test_stats_as_dict_logs_through_fabric_log_dict(tmp_path: Path) -> None:
    """plugin.stats.as_dict() is a mapping of floats that fabric.log_dict writes to a real CSV log."""
    plugin = MixedPrecision("16-mixed", init_scale=2.0**8)
    fabric, model, optimizer = setup(plugin, loggers=CSVLogger(tmp_path, name="run"))
    for step in range(3):
        train_step(fabric, model, optimizer, seed=step, inject=step == 1)
        fabric.log_dict(plugin.stats.as_dict(), step=step)
    fabric.logger.finalize("success")
    rows = list(csv.DictReader((tmp_path / "run" / "version_0" / "metrics.csv").open()))
    assert [float(row["precision/skipped_steps"]) for row in rows] == [0.0, 1.0, 1.0]
    assert [float(row["precision/loss_scale"]) for row in rows] == [2.0**8, 2.0**7, 2.0**7]
    assert all(isinstance(value, float) for value in plugin.stats.as_dict().values())


def test_inputs_on_another_device_type_raise_value_error() -> None:
    """Inputs on another device type than the model's are refused, naming both and the fix (fabric.to_device)."""
    _, model, _ = setup(MixedPrecision("16-mixed"))
    with pytest.raises(ValueError, match=r"autocasts on 'cpu'.*inputs are on \['meta'\].*fabric\.to_device"):
        model(torch.empty(2, 8, device="meta"))


def test_backward_before_setup_raises_a_clear_error() -> None:
    """Using the plugin's hooks before setup names both ways to set it up: fabric.setup, and setup_for_device."""
    plugin = MixedPrecision("16-mixed")
    with pytest.raises(RuntimeError, match=r"was not set up") as raised:
        plugin.backward(torch.ones((), requires_grad=True), None)
    assert "fabric.setup(model, optimizer)" in str(raised.value)
    assert "plugin.setup_for_device('cpu' or 'cuda')" in str(raised.value)


def test_example_script_trains_skips_and_resumes(tmp_path: Path) -> None:
    """examples/fabric_train.py trains in fp16, skips the injected step, and resumes from its checkpoint."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        import fabric_train
    finally:
        sys.path.remove(str(EXAMPLES))
    checkpoint = tmp_path / "example.ckpt"
    common = ["--checkpoint", str(checkpoint), "--logs", str(tmp_path / "logs")]
    first = fabric_train.main(["--steps", "8", "--inject-at", "3", *common])
    assert first["losses"][-1] < first["losses"][0]
    assert first["stats"]["precision/skipped_steps"] == 1.0
    second = fabric_train.main(["--steps", "2", *common])
    assert second["stats"]["precision/optimizer_steps"] == 10.0
    assert second["stats"]["precision/skipped_steps"] == 1.0
    assert second["stats"]["precision/loss_scale"] >= first["stats"]["precision/loss_scale"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "optimizer_and_clip",
    [
        ["--optimizer", "sgd"],
        ["--optimizer", "fused-adam", "--clip", "value"],
        ["--optimizer", "fused-adam", "--clip", "value", "--precision", "bf16-mixed", "--opt-level", "lean"],
    ],
)
def test_fabric_ddp_ranks_agree_on_skips(tmp_path: Path, optimizer_and_clip: list[str]) -> None:
    """Fabric DDP on 2 CPU processes, clipped SGD or fused Adam (fp16, lean): an inf on rank 1 only skips both ranks."""
    script = Path(__file__).with_name("ddp_scripts") / "fabric_train.py"
    arguments = ["--out", str(tmp_path), "--inject-rank", "1", "--inject-at", "2,5", *optimizer_and_clip]
    process = subprocess.Popen(
        [sys.executable, str(script), *arguments],
        env=clean_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    finish(process, timeout=90)
    ranks = reports(tmp_path)
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert ranks[0]["steps"] == ranks[1]["steps"]
    assert [step for step, _, skipped in ranks[0]["steps"] if skipped] == [2, 5]
    assert ranks[0]["stats"] == ranks[1]["stats"]
    assert ranks[0]["stats"]["precision/skipped_steps"] == 2.0
    assert len({checksum for r in ranks for checksum in r["checksums"]}) == 1, "the parameters differ across ranks"
    assert [r["local_overflows"] for r in ranks] == [0, 2]
    assert ranks[0]["resumed_stats"] == ranks[0]["stats"]


def test_a_fabric_step_syncs_the_host_once_and_reading_the_stats_never() -> None:
    """A steady-state fp16 Fabric step syncs once (torch's skip decision); the lazy update and the stats add none."""
    plugin = MixedPrecision("16-mixed", init_scale=2.0**8, growth_interval=1)
    fabric, model, optimizer = setup(plugin)
    train_step(fabric, model, optimizer, seed=0)
    x, y = batch(1)
    loss = nn.functional.mse_loss(model(x), y)
    with count_syncs_and_ops() as step_counts:
        fabric.backward(loss)  # applies the previous step's pending update first
        optimizer.step()
    with count_syncs_and_ops() as stats_counts:
        logged = plugin.stats.as_dict()
    assert step_counts.syncs == 1
    assert stats_counts.syncs == 0
    assert logged["precision/optimizer_steps"] == 2.0
    assert logged["precision/loss_scale"] == 2.0**10


def test_reading_the_plugins_properties_after_a_skipped_step_changes_nothing() -> None:
    """Right after a skipped optimizer.step(), plugin.stats already count the skip and the backed-off scale, and
    reading them or plugin.scaler (as often as wanted) applies nothing: the scale moves at the next backward, or when
    fabric.save asks for the plugin's state."""
    plugin = MixedPrecision("16-mixed", init_scale=2.0**8)
    fabric, model, optimizer = setup(plugin)
    train_step(fabric, model, optimizer, seed=0, inject=True)
    for _ in range(2):
        assert plugin.stats.loss_scale == 2.0**7
        assert plugin.stats.skipped_steps == 1 and plugin.stats.last_step_skipped
        assert plugin.scaler is not None and plugin.scaler.get_scale() == 2.0**8
    assert plugin.state_dict()["scale"] == 2.0**7
    assert plugin.scaler.get_scale() == 2.0**7
    train_step(fabric, model, optimizer, seed=1)
    assert plugin.stats.skipped_steps == 1 and plugin.stats.optimizer_steps == 2 and not plugin.stats.last_step_skipped


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize(
    ("precision", "knobs"),
    [("16-mixed", {"growth_interval": 2}), ("16-mixed", {"growth_interval": 1, "hysteresis": 2}), ("bf16-mixed", {})],
)
def test_stats_read_before_the_pending_update_are_those_after_it(precision: str, knobs: dict, fused: bool) -> None:
    """plugin.stats read right after each step (update pending) equal the stats once the update is applied: the
    same skips, growths, backoffs, streak and scale, step after step."""
    plugin = MixedPrecision(precision, **({"init_scale": 2.0**8, **knobs} if precision == "16-mixed" else knobs))
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    module = make_model()
    model, optimizer = fabric.setup(module, torch.optim.Adam(module.parameters(), lr=1e-3, fused=fused))
    for step in range(7):
        train_step(fabric, model, optimizer, seed=step, inject=step in (2, 3, 5))
        before = plugin.stats
        plugin.state_dict()  # applies the pending update, as fabric.save does
        assert plugin.stats == before, step


def test_two_models_with_their_own_optimizers_train_like_a_gan() -> None:
    """Two models set up separately, each stepped after its own backward, train and each skips only its own step."""
    plugin = MixedPrecision("16-mixed", init_scale=2.0**8)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    first_module, second_module = make_model(0), make_model(1)
    first, first_optimizer = fabric.setup(first_module, torch.optim.SGD(first_module.parameters(), lr=1e-2))
    second, second_optimizer = fabric.setup(second_module, torch.optim.SGD(second_module.parameters(), lr=1e-2))
    for step in range(3):
        x, y = batch(step)
        fabric.backward(nn.functional.mse_loss(first(x), y))
        first_optimizer.step()
        first_optimizer.zero_grad()
        before = [p.detach().clone() for p in second_module.parameters()]
        fabric.backward(nn.functional.mse_loss(second(x), y))
        if step == 1:
            second_module[0].weight.grad[0, 0] = float("nan")
        second_optimizer.step()
        second_optimizer.zero_grad()
        unchanged = all(torch.equal(b, a) for b, a in zip(before, second_module.parameters(), strict=True))
        assert unchanged == (step == 1)
    stats = plugin.stats
    assert (stats.optimizer_steps, stats.skipped_steps) == (6, 1)
    assert plugin.scaler is not None and set(plugin.scaler.param_names.values()) >= {"0.weight", "2.bias"}


def test_clipping_an_overflowing_step_clips_nothing_and_the_step_is_skipped() -> None:
    """With Fabric's default error_if_nonfinite=True, clipping an inf step does not raise: it is skipped anyway."""
    plugin = MixedPrecision("16-mixed", init_scale=2.0**8)
    fabric, model, optimizer = setup(plugin)
    weights = [p.detach().clone() for p in model.parameters()]
    x, y = batch(0)
    fabric.backward(nn.functional.mse_loss(model(x), y))
    next(model.parameters()).grad.view(-1)[0] = float("inf")
    total_norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)
    optimizer.step()
    assert float(total_norm) == 0.0
    assert all(torch.equal(b, a) for b, a in zip(weights, model.parameters(), strict=True))
    assert plugin.stats.skipped_steps == 1


@pytest.mark.parametrize(
    ("precision", "opt_level"), [("16-mixed", "O1"), ("16-mixed", "O2"), ("bf16-mixed", "O1"), ("bf16-mixed", "lean")]
)
@pytest.mark.parametrize("fused", [False, True])
def test_clipping_by_value_on_an_overflowing_step_skips_it(precision: str, opt_level: str, fused: bool) -> None:
    """fabric.clip_gradients(clip_val=...) on a step with an inf gradient does not raise, and the step is skipped."""
    plugin = MixedPrecision(precision, opt_level=opt_level)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    module = make_model()
    model, optimizer = fabric.setup(module, torch.optim.Adam(module.parameters(), lr=1e-2, fused=fused))
    # state_dict(): the weights the optimizer steps (O2's fp32 masters, while the model holds their half copies).
    weights = [value.clone() for value in model.state_dict().values()]
    x, y = batch(0)
    fabric.backward(nn.functional.mse_loss(model(x).float(), y))
    next(model.parameters()).grad.view(-1)[0] = float("inf")
    fabric.clip_gradients(model, optimizer, clip_val=0.01)
    optimizer.step()
    optimizer.zero_grad()
    assert all(torch.equal(b, a) for b, a in zip(weights, model.state_dict().values(), strict=True))
    assert plugin.stats.skipped_steps == 1
    train_step(fabric, model, optimizer, seed=1)
    assert not torch.equal(weights[0], next(model.parameters()))


@pytest.mark.parametrize(
    ("precision", "fused"), [("16-mixed", False), ("16-mixed", True), ("bf16-mixed", True), ("bf16-mixed", False)]
)
def test_a_skipped_step_leaves_batchnorm_running_statistics_as_they_were(precision: str, fused: bool) -> None:
    """A step skipped for a NaN input puts BatchNorm's running statistics back; a clean step keeps its update."""
    plugin = MixedPrecision(precision)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 1))
    model, optimizer = fabric.setup(module, torch.optim.Adam(module.parameters(), lr=1e-2, fused=fused))
    norm = module[1]

    def step(x: torch.Tensor) -> None:
        fabric.backward(model(x).float().pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()

    step(batch(0)[0])
    before = [norm.running_mean.clone(), norm.running_var.clone(), norm.num_batches_tracked.clone()]
    poisoned = batch(1)[0]
    poisoned[0, 0] = float("nan")
    step(poisoned)
    assert plugin.stats.skipped_steps == 1
    for saved, buffer in zip(before, [norm.running_mean, norm.running_var, norm.num_batches_tracked], strict=True):
        assert torch.equal(saved, buffer)
    step(batch(2)[0])
    assert plugin.stats.skipped_steps == 1 and int(norm.num_batches_tracked) == 2
    assert not torch.equal(before[0], norm.running_mean) and torch.isfinite(norm.running_mean).all()


def test_a_skipped_step_of_one_optimizer_over_two_models_restores_batchnorm_in_both() -> None:
    """One optimizer over two set-up models: a skipped step puts back the running statistics of each model."""
    plugin = MixedPrecision("16-mixed")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    encoder = fabric.setup_module(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16)))
    head = fabric.setup_module(nn.Sequential(nn.BatchNorm1d(16), nn.Linear(16, 1)))
    optimizer = fabric.setup_optimizers(torch.optim.SGD([*encoder.parameters(), *head.parameters()], lr=0.1))
    norms = [encoder.module[1], head.module[0]]
    poisoned = batch(0)[0]
    poisoned[0, 0] = float("nan")
    fabric.backward(head(encoder(poisoned)).float().pow(2).mean())
    optimizer.step()
    assert plugin.stats.skipped_steps == 1
    for norm in norms:
        assert int(norm.num_batches_tracked) == 0 and torch.equal(norm.running_mean, torch.zeros(16))


@pytest.mark.parametrize("fused", [False, True])
def test_o2_names_a_weight_beyond_fp16_range_with_fused_and_foreach_adam(fused: bool) -> None:
    """Under O2 a weight grown beyond 65504 is named by HalfOverflowError, also when fused Adam skips on the device."""
    plugin = MixedPrecision("16-mixed", opt_level="O2")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    module = make_model()
    model, optimizer = fabric.setup(module, torch.optim.Adam(module.parameters(), lr=1e-2, fused=fused))
    train_step(fabric, model, optimizer, seed=0)
    with torch.no_grad():
        module[0].weight[0, 0] = 1e5
    with pytest.raises(HalfOverflowError, match=r"0\.weight"):
        for seed in range(1, 3):
            train_step(fabric, model, optimizer, seed=seed)
    assert plugin.stats.skipped_steps == 1


def test_the_plugin_pickles_and_deep_copies_mid_run() -> None:
    """After a Fabric step the plugin still pickles and deep-copies, with the step's outcome in the copy."""
    plugin = MixedPrecision("16-mixed", init_scale=2.0**8)
    fabric, model, optimizer = setup(plugin)
    train_step(fabric, model, optimizer, seed=0, inject=True)
    for copied in (pickle.loads(pickle.dumps(plugin)), copy.deepcopy(plugin)):
        assert copied.stats == plugin.stats
        assert copied.stats.skipped_steps == 1
    train_step(fabric, model, optimizer, seed=1)
    assert plugin.stats.optimizer_steps == 2


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "32-true"])
@pytest.mark.parametrize("kind", ["foreach", "fused"])
@pytest.mark.parametrize("clip", [{"max_norm": float("nan")}, {"clip_val": float("nan")}])
def test_a_nan_clipping_threshold_never_reaches_the_weights(precision: str, kind: str, clip: dict[str, float]) -> None:
    """fabric.clip_gradients with a NaN threshold makes the gradients NaN: that step is skipped, the weights stay."""
    plugin = MixedPrecision(precision)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    module = make_model()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1, **{kind: True}))
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batch(0)
    fabric.backward(nn.functional.mse_loss(model(x), y))
    fabric.clip_gradients(model, optimizer, **clip)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
    optimizer.zero_grad()
    for parameter, weight in zip(model.parameters(), before, strict=True):
        assert torch.equal(parameter, weight)
    assert plugin.stats.skipped_steps == 1
    # The host learns of a skip decided on the device only at the scale update; one decided on the host at once, and
    # says why. In bf16 and fp32 a foreach SGD is handed to the fused kernel: only fp16's foreach step is on the host.
    decided_on_host = kind != "fused" and precision == "16-mixed"
    assert any("clip_gradients made finite gradients inf or NaN" in str(w.message) for w in caught) == decided_on_host
    train_step(fabric, model, optimizer, seed=1)
    assert plugin.stats.skipped_steps == 1 and plugin.stats.consecutive_skips == 0


def test_backward_of_a_number_names_the_argument() -> None:
    """fabric.backward(loss.item()) raises a TypeError naming the argument, not 'float' has no attribute 'backward'."""
    fabric, model, _ = setup(MixedPrecision("16-mixed"))
    x, y = batch(0)
    loss = nn.functional.mse_loss(model(x), y)
    with pytest.raises(TypeError, match=r"fabric.backward\(tensor=.*\) is not allowed: expected the loss as a torch"):
        fabric.backward(loss.item())


def test_a_new_fabric_run_with_a_reused_plugin_starts_with_no_skip_streak() -> None:
    """A plugin whose previous Fabric run ended on a skipped step reports consecutive_skips 0 after clean steps."""
    plugin = MixedPrecision("16-mixed", init_scale=2.0**8)
    fabric, model, optimizer = setup(plugin)
    train_step(fabric, model, optimizer, seed=0)
    train_step(fabric, model, optimizer, seed=1, inject=True)
    assert plugin.stats.consecutive_skips == 1
    fabric, model, optimizer = setup(plugin)
    train_step(fabric, model, optimizer, seed=2)
    train_step(fabric, model, optimizer, seed=3)
    assert plugin.stats.consecutive_skips == 0 and not plugin.stats.last_step_skipped


def test_a_reused_plugin_trains_a_new_fabric_run_like_a_fresh_plugin() -> None:
    """A second Fabric run with the same plugin starts from init_scale and zero counters, as a new plugin would."""
    reused = MixedPrecision("16-mixed", init_scale=2.0**8, growth_interval=1)
    fabric, model, optimizer = setup(reused)
    for seed in range(3):
        train_step(fabric, model, optimizer, seed=seed, inject=seed == 2)
    runs = {}
    for name, plugin in (
        ("reused", reused),
        ("fresh", MixedPrecision("16-mixed", init_scale=2.0**8, growth_interval=1)),
    ):
        fabric, model, optimizer = setup(plugin)
        for seed in range(3):
            train_step(fabric, model, optimizer, seed=seed)
        runs[name] = (plugin.stats, [p.detach().clone() for p in model.parameters()])
    assert runs["reused"][0] == runs["fresh"][0]
    for reused_weight, fresh_weight in zip(runs["reused"][1], runs["fresh"][1], strict=True):
        assert torch.equal(reused_weight, fresh_weight)


def _fabric_run(plugin: MixedPrecision, inject_at: tuple[int, ...]) -> list[torch.Tensor]:
    """Eight Fabric steps of a seeded model, an inf planted at ``inject_at``; the weights it ends with."""
    fabric, model, optimizer = setup(plugin)
    for seed in range(8):
        train_step(fabric, model, optimizer, seed=seed, inject=seed in inject_at)
    return [p.detach().clone() for p in model.parameters()]


def _trainer_run(plugin: MixedPrecision, inject_at: tuple[int, ...]) -> list[torch.Tensor]:
    """Eight steps of a Trainer's fit of a seeded model, an inf planted at ``inject_at``; the weights it ends with."""
    torch.manual_seed(0)
    model = TinyRegressor(inject_at=inject_at)
    make_trainer(plugin).fit(model, loader())
    return [p.detach().clone() for p in model.parameters()]


_RUNS = {"fabric": _fabric_run, "trainer": _trainer_run}


@pytest.mark.parametrize("first", ["trainer", "fabric"])
@pytest.mark.parametrize("second", ["trainer", "fabric"])
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_plugin_reused_by_a_trainer_or_fabric_starts_the_next_run_as_a_new_plugin(
    first: str, second: str, opt_level: str
) -> None:
    """After a Trainer's fit or a Fabric loop, a second run of either kind sees init_scale, zero counters and no
    skip streak, and trains the weights a new plugin trains."""
    knobs: dict[str, Any] = {"opt_level": opt_level, "init_scale": 2.0**10, "hysteresis": 1}
    reused = MixedPrecision("16-mixed", **knobs)
    _RUNS[first](reused, (3, 6, 7))  # ends on a streak of two skips, at a quarter of init_scale
    assert (reused.stats.skipped_steps, reused.stats.consecutive_skips) == (3, 2)
    fresh = MixedPrecision("16-mixed", **knobs)
    weights = {name: _RUNS[second](plugin, (1, 4)) for name, plugin in (("reused", reused), ("fresh", fresh))}
    assert reused.stats == fresh.stats
    assert (reused.stats.optimizer_steps, reused.stats.skipped_steps, reused.stats.loss_scale) == (8, 2, 2.0**8)
    for reused_weight, fresh_weight in zip(weights["reused"], weights["fresh"], strict=True):
        assert torch.equal(reused_weight, fresh_weight)


def test_setup_for_device_after_a_fit_starts_a_new_run_as_a_new_plugin() -> None:
    """plugin.setup_for_device after a Trainer's fit (to use it outside both) starts from init_scale, zero counters."""
    reused = MixedPrecision("16-mixed", init_scale=2.0**10)
    _trainer_run(reused, (2, 3))
    assert reused.stats.skipped_steps == 2
    fresh = MixedPrecision("16-mixed", init_scale=2.0**10)
    for plugin in (reused, fresh):
        plugin.setup_for_device("cpu")
    assert reused.stats == fresh.stats
    assert reused.state_dict()["scaler"] == fresh.state_dict()["scaler"]


@pytest.mark.parametrize("load", ["after_setup", "before_setup"])
def test_a_plugin_reused_by_fabric_after_a_trainer_resumes_from_fabric_load(tmp_path: Path, load: str) -> None:
    """A plugin that drove a Trainer's fit, then loaded with a Fabric checkpoint (before or after fabric.setup),
    continues at the checkpoint's scale and counters: the new run starts from the loaded state, not a new one."""
    saver = MixedPrecision("16-mixed", init_scale=2.0**10)
    fabric, model, optimizer = setup(saver)
    for seed in range(3):
        train_step(fabric, model, optimizer, seed=seed, inject=seed == 1)
    path = tmp_path / "state.ckpt"
    fabric.save(path, {"precision": saver})
    saved = saver.state_dict()["scaler"]
    reused = MixedPrecision("16-mixed", init_scale=2.0**10)
    _trainer_run(reused, (2,))
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[reused])
    if load == "before_setup":
        fabric.load(path, {"precision": reused})
    module = make_model()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=1e-2))
    if load == "after_setup":
        fabric.load(path, {"precision": reused})
    assert reused.state_dict()["scaler"] == saved
    train_step(fabric, model, optimizer, seed=3)
    assert (reused.stats.optimizer_steps, reused.stats.skipped_steps) == (4, 1)


def _saved_fabric_state(tmp_path: Path, precision: str = "16-mixed") -> Path:
    plugin = MixedPrecision(precision)
    fabric, model, optimizer = setup(plugin)
    train_step(fabric, model, optimizer, seed=0)
    path = tmp_path / "state.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "precision": plugin})
    return path


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda s: [s["scaler"]], r"MixedPrecision state holds \[\{.*\}\]; expected a dict"),
        (lambda s: None, r"MixedPrecision state holds None; expected a dict"),
        (lambda s: {**s, "scaler": None}, r"'scaler'=None; expected a dict \(the loss scaler's state\)"),
        (lambda s: {**s, "scaler": [1]}, r"'scaler'=\[1\]; expected a dict"),
        (lambda s: {**s, "policy": "O1"}, r"'policy'='O1'; expected a dict \(the opt level's state\)"),
        (lambda s: {**s, "precision": 16}, r"'precision'=16; expected one of \['auto', '16-mixed'"),
        (lambda s: {**s, "opt_level": None}, r"'opt_level'=None; expected one of \['O0'"),
        (lambda s: {**s, "scaler": {**s["scaler"], "counters": "x"}}, r"key 'counters' holds 'x'"),
    ],
)
def test_damaged_plugin_state_is_refused_at_fabric_load_naming_the_field(
    tmp_path: Path, damage: Any, match: str
) -> None:
    """fabric.load of a checkpoint whose plugin state is damaged raises a ValueError naming the field and value."""
    path = _saved_fabric_state(tmp_path)
    checkpoint = torch.load(path, weights_only=False)
    checkpoint["precision"] = damage(checkpoint["precision"])
    torch.save(checkpoint, path)
    plugin = MixedPrecision("16-mixed")
    fabric, model, optimizer = setup(plugin)
    with pytest.raises(ValueError, match=match):
        fabric.load(path, {"model": model, "optimizer": optimizer, "precision": plugin})


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_a_scale_that_training_cannot_make_is_refused_at_fabric_load(tmp_path: Path, scale: float) -> None:
    """A checkpoint whose loss scale is 0, negative or not finite is refused at fabric.load, naming 'scale'."""
    path = _saved_fabric_state(tmp_path)
    checkpoint = torch.load(path, weights_only=False)
    checkpoint["precision"]["scaler"]["scale"] = scale
    torch.save(checkpoint, path)
    plugin = MixedPrecision("16-mixed")
    fabric, model, optimizer = setup(plugin)
    with pytest.raises(ValueError, match=rf"key 'scale' holds {scale}; expected a finite positive number"):
        fabric.load(path, {"model": model, "optimizer": optimizer, "precision": plugin})
    assert plugin.stats.loss_scale == 2.0**16


@pytest.mark.parametrize("clip", [{"max_norm": float("inf")}, {"clip_val": float("inf")}])
def test_an_infinite_clipping_threshold_clips_nothing_and_steps(clip: dict[str, float]) -> None:
    """fabric.clip_gradients with an infinite threshold (torch's idiom for 'norm only') steps as without clipping."""
    runs = []
    for clipped in (True, False):
        plugin = MixedPrecision("16-mixed", init_scale=2.0**8)
        fabric, model, optimizer = setup(plugin)
        x, y = batch(0)
        fabric.backward(nn.functional.mse_loss(model(x), y))
        if clipped:
            fabric.clip_gradients(model, optimizer, **clip)
        optimizer.step()
        assert plugin.stats.skipped_steps == 0
        runs.append([p.detach().clone() for p in model.parameters()])
    for clipped_weight, plain_weight in zip(*runs, strict=True):
        assert torch.equal(clipped_weight, plain_weight)


def test_a_fabric_run_in_another_thread_is_refused_while_one_runs() -> None:
    """fabric.setup with a plugin that another live thread's loop drives raises; after its teardown it works."""
    plugin = MixedPrecision("16-mixed")
    fabric, model, optimizer = setup(plugin)
    train_step(fabric, model, optimizer, seed=0)
    outcome: list[Any] = []

    def other_run() -> None:
        try:
            other_fabric, other_model, other_optimizer = setup(plugin)
            train_step(other_fabric, other_model, other_optimizer, seed=1)
            outcome.append(plugin.stats.optimizer_steps)
        except RuntimeError as error:
            outcome.append(error)

    for _ in range(2):
        thread = threading.Thread(target=other_run)
        thread.start()
        thread.join(timeout=60)
        plugin.teardown()
    assert isinstance(outcome[0], RuntimeError) and "already driving a run in another thread" in str(outcome[0])
    assert outcome[1] == 1
