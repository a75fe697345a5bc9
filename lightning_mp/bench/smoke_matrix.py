"""The GPU proof's smoke matrix: every precision x opt level x optimizer family x front end trains and skips an inf.

Each case trains a tiny network (Linear, LayerNorm, BatchNorm, ReLU, Linear: fp32 normalisation parameters beside
half ones at O2 and O3) on a seeded regression batch for :data:`SMOKE_STEPS` optimizer steps, through the Trainer
or through Fabric, with :class:`~lightning_mp.MixedPrecision` at one precision and opt level and one of three
optimizer families: fused AdamW, foreach AdamW and SGD with momentum. After the backward of step :data:`INF_STEP`
an inf is written into the first gradient, as an overflow would. A case passes when that step, and no other, was
skipped (:attr:`~lightning_mp.MixedPrecision.stats`) and every weight and running statistic is finite at the end.

The inf is planted after the first optimizer steps, so that the optimizers' states (fused SGD's momentum buffers,
AdamW's moments) exist when the skip has to leave them alone. fp16 starts at a scale the tiny network never
overflows, so only the planted step skips.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_mp.bench.workloads import QUIET_TRAINER
from lightning_mp.plugin import MixedPrecision

PRECISION_LEVELS: tuple[tuple[str, str], ...] = (
    ("32-true", "O0"),
    ("32-true", "O1"),
    ("16-mixed", "O1"),
    ("16-mixed", "O2"),
    ("16-mixed", "O3"),
    ("bf16-mixed", "O1"),
    ("bf16-mixed", "O2"),
    ("bf16-mixed", "O3"),
    ("bf16-mixed", "lean"),
    ("bf16-mixed", "lean-kahan"),
)
"""Every precision with every opt level it accepts (32-true trains O1 as O0; lean needs bf16)."""
OPTIMIZER_FAMILIES = ("fused-adamw", "foreach-adamw", "sgd-momentum")
FRONT_ENDS = ("trainer", "fabric")
SMOKE_STEPS = 20
QUICK_SMOKE_STEPS = 6
"""The steps of each case in ``--smoke`` runs: enough for the planted inf and a few clean steps around it."""
INF_STEP = 2
"""The step whose gradient gets the inf: steps 0 and 1 create the optimizer states first."""
FEATURES = 8
BATCH_SIZE = 8


@dataclass(frozen=True)
class SmokeCase:
    """One cell of the matrix."""

    precision: str
    opt_level: str
    optimizer: str
    front_end: str

    def describe(self) -> str:
        """The case in words, as the report lists it."""
        return f"{self.precision} {self.opt_level}, {self.optimizer}, {self.front_end}"


def smoke_cases() -> list[SmokeCase]:
    """Every case: each precision and opt level with each optimizer family and each front end."""
    return [
        SmokeCase(precision, level, optimizer, front_end)
        for precision, level in PRECISION_LEVELS
        for optimizer in OPTIMIZER_FAMILIES
        for front_end in FRONT_ENDS
    ]


def make_optimizer(family: str, parameters: Any) -> torch.optim.Optimizer:
    """One of :data:`OPTIMIZER_FAMILIES`; AdamW's ``eps`` is one fp16 represents, so O3 trains with it."""
    if family == "sgd-momentum":
        return torch.optim.SGD(parameters, lr=0.01, momentum=0.9)
    fused = family == "fused-adamw"
    return torch.optim.AdamW(parameters, lr=1e-3, eps=1e-4, fused=fused, foreach=not fused)


def make_network() -> nn.Sequential:
    """Linear, LayerNorm, BatchNorm, ReLU, Linear: about 200 parameters, seeded."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.LayerNorm(8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


def regression_batches(steps: int) -> DataLoader:
    """``steps`` seeded batches of a linear regression problem."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(steps * BATCH_SIZE, FEATURES, generator=generator)
    targets = inputs @ torch.randn(FEATURES, 1, generator=generator)
    return DataLoader(TensorDataset(inputs, targets), batch_size=BATCH_SIZE)


def plant_inf(network: nn.Module) -> None:
    """Write an inf into the first gradient, as an overflow would."""
    gradient = next(p.grad for p in network.parameters() if p.grad is not None)
    gradient.view(-1)[0] = float("inf")


class _Regressor(L.LightningModule):
    def __init__(self, optimizer: str, inf_step: int) -> None:
        super().__init__()
        self.network = make_network()
        self.optimizer_family = optimizer
        self.inf_step = inf_step

    @override
    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.network(inputs)
        return output

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self(inputs).float(), targets)

    @override
    def on_after_backward(self) -> None:
        if self.global_step == self.inf_step:
            plant_inf(self.network)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.optimizer_family, self.parameters())


def _make_plugin(case: SmokeCase) -> MixedPrecision:
    extra: dict[str, Any] = {"init_scale": 2.0**8} if case.precision == "16-mixed" else {}
    return MixedPrecision(case.precision, opt_level=case.opt_level, **extra)


def _train_with_trainer(case: SmokeCase, device: str, steps: int) -> tuple[nn.Module, MixedPrecision]:
    plugin = _make_plugin(case)
    model = _Regressor(case.optimizer, INF_STEP)
    trainer = L.Trainer(accelerator=device, devices=1, max_steps=steps, plugins=[plugin], **QUIET_TRAINER)
    trainer.fit(model, regression_batches(steps))
    return model.network, plugin


def _train_with_fabric(case: SmokeCase, device: str, steps: int) -> tuple[nn.Module, MixedPrecision]:
    plugin = _make_plugin(case)
    fabric = Fabric(accelerator=device, devices=1, plugins=[plugin])
    network = make_network()
    model, optimizer = fabric.setup(network, make_optimizer(case.optimizer, network.parameters()))
    for step, (inputs, targets) in enumerate(regression_batches(steps)):
        inputs, targets = fabric.to_device((inputs, targets))
        fabric.backward(nn.functional.mse_loss(model(inputs).float(), targets))
        if step == INF_STEP:
            plant_inf(network)
        optimizer.step()
        optimizer.zero_grad()
    return network, plugin


def _non_finite(network: nn.Module) -> list[str]:
    tensors = [*network.named_parameters(), *network.named_buffers()]
    return [name for name, tensor in tensors if tensor.is_floating_point() and not torch.isfinite(tensor).all()]


def run_smoke_case(case: SmokeCase, device: str, steps: int = SMOKE_STEPS) -> dict[str, Any]:
    """Train ``case`` on ``device`` (``"cuda"`` or ``"cpu"``) and check the skip: a record for the report.

    The record says ``"passed"`` or ``"failed"`` (with the reason) in ``outcome``, and gives the plugin's counters;
    an exception is a failed case whose reason is the error, so the matrix runs on.
    """
    record: dict[str, Any] = {"kind": "smoke", **case.__dict__, "steps": steps, "inf_step": INF_STEP}
    start = time.perf_counter()
    try:
        train = _train_with_trainer if case.front_end == "trainer" else _train_with_fabric
        network, plugin = train(case, device, steps)
        stats = plugin.stats
        plugin.teardown()
        record.update(optimizer_steps=stats.optimizer_steps, skipped_steps=stats.skipped_steps)
        problems = []
        if stats.skipped_steps != 1:
            problems.append(f"{stats.skipped_steps} skipped steps, expected 1 (the planted inf at step {INF_STEP})")
        broken = _non_finite(network)
        if broken:
            problems.append(f"not finite after training: {', '.join(broken)}")
        record.update(outcome="failed" if problems else "passed", reason="; ".join(problems))
    except Exception as error:
        message = str(error).strip().splitlines()
        record.update(outcome="failed", reason=f"{type(error).__name__}: {message[0] if message else ''}")
    record["seconds"] = round(time.perf_counter() - start, 3)
    return record


def run_matrix(cases: list[SmokeCase], device: str, steps: int, deadline: float) -> Iterator[dict[str, Any]]:
    """Each case's record in turn; a case that would not finish before ``deadline`` (``time.time()``) is not started.

    The estimate is the case before it (the first case also pays for the first kernels, so it is no guide). The
    cases left out get a record with outcome ``"cut"``.
    """
    previous = 0.0
    for index, case in enumerate(cases):
        if time.time() + previous > deadline:
            for left in cases[index:]:
                yield {**left.__dict__, "kind": "smoke", "steps": steps, "inf_step": INF_STEP, "outcome": "cut"}
            return
        record = run_smoke_case(case, device, steps)
        previous = record["seconds"]
        yield record
