"""keep_fp32 under torch.compile: compiled models and submodules train under O1 and O2, in the Trainer and Fabric.

The point is dynamo tracing, so the runs use the ``eager`` backend (dynamo's graph capture alone) or ``aot_eager``
(with AOT autograd), never inductor's slow code generation. The plugin must cause no graph break, and the numbers
must match the same run without compilation. Under O1 that needs the plugin to compile backward passes outside
autocast (:mod:`lightning_mp.plugin.compile`): by default AOT autograd would differentiate the fp32 region in fp16.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from torch import Tensor, nn
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecision
from lightning_mp._compat import (
    AOT_BACKWARD_AUTOCAST_CONFIGURABLE,
    AOT_BACKWARD_SWITCH_BREAKS_GRAPHS,
    DYNAMO_TRACES_AUTOCAST_FLAGS,
)
from lightning_mp.overrides import Fp32Overrides
from lightning_mp.policies import POLICIES
from tests.helpers import make_trainer

BACKEND = "eager"
KEEP_FP32 = [r"re:(net\.)?head"]  # the head, whether the root is the Net or the LightningModule around it
STEPS = 3


class Net(nn.Module):
    """A stem in half precision, a head that ``keep_fp32`` keeps in fp32; records the head's output dtype."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.norm(torch.relu(self.stem(x))))


class Regressor(L.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def batches() -> Iterator[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        yield torch.randn(8, 8, generator=generator), torch.randn(8, 1, generator=generator)


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def assert_no_graph_breaks() -> None:
    """No graph break but the degradations lightning_mp._compat lists: before torch 2.12 the autocast flag toggles and
    their warning; from torch 2.15 the backward switch, a ContextVar there, in a model compiled after fabric.setup."""
    allowed = []
    if not DYNAMO_TRACES_AUTOCAST_FLAGS:
        allowed += ["set_autocast_enabled", "disable"]
    if AOT_BACKWARD_SWITCH_BREAKS_GRAPHS:
        allowed += ["backward_pass_autocast"]
    for reason in counters["graph_break"]:
        assert any(known in reason for known in allowed), dict(counters["graph_break"])


def head_dtype_recorder(net: Net) -> list[torch.dtype]:
    seen: list[torch.dtype] = []
    net.head.register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    return seen


@pytest.mark.skipif(
    not DYNAMO_TRACES_AUTOCAST_FLAGS, reason="torch<2.12 cannot trace torch.set_autocast_enabled (lightning_mp._compat)"
)
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_fp32_regions_trace_in_one_graph(opt_level: str) -> None:
    """A model with keep_fp32 regions compiles to one graph, with the region's output still fp32."""
    model = POLICIES[opt_level](torch.float16, keep_fp32=KEEP_FP32).convert_module(Net())
    seen = head_dtype_recorder(model)
    x = torch.randn(4, 8)
    # Autocast under O2 too: its converted model holds half weights and takes fp32 inputs through autocast.
    with torch.autocast("cpu", dtype=torch.float16):
        explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    assert seen[-1] == torch.float32
    assert not torch.is_autocast_enabled("cpu")


def test_compiled_fp32_regions_warn_once_where_torch_splits_the_graph() -> None:
    """A compiled keep_fp32 region warns once that it splits the graph, on a torch that cannot trace it, else never."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    Fp32Overrides(["1"]).apply(model)
    compiled = torch.compile(model, backend=BACKEND)
    with warnings.catch_warnings(record=True) as caught, torch.autocast("cpu", dtype=torch.bfloat16):
        warnings.simplefilter("always")
        for batch in range(3):
            compiled(torch.full((batch + 1, 4), 1.0))  # a new shape each time: dynamo traces the region again
    splits = [w for w in caught if "cannot compile `torch.set_autocast_enabled`" in str(w.message)]
    assert len(splits) == (0 if DYNAMO_TRACES_AUTOCAST_FLAGS else 1), [str(w.message) for w in caught]


@pytest.mark.slow
def test_fp32_region_restores_autocast_inside_a_compiled_graph() -> None:
    """Layers after a keep_fp32 region run under autocast again inside the compiled graph, as in eager."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    Fp32Overrides(["1"]).apply(model)
    dtypes: list[torch.dtype] = []
    for layer in model:
        layer.register_forward_hook(lambda module, args, output: dtypes.append(output.dtype))
    compiled = torch.compile(model, backend=BACKEND)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = model(torch.ones(2, 4))
        traced = compiled(torch.ones(2, 4))
    assert dtypes == [torch.bfloat16, torch.float32, torch.bfloat16] * 2
    torch.testing.assert_close(traced, eager)


def trainer_run(opt_level: str, compile_what: str, backend: str = BACKEND) -> tuple[list[Tensor], list[torch.dtype]]:
    net = Net()
    seen = head_dtype_recorder(net)
    if compile_what == "submodule":
        net.stem = torch.compile(net.stem, backend=backend)
    model: L.LightningModule = Regressor(net)
    if compile_what == "model":
        model = torch.compile(model, backend=backend)
    plugin = MixedPrecision("16-mixed", opt_level=opt_level, keep_fp32=KEEP_FP32)
    data = DataLoader(TensorDataset(*map(torch.cat, zip(*batches(), strict=True))), batch_size=8)
    make_trainer(plugin, max_steps=STEPS).fit(model, data)
    weights = dict(net.named_parameters())  # fp32 after fit at every level but O3
    return [w.detach().clone() for w in weights.values()], seen


@pytest.mark.parametrize(
    ("opt_level", "compile_what", "backend"),
    [("O1", "model", "eager"), pytest.param("O2", "submodule", "aot_eager", marks=pytest.mark.slow)],
)
def test_compiled_training_matches_eager_in_the_trainer(opt_level: str, compile_what: str, backend: str) -> None:
    """A Trainer run of a compiled model (or submodule) with keep_fp32 matches the eager run, without graph breaks."""
    compiled_weights, seen = trainer_run(opt_level, compile_what, backend)
    assert_no_graph_breaks()
    assert seen and set(seen) == {torch.float32}
    eager_weights, _ = trainer_run(opt_level, "nothing")
    for compiled, eager in zip(compiled_weights, eager_weights, strict=True):
        torch.testing.assert_close(compiled, eager)


def fabric_run(opt_level: str, compile_what: str, backend: str = BACKEND) -> tuple[list[Tensor], list[torch.dtype]]:
    net = Net()
    seen = head_dtype_recorder(net)
    if compile_what == "submodule":
        net.stem = torch.compile(net.stem, backend=backend)
    plugin = MixedPrecision("16-mixed", opt_level=opt_level, keep_fp32=KEEP_FP32)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    module = torch.compile(net, backend=backend) if compile_what == "model" else net
    model, optimizer = fabric.setup(module, optimizer)
    if compile_what == "after setup":  # the compiled graph then holds the plugin's forward context too
        model = torch.compile(model, backend=backend)
    for x, y in batches():
        fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    weights = net.state_dict()  # fp32 at every level but O3 (O2's fp32 masters)
    return [copy.deepcopy(w.detach()) for w in weights.values()], seen


@pytest.mark.parametrize(
    ("opt_level", "compile_what", "backend"),
    [
        ("O1", "submodule", "eager"),
        pytest.param("O2", "model", "eager", marks=pytest.mark.slow),
        # Compiling after setup recompiles the wrapped module: the slowest cases, kept for the full run.
        pytest.param("O1", "after setup", "aot_eager", marks=pytest.mark.slow),
        pytest.param("O2", "after setup", "eager", marks=pytest.mark.slow),
        pytest.param("O2", "after setup", "aot_eager", marks=pytest.mark.slow),
    ],
)
def test_compiled_training_matches_eager_in_fabric(opt_level: str, compile_what: str, backend: str) -> None:
    """A Fabric run of a compiled model (or submodule) with keep_fp32 matches the eager run, without graph breaks."""
    compiled_weights, seen = fabric_run(opt_level, compile_what, backend)
    assert_no_graph_breaks()
    assert seen and set(seen) == {torch.float32}
    eager_weights, _ = fabric_run(opt_level, "nothing")
    for compiled, eager in zip(compiled_weights, eager_weights, strict=True):
        torch.testing.assert_close(compiled, eager)


@pytest.mark.slow
@pytest.mark.skipif(
    not AOT_BACKWARD_AUTOCAST_CONFIGURABLE, reason="torch<2.9 has no backward_pass_autocast (lightning_mp._compat)"
)
def test_aot_autograd_o1_training_differentiates_fp32_regions_in_fp32() -> None:
    """With AOT autograd, an O1 Fabric run of a compiled model with keep_fp32 matches eager: its backward is fp32."""
    user_setting = torch._functorch.config.backward_pass_autocast
    compiled_weights, seen = fabric_run("O1", "model", "aot_eager")
    assert torch._functorch.config.backward_pass_autocast == user_setting  # changed only inside the forward
    assert_no_graph_breaks()
    assert seen and set(seen) == {torch.float32}
    eager_weights, _ = fabric_run("O1", "nothing")
    for compiled, eager in zip(compiled_weights, eager_weights, strict=True):
        torch.testing.assert_close(compiled, eager)
