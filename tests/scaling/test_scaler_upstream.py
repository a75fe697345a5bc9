"""torch's own GradScaler tests (``test/test_torch.py``, ``test/test_cuda.py``: ``test_grad_scaling_*``), on LossScaler.

torch tests its scaler in two ways, and so do these adaptations:

* **Against an unscaled control.** Two copies of a small model train on the same data, one in plain fp32 and one
  through the scaler, and an inf is planted in one gradient at iteration :data:`SKIP_ITER`. The control simply does
  not step there. The scaled copy must end with the control's weights, gradients and optimizer states. Its scale
  must have grown once per clean iteration and backed off once per overflow (``growth_interval=1``).
  torch runs each case twice, with the scaler enabled and disabled. LossScaler has no ``enabled=False``. Its closest
  form is ``mode="check"`` (bf16, fp32): it scales nothing, keeps the scale at 1, and still skips a step whose
  gradients are not finite. So both modes are run here, and the control skips the same step in both.
* **Side by side with torch's scaler** (``test_scaler_upstream_side_by_side.py``). The same scenario runs once with
  ``torch.amp.GradScaler("cpu")`` and once with ``LossScaler("cpu")`` at torch's settings. Both must give the same
  scales and the same weights.

Every test names the upstream test it adapts. ``tests/upstream_inventory/`` lists each upstream test as adapted,
skipped, or deliberately different, with the reason for each.
"""

from __future__ import annotations

import copy
import math
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from lightning_mp import LossScaler
from lightning_mp.scaling.rules import FLOAT32_MAX

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")

SETTINGS = {"init_scale": 128.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2}
ITERATIONS = 6
OVERFLOW_AT = (2,)
SKIP_ITER = 2
"""The iteration of torch's scaling cases whose gradient gets an inf (torch's ``skip_iter``)."""
MODES = ("dynamic", "check")
"""LossScaler's two forms of torch's ``enabled=True`` and ``enabled=False``."""

Run = Callable[..., Any]


# ------------------------------------------------------------------------------------------------ torch's case


def _scaling_case(
    optimizer_ctor: Callable[..., torch.optim.Optimizer] = torch.optim.SGD, **optimizer_kwargs: Any
) -> tuple[nn.Sequential, nn.Sequential, torch.optim.Optimizer, torch.optim.Optimizer, list[Any]]:
    """Two identical two-layer models with their optimizers (lr 1), and four batches: torch's scaling case."""
    torch.manual_seed(0)
    control = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    scaled = copy.deepcopy(control)
    options = {"lr": 1.0, **optimizer_kwargs}
    data = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(4)]
    return (
        control,
        scaled,
        optimizer_ctor(control.parameters(), **options),
        optimizer_ctor(scaled.parameters(), **options),
        data,
    )


def _case_scaler(mode: str) -> LossScaler:
    # torch's case: a modest initial scale and a growth every clean iteration, so that growth errors show.
    return LossScaler("cpu", init_scale=128.0, growth_factor=2.0, growth_interval=1, mode=mode)


def _plant_inf_at_skip_iter(model: nn.Sequential, iteration: int) -> None:
    if iteration == SKIP_ITER:
        with torch.no_grad():
            model[1].weight.grad.fill_(math.inf)


def _assert_like_control(
    control: nn.Module,
    scaled: nn.Module,
    opt_control: torch.optim.Optimizer,
    opt_scaled: torch.optim.Optimizer,
    atol: float,
    rtol: float = 1e-5,
) -> None:
    for c, s in zip(control.parameters(), scaled.parameters(), strict=True):
        torch.testing.assert_close(s.grad, c.grad, atol=atol, rtol=rtol)
        for key, value in opt_control.state[c].items():
            torch.testing.assert_close(opt_scaled.state[s][key], value, atol=atol, rtol=rtol, msg=key)
        torch.testing.assert_close(s, c, atol=atol, rtol=rtol)


def _run_scaling_case(
    run: Run,
    unskipped: int,
    skipped: int,
    atol: float = 1e-6,
    optimizer_ctor: Callable[..., torch.optim.Optimizer] = torch.optim.SGD,
    **optimizer_kwargs: Any,
) -> None:
    """torch's ``_run_scaling_case``: the scaled run ends like the control, its scale moved by the counts given."""
    for mode in MODES:
        control, scaled, opt_control, opt_scaled, data = _scaling_case(optimizer_ctor, **optimizer_kwargs)
        scaler = _case_scaler(mode)
        run(data, control, opt_control, None)
        scaler = run(data, scaled, opt_scaled, scaler) or scaler
        expected_scale = 128.0 * 2.0**unskipped * 0.5**skipped if mode == "dynamic" else 1.0
        assert scaler.get_scale() == expected_scale, mode
        _assert_like_control(control, scaled, opt_control, opt_scaled, atol)


def _autocast_run(try_pickle: bool) -> Run:
    def run(data: list[Any], model: nn.Sequential, optimizer: torch.optim.Optimizer, scaler: Any) -> Any:
        for i, (x, target) in enumerate(data):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=scaler is not None):
                loss = nn.functional.mse_loss(model(x), target)
            if scaler is None:
                loss.backward()
                if i != SKIP_ITER:
                    optimizer.step()
                continue
            scaler.scale(loss).backward()
            _plant_inf_at_skip_iter(model, i)
            scaler.step(optimizer)
            scaler.update()
            if try_pickle:
                scaler = pickle.loads(pickle.dumps(scaler))
        return scaler

    return run


@pytest.mark.parametrize("try_pickle", [False, True], ids=["kept", "pickled-every-iteration"])
@pytest.mark.parametrize("form", [{}, {"foreach": True}], ids=["default", "foreach"])
def test_autocast_training_matches_fp32_training_within_fp16_rounding(form, try_pickle):
    """fp16 autocast with scaling trains SGD like fp32 without (to 1e-3), also when the scaler is pickled each time.

    Upstream: test/test_torch.py test_grad_scaling_autocast (SGD, in its default and foreach forms).
    """
    _run_scaling_case(_autocast_run(try_pickle), unskipped=3, skipped=1, atol=1e-3, **form)


def test_clipping_the_scaled_gradients_by_a_scaled_norm_matches_clipping_true_ones():
    """Clipping scaled gradients at max_norm * scale trains like clipping fp32 gradients at max_norm.

    Upstream: test/test_torch.py test_grad_scaling_clipping.
    """
    max_norm = 0.2

    def run(data: list[Any], model: nn.Sequential, optimizer: torch.optim.Optimizer, scaler: Any) -> None:
        for i, (x, target) in enumerate(data):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), target)
            if scaler is None:
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if i != SKIP_ITER:
                    optimizer.step()
                continue
            scaler.scale(loss).backward()
            nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
            _plant_inf_at_skip_iter(model, i)
            scaler.step(optimizer)
            scaler.update()

    _run_scaling_case(run, unskipped=3, skipped=1, atol=1e-5)


def test_unscale_then_clip_matches_clipping_fp32_gradients():
    """unscale_, clip_grad_norm_ on the true gradients, step: trains like fp32 clipping; the inf step is skipped.

    Upstream: test/test_torch.py test_grad_scaling_clipping_separate_unscale.
    """
    max_norm = 0.2

    def run(data: list[Any], model: nn.Sequential, optimizer: torch.optim.Optimizer, scaler: Any) -> None:
        for i, (x, target) in enumerate(data):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), target)
            if scaler is None:
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if i != SKIP_ITER:
                    optimizer.step()
                continue
            scaler.scale(loss).backward()
            _plant_inf_at_skip_iter(model, i)
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=False)
            scaler.step(optimizer)
            scaler.update()

    _run_scaling_case(run, unskipped=3, skipped=1)


def test_gradient_penalty_from_scaled_autograd_grad_matches_fp32():
    """A gradient-norm penalty built from autograd.grad of the scaled loss, unscaled by hand, trains like fp32's.

    Upstream: test/test_torch.py test_grad_scaling_penalty.
    """

    def run(data: list[Any], model: nn.Sequential, optimizer: torch.optim.Optimizer, scaler: Any) -> None:
        for i, (x, target) in enumerate(data):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), target)
            if scaler is None:
                grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
            else:
                scaled_grads = torch.autograd.grad(scaler.scale(loss), list(model.parameters()), create_graph=True)
                grads = tuple(g * (1.0 / scaler.get_scale()) for g in scaled_grads)
            loss = loss + torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
            if scaler is None:
                loss.backward()
                if i != SKIP_ITER:
                    optimizer.step()
                continue
            scaler.scale(loss).backward()
            _plant_inf_at_skip_iter(model, i)
            scaler.step(optimizer)
            scaler.update()

    _run_scaling_case(run, unskipped=3, skipped=1)


def test_accumulating_two_scaled_backwards_per_step_matches_fp32():
    """Two scaled backwards per step, one step and one update: trains like fp32 and grows the scale twice.

    Upstream: test/test_torch.py test_grad_scaling_accumulation.
    """

    def run(data: list[Any], model: nn.Sequential, optimizer: torch.optim.Optimizer, scaler: Any) -> None:
        for i, (x, target) in enumerate(data):
            loss = nn.functional.mse_loss(model(x), target) / 2
            (loss if scaler is None else scaler.scale(loss)).backward()
            if (i + 1) % 2 == 0:
                if scaler is None:
                    optimizer.step()
                else:
                    scaler.step(optimizer)
                    scaler.update()
                optimizer.zero_grad()

    _run_scaling_case(run, unskipped=2, skipped=0)


@pytest.mark.parametrize("mode", MODES)
def test_two_models_two_losses_two_optimizers_match_fp32(mode):
    """Two models mixed into two losses, one unscaled early: both train like fp32; an inf in one skips only it.

    Upstream: test/test_torch.py test_grad_scaling_multiple.
    """
    control0, scaled0, opt_control0, opt_scaled0, data = _scaling_case()
    control1, scaled1, opt_control1, opt_scaled1, _ = _scaling_case()
    with torch.no_grad():  # a second pair of models with other weights than the first pair
        for c, s in zip(control1.parameters(), scaled1.parameters(), strict=True):
            c.mul_(0.5)
            s.copy_(c)
    scaler = _case_scaler(mode)

    def run(models: tuple[nn.Sequential, nn.Sequential], optimizers: tuple[Any, Any], scaling: bool) -> None:
        for i, (x, target) in enumerate(data):
            for optimizer in optimizers:
                optimizer.zero_grad()
            out0, out1 = models[0](x), models[1](x)
            loss0 = nn.functional.mse_loss(0.3 * out0 + 0.7 * out1, target)
            loss1 = nn.functional.mse_loss(0.6 * out0 - 0.4 * out1, target)
            if not scaling:
                loss0.backward(retain_graph=True)
                loss1.backward()
                optimizers[0].step()
                if i != SKIP_ITER:
                    optimizers[1].step()
                continue
            scaler.scale(loss0).backward(retain_graph=True)
            scaler.scale(loss1).backward()
            _plant_inf_at_skip_iter(models[1], i)
            scaler.unscale_(optimizers[0])  # torch's extra stress: one optimizer unscaled on its own
            scaler.step(optimizers[0])
            scaler.step(optimizers[1])
            scaler.update()

    run((control0, control1), (opt_control0, opt_control1), scaling=False)
    run((scaled0, scaled1), (opt_scaled0, opt_scaled1), scaling=True)
    assert scaler.get_scale() == (128.0 * 2.0**3 * 0.5 if mode == "dynamic" else 1.0)
    _assert_like_control(control0, scaled0, opt_control0, opt_scaled0, atol=1e-6)
    _assert_like_control(control1, scaled1, opt_control1, opt_scaled1, atol=1e-6)


# ------------------------------------------------------------------------------------------------ single calls


def test_update_grows_after_growth_interval_clean_iterations_and_backs_off_on_an_overflow():
    """Scale 4, growth 2 every 2 clean iterations, backoff 0.25: 4, then 8, then 2 after an overflow; tracker reset.

    Upstream: test/test_torch.py test_grad_scaling_update_scale.
    """
    weight = torch.ones(2, requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=0.0)
    scaler = LossScaler("cpu", init_scale=4.0, growth_factor=2.0, backoff_factor=0.25, growth_interval=2)
    seen = []
    for gradient in (1.0, 1.0, math.inf):
        weight.grad = torch.full_like(weight, gradient)
        scaler.step(optimizer)
        scaler.update()
        seen.append((scaler.get_scale(), scaler.state_dict()["_growth_tracker"]))
    assert seen == [(4.0, 1), (8.0, 0), (2.0, 0)]


def _gradient_layouts() -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """torch's gradient layouts: contiguous (one multi-tensor kernel), transposed, and sliced (not dense)."""
    return {
        "contiguous": lambda g: g.clone(),
        "transposed": lambda g: g.clone().t(),
        "sliced": lambda g: g.clone()[:, :5],
    }


@pytest.mark.parametrize("planted", [None, math.inf, math.nan], ids=["finite", "inf", "nan"])
@pytest.mark.parametrize("second", list(_gradient_layouts()))
@pytest.mark.parametrize("first", ["contiguous", "sliced"])
def test_unscale_divides_every_layout_and_finds_an_inf_or_nan_in_any(first, second, planted):
    """Gradients of 4 at scale 4 become 1 in every layout; an inf or NaN in the second one is found.

    Upstream: test/test_torch.py test_grad_scaling_unscale (its mixed-layout cases, through the public unscale_).
    """
    layouts = _gradient_layouts()
    full = torch.full((20, 20), 4.0)
    grads = [layouts[first](full), layouts[second](full)]
    if planted is not None:
        grads[1][2, 2] = planted
    params = [torch.empty_like(g, requires_grad=True) for g in grads]
    for parameter, grad in zip(params, grads, strict=True):
        parameter.grad = grad
    optimizer = torch.optim.SGD(params, lr=1.0)
    scaler = LossScaler("cpu", init_scale=4.0)
    scaler.unscale_(optimizer)
    assert scaler.found_inf(optimizer) is (planted is not None)
    if planted is None:
        for parameter in params:
            torch.testing.assert_close(parameter.grad, torch.ones_like(parameter.grad), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("inject_at", [-1, 0, 1, 2, 3])
def test_unscale_sorts_mixed_dtypes_and_layouts_and_finds_an_inf_in_any(inject_at):
    """fp32 and fp16 gradients, dense and sliced, in one optimizer: all unscaled; an inf in any one is found.

    fp16 gradients are unscaled where the opt level allows them (O3's ``allow_fp16_gradients``), as torch's private
    call does with ``allow_fp16=True``.

    Upstream: test/test_torch.py test_grad_scaling_unscale (its "perfect storm" of dtypes and layouts).
    """
    full = torch.full((20, 20), 4.0)
    grads = [full.clone(), full.clone()[:, :5], full.half(), full.half()[:, :5]]
    if inject_at >= 0:
        grads[inject_at][2, 2] = math.inf
    params = [torch.empty_like(g, requires_grad=True) for g in grads]
    for parameter, grad in zip(params, grads, strict=True):
        parameter.grad = grad
    optimizer = torch.optim.SGD(params, lr=1.0)
    scaler = LossScaler("cpu", init_scale=4.0)
    scaler.allow_fp16_gradients = True
    scaler.unscale_(optimizer)
    assert scaler.found_inf(optimizer) is (inject_at >= 0)
    if inject_at < 0:
        for parameter in params:
            torch.testing.assert_close(parameter.grad, torch.ones_like(parameter.grad), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("make_scaler", [torch.amp.GradScaler, LossScaler], ids=["torch", "ours"])
def test_unscale_refuses_fp16_gradients_by_default(make_scaler):
    """Like torch's public unscale_, LossScaler refuses fp16 gradients unless the opt level allows them.

    Upstream: test/test_torch.py test_grad_scaling_unscale (the public side of its ``allow_fp16`` switch).
    """
    weight = torch.ones(3, dtype=torch.float16, requires_grad=True)
    weight.grad = torch.ones_like(weight)
    scaler = make_scaler("cpu")
    scaler.scale(torch.ones(1))
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(torch.optim.SGD([weight], lr=1.0))


def _sparse(values: list[float], indices: list[list[int]], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.sparse_coo_tensor(torch.tensor(indices), torch.tensor(values), (2, 3), dtype=dtype)


def test_unscale_handles_sparse_gradients_and_finds_an_overflow_of_their_coalesced_sum():
    """Sparse gradients are divided by the scale; inf, NaN, and duplicate fp16 entries whose sum overflows are found.

    Upstream: test/test_torch.py test_grad_scaling_unscale_sparse.
    """
    indices = [[0, 1, 1], [2, 0, 2]]
    gradient = _sparse([16.0, 32.0, 64.0], indices)
    parameter = gradient.clone().requires_grad_()
    optimizer = torch.optim.SGD([parameter], lr=1.0)
    scaler = LossScaler("cpu", init_scale=4.0)

    def unscale(grad: torch.Tensor, opt: torch.optim.Optimizer) -> bool:
        next(p for group in opt.param_groups for p in group["params"]).grad = grad
        scaler.unscale_(opt)
        found = scaler.found_inf(opt)
        scaler.update(new_scale=4.0)  # end the iteration without stepping
        return found

    assert not unscale(gradient.clone(), optimizer)
    torch.testing.assert_close(parameter.grad.to_dense(), (gradient / 4).to_dense())
    assert unscale(_sparse([16.0, 32.0, math.inf], indices), optimizer)
    assert unscale(_sparse([16.0, 32.0, math.nan], indices), optimizer)

    scaler.allow_fp16_gradients = True
    half = gradient.clone().half().requires_grad_()
    half_optimizer = torch.optim.SGD([half], lr=1.0)
    assert not unscale(gradient.clone().half(), half_optimizer)
    torch.testing.assert_close(half.grad.to_dense(), (gradient.half() / 4).to_dense())
    # Uncoalesced, each entry fits fp16; coalesced, 64000 + 64000 does not.
    assert unscale(_sparse([64000.0, 32.0, 64000.0], [[0, 1, 0], [2, 0, 2]], torch.float16), half_optimizer)


def test_scale_multiplies_every_tensor_of_nested_outputs():
    """scale() of a tuple holding tensors, tuples and lists multiplies each tensor and keeps the nesting.

    Upstream: test/test_cuda.py test_grad_scaling_scale (there across two GPUs; here on one device).
    """
    t0, t1 = torch.full((1,), 4.0), torch.full((1,), 4.0)
    outputs = LossScaler("cpu", init_scale=2.0).scale(
        (t1.clone(), (t0.clone(), t1.clone()), [t0.clone(), (t1.clone(), t0.clone())])
    )
    assert isinstance(outputs, tuple) and isinstance(outputs[2], list) and isinstance(outputs[2][1], tuple)
    flat = [outputs[0], *outputs[1], outputs[2][0], *outputs[2][1]]
    assert all(torch.equal(t, torch.full((1,), 8.0)) for t in flat)


@pytest.mark.parametrize("scaled_before", [True, False], ids=["scale-already-on-device", "lazy"])
def test_load_state_dict_takes_the_scale_and_tracker_but_keeps_this_runs_factors(scaled_before):
    """Loading another scaler's state takes its scale and tracker; this run's factors stay, with a warning naming them.

    torch adopts the loaded factors and interval; LossScaler keeps the ones it was built with (the run's own
    configuration wins over a checkpoint's) and says which differ.

    Upstream: test/test_torch.py test_grad_scaling_state_dict.
    """
    source = LossScaler("cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    target = LossScaler("cpu", init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
    if scaled_before:
        target.scale(torch.full((1,), 4.0))
    with pytest.warns(UserWarning, match=r"growth_factor: 4.0 -> 7.0.*backoff_factor: 0.5 -> 0.8.*growth_interval: 2"):
        target.load_state_dict(source.state_dict())
    assert target.get_scale() == 3.0
    assert target.state_dict()["_growth_tracker"] == 0
    assert (target.get_growth_factor(), target.get_backoff_factor(), target.get_growth_interval()) == (7.0, 0.8, 1)
    assert torch.equal(target.scale(torch.ones(1)), torch.full((1,), 3.0))


def test_a_huge_scale_stays_finite_after_growing():
    """A scale grown past float32's range stops at max_scale (here float32's largest): it never becomes inf.

    torch starts at 1e38 freely and keeps 1e38 where growing would overflow; LossScaler refuses an ``init_scale``
    above ``max_scale`` (2**24 by default) and caps growth at ``max_scale``.

    Upstream: test/test_cuda.py test_grad_scale_will_not_overflow.
    """
    with pytest.raises(ValueError, match=r"init_scale.*max_scale"):
        LossScaler("cpu", init_scale=1e38)
    torch.manual_seed(0)
    model = nn.Linear(5, 1)
    optimizer = torch.optim.Adam(model.parameters())
    scaler = LossScaler("cpu", init_scale=1e38, max_scale=FLOAT32_MAX, growth_interval=1, growth_factor=2**4)
    loss = (model(torch.randn(1, 5)) - 1e-30 * torch.randn(1, 1)).pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    assert scaler.skipped_steps == 0
    assert scaler.get_scale() == FLOAT32_MAX  # 1e38 * 16 capped: finite


@pytest.mark.parametrize("separate_unscale", [False, True], ids=["step", "unscale-then-step"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("optimizer_ctor", [torch.optim.Adam, torch.optim.AdamW], ids=["Adam", "AdamW"])
def test_fused_adam_unscaling_inside_its_kernel_matches_the_unfused_one(optimizer_ctor, amsgrad, separate_unscale):
    """Fused Adam/AdamW (unscaling in the kernel, or after unscale_) and the unfused one end with the same state.

    Upstream: test/test_cuda.py test_grad_scaling_autocast_fused_optimizers (on the CPU's fused kernels).
    """
    control, scaled, _, _, data = _scaling_case()
    opt_control = optimizer_ctor(control.parameters(), lr=1.0, amsgrad=amsgrad, fused=False)
    opt_scaled = optimizer_ctor(scaled.parameters(), lr=1.0, amsgrad=amsgrad, fused=True)
    scaler = LossScaler("cpu", init_scale=128.0)
    for x, target in data:
        losses = []
        for model, optimizer, unscale_first in ((control, opt_control, False), (scaled, opt_scaled, separate_unscale)):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x), target)
            scaler.scale(loss).backward()
            if unscale_first:
                scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
            losses.append(loss)
        torch.testing.assert_close(losses[1], losses[0])
        _assert_like_control(control, scaled, opt_control, opt_scaled, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("form", [{"foreach": False}, {"foreach": True}, {"fused": True}], ids=lambda f: next(iter(f)))
@pytest.mark.parametrize("optimizer_ctor", [torch.optim.Adam, torch.optim.AdamW], ids=["Adam", "AdamW"])
def test_gradients_broken_gradients_changed_reach_the_weights_as_in_torch(optimizer_ctor, form):
    """A user who writes inf/NaN into gradients after unscale_ gets NaN weights: the check happened at unscale_.

    The plugin rechecks clipped gradients before its step (``recheck_gradients``); a bare scaler, like torch's, does
    not look again.

    Upstream: test/test_cuda.py test_params_invalidated_with_grads_invalidated_between_unscale_and_step.
    """
    _, model, _, optimizer, data = _scaling_case(optimizer_ctor, **form)
    scaler = LossScaler("cpu", init_scale=128.0)
    for x, target in data:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x), target)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        for j, parameter in enumerate(model.parameters()):
            parameter.grad.copy_(torch.full_like(parameter.grad, math.inf if j % 2 else math.nan))
        scaler.step(optimizer)
        scaler.update()
    assert all(not torch.isfinite(p).all() for p in model.parameters())
