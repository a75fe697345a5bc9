"""lean-exact's chunked step: one call of the user's optimizer, stepping a chunk of rebuilt masters at a time.

The results must be O2's bit for bit with every per-parameter torch optimizer; hooks, schedulers and step counts must
see one whole step over the user's own parameters; and the memory the step adds must be bounded by the chunk, not by
the model.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor, nn

from lightning_mp import MixedPrecision
from lightning_mp.policies.o2.chunked_step import steps_each_parameter_alone
from tests.policies.lean_helpers import CHUNK_NUMEL, AfterStep, assert_same_run, fabric_run

OTHER_PER_PARAMETER_OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "rmsprop-centered": lambda params: torch.optim.RMSprop(params, lr=1e-2, momentum=0.5, centered=True),
    "adamax": lambda params: torch.optim.Adamax(params, lr=1e-2),
    "nadam": lambda params: torch.optim.NAdam(params, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
    "radam": lambda params: torch.optim.RAdam(params, lr=1e-2),
    "adadelta": lambda params: torch.optim.Adadelta(params),
    "asgd": lambda params: torch.optim.ASGD(params, lr=1e-2, t0=2),
    "rprop": lambda params: torch.optim.Rprop(params, lr=1e-2),
    "adafactor": lambda params: torch.optim.Adafactor(params, lr=1e-2),
    "adam-maximize-foreach": lambda params: torch.optim.Adam(params, lr=1e-2, maximize=True, foreach=True),
}


@pytest.mark.parametrize("optimizer", list(OTHER_PER_PARAMETER_OPTIMIZERS))
def test_every_per_parameter_torch_optimizer_steps_in_chunks_as_at_o2(optimizer: str) -> None:
    """RMSprop, Adamax, NAdam, RAdam, Adadelta, ASGD, Rprop, Adafactor and a maximizing Adam step in chunks to O2's
    numbers, bit for bit."""
    build = OTHER_PER_PARAMETER_OPTIMIZERS[optimizer]
    o2 = fabric_run("O2", build, steps=7, accumulate=1)
    exact = fabric_run("lean-exact", build, steps=7, accumulate=1, master_chunk_numel=CHUNK_NUMEL)
    assert_same_run(exact, o2)


class LoggedAdamW(torch.optim.AdamW):
    """An AdamW with a ``step`` of its own: lean-exact cannot know what it does, so it steps it whole."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        return super().step(closure)


def test_only_torchs_own_per_parameter_steps_are_cut_into_chunks() -> None:
    """torch's AdamW and SGD step in chunks; LBFGS (its update couples every parameter) and a subclass with a step of
    its own step whole, and still give O2's numbers."""
    weight = nn.Parameter(torch.zeros(2))
    assert steps_each_parameter_alone(torch.optim.AdamW([weight]))
    assert steps_each_parameter_alone(torch.optim.SGD([weight]))
    assert not steps_each_parameter_alone(torch.optim.LBFGS([weight]))
    assert not steps_each_parameter_alone(LoggedAdamW([weight]))

    def build(params: Any) -> torch.optim.Optimizer:
        return LoggedAdamW(params, lr=1e-2)

    o2 = fabric_run("O2", build, steps=7, accumulate=1)
    exact = fabric_run("lean-exact", build, steps=7, accumulate=1, master_chunk_numel=CHUNK_NUMEL)
    assert_same_run(exact, o2)


class StepWatch:
    """Step hooks and a per-step scheduler on an optimizer: what each hook saw, at every step."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.seen: list[dict[str, Any]] = []
        self.weights_before: list[Tensor] = []
        optimizer.register_step_pre_hook(self.before)
        optimizer.register_step_post_hook(self.after)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.9**step)

    def before(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        walked = [p for group in optimizer.param_groups for p in group["params"]]
        own = len(walked) == len(self.params) and all(a is b for a, b in zip(walked, self.params, strict=True))
        self.seen.append(
            {"pre_sees_own_params": own, "pre_grad_dtypes": {p.grad.dtype for p in walked if p.grad is not None}}
        )
        self.weights_before = [p.detach().clone() for p in walked]

    def after(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        walked = [p for group in optimizer.param_groups for p in group["params"]]
        self.seen[-1]["post_sees_own_params"] = all(a is b for a, b in zip(walked, self.params, strict=True))
        self.seen[-1]["post_weights_moved"] = any(
            not torch.equal(p, before) for p, before in zip(walked, self.weights_before, strict=True)
        )
        self.seen[-1]["post_steps"] = {int(optimizer.state[p]["step"]) for p in walked}

    def after_step(self) -> list[AfterStep]:
        return [self.scheduler.step]


def test_hooks_and_a_scheduler_see_one_whole_step_over_the_users_parameters() -> None:
    """Each step fires the pre- and post-hooks once; both see the user's parameters (bf16 gradients before the step,
    moved weights and the state keyed by them after it); ``state["step"]`` and a scheduler move once per step; and
    the run equals O2's with the same hooks and scheduler."""
    watches: dict[str, StepWatch] = {}

    def watched(opt_level: str) -> Callable[[torch.optim.Optimizer], list[AfterStep]]:
        def prepare(optimizer: torch.optim.Optimizer) -> list[AfterStep]:
            watches[opt_level] = StepWatch(optimizer)
            return watches[opt_level].after_step()

        return prepare

    o2 = fabric_run("O2", "adamw-foreach", steps=8, accumulate=1, prepare=watched("O2"))
    exact = fabric_run(
        "lean-exact", "adamw-foreach", steps=8, accumulate=1, master_chunk_numel=CHUNK_NUMEL, prepare=watched("exact")
    )
    assert_same_run(exact, o2)
    seen, o2_seen = watches["exact"].seen, watches["O2"].seen
    assert len(seen) == len(o2_seen) == 8  # the step with a NaN gradient runs too, skipped on the device
    for step in seen:
        assert step["pre_sees_own_params"] and step["post_sees_own_params"]
        assert step["pre_grad_dtypes"] == {torch.bfloat16, torch.float32}  # fp32 for the LayerNorm's only
    assert [step["post_weights_moved"] for step in seen] == [step != 5 for step in range(8)]
    assert [step["post_steps"] for step in seen] == [step["post_steps"] for step in o2_seen]
    assert seen[-1]["post_steps"] == {7}


def test_a_pre_hook_that_walks_the_groups_changes_nothing_but_what_it_writes() -> None:
    """A step pre-hook, registered after the first step, that sets each group's learning rate and reads every
    gradient trains to O2's numbers with the same hook."""

    def rescaling(optimizer: torch.optim.Optimizer) -> list[AfterStep]:
        rates = iter([1e-2 * 0.8**k for k in range(10)])
        read: list[float] = []

        def before(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            rate = next(rates)
            for group in optimizer.param_groups:
                group["lr"] = rate
                read.append(sum(float(p.grad.float().abs().sum()) for p in group["params"] if p.grad is not None))

        registered = []

        def register_once() -> None:
            if not registered:
                registered.append(optimizer.register_step_pre_hook(before))

        return [register_once]

    o2 = fabric_run("O2", "adam-amsgrad", steps=6, accumulate=1, prepare=rescaling)
    exact = fabric_run(
        "lean-exact", "adam-amsgrad", steps=6, accumulate=1, master_chunk_numel=CHUNK_NUMEL, prepare=rescaling
    )
    assert_same_run(exact, o2)


def train_through_a_failing_hook(
    opt_level: str, hook: str | None, take_step_3: bool = True
) -> tuple[dict[str, Tensor], Any, list[bool]]:
    """Six Fabric steps at ``opt_level`` (lean-exact in chunks). At step 3 a user's step ``hook`` raises: a
    ``"pre"``-hook registered after the plugin's (it runs inside the step, before torch's), a ``"post"``-hook
    registered before the plugin's (which Fabric registers at the first step); with no hook, step 3 is taken or not.

    Returns the weights, the optimizer's state, and after each failure whether the groups held the user's parameters
    (and at lean-exact, at the end, whether every master was packed).
    """
    chunking = {"master_chunk_numel": CHUNK_NUMEL} if opt_level == "lean-exact" else {}
    plugin = MixedPrecision("bf16-mixed", opt_level=opt_level, **chunking)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))
    module, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    params = list(model.parameters())
    generator = torch.Generator().manual_seed(1)
    now = {"step": 0}
    after_failure: list[bool] = []

    def fail_at_step_3(optimizer: torch.optim.Optimizer, *args: Any) -> None:
        if now["step"] == 3:
            raise RuntimeError(f"a {hook}-hook failed")

    if hook == "post":
        opt.optimizer.register_step_post_hook(fail_at_step_3)
    for step in range(6):
        now["step"] = step
        features, target = torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator)
        fabric.backward(nn.functional.cross_entropy(module(features).float(), target))
        if step == 1 and hook == "pre":
            opt.optimizer.register_step_pre_hook(fail_at_step_3)
        if step != 3 or take_step_3:
            try:
                opt.step()
            except RuntimeError:
                grouped = [p for group in opt.optimizer.param_groups for p in group["params"]]
                after_failure.append(all(a is b for a, b in zip(grouped, params, strict=True)))
        opt.zero_grad()
    if opt_level == "lean-exact":
        masters = plugin.policy.masters  # type: ignore[union-attr]
        after_failure.append(all(remainder is not None for remainder in masters.remainders))
    result = {name: value.clone() for name, value in module.state_dict().items()}, opt.state_dict()["state"]
    plugin.teardown()
    return *result, after_failure


def assert_same_training(run: tuple[dict[str, Tensor], Any, list[bool]], expected: tuple[Any, ...]) -> None:
    weights, state, _ = run
    expected_weights, expected_state, _ = expected
    for name, value in expected_weights.items():
        assert torch.equal(weights[name], value), name
    for index, entries in expected_state.items():
        for key, value in entries.items():
            assert torch.equal(state[index][key], value), (index, key)


@pytest.mark.parametrize("opt_level", ["O2", "lean-exact"])
def test_a_step_that_fails_in_a_hook_is_a_step_not_taken(opt_level: str) -> None:
    """A step pre-hook that runs after the plugin's and raises leaves the groups holding the user's parameters (and
    the lean-exact masters packed): training goes on exactly as if that step had not been taken."""
    failed = train_through_a_failing_hook(opt_level, "pre")
    assert failed[2] == ([True, True] if opt_level == "lean-exact" else [True])
    assert_same_training(failed, train_through_a_failing_hook(opt_level, None, take_step_3=False))


@pytest.mark.parametrize("opt_level", ["O2", "lean-exact"])
def test_a_post_hook_that_fails_after_the_step_leaves_the_step_taken(opt_level: str) -> None:
    """A user's step post-hook, registered before the plugin's, raises after the step: the step stands, written into
    the model's weights (the next forward computes with them), the groups hold the user's parameters again, the
    lean-exact masters are packed, and training goes on bit for bit as if nothing had raised."""
    failed = train_through_a_failing_hook(opt_level, "post")
    assert failed[2] == ([True, True] if opt_level == "lean-exact" else [True])
    assert_same_training(failed, train_through_a_failing_hook("O2", None))


MARKER_BYTES = 999_983
"""The size of a tensor made just before the measured step and freed after it, which marks it in the profile."""


def bytes_made_by_a_step(width: int, layers: int, optimizer: str, master_chunk_numel: int | None) -> int:
    """The most bytes the second of two lean-exact Fabric steps of ``layers`` square linears holds beyond what was
    allocated when it began: the CPU allocator's running total in torch.profiler's trace, every block of which was
    made inside the profile, so that its free is recorded too.

    The step's fp32 gradients are made before it, by clipping, as the plugin makes them before any step.
    """
    chunking = {} if master_chunk_numel is None else {"master_chunk_numel": master_chunk_numel}
    plugin = MixedPrecision("bf16-mixed", opt_level="lean-exact", **chunking)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    kernel = {"fused": True} if optimizer == "fused" else {"foreach": True}
    module, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3, **kernel))

    def backward() -> None:
        fabric.backward(module(torch.randn(4, width)).float().square().mean())
        fabric.clip_gradients(module, opt, max_norm=1e9)

    backward()
    opt.step()
    opt.zero_grad()
    backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as run:
        # A first step inside the profile: the measured step frees the remainders this one packs.
        opt.step()
        opt.zero_grad()
        backward()
        marker = torch.empty(MARKER_BYTES, dtype=torch.uint8)
        opt.step()
        del marker
    plugin.teardown()
    with tempfile.TemporaryDirectory() as directory:
        run.export_chrome_trace(f"{directory}/trace.json")
        with open(f"{directory}/trace.json") as file:
            events = json.load(file)["traceEvents"]
    allocations = sorted((event["ts"], event["args"]) for event in events if event.get("name") == "[memory]")
    start, most = None, 0
    for _, allocation in allocations:
        if start is None:
            start = allocation["Total Allocated"] if allocation["Bytes"] == MARKER_BYTES else None
        elif allocation["Bytes"] == -MARKER_BYTES:
            break
        else:
            most = max(most, allocation["Total Allocated"] - start)
    assert start is not None, "the marker's allocation is not in the profile"
    return most


@pytest.mark.parametrize("optimizer", ["foreach", "fused"])
def test_the_steps_extra_memory_is_bounded_by_the_chunk_not_by_the_model(optimizer: str) -> None:
    """With a chunk of two layers, the step adds the 4 bytes per element of one chunk's rebuilt masters (AdamW's
    fused kernel, which bf16 steps go to, makes no temporaries) whether the model has 4 layers or 8; in one chunk,
    as many bytes per parameter of the model."""
    width = 64
    layer = width * width + width
    chunk = 2 * layer
    four, eight = (bytes_made_by_a_step(width, layers, optimizer, chunk) for layers in (4, 8))
    whole = bytes_made_by_a_step(width, 8, optimizer, None)  # the default chunk, 2**24, holds the whole model
    scalars = 256  # the step's inf flag and such, whatever the model
    assert 4 * chunk <= four == eight <= 4 * chunk + scalars
    assert 4 * 8 * layer <= whole <= 4 * 8 * layer + scalars
