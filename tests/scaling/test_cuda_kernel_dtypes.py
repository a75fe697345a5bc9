"""A CPU guard for CUDA-only dtype refusals: the package hands torch's CUDA-restricted kernels only dtypes CUDA takes.

torch's CPU kernels are laxer than its CUDA ones: the CPU's ``_amp_foreach_non_finite_check_and_unscale_`` accepts
bf16, CUDA's raises ``NotImplementedError``. A bug of that kind passes every CPU test and crashes the first step on a
GPU. :class:`CudaDtypeGuard` watches the real CPU kernels run (a ``TorchDispatchMode`` sees every aten call with its
arguments) and records each argument whose dtype the CUDA kernel would refuse, per :data:`CUDA_ACCEPTS`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_mp import LossScaler
from tests.cuda.matrix import (
    FRONT_ENDS,
    OPTIMIZERS,
    PRECISION_LEVELS,
    assert_trained_and_skipped,
    train,
)

pytestmark = pytest.mark.filterwarnings("ignore:.*opt_level='O3'", "ignore:lightning_mp:UserWarning")

_HALF_FLOAT_DOUBLE = frozenset({torch.float16, torch.float32, torch.float64})
_OPTIMIZER_DTYPES = _HALF_FLOAT_DOUBLE | {torch.bfloat16}
_FLOAT32 = frozenset({torch.float32})
_FUSED_OPTIMIZER_RULES: dict[int | str, frozenset[torch.dtype]] = {
    0: _OPTIMIZER_DTYPES,
    1: _OPTIMIZER_DTYPES,
    "grad_scale": _FLOAT32,
    "found_inf": _FLOAT32,
}
CUDA_ACCEPTS: dict[Any, dict[int | str, frozenset[torch.dtype]]] = {
    # aten/src/ATen/native/cuda/AmpKernels.cu: the tensors dispatch on AT_DISPATCH_FLOATING_TYPES_AND_HALF (no bf16);
    # TORCH_CHECKs require a float found_inf and a float inv_scale.
    torch.ops.aten._amp_foreach_non_finite_check_and_unscale_: {0: _HALF_FLOAT_DOUBLE, 1: _FLOAT32, 2: _FLOAT32},
    # The same file: the scale and found_inf must be float, the growth tracker int.
    torch.ops.aten._amp_update_scale_: {0: _FLOAT32, 1: frozenset({torch.int32}), 2: _FLOAT32},
    # aten/src/ATen/native/cuda/fused_adam*_impl.cu and FusedSgdKernel.cu: params and grads dispatch on floating types,
    # half and bf16; grad_scale and found_inf are read through data_ptr<float>(), so they must be float32.
    # (Fused Adagrad has a CPU kernel only; its arguments follow the same rule there.)
    torch.ops.aten._fused_adam_: _FUSED_OPTIMIZER_RULES,
    torch.ops.aten._fused_adamw_: _FUSED_OPTIMIZER_RULES,
    torch.ops.aten._fused_sgd_: _FUSED_OPTIMIZER_RULES,
    torch.ops.aten._fused_adagrad_: _FUSED_OPTIMIZER_RULES,
}
"""Per CUDA-restricted op: argument (position, or keyword name) -> the dtypes CUDA's kernel accepts there."""


class CudaDtypeGuard(TorchDispatchMode):
    """Record every argument of a :data:`CUDA_ACCEPTS` op whose dtype or device CUDA's kernel would refuse.

    The real kernel runs afterwards, so a run under the guard trains exactly as without it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.refusals: list[str] = []
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        rules = CUDA_ACCEPTS.get(func.overloadpacket)
        if rules is not None:
            self.calls[func.overloadpacket.__name__] += 1
            self._inspect(func.overloadpacket.__name__, rules, args, kwargs)
        return func(*args, **kwargs)

    def _inspect(
        self, name: str, rules: dict[int | str, frozenset[torch.dtype]], args: tuple[Any, ...], kwargs: Any
    ) -> None:
        first = args[0][0] if isinstance(args[0], list | tuple) else args[0]
        for key, accepted in rules.items():
            value = args[key] if isinstance(key, int) and key < len(args) else kwargs.get(key)
            for tensor in value if isinstance(value, list | tuple) else [value]:
                if not isinstance(tensor, torch.Tensor):
                    continue
                if tensor.dtype not in accepted:
                    self.refusals.append(
                        f"{name} argument {key}: {tensor.dtype} (CUDA takes {sorted(map(str, accepted))})"
                    )
                elif tensor.device != first.device:
                    self.refusals.append(f"{name} argument {key}: on {tensor.device}, the tensors on {first.device}")


def test_the_guard_flags_what_cuda_refuses() -> None:
    """The guard records a bf16 tensor handed to the unscale kernel (what CUDA refuses) and lets the CPU kernel run."""
    found_inf = torch.zeros(())
    with CudaDtypeGuard() as guard:
        torch._amp_foreach_non_finite_check_and_unscale_(
            [torch.ones(2, dtype=torch.bfloat16)], found_inf, torch.ones(())
        )
    assert guard.calls == {"_amp_foreach_non_finite_check_and_unscale_": 1}
    assert guard.refusals == [
        "_amp_foreach_non_finite_check_and_unscale_ argument 0: torch.bfloat16"
        " (CUDA takes ['torch.float16', 'torch.float32', 'torch.float64'])"
    ]


_FAST = {
    ("bf16-mixed", "O3", "fused-adamw"),
    ("bf16-mixed", "lean", "fused-adamw"),
    ("bf16-mixed", "lean", "foreach-adamw"),
    ("16-mixed", "O1", "fused-adamw"),
}
"""The fast loop's cases: the three that crashed on CUDA, and fp16's scaled fused step."""


@pytest.mark.parametrize("front_end", FRONT_ENDS)
@pytest.mark.parametrize(
    ("precision", "opt_level", "optimizer"),
    [
        pytest.param(*case, marks=[] if case in _FAST else [pytest.mark.slow])
        for case in ((p, level, o) for p, level in PRECISION_LEVELS for o in OPTIMIZERS)
    ],
)
def test_every_mode_calls_cuda_kernels_with_dtypes_cuda_accepts(
    front_end: str, precision: str, opt_level: str, optimizer: str
) -> None:
    """Every mode trains on the CPU handing the amp and fused-optimizer kernels only dtypes their CUDA versions take."""
    with CudaDtypeGuard() as guard:
        network, plugin = train(front_end, "cpu", precision, opt_level, optimizer)
    assert guard.refusals == []
    assert_trained_and_skipped(network, plugin)
    if optimizer == "fused-adamw":
        assert guard.calls["_fused_adamw_"] >= 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
@pytest.mark.parametrize("mode", ["dynamic", "check"])
def test_scaler_checks_bf16_and_float64_gradients_with_dtypes_cuda_accepts(mode: str, dtype: torch.dtype) -> None:
    """A LossScaler used by hand on bf16 or fp64 gradients unscales them and skips an inf step, in dtypes CUDA takes."""
    weight = torch.nn.Parameter(torch.ones(4, dtype=dtype))
    bias = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight, bias], lr=1.0, foreach=True)
    scaler = LossScaler("cpu", init_scale=4.0, mode=mode)  # type: ignore[arg-type]
    unscaled: list[torch.Tensor] = []
    with CudaDtypeGuard() as guard:
        for planted in (False, True):
            optimizer.zero_grad()
            scaler.scale(weight.float().sum() * 2 + bias.sum()).backward()
            if planted:
                bias.grad[0] = float("inf")
            scaler.unscale_(optimizer)
            unscaled.append(weight.grad.clone())
            scaler.step(optimizer)
            scaler.update()
    assert guard.refusals == []
    assert guard.calls["_amp_foreach_non_finite_check_and_unscale_"] >= 1
    assert torch.equal(unscaled[0], torch.full((4,), 2.0, dtype=dtype))
    assert torch.equal(weight.detach(), torch.full((4,), -1.0, dtype=dtype))
    assert (scaler.optimizer_steps, scaler.skipped_steps) == (2, 1)
