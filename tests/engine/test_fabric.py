"""MixedPrecision under Lightning Fabric's own loop: real Fabric runs on the CPU, fp16 with a real loss scaler."""

from __future__ import annotations

import copy
import csv
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger
from torch import nn

from lightning_mp import MixedPrecision
from lightning_mp.policies.o2 import HalfOverflowError
from tests.ddp_scripts.launch import clean_environment, finish, reports
from tests.engine.fabric_helpers import batch, make_model, setup, train_step

pytestmark = pytest.mark.filterwarnings("ignore:.*opt_level='O3'")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


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
        ("16-mixed", "O2", torch.float16),
    ],
)
def test_opt_levels_train_under_fabric(precision: str, opt_level: str, weight_dtype: torch.dtype) -> None:
    """Each opt level trains under Fabric: the loss falls, the optimizer holds the model's own parameters (O2's half,
    with fp32 states), and a keep_fp32 module stays fp32."""
    plugin = MixedPrecision(precision, opt_level=opt_level, keep_fp32=["2"])
    fabric, model, optimizer = setup(plugin, optimizer="adam")
    losses = [train_step(fabric, model, optimizer, seed=step % 2) for step in range(12)]
    assert float(losses[-1]) < float(losses[0])
    assert model.module[0].weight.dtype == weight_dtype
    assert model.module[2].weight.dtype == torch.float32  # keep_fp32
    assert [p for group in optimizer.param_groups for p in group["params"]] == list(model.parameters())
    moments = [state["exp_avg"] for state in optimizer.state.values()]
    assert moments and all(moment.dtype == torch.float32 for moment in moments)
    assert plugin.stats.optimizer_steps == 12


def test_o3_trains_half_weights_under_fabric() -> None:
    """O3 keeps pure fp16 weights under Fabric and still takes finite steps."""
    plugin = MixedPrecision("16-mixed", opt_level="O3")
    fabric, model, optimizer = setup(plugin)
    for step in range(3):
        train_step(fabric, model, optimizer, seed=step)
    assert all(p.dtype == torch.float16 and torch.isfinite(p).all() for p in model.parameters())
    assert plugin.stats.optimizer_steps == 3


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
    script = Path(__file__).parents[1] / "ddp_scripts" / "fabric_train.py"
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
    ("precision", "settings"),
    [("16-mixed", {"growth_interval": 2}), ("16-mixed", {"growth_interval": 1, "hysteresis": 2}), ("bf16-mixed", {})],
)
def test_stats_read_before_the_pending_update_are_those_after_it(precision: str, settings: dict, fused: bool) -> None:
    """plugin.stats read right after each step (update pending) equal the stats once the update is applied: the
    same skips, growths, backoffs, streak and scale, step after step."""
    plugin = MixedPrecision(precision, **({"init_scale": 2.0**8, **settings} if precision == "16-mixed" else settings))
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


def test_backward_of_a_number_names_the_argument() -> None:
    """fabric.backward(loss.item()) raises a TypeError naming the argument, not 'float' has no attribute 'backward'."""
    fabric, model, _ = setup(MixedPrecision("16-mixed"))
    x, y = batch(0)
    loss = nn.functional.mse_loss(model(x), y)
    with pytest.raises(TypeError, match=r"fabric.backward\(tensor=.*\) is not allowed: expected the loss as a torch"):
        fabric.backward(loss.item())
