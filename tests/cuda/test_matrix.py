"""Every precision x opt level x optimizer x front end trains with finite weights and skips a planted inf step.

The bodies run on ``"cuda"`` (``pytest -m cuda tests/cuda``) and on ``"cpu"``, a few cases in the fast loop and the
rest marked slow, which keeps the test logic itself proven where no GPU is present.
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

_FAST_ON_CPU = {("bf16-mixed", "lean", "fused-adamw"), ("16-mixed", "O2", "sgd-momentum")}
COMPILE_BACKEND = {"cuda": "inductor", "cpu": "aot_eager"}
"""torch.compile's default on a GPU; on the CPU dynamo's capture with AOT autograd, without code generation."""


def _cases(compiled: bool) -> list:
    cases = []
    for device in ("cpu", "cuda"):
        for precision, opt_level in PRECISION_LEVELS:
            # Compilation changes the forward and backward, not the step: one optimizer covers it.
            for optimizer in OPTIMIZERS[:1] if compiled else OPTIMIZERS:
                fast = not compiled and (precision, opt_level, optimizer) in _FAST_ON_CPU
                marks = [] if fast else [pytest.mark.slow]
                device_param = on_device(device, *marks)
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
