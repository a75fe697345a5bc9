"""One inventory entry (:class:`UpstreamTest`), the upstream files and the local modules it names, and the reasons
several entries share."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Status = Literal["adapted", "differs", "skipped"]

TORCH_TESTS = "pytorch/pytorch test/test_torch.py"
CUDA_TESTS = "pytorch/pytorch test/test_cuda.py"
_PL = "Lightning-AI/pytorch-lightning tests/tests_pytorch/"
_FABRIC = "Lightning-AI/pytorch-lightning tests/tests_fabric/"
PL_AMP = _PL + "plugins/precision/test_amp.py"
PL_AMP_INTEGRATION = _PL + "plugins/precision/test_amp_integration.py"
PL_ALL = _PL + "plugins/precision/test_all.py"
PL_FSDP = _PL + "plugins/precision/test_fsdp.py"
PL_AMP_PLUGINS = _PL + "plugins/test_amp_plugins.py"
PL_MANUAL = _PL + "trainer/optimization/test_manual_optimization.py"
FABRIC_AMP = _FABRIC + "plugins/precision/test_amp.py"
FABRIC_AMP_INTEGRATION = _FABRIC + "plugins/precision/test_amp_integration.py"
FABRIC_ALL = _FABRIC + "plugins/precision/test_all.py"
FABRIC_FSDP = _FABRIC + "plugins/precision/test_fsdp.py"

SCALER = "scaling/test_scaler_upstream.py"
SCALER_SIDE_BY_SIDE = "scaling/test_scaler_upstream_side_by_side.py"
"""torch's scaler tests run beside torch's own scaler; the others are in :data:`SCALER`."""
PLUGIN = "plugin/test_plugin_upstream.py"
FABRIC = "engine/test_fabric_upstream.py"
FSDP = "distributed/test_fsdp_upstream.py"


@dataclass(frozen=True)
class UpstreamTest:
    """One upstream test (or, with ``name="*"``, a whole file) and what this package does with it."""

    source: str
    """``"<repository> <path>"`` of the upstream test file."""
    name: str
    status: Status
    reason: str
    local: tuple[str, ...] = ()
    """The tests that adapt it, ``"<module>::<function>"``; none for a skipped entry."""


def test_names_in(module: str) -> frozenset[str]:
    tree = ast.parse((Path(__file__).parent.parent / module).read_text())
    return frozenset(node.name for node in tree.body if isinstance(node, ast.FunctionDef))


def local_tests(module: str, *names: str) -> tuple[str, ...]:
    """``"<module>::<name>"`` for each name; torch's scaler tests are found in whichever of their two modules."""
    if module != SCALER:
        return tuple(f"{module}::{name}" for name in names)
    beside = test_names_in(SCALER_SIDE_BY_SIDE)
    return tuple(f"{SCALER_SIDE_BY_SIDE if name in beside else SCALER}::{name}" for name in names)


_NO_ENABLED_FLAG = (
    "LossScaler has no enabled=False. torch's disabled pass runs as mode='check' (bf16, fp32): nothing scaled, the"
    " scale stays 1, but a non-finite step is still skipped, so the control skips it too"
)

_TORCH_SCALING_CASES = local_tests(
    SCALER,
    "test_autocast_training_matches_fp32_training_within_fp16_rounding",
    "test_clipping_the_scaled_gradients_by_a_scaled_norm_matches_clipping_true_ones",
    "test_unscale_then_clip_matches_clipping_fp32_gradients",
    "test_gradient_penalty_from_scaled_autograd_grad_matches_fp32",
    "test_accumulating_two_scaled_backwards_per_step_matches_fp32",
    "test_two_models_two_losses_two_optimizers_match_fp32",
)

_AT_EVERY_FP16_LEVEL = (
    "; at O1, O2 and O3. O3 is a strict xfail on the torch releases whose fused CPU SGD skips half weights (issue 28,"
    " defect 4): it turns into a failure once the package keeps half weights off that kernel there"
)

_OTHER_PLUGIN = "tests another precision plugin (or another accelerator's), not the AMP plugin this package replaces"
