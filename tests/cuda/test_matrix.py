"""Every precision x opt level x optimizer x front end trains with finite weights and skips a planted inf step.

The bodies run on ``"cuda"`` (``pytest -m cuda tests/cuda``) for every case, and on ``"cpu"`` for a few (two eager
ones in the fast loop, some compiled ones marked slow), which keeps the test logic proven where no GPU is present;
``tests/scaling/test_cuda_kernel_dtypes.py`` trains every eager case on the CPU under its dtype guard.
"""

from __future__ import annotations

import pytest

from tests.cuda.matrix import (
    FRONT_ENDS,
    OPTIMIZERS,
    PRECISION_LEVELS,
    assert_trained_and_skipped,
    on_device,
    train,
)

pytestmark = pytest.mark.filterwarnings("ignore:.*opt_level='O3'", "ignore:lightning_mp:UserWarning")

_ON_CPU_FAST = {("bf16-mixed", "lean", "fused-adamw"), ("16-mixed", "O2", "sgd-momentum")}
"""The eager cases the CPU runs, in the fast loop: tests/scaling/test_cuda_kernel_dtypes.py runs every eager one."""
_ON_CPU_COMPILED = {("32-true", "O0"), ("16-mixed", "O2"), ("bf16-mixed", "O3"), ("bf16-mixed", "lean")}
"""The compiled cases the CPU runs (slow); tests/test_compile.py covers O1 and O2's compiled regions in depth."""
COMPILE_BACKEND = {"cuda": "inductor", "cpu": "aot_eager"}
"""torch.compile's default on a GPU; on the CPU dynamo's capture with AOT autograd, without code generation."""


def _cases(compiled: bool) -> list:
    """Every case on CUDA; on the CPU the subset above, so that the bodies are proven without repeating the guard."""
    cases = []
    for precision, opt_level in PRECISION_LEVELS:
        # Compilation changes the forward and backward, not the step: one optimizer covers it.
        for optimizer in OPTIMIZERS[:1] if compiled else OPTIMIZERS:
            for device in ("cpu", "cuda"):
                if device == "cpu" and compiled and (precision, opt_level) not in _ON_CPU_COMPILED:
                    continue
                if device == "cpu" and not compiled and (precision, opt_level, optimizer) not in _ON_CPU_FAST:
                    continue
                device_param = on_device(device, *([pytest.mark.slow] if compiled else []))
                cases.append(
                    pytest.param(device_param.values[0], precision, opt_level, optimizer, marks=device_param.marks)
                )
    return cases


@pytest.mark.parametrize("front_end", FRONT_ENDS)
@pytest.mark.parametrize(("device", "precision", "opt_level", "optimizer"), _cases(compiled=False))
def test_every_mode_trains_and_skips_the_inf_step(
    device: str, precision: str, opt_level: str, optimizer: str, front_end: str
) -> None:
    """Each mode trains on the device with finite weights and skips exactly the step whose gradient holds an inf."""
    network, plugin = train(front_end, device, precision, opt_level, optimizer)
    assert next(network.parameters()).device.type == device
    assert_trained_and_skipped(network, plugin)


@pytest.mark.parametrize("front_end", FRONT_ENDS)
@pytest.mark.parametrize(("device", "precision", "opt_level", "optimizer"), _cases(compiled=True))
def test_every_mode_trains_and_skips_the_inf_step_compiled(
    device: str, precision: str, opt_level: str, optimizer: str, front_end: str
) -> None:
    """The same under torch.compile: the compiled model trains and the planted inf step is skipped."""
    network, plugin = train(front_end, device, precision, opt_level, optimizer, COMPILE_BACKEND[device])
    assert_trained_and_skipped(network, plugin)
