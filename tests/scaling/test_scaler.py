"""The LossScaler on its own, driven by hand like a torch GradScaler: hysteresis, bounds, modes and state."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
import torch
from torch import nn

from lightning_mp import LossScaleCollapseError, LossScaler, MixedPrecision, NonFiniteStepsError
from lightning_mp.scaling.rules import ScalerSettings


def _step(scaler: LossScaler, model: nn.Linear, optimizer: torch.optim.Optimizer, overflow: bool) -> None:
    """One real fp16-autocast step; ``overflow`` plants an inf in the weight gradient."""
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.ones(2, 4)).float().pow(2).mean()
    scaler.scale(loss).backward()
    if overflow:
        model.weight.grad[0, 0] = float("inf")
    scaler.step(optimizer)
    scaler.update()


@pytest.fixture
def model_and_optimizer() -> tuple[nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def test_hysteresis_two_absorbs_one_overflow_and_backs_off_on_the_second(model_and_optimizer):
    """With hysteresis=2 the first overflow is skipped at the same scale; the second consecutive one halves it."""
    model, optimizer = model_and_optimizer
    scaler = LossScaler("cpu", init_scale=1024.0, hysteresis=2, growth_interval=100)
    _step(scaler, model, optimizer, overflow=True)
    assert scaler.get_scale() == 1024.0
    assert scaler.skipped_steps == 1 and scaler.scale_backoffs == 0
    _step(scaler, model, optimizer, overflow=True)
    assert scaler.get_scale() == 512.0
    assert scaler.skipped_steps == 2 and scaler.scale_backoffs == 1
    # The tracker refills only at a growth: a third overflow backs off at once, as in DeepSpeed and Megatron.
    _step(scaler, model, optimizer, overflow=False)
    _step(scaler, model, optimizer, overflow=True)
    assert scaler.get_scale() == 256.0


def test_consecutive_hysteresis_refills_after_a_clean_step(model_and_optimizer):
    """With consecutive_hysteresis=True only overflows in a row count towards a backoff."""
    model, optimizer = model_and_optimizer
    scaler = LossScaler("cpu", init_scale=1024.0, hysteresis=2, consecutive_hysteresis=True, growth_interval=100)
    for overflow in (True, False, True, False, True):
        _step(scaler, model, optimizer, overflow)
    assert scaler.get_scale() == 1024.0
    assert scaler.skipped_steps == 3


def test_scale_never_exceeds_max_scale(model_and_optimizer):
    """Growth stops at max_scale and growths are counted only when the scale really grew."""
    model, optimizer = model_and_optimizer
    scaler = LossScaler("cpu", init_scale=2.0**10, growth_interval=1, max_scale=2.0**12)
    for _ in range(6):
        _step(scaler, model, optimizer, overflow=False)
        assert scaler.get_scale() <= 2.0**12
    assert scaler.get_scale() == 2.0**12
    assert scaler.scale_growths == 2


def test_min_scale_raise_names_the_step_scale_and_parameter(model_and_optimizer):
    """An overflow that would push the scale below min_scale raises LossScaleCollapseError with a useful message."""
    model, optimizer = model_and_optimizer
    scaler = LossScaler("cpu", init_scale=2.0**11, min_scale=2.0**10, growth_interval=100)
    scaler.param_names = {id(p): n for n, p in model.named_parameters()}
    _step(scaler, model, optimizer, overflow=True)
    assert scaler.get_scale() == 2.0**10
    with pytest.raises(LossScaleCollapseError) as caught:
        _step(scaler, model, optimizer, overflow=True)
    error = caught.value
    assert error.step == 2 and error.scale == 2.0**10
    assert [name for name, _ in error.nonfinite_parameters] == ["weight"]
    assert "weight [2, 4]" in str(error) and "bf16" in str(error)


def test_min_scale_warn_stays_at_the_floor(model_and_optimizer):
    """With on_min_scale='warn' the scale stays at the floor and each collapse warns instead of raising."""
    model, optimizer = model_and_optimizer
    scaler = LossScaler("cpu", init_scale=2.0, min_scale=1.0, on_min_scale="warn", growth_interval=100)
    _step(scaler, model, optimizer, overflow=True)
    with pytest.warns(RuntimeWarning, match="floor"):
        _step(scaler, model, optimizer, overflow=True)
    assert scaler.get_scale() == 1.0
    assert scaler.skipped_steps == 2


def test_collapse_without_min_scale_still_ends(model_and_optimizer):
    """With min_scale=None an always-overflowing model stops with the error within a bounded number of steps."""
    model, optimizer = model_and_optimizer
    scaler = LossScaler("cpu", init_scale=2.0**16, growth_interval=100)
    with pytest.raises(LossScaleCollapseError):
        for _ in range(200):
            _step(scaler, model, optimizer, overflow=True)
    assert scaler.skipped_steps <= 41


def test_static_mode_keeps_the_scale_and_skips_overflows(model_and_optimizer):
    """A static scale never moves, yet an overflowing step is still skipped."""
    model, optimizer = model_and_optimizer
    scaler = LossScaler("cpu", init_scale=128.0, mode="static", growth_interval=1)
    before = model.weight.detach().clone()
    _step(scaler, model, optimizer, overflow=True)
    assert torch.equal(model.weight, before)
    for _ in range(3):
        _step(scaler, model, optimizer, overflow=False)
    assert scaler.get_scale() == 128.0 and scaler.skipped_steps == 1


@pytest.mark.parametrize("scale", [2.0**-25, 2.0**-126])
def test_a_static_scale_below_the_dynamic_floor_scales_and_unscales_exactly(scale):
    """A static scale under 2**-24 with a finite inverse is accepted and the optimizer sees the true gradients."""
    torch.manual_seed(0)
    model, x = nn.Linear(4, 2), torch.randn(3, 4)
    model(x).pow(2).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = LossScaler("cpu", init_scale=scale, mode="static")
    scaler.scale(model(x).pow(2).sum()).backward()
    scaler.unscale_(optimizer)
    for parameter, gradient in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(parameter.grad, gradient)
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == scale and scaler.skipped_steps == 0
    restored = LossScaler("cpu", init_scale=scale, mode="static")
    restored.load_state_dict(scaler.state_dict())
    assert restored.get_scale() == scale


def test_static_new_scale_accepts_every_normal_float32_and_nothing_below():
    """update(new_scale=...) in static mode takes 2**-126, float32's smallest normal, and refuses 2**-127."""
    scaler = LossScaler("cpu", init_scale=1.0, mode="static")
    scaler.update(new_scale=2.0**-126)
    assert scaler.get_scale() == 2.0**-126
    with pytest.raises(
        ValueError, match=r"new_scale must be a finite number >= 2\*\*-126 and <= 3\.4028234663852886e\+38"
    ):
        scaler.update(new_scale=2.0**-127)
    with pytest.raises(ValueError, match=r"init_scale must be a finite number >= 2\*\*-126"):
        LossScaler("cpu", init_scale=2.0**-127, mode="static")


def test_check_mode_scales_nothing_and_skips_non_finite(model_and_optimizer):
    """Check mode (bf16/fp32) leaves the loss as it is but still refuses to step on inf gradients."""
    model, optimizer = model_and_optimizer
    scaler = LossScaler("cpu", mode="check")
    loss = torch.tensor(3.0)
    assert scaler.scale(loss) is loss and scaler.get_scale() == 1.0
    before = model.weight.detach().clone()
    _step(scaler, model, optimizer, overflow=True)
    assert torch.equal(model.weight, before) and scaler.skipped_steps == 1


def test_state_dict_round_trip_continues_exactly(model_and_optimizer):
    """A restored scaler has the same scale, trackers and counters, and keeps torch's five keys."""
    model, optimizer = model_and_optimizer
    scaler = LossScaler("cpu", init_scale=256.0, hysteresis=3, growth_interval=5)
    for overflow in (False, True, False, False):
        _step(scaler, model, optimizer, overflow)
    state = scaler.state_dict()
    assert {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"} <= set(state)
    restored = LossScaler("cpu", init_scale=256.0, hysteresis=3, growth_interval=5)
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    assert restored.hysteresis_tracker == 2 and restored._get_growth_tracker() == 2
    assert restored.stats() == scaler.stats()


def test_loads_torch_grad_scaler_state(model_and_optimizer):
    """torch's own five-key GradScaler state (Lightning's plugin writes it) loads, counters starting at zero."""
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=4096.0)
    scaler = LossScaler("cpu")
    scaler.load_state_dict(torch_scaler.state_dict())
    assert scaler.get_scale() == 4096.0 and scaler.skipped_steps == 0


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"backoff_factor": 0.0}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"hysteresis": 0}, "hysteresis"),
        ({"init_scale": 0.0}, "init_scale"),
        ({"init_scale": math.inf}, "init_scale"),
        ({"min_scale": 8.0, "max_scale": 4.0, "init_scale": 4.0}, "min_scale"),
        ({"init_scale": 2.0**30}, "init_scale"),
        ({"on_min_scale": "ignore"}, "on_min_scale"),
        ({"mode": "auto"}, "mode"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, argument):
    """Each invalid setting raises ValueError naming the argument and the value."""
    with pytest.raises(ValueError, match=argument) as caught:
        LossScaler("cpu", **kwargs)
    assert repr(next(iter(kwargs.values()))) in str(caught.value) or argument == "min_scale"


# ------------------------------------------------------------------------------------------------ issue 9 faults


def _two_optimizer_iteration(scaler, models, optimizers, overflow_in=()):
    """One iteration of two models and two optimizers, an inf planted in the models listed, one update."""
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=True)
    loss = sum(m(torch.ones(2, 4)).float().pow(2).mean() for m in models)
    scaler.scale(loss).backward()
    for index in overflow_in:
        models[index].weight.grad[0, 0] = float("inf")
    for optimizer in optimizers:
        scaler.step(optimizer)
    scaler.update()


@pytest.mark.parametrize(
    ("build", "argument"),
    [
        (lambda: LossScaler("cpu", init_scale=0.0), "init_scale"),
        (lambda: LossScaler("cpu", init_scale=-4.0), "init_scale"),
        (lambda: LossScaler("cpu", init_scale=1e-39), "init_scale"),
        (lambda: LossScaler("cpu", init_scale=2.0**-30), "init_scale"),
        (lambda: LossScaler("cpu", mode="static", init_scale=1e39), "init_scale"),
        (lambda: LossScaler("cpu", mode="static", init_scale=0.0), "init_scale"),
        (lambda: LossScaler("cpu", max_scale=1e39), "max_scale"),
        (lambda: LossScaler("cpu").update(new_scale=0.0), "new_scale"),
        (lambda: LossScaler("cpu").update(new_scale=-1.0), "new_scale"),
        (lambda: LossScaler("cpu").update(new_scale=math.nan), "new_scale"),
        (lambda: LossScaler("cpu").update(new_scale=math.inf), "new_scale"),
        (lambda: LossScaler("cpu").update(new_scale=torch.tensor(1e-39)), "new_scale"),
    ],
)
def test_no_entry_point_accepts_a_scale_whose_inverse_is_not_finite(build, argument):
    """Scales of 0, below 0, below 2**-24, inf or NaN are refused with a ValueError naming the argument (defect 2)."""
    with pytest.raises(ValueError, match=argument):
        build()


@pytest.mark.parametrize("saved", [1e-39, 1e39])
def test_checkpoint_scales_outside_the_range_are_clamped_with_a_warning(saved):
    """A checkpoint's (or torch's five-key dict's) positive scale out of range is clamped; the warning names both."""
    scaler = LossScaler("cpu", max_scale=2.0**20)
    state = {**torch.amp.GradScaler("cpu").state_dict(), "scale": saved}
    with pytest.warns(UserWarning, match=r"'scale' holds .* clamped to"):
        scaler.load_state_dict(state)
    assert 2.0**-24 <= scaler.get_scale() <= 2.0**20
    assert math.isfinite(1.0 / scaler.scale(torch.ones(())).item())


@pytest.mark.parametrize("saved", [math.nan, math.inf, 0.0, -8.0, "abc", None])
def test_a_non_finite_or_malformed_checkpoint_scale_is_refused_naming_the_key(saved):
    """A NaN/inf/zero/negative/non-number scale, which no training makes, is refused naming the key and the value."""
    with pytest.raises(ValueError, match=r"key 'scale' holds"):
        LossScaler("cpu").load_state_dict({"scale": saved})


def test_a_huge_growth_factor_still_grows_to_max_scale(model_and_optimizer):
    """growth_factor=1e300 overflows float32 but the scale grows to max_scale, on host and device rules alike."""
    model, optimizer = model_and_optimizer
    scaler = LossScaler("cpu", init_scale=4.0, growth_factor=1e300, growth_interval=1, max_scale=2.0**20)
    _step(scaler, model, optimizer, overflow=False)
    assert scaler.get_scale() == 2.0**20


def test_every_optimizer_of_an_iteration_sees_one_scale_and_growth_counts_iterations():
    """Two optimizers, one update per iteration: growth_interval counts iterations, a backoff halves once (defect 3)."""
    torch.manual_seed(0)
    models = [nn.Linear(4, 2), nn.Linear(4, 2)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.01) for m in models]
    scaler = LossScaler("cpu", init_scale=64.0, growth_interval=2)
    _two_optimizer_iteration(scaler, models, optimizers)
    assert scaler.get_scale() == 64.0
    _two_optimizer_iteration(scaler, models, optimizers)
    assert scaler.get_scale() == 128.0
    _two_optimizer_iteration(scaler, models, optimizers, overflow_in=(0,))
    assert scaler.get_scale() == 64.0
    assert scaler.stats().optimizer_steps == 6 and scaler.stats().skipped_steps == 1


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_one_broken_optimizer_beside_a_clean_one_stops_the_run_naming_it(fused):
    """max_consecutive_skips counts per optimizer: one always-inf optimizer stops the run, and is named (defect 4)."""
    torch.manual_seed(0)
    models = [nn.Linear(4, 2), nn.Linear(4, 2)]
    optimizers = [
        torch.optim.SGD(models[0].parameters(), lr=0.01),
        torch.optim.Adam(models[1].parameters(), fused=fused),
    ]
    scaler = LossScaler("cpu", mode="check", max_consecutive_skips=3)
    scaler.param_names = {id(p): f"second.{n}" for n, p in models[1].named_parameters()}
    with pytest.raises(NonFiniteStepsError, match=r"optimizer 1 \(Adam\).*second\.weight") as caught:
        for _ in range(5):
            _two_optimizer_iteration(scaler, models, optimizers, overflow_in=(1,))
    assert caught.value.consecutive_skips == 3 and caught.value.optimizer == "optimizer 1 (Adam)"


def test_resume_fits_the_trackers_and_counters_to_this_runs_settings():
    """Saved trackers beyond a smaller growth_interval/hysteresis, and long streaks, are clamped with a warning."""
    saved = LossScaler("cpu", growth_interval=100, hysteresis=4).state_dict()
    saved.update(_growth_tracker=50, hysteresis_tracker=4, streaks=[10**6])
    saved["counters"].update(optimizer_steps=10**6, skipped_steps=10**6, consecutive_skips=10**6)
    scaler = LossScaler("cpu", growth_interval=10, hysteresis=2, max_consecutive_skips=100)
    with pytest.warns(UserWarning, match="clamped"):
        scaler.load_state_dict(saved)
    assert scaler._get_growth_tracker() == 9 and scaler.hysteresis_tracker == 2
    assert scaler.consecutive_skips == 99


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"_growth_tracker": -3}, "_growth_tracker"),
        ({"_growth_tracker": "abc"}, "_growth_tracker"),
        ({"hysteresis_tracker": 1.5}, "hysteresis_tracker"),
        ({"counters": None}, "counters"),
        ({"counters": {"skipped_steps": -1}}, "skipped_steps"),
        ({"counters": {"optimizer_steps": 1, "skipped_steps": 5}}, "inconsistent"),
        ({"last_step_skipped": "no"}, "last_step_skipped"),
    ],
)
def test_malformed_checkpoint_fields_name_the_key_and_value(change, key):
    """Each malformed field raises a ValueError naming the key, the value and what was expected (defect 7)."""
    state = {**LossScaler("cpu").state_dict(), **change}
    with pytest.raises(ValueError, match=key):
        LossScaler("cpu").load_state_dict(state)


def test_default_device_works_without_cuda_and_bad_devices_are_refused():
    """LossScaler() picks an available device; an unknown or unavailable device is a ValueError (defect 10)."""
    scaler = LossScaler()
    assert scaler.get_scale() == 2.0**16
    assert scaler._device == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="device='tpu9'"):
        LossScaler(device="tpu9")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="not available"):
            LossScaler(device="cuda")


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"consecutive_hysteresis": "no"}, "consecutive_hysteresis"),
        ({"consecutive_hysteresis": 1}, "consecutive_hysteresis"),
        ({"growth_interval": 10**400}, "growth_interval"),
        ({"init_scale": 10**400}, "init_scale"),
        ({"growth_factor": 10**400}, "growth_factor"),
        ({"growth_interval": torch.tensor(2.0)}, "growth_interval"),
        ({"growth_factor": np.bool_(True)}, "growth_factor"),
    ],
)
def test_bad_booleans_huge_integers_and_wrong_kinds_are_value_errors(kwargs, argument):
    """Booleans must be bools; ints beyond float range are ValueErrors, not OverflowErrors (defect 12)."""
    with pytest.raises(ValueError, match=argument):
        LossScaler("cpu", **kwargs)


def test_numpy_scalars_and_zero_d_tensors_of_the_right_kind_are_accepted():
    """numpy scalars and 0-d tensors are accepted and stored as Python numbers (defect 12)."""
    scaler = LossScaler(
        "cpu",
        init_scale=np.float32(1024.0),
        growth_factor=torch.tensor(2.0),
        growth_interval=np.int64(3),
        hysteresis=torch.tensor(2),
        consecutive_hysteresis=np.bool_(True),
    )
    assert scaler.get_scale() == 1024.0 and scaler.settings.growth_interval == 3
    assert type(scaler.settings.growth_factor) is float and type(scaler.settings.hysteresis) is int


def test_settings_are_one_validated_object_shared_by_the_plugin_and_the_scaler():
    """MixedPrecision builds its scaler from the same ScalerSettings it validated (defect 14)."""
    plugin = MixedPrecision("16-mixed", growth_interval=7, hysteresis=3)
    plugin.setup_for_device("cpu")
    scaler = plugin.scaler
    assert scaler is not None and scaler.settings.growth_interval == 7 and scaler.settings.hysteresis == 3
    rules = ScalerSettings(growth_interval=7, hysteresis=3)
    assert LossScaler.from_settings(rules, "cpu").settings is rules


def test_a_scaler_pickles_after_training_and_continues_exactly(model_and_optimizer):
    """A pickled scaler (as ddp_spawn does) keeps its scale, trackers and counters, and can keep training."""
    model, optimizer = model_and_optimizer
    scaler = LossScaler("cpu", init_scale=256.0, growth_interval=2, hysteresis=2)
    for overflow in (False, True, False):
        _step(scaler, model, optimizer, overflow)
    restored = pickle.loads(pickle.dumps(scaler))
    assert restored.state_dict() == scaler.state_dict()
    _step(restored, model, optimizer, overflow=False)
    assert restored.get_scale() == 512.0 and restored.stats().optimizer_steps == 4


def _check_mode_backward(model: nn.Linear, overflow: bool) -> None:
    model.zero_grad(set_to_none=True)
    model(torch.ones(2, 4)).pow(2).mean().backward()
    if overflow:
        model.weight.grad[0, 0] = float("nan")


def test_check_mode_with_a_host_decided_step_keeps_no_flag_between_iterations(model_and_optimizer):
    """Check mode with an optimizer that has no fused form reads the gradient norms at the step and keeps no flag."""
    from lightning_mp.bench.counting import count_syncs_and_ops

    model, _ = model_and_optimizer
    optimizer = torch.optim.RMSprop(model.parameters(), lr=0.01)
    scaler = LossScaler("cpu", mode="check")
    for overflow in (False, True, False):
        before = model.weight.detach().clone()
        _check_mode_backward(model, overflow)
        with count_syncs_and_ops() as counts:
            scaler.unscale_(optimizer)
            found = scaler.found_inf(optimizer)  # asked before the step (clipping): read once, reused by the step
            scaler.step(optimizer)
        scaler.update()
        assert counts.syncs == 1 and found is overflow
        assert torch.equal(model.weight, before) is overflow
        assert len(scaler.steps.flags) == 0  # nothing on the device outlives the iteration
    assert scaler.skipped_steps == 1 and scaler.optimizer_steps == 3


def test_check_mode_unscale_then_update_without_a_step_is_a_recorded_check(model_and_optimizer):
    """unscale_ alone records a check (update accepts it, as torch's does) and its verdict is known before update."""
    model, _ = model_and_optimizer
    optimizer = torch.optim.RMSprop(model.parameters(), lr=0.01)  # no fused form: the verdict is read on the host
    scaler = LossScaler("cpu", mode="check", max_consecutive_skips=None)
    _check_mode_backward(model, overflow=True)
    scaler.unscale_(optimizer)
    assert scaler.step_verdict(optimizer) is True and scaler.found_inf(optimizer)
    scaler.update()  # torch raises "No inf checks were recorded" when unscale_ recorded nothing
    assert scaler.optimizer_steps == 0 and scaler.skipped_steps == 0
    assert scaler.step_verdict(optimizer) is None  # a new iteration knows nothing yet


def test_sparse_gradients_with_repeated_rows_unscale_to_the_true_gradient() -> None:
    """A sparse embedding gradient with a row looked up twice unscales to the gradient of the unscaled loss."""
    torch.manual_seed(0)
    embedding = nn.Embedding(4, 3, sparse=True)
    optimizer = torch.optim.SGD(embedding.parameters(), lr=0.1)
    scaler = LossScaler("cpu", init_scale=8.0)
    rows = torch.tensor([1, 1, 2])
    embedding(rows).pow(2).sum().backward()
    expected = embedding.weight.grad.to_dense().clone()
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(embedding(rows).pow(2).sum()).backward()
    scaler.unscale_(optimizer)
    assert torch.equal(embedding.weight.grad.to_dense(), expected)
    before = embedding.weight.detach().clone()
    scaler.step(optimizer)
    scaler.update()
    assert scaler.skipped_steps == 0
    torch.testing.assert_close(embedding.weight.detach(), before - 0.1 * expected)


def test_a_sparse_gradient_whose_repeated_rows_sum_to_inf_skips_the_step() -> None:
    """In check mode a step is skipped when a row looked up twice sums to inf, though each lookup's part is finite:
    the optimizer would add that inf to the weights."""
    embedding = nn.Embedding(4, 3, sparse=True)
    optimizer = torch.optim.SGD(embedding.parameters(), lr=0.1)
    scaler = LossScaler("cpu", mode="check")
    huge = torch.finfo(torch.float32).max
    embedding(torch.tensor([1, 1, 2])).mul(torch.tensor([[huge], [huge], [0.0]])).sum().backward()
    assert not embedding.weight.grad.is_coalesced() and not embedding.weight.grad.to_dense().isfinite().all()
    before = embedding.weight.detach().clone()
    scaler.step(optimizer)
    scaler.update()
    assert scaler.skipped_steps == 1 and torch.equal(embedding.weight, before)


@pytest.mark.parametrize("scaler_class", [torch.amp.GradScaler, LossScaler])
def test_a_scaled_step_of_an_optimizer_without_gradients_raises_as_torchs_does(scaler_class: type) -> None:
    """``step`` of an optimizer whose parameters got no gradient (a backward that never reached them) raises torch's
    "No inf checks were recorded for this optimizer." with either scaler, instead of stepping unchecked."""
    model, other = nn.Linear(4, 2), nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = scaler_class("cpu", init_scale=2.0**8)
    scaler.scale(other(torch.ones(1, 4)).sum()).backward()  # the backward reaches another model only
    with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer"):
        scaler.step(optimizer)


def test_a_check_only_step_without_gradients_steps_as_an_unscaled_run_does() -> None:
    """In check mode (bf16, fp32: nothing scaled, as torch's disabled GradScaler) such a step is taken, unchecked."""
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler("cpu", mode="check")
    scaler.step(optimizer)
    scaler.update()
    assert (scaler.optimizer_steps, scaler.skipped_steps) == (1, 0)
