"""The step a user sees: what ``.grad`` holds at every moment a user reads it, at every opt level, under the Trainer and
Fabric, on the model's parameters and on the optimizer's alike (the table of docs/guide/gradients.md).

Each moment is read the ways users read gradients: ``torch.nn.utils.get_total_norm``, ``clip_grad_norm_`` with an
infinite ``max_norm`` (it returns the norm and clips nothing), Lightning's ``grad_norm`` and a manual sum of squares,
over ``model.parameters()`` and over ``optimizer.param_groups``. Every reading must agree with the others, hold no
sparse tensor, and give fp32's numbers on the same batch and weights within the level's rounding (times the loss scale
where the table says the gradients are still scaled).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities import grad_norm
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_mp import MixedPrecision
from tests.helpers import make_trainer

SCALE = 2.0**8
"""fp16's loss scale in these runs: the gradients of the tiny task never overflow it."""


@dataclass(frozen=True)
class Row:
    """What ``.grad`` holds at one moment: present or None, its dtype, whether it is still multiplied by the scale."""

    present: bool
    dtype: str = ""
    """``"fp32"``, ``"half"`` (the run's half type) or ``""`` where there is no gradient."""
    scaled: bool = False


LEVELS = [
    ("32-true", "O0"),
    ("16-mixed", "O1"),
    ("16-mixed", "O2"),
    ("16-mixed", "O3"),
    ("bf16-mixed", "O1"),
    ("bf16-mixed", "O2"),
    ("bf16-mixed", "O3"),
    ("bf16-mixed", "lean"),
    ("bf16-mixed", "lean-kahan"),
    ("bf16-mixed", "lean-exact"),
]
MOMENTS = ["after_backward", "before_step", "after_step", "after_skip", "after_zero_grad"]


def expected_row(precision: str, opt_level: str, moment: str) -> Row:
    """The table: the gradients' dtype is the weights' (fp32 at O0 and O1, half at O2, O3 and lean); in fp16 at O1 and
    O2 they are scaled from the backward until the plugin (or the user's ``unscale_``) unscales them, before the hooks
    and the clipping (O3 scales nothing unless given a ``loss_scale``); a step or a skip leaves them in place until
    ``zero_grad``, but O2 (and lean-exact, which is O2 with packed masters) frees them with a taken step, and with a
    skip the device decided (bf16 hands SGD's step to torch's fused kernel; fp16's plain SGD is decided on the
    host)."""
    o2 = opt_level in ("O2", "lean-exact")
    skipped_on_device = moment == "after_skip" and precision == "bf16-mixed"
    if moment == "after_zero_grad" or (o2 and (moment == "after_step" or skipped_on_device)):
        # O2 frees the gradients of the parameters it made half with the step (their fp32 copies were what it
        # applied); its normalisation layers keep theirs, as at every level.
        return Row(present=False)
    dtype = "fp32" if opt_level in ("O0", "O1") else "half"
    scales = precision == "16-mixed" and opt_level in ("O1", "O2")
    return Row(present=True, dtype=dtype, scaled=scales and moment == "after_backward")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)


def batch(seed: int = 0) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(16, 8, generator=generator), torch.randint(0, 4, (16,), generator=generator)


def reading(module: nn.Module, optimizer: torch.optim.Optimizer, half: torch.dtype) -> tuple[Row, float]:
    """The row the gradients show now, and their norm, read five ways that must agree (checked here)."""
    params = list(module.parameters())
    held = [p for group in optimizer.param_groups for p in group["params"]]
    assert held == params  # one identity: the optimizer holds the model's own parameters
    grads = [p.grad for p in params if p.grad is not None]
    if module.body[0].weight.grad is None:  # O2 after a step frees its converted parameters' gradients
        return Row(present=False), 0.0
    assert not any(grad.is_sparse for grad in grads)
    dtypes = {grad.dtype for grad in grads}
    weight_dtype = module.body[0].weight.grad.dtype
    dtype = "fp32" if weight_dtype == torch.float32 else "half" if weight_dtype == half else str(weight_dtype)
    norms = [
        float(nn.utils.get_total_norm([p.grad for p in held if p.grad is not None])),
        float(nn.utils.clip_grad_norm_(held, max_norm=math.inf)),
        float(nn.utils.clip_grad_norm_(params, max_norm=math.inf)),
        float(grad_norm(module, norm_type=2)["grad_2.0_norm_total"]),
        math.sqrt(sum(float(g.float().pow(2).sum()) for g in grads)),
    ]
    assert dtypes <= {torch.float32, half}
    if all(math.isfinite(n) for n in norms):
        assert max(norms) - min(norms) <= 2e-2 * max(norms), norms  # grad_norm rounds each norm to 4 digits
    return Row(present=True, dtype=dtype, scaled=False), norms[-1]


class Recorder(L.LightningModule):
    """A Trainer run of two steps whose second gradient is made inf; records the readings at each moment."""

    def __init__(self, half: torch.dtype) -> None:
        super().__init__()
        self.net = Net()
        self.half = half
        self.readings: dict[str, tuple[Row, float]] = {}

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, data: Any, batch_idx: int) -> Tensor:
        if batch_idx == 1:  # before this batch's backward: what the first step left
            self.readings["after_step"] = reading(self.net, self.optimizers().optimizer, self.half)
        features, target = batch(0)
        loss = F.cross_entropy(self(features), target)
        return loss * (math.inf if batch_idx == 1 else 1.0)

    def on_after_backward(self) -> None:
        if self.global_step == 0:
            self.readings["after_backward"] = reading(self.net, self.optimizers().optimizer, self.half)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.global_step == 0:
            self.readings["before_step"] = reading(self.net, optimizer, self.half)

    def on_train_batch_end(self, outputs: Any, data: Any, batch_idx: int) -> None:
        optimizer = self.optimizers().optimizer
        if batch_idx == 1:
            self.readings["after_skip"] = reading(self.net, optimizer, self.half)
            optimizer.zero_grad()
            self.readings["after_zero_grad"] = reading(self.net, optimizer, self.half)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer_readings(precision: str, opt_level: str, half: torch.dtype) -> dict[str, tuple[Row, float]]:
    plugin = MixedPrecision(precision, opt_level=opt_level, init_scale=SCALE)  # type: ignore[arg-type]
    model = Recorder(half)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(2, 1)), batch_size=1)
    make_trainer(plugin, max_steps=2).fit(model, loader)
    assert plugin.stats.skipped_steps == 1
    return model.readings


def fabric_readings(precision: str, opt_level: str, half: torch.dtype) -> dict[str, tuple[Row, float]]:
    plugin = MixedPrecision(precision, opt_level=opt_level, init_scale=SCALE)  # type: ignore[arg-type]
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = Net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    readings: dict[str, tuple[Row, float]] = {}
    features, target = batch(0)
    fabric.backward(F.cross_entropy(model(features), target))
    readings["after_backward"] = reading(net, optimizer.optimizer, half)
    fabric.clip_gradients(model, optimizer, max_norm=math.inf)  # unscales; clips nothing
    readings["before_step"] = reading(net, optimizer.optimizer, half)
    optimizer.step()
    readings["after_step"] = reading(net, optimizer.optimizer, half)
    optimizer.zero_grad()
    fabric.backward(F.cross_entropy(model(features), target) * math.inf)
    optimizer.step()
    readings["after_skip"] = reading(net, optimizer.optimizer, half)
    optimizer.zero_grad()
    readings["after_zero_grad"] = reading(net, optimizer.optimizer, half)
    assert plugin.stats.skipped_steps == 1
    plugin.teardown()
    return readings


def fp32_norms() -> dict[str, float]:
    """fp32's gradient norm after the first backward, and after the step (the same gradient: SGD leaves it)."""
    net = Net()
    features, target = batch(0)
    F.cross_entropy(net(features), target).backward()
    norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in net.parameters()))
    return {"after_backward": norm, "before_step": norm, "after_step": norm}


TOLERANCE = {"16-mixed": 1e-2, "bf16-mixed": 5e-2, "32-true": 1e-5}
"""The relative error of a gradient norm against fp32's on the same batch: the half forward's rounding."""


@pytest.mark.parametrize("front_end", ["trainer", "fabric"])
@pytest.mark.parametrize(("precision", "opt_level"), LEVELS, ids=[f"{p}-{o}" for p, o in LEVELS])
def test_every_moment_of_the_step_shows_the_gradients_the_table_says(
    precision: str, opt_level: str, front_end: str
) -> None:
    """At every moment a user reads gradients, at every level, under both front ends: present or None, dtype and scale
    as the table says, the same on the model's and the optimizer's parameters, no sparse marker, and fp32's norm
    within the level's rounding."""
    half = torch.float16 if precision == "16-mixed" else torch.bfloat16
    runs = trainer_readings if front_end == "trainer" else fabric_readings
    readings = runs(precision, opt_level, half)
    reference = fp32_norms()
    for moment in MOMENTS:
        row, norm = readings[moment]
        expected = expected_row(precision, opt_level, moment)
        assert (row.present, row.dtype) == (expected.present, expected.dtype), moment
        if moment in reference and row.present:
            factor = SCALE if expected.scaled else 1.0
            assert norm / factor == pytest.approx(reference[moment], rel=TOLERANCE[precision]), moment
        if moment == "after_skip" and row.present:
            assert not math.isfinite(norm)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_parameter_no_optimizer_holds_keeps_its_scaled_gradient_as_with_torchs_scaler(opt_level: str) -> None:
    """The scaler unscales the gradients of the optimizers it steps, as torch's does: in fp16 a parameter no
    optimizer holds keeps the gradient backward gave it, multiplied by the loss scale, before and after the step."""
    plugin = MixedPrecision("16-mixed", opt_level=opt_level, init_scale=SCALE)  # type: ignore[arg-type]
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = Net()
    head = net.body[3]
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.body[0].parameters(), lr=0.1))
    features, target = batch(0)
    fabric.backward(F.cross_entropy(model(features), target))
    optimizer.step()
    reference = Net()
    F.cross_entropy(reference(features), target).backward()
    assert head.weight.grad is not None
    true = reference.body[3].weight.grad
    assert (head.weight.grad.float() / SCALE - true).norm() <= 1e-2 * true.norm()
