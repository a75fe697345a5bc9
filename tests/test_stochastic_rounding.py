"""Stochastic rounding and the bf16 optimizer step: unbiased, faithful to torch's rules, and exactly resumable."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from lightning_mp.bench.counting import StepCounts, count_syncs_and_ops
from lightning_mp.scaling import fused_steps
from lightning_mp.stochastic_rounding import (
    COMPENSATION_KEY,
    MAX_CHUNKS,
    MIN_CHUNK_NUMEL,
    STATE_KEY,
    StochasticRoundingStep,
    chunk_limit,
    stale_update_share,
    stochastic_round_,
)

BF16_GAP_AT_ONE = 2.0**-7


def kept_update_share(before: torch.Tensor, after: torch.Tensor, intended: torch.Tensor) -> float:
    """How much of an update the stored values received: 1.0 when it is kept in expectation, 0.0 when all is lost.

    ``sum((after - before) * sign(intended)) / sum(|intended|)``, in float64; the lean guide's table of what rounding
    loses is measured with it.
    """
    magnitude = float(intended.double().abs().sum())
    if magnitude == 0.0:
        return 0.0
    moved = (after.double() - before.double()) * intended.double().sign()
    return float(moved.sum()) / magnitude


def bf16_gap(values: torch.Tensor) -> torch.Tensor:
    """The distance from each value to the next bf16 number away from zero."""
    exponent = torch.floor(torch.log2(values.abs().clamp_min(2.0**-126)))
    return torch.pow(2.0, exponent - 7)


def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour() -> None:
    """Rounding 1 + u many times gives 1 or the next bf16 number, and the mean is 1 + u (not 1, as to-nearest)."""
    update = 1e-4  # 1.3% of a bf16 gap: round-to-nearest loses it entirely
    values = torch.full((400_000,), 1.0 + update)
    rounded = stochastic_round_(values.clone(), torch.Generator().manual_seed(0))
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + BF16_GAP_AT_ONE}
    assert torch.equal(rounded.bfloat16().float(), rounded)
    assert rounded.double().mean().item() - 1.0 == pytest.approx(update, rel=0.05)
    assert (values.bfloat16().float() - 1.0).abs().max().item() == 0.0


def test_stochastic_rounding_keeps_zero_exact_values_and_signs() -> None:
    """Zero, numbers that bf16 represents exactly, and negative numbers round as their magnitudes would."""
    generator = torch.Generator().manual_seed(1)
    exact = torch.tensor([0.0, -0.0, 1.0, -2.5, 3.0e38, 1.0e-40]).bfloat16().float()
    assert torch.equal(stochastic_round_(exact.clone(), generator), exact)
    negative = stochastic_round_(torch.full((100_000,), -(1.0 + 1e-3)), generator)
    assert set(negative.unique().tolist()) == {-1.0, -(1.0 + BF16_GAP_AT_ONE)}
    assert negative.double().mean().item() == pytest.approx(-(1.0 + 1e-3), abs=2e-5)


def test_stochastic_round_refuses_other_dtypes() -> None:
    """Only fp32 values can be rounded; the error names the dtype."""
    with pytest.raises(TypeError, match="bfloat16"):
        stochastic_round_(torch.ones(2, dtype=torch.bfloat16))


def test_stale_update_share_counts_the_elements_an_update_missed() -> None:
    """Elements that were meant to move but kept their value are stale; elements not meant to move are not counted."""
    before = torch.zeros(4)
    after = torch.tensor([1.0, 0.0, 0.0, 5.0])
    assert stale_update_share(before, after, torch.tensor([1.0, 1.0, 0.0, 0.0])) == 0.5
    assert stale_update_share(before, after, torch.zeros(4)) == 0.0
    assert kept_update_share(before, after, torch.tensor([1.0, 1.0, 0.0, 0.0])) == 0.5


def _one_adamw_step(lr: float, stochastic: bool) -> tuple[float, float]:
    generator = torch.Generator().manual_seed(0)
    before = torch.randn(50_000, generator=generator).bfloat16()
    grad = torch.randn(50_000, generator=generator)
    reference = nn.Parameter(before.float())
    reference.grad = grad.clone()
    torch.optim.AdamW([reference], lr=lr).step()
    intended = reference.detach() - before.float()
    weight = nn.Parameter(before.clone())
    weight.grad = grad.bfloat16()
    optimizer = torch.optim.AdamW([weight], lr=lr)
    if stochastic:
        StochasticRoundingStep(optimizer, seed=0)
    optimizer.step()
    return stale_update_share(before, weight.detach(), intended), kept_update_share(before, weight.detach(), intended)


@pytest.mark.parametrize("lr", [1e-3, 1e-4])
def test_round_to_nearest_loses_updates_that_stochastic_rounding_keeps(lr: float) -> None:
    """One AdamW step on N(0, 1) bf16 weights: to-nearest keeps part of the update, SR all of it in expectation."""
    nearest_stale, nearest_kept = _one_adamw_step(lr, stochastic=False)
    stochastic_stale, stochastic_kept = _one_adamw_step(lr, stochastic=True)
    assert stochastic_kept == pytest.approx(1.0, abs=0.05)
    assert nearest_kept < 0.6
    assert stochastic_stale < nearest_stale - 0.02


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "adamw-fused": lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True),
    "adam-amsgrad-l2": lambda params: torch.optim.Adam(params, lr=1e-2, amsgrad=True, weight_decay=0.01),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "sgd-nesterov": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "sgd-dampening-maximize": lambda params: torch.optim.SGD(
        params, lr=0.1, momentum=0.5, dampening=0.3, maximize=True
    ),
}


@pytest.mark.parametrize("chunk_numel", [1, 1 << 19])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_bf16_steps_follow_torchs_fp32_rule_within_one_bf16_gap(name: str, chunk_numel: int) -> None:
    """Three steps on bf16 weights land within one bf16 gap of torch's fp32 optimizer, weights and states alike."""
    reference_model = _model()
    lean_model = copy.deepcopy(reference_model).bfloat16()
    reference_model.load_state_dict({k: v.float() for k, v in lean_model.state_dict().items()})
    reference = OPTIMIZERS[name](list(reference_model.parameters()))
    lean = OPTIMIZERS[name](list(lean_model.parameters()))
    StochasticRoundingStep(lean, seed=0, chunk_numel=chunk_numel)
    inputs = torch.randn(16, 6, generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        for model, optimizer in ((reference_model, reference), (lean_model, lean)):
            optimizer.zero_grad()
            model(inputs.to(next(model.parameters()).dtype)).float().square().mean().backward()
        # Same gradients on both sides, so that only the update's rounding differs.
        for reference_parameter, lean_parameter in zip(
            reference_model.parameters(), lean_model.parameters(), strict=True
        ):
            reference_parameter.grad = lean_parameter.grad.float()
        reference.step()
        lean.step()
        for reference_parameter, lean_parameter in zip(
            reference_model.parameters(), lean_model.parameters(), strict=True
        ):
            assert lean_parameter.dtype is torch.bfloat16 and lean_parameter.grad.dtype is torch.bfloat16
            exact = reference_parameter.detach()
            assert ((lean_parameter.float() - exact).abs() <= bf16_gap(exact) + 1e-12).all()
            for key, value in reference.state[reference_parameter].items():
                if key != "step":
                    saved = lean.state[lean_parameter][key]
                    assert saved.dtype is torch.bfloat16
                    assert ((saved.float() - value).abs() <= bf16_gap(value) + 1e-30).all(), key
                    reference.state[reference_parameter][key] = saved.float()  # follow the lean trajectory
            reference_parameter.data = lean_parameter.detach().float()


@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize(("dampening", "weight_decay"), [(0.0, 0.0), (0.5, 0.0), (0.5, 0.5), (0.0, 0.5)])
def test_first_sgd_momentum_steps_equal_torchs_exactly(dampening: float, weight_decay: float, maximize: bool) -> None:
    """On values bf16 holds exactly, momentum SGD's first steps (one parameter starting while another is past its
    first) give torch's fp32 weights and momentum buffers bit for bit."""
    options = {"lr": 0.5, "momentum": 0.5, "dampening": dampening, "weight_decay": weight_decay, "maximize": maximize}
    values = torch.tensor([[1.0, -2.0, 0.5, 0.0], [-0.5, 1.5, 2.0, -1.0]])
    gradients = [torch.tensor([[0.5, -0.25, 1.0, 0.0], [0.0, 0.25, -0.5, 1.0]]), torch.tensor([[-1.0, 0.5, 0.0, 0.25]])]
    reference = [nn.Parameter(values[:1].clone()), nn.Parameter(values[1:].clone())]
    lean = [nn.Parameter(values[:1].bfloat16()), nn.Parameter(values[1:].bfloat16())]
    reference_optimizer = torch.optim.SGD(reference, **options)
    lean_optimizer = torch.optim.SGD(lean, **options)
    StochasticRoundingStep(lean_optimizer, seed=0)
    for step, started in enumerate(([0], [0, 1])):
        for index in (0, 1):
            grad = gradients[index][step - index].reshape(1, 4) if index in started else None
            reference[index].grad = None if grad is None else grad.clone()
            lean[index].grad = None if grad is None else grad.bfloat16()
        reference_optimizer.step()
        lean_optimizer.step()
        for exact, stored in zip(reference, lean, strict=True):
            assert torch.equal(stored.float(), exact.detach())
            if exact in reference_optimizer.state:
                momentum = reference_optimizer.state[exact]["momentum_buffer"]
                assert torch.equal(lean_optimizer.state[stored]["momentum_buffer"].float(), momentum)


def _sum_of_tiny_sgd_steps(kahan: bool) -> tuple[torch.Tensor, torch.optim.Optimizer, nn.Parameter]:
    weight = nn.Parameter(torch.ones(1000, dtype=torch.bfloat16))
    optimizer = torch.optim.SGD([weight], lr=1e-4)
    StochasticRoundingStep(optimizer, kahan=kahan, seed=0)
    for _ in range(50):
        weight.grad = -torch.ones_like(weight)
        optimizer.step()
    stored = weight.detach().double()
    if kahan:
        stored = stored + optimizer.state[weight][COMPENSATION_KEY].double()
    return stored - (1.0 + 50 * 1e-4), optimizer, weight


def test_kahan_compensation_tracks_the_fp32_sum_of_tiny_updates() -> None:
    """Over 50 tiny SGD steps, weight plus bf16 compensation stays far closer to fp32 than the rounded weight alone."""
    compensated_error, optimizer, weight = _sum_of_tiny_sgd_steps(kahan=True)
    rounded_error, _, _ = _sum_of_tiny_sgd_steps(kahan=False)
    assert optimizer.state[weight][COMPENSATION_KEY].dtype is torch.bfloat16
    assert compensated_error.abs().mean() < 0.1 * rounded_error.abs().mean()
    assert compensated_error.abs().max() < BF16_GAP_AT_ONE / 16
    assert rounded_error.mean().abs() < 0.1 * BF16_GAP_AT_ONE  # unbiased without compensation too


def test_state_dict_carries_the_rounding_generator_so_a_resumed_step_is_identical() -> None:
    """Loading the optimizer's state_dict into a fresh optimizer reproduces the next steps bit for bit."""
    model = _model().bfloat16()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    StochasticRoundingStep(optimizer, kahan=True, seed=3)
    inputs = torch.randn(16, 6, dtype=torch.bfloat16)

    def step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad()
        model(inputs).float().square().mean().backward()
        optimizer.step()

    step(model, optimizer)
    saved_model, saved_optimizer = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    assert set(saved_optimizer[STATE_KEY]) == {"seed", "kahan", "generators"}
    step(model, optimizer)
    step(model, optimizer)

    resumed = _model().bfloat16()
    resumed.load_state_dict(saved_model)
    resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    StochasticRoundingStep(resumed_optimizer, kahan=True, seed=99)
    resumed_optimizer.load_state_dict(saved_optimizer)
    step(resumed, resumed_optimizer)
    step(resumed, resumed_optimizer)
    for original, again in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(original, again)
    assert torch.equal(
        optimizer.state_dict()[STATE_KEY]["generators"]["cpu"],
        resumed_optimizer.state_dict()[STATE_KEY]["generators"]["cpu"],
    )


FLAGGED_OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "adam-fused": lambda model: torch.optim.Adam(model.parameters(), lr=1e-2, fused=True),
    "adamw-foreach": lambda model: torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True),
    "sgd-momentum": lambda model: torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, dampening=0.1),
}


def _flagged_step(model: nn.Module, optimizer: torch.optim.Optimizer, flag: float) -> StepCounts:
    """One step with unit gradients, handed an inf flag as the loss scaler hands it; its syncs and ops."""
    for parameter in model.parameters():
        parameter.grad = torch.ones_like(parameter)
    with count_syncs_and_ops() as counts:
        # As lightning_mp's scaler does in bf16: the step goes to torch's fused kernel, told to skip by ``found_inf``.
        fused_steps.step_on_device(optimizer, torch.full((), flag), None)
    return counts


@pytest.mark.parametrize("kahan", [False, True], ids=["plain", "kahan"])
@pytest.mark.parametrize("name", FLAGGED_OPTIMIZERS)
def test_a_step_flagged_non_finite_changes_nothing_and_is_decided_on_the_device(name: str, kahan: bool) -> None:
    """A flagged step leaves weights, states and Kahan buffers as they were, without a host sync; the rounding draws
    its numbers as a clean step does, so later steps round alike whether or not one was skipped."""
    model = _model().bfloat16()
    optimizer = FLAGGED_OPTIMIZERS[name](model)
    StochasticRoundingStep(optimizer, kahan=kahan, seed=0)
    _flagged_step(model, optimizer, flag=0.0)  # states (and SGD's momentum buffers) exist from here on
    twin = copy.deepcopy(model)
    twin_optimizer = FLAGGED_OPTIMIZERS[name](twin)
    StochasticRoundingStep(twin_optimizer, kahan=kahan, seed=0)
    twin_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # torch would share the step tensors
    before_model, before_state = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())

    counts = _flagged_step(model, optimizer, flag=1.0)
    _flagged_step(twin, twin_optimizer, flag=0.0)

    assert counts.syncs == 0
    assert all(torch.equal(before_model[key], value) for key, value in model.state_dict().items())
    after_state = optimizer.state_dict()
    for index, state in before_state["state"].items():
        assert state.keys() == after_state["state"][index].keys()
        for key, value in state.items():
            assert torch.equal(value, after_state["state"][index][key]), key
    assert all(parameter.grad is not None for parameter in model.parameters())
    generators = after_state[STATE_KEY]["generators"]["cpu"]
    assert torch.equal(generators, twin_optimizer.state_dict()[STATE_KEY]["generators"]["cpu"])


def test_a_first_sgd_momentum_step_flagged_non_finite_starts_no_momentum_buffer() -> None:
    """SGD's first momentum step, flagged non-finite, leaves no buffer started from the bad gradients: the next
    clean step starts the momentum as torch's first step does."""
    model = _model().bfloat16()
    optimizer = FLAGGED_OPTIMIZERS["sgd-momentum"](model)
    StochasticRoundingStep(optimizer, seed=0)
    before = copy.deepcopy(model.state_dict())
    _flagged_step(model, optimizer, flag=1.0)
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())
    assert all(optimizer.state[parameter].get("momentum_buffer") is None for parameter in model.parameters())


def test_fp32_parameters_are_stepped_by_the_optimizer_itself() -> None:
    """An fp32 parameter beside bf16 ones keeps torch's own fp32 update and fp32 states."""
    half, full = nn.Parameter(torch.ones(4, dtype=torch.bfloat16)), nn.Parameter(torch.ones(4))
    optimizer = torch.optim.AdamW([half, full], lr=0.1)
    StochasticRoundingStep(optimizer, seed=0)
    reference = nn.Parameter(torch.ones(4))
    reference_optimizer = torch.optim.AdamW([reference], lr=0.1)
    for parameter in (half, full, reference):
        parameter.grad = torch.full_like(parameter, 0.5)
    optimizer.step()
    reference_optimizer.step()
    assert torch.equal(full, reference)
    assert optimizer.state[full]["exp_avg"].dtype is torch.float32
    assert optimizer.state[half]["exp_avg"].dtype is torch.bfloat16


def test_bad_arguments_are_refused_with_clear_errors() -> None:
    """Unsupported optimizers, differentiable optimizers and an empty chunk are refused by name."""
    parameter = nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="RMSprop"):
        StochasticRoundingStep(torch.optim.RMSprop([parameter]))
    with pytest.raises(ValueError, match="differentiable"):
        StochasticRoundingStep(torch.optim.SGD([parameter], lr=0.1, differentiable=True))
    with pytest.raises(ValueError, match="chunk_numel=0"):
        StochasticRoundingStep(torch.optim.SGD([parameter], lr=0.1), chunk_numel=0)


def test_detach_gives_the_optimizer_back_its_own_step() -> None:
    """After detach the optimizer rounds to nearest again and its state_dict has no rounding entry."""
    parameter = nn.Parameter(torch.ones(1000, dtype=torch.bfloat16))
    optimizer = torch.optim.SGD([parameter], lr=1e-4)
    StochasticRoundingStep(optimizer, seed=0).detach()
    parameter.grad = -torch.ones_like(parameter)
    optimizer.step()
    assert torch.equal(parameter, torch.ones_like(parameter))
    assert STATE_KEY not in optimizer.state_dict()


def test_a_large_model_is_stepped_in_a_bounded_number_of_chunks() -> None:
    """Each chunk costs about a dozen kernel launches: a small model keeps chunks of 2**19 elements, and a large one
    gets at most MAX_CHUNKS larger chunks per group and device instead of one chunk per 2**19 elements."""
    assert chunk_limit(1_000) == chunk_limit(MAX_CHUNKS * MIN_CHUNK_NUMEL) == MIN_CHUNK_NUMEL == 1 << 19
    for numel in (MAX_CHUNKS * MIN_CHUNK_NUMEL + 1, 219_000_000):
        limit = chunk_limit(numel)
        assert limit * MAX_CHUNKS >= numel > limit * (MAX_CHUNKS - 1)
