"""What the hardware runs fast, for ``precision="auto"`` and for the advisor.

bf16 has fp32's exponent range, so it needs no loss scaling and cannot overflow where fp32 would not: it is the
better half type wherever the hardware multiplies it natively. That is CUDA GPUs of compute capability 8.0 or
higher (Ampere on), and CPUs with AVX512-BF16 or AMX. Elsewhere bf16 is emulated and can be 10-100x slower than
fp32, so "auto" picks fp16 with loss scaling on older GPUs and plain fp32 on such CPUs.

The decision is split in two, so that it can be tested on any machine:

1. :meth:`DeviceCapabilities.detect` reads what this machine has (CUDA compute capability, the kernel's CPU flags);
2. :func:`native_bf16` and :func:`precision_for` are pure functions of those capabilities (and the opt level).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from lightning_mp.policies import POLICIES

ResolvedPrecision = Literal["16-mixed", "bf16-mixed", "32-true"]
"""What ``precision="auto"`` resolves to: one of Lightning's own precision strings."""

CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
"""CPU flags (as ``/proc/cpuinfo`` names them) of native bf16 matrix products."""
AMPERE = (8, 0)
"""The first CUDA compute capability with native bf16 tensor cores."""


def computes_with_half_weights(opt_level: str) -> bool:
    """Whether ``opt_level``'s forward computes with half weights, as its policy declares; False for an unknown name."""
    policy = POLICIES.get(opt_level)
    return policy is not None and policy.computes_with_half_weights


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's flags, read from the kernel (empty where ``/proc/cpuinfo`` does not exist)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def native_bf16(device_type: str, compute_capability: tuple[int, int] | None = None, flags: Iterable[str] = ()) -> bool:
    """Whether a device multiplies bf16 natively: a pure function of what it has.

    Args:
        device_type: ``"cpu"``, ``"cuda"``, ``"mps"``, ``"xpu"``, ...
        compute_capability: the CUDA compute capability (CUDA only).
        flags: the CPU flags (CPU only).

    Example:
        >>> native_bf16("cpu", flags={"avx2"}), native_bf16("cpu", flags={"avx512_bf16"}), native_bf16("cuda", (7, 5))
        (False, True, False)

    """
    if device_type == "cuda":
        return compute_capability is not None and tuple(compute_capability) >= AMPERE
    if device_type == "cpu":
        return not CPU_BF16_FLAGS.isdisjoint(flags)
    return device_type == "xpu"


@dataclass(frozen=True)
class DeviceCapabilities:
    """What a device can run fast, as far as precision goes.

    Attributes:
        device_type: ``"cpu"``, ``"cuda"``, ...
        native_bf16: whether it multiplies bf16 natively.
        compute_capability: the CUDA compute capability, None elsewhere.

    """

    device_type: str
    native_bf16: bool
    compute_capability: tuple[int, int] | None = None

    @classmethod
    def detect(cls, device_type: str) -> DeviceCapabilities:
        """Read this machine's capabilities for ``device_type``."""
        capability: tuple[int, int] | None = None
        if device_type == "cuda" and torch.cuda.is_available():
            capability = torch.cuda.get_device_capability()
        flags = cpu_flags() if device_type == "cpu" else frozenset()
        return cls(device_type, native_bf16(device_type, capability, flags), capability)

    def describe(self) -> str:
        """The device in words, for messages: ``"the CPU (no AVX512-BF16 or AMX)"``."""
        if self.device_type == "cuda" and self.compute_capability is not None:
            major, minor = self.compute_capability
            return f"the GPU (compute capability {major}.{minor})"
        if self.device_type == "cpu":
            return f"the CPU ({'with' if self.native_bf16 else 'no'} AVX512-BF16 or AMX)"
        return f"the {self.device_type.upper()}"


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX), read from the kernel's CPU flags."""
    return native_bf16("cpu", flags=cpu_flags())


def device_has_native_bf16(device_type: str) -> bool:
    """Whether ``device_type`` ("cpu", "cuda", ...) on this machine runs bf16 matrix products natively."""
    return DeviceCapabilities.detect(device_type).native_bf16


def precision_for(capabilities: DeviceCapabilities, opt_level: str = "O1") -> tuple[ResolvedPrecision, str]:
    """The precision ``"auto"`` picks on a device with these capabilities, and why: a pure function.

    - O0 is the fp32 baseline;
    - native bf16: ``"bf16-mixed"``;
    - a GPU (or MPS) without it: ``"16-mixed"`` with dynamic loss scaling;
    - a CPU without it: ``"32-true"``, because both half types are emulated there and slower than fp32, except at
      the levels whose policy computes with half weights (O2, O3, lean: ``computes_with_half_weights``), which fp32
      would turn into O0: then ``"bf16-mixed"`` (no loss scaler to tune), and the reason says that it will be slower
      than fp32 and how to get fp32's speed.

    Returns:
        ``(precision, reason)``.

    Example:
        >>> slow_cpu = DeviceCapabilities("cpu", native_bf16=False)
        >>> precision_for(slow_cpu, "O1")[0], precision_for(slow_cpu, "O2")[0]
        ('32-true', 'bf16-mixed')

    """
    device = capabilities.describe()
    if opt_level == "O0":
        return "32-true", "opt_level='O0' is the fp32 baseline"
    if capabilities.native_bf16:
        return "bf16-mixed", f"{device} runs bf16 natively, and bf16 needs no loss scaling"
    if capabilities.device_type in ("cuda", "mps"):
        return "16-mixed", f"{device} has no fast bf16, so fp16 with dynamic loss scaling"
    if computes_with_half_weights(opt_level):
        return "bf16-mixed", (
            f"opt_level={opt_level!r} keeps the weights in a half type and bf16 needs no loss scaling, but {device}"
            " emulates bf16, so this run will be slower than fp32; precision='auto' with opt_level='O1' trains in"
            " fp32 here"
        )
    return "32-true", f"{device} emulates both half types, which are slower than fp32 there"


def emulated_bf16_warning(requested_precision: str, opt_level: str, reason: str = "") -> str:
    """The warning for bf16 on a CPU that emulates it, with advice that fits what the user asked for.

    Args:
        requested_precision: what the user passed: ``"auto"`` or ``"bf16-mixed"``.
        opt_level: the opt level; O0 and O1 can train in fp32 instead, the others keep half weights.
        reason: under ``"auto"``, why it chose bf16 (:func:`precision_for`), repeated so no message contradicts it.

    Example:
        >>> emulated_bf16_warning("bf16-mixed", "O1").endswith("Use precision='32-true' for fp32's speed here.")
        True

    """
    if requested_precision == "auto":
        advice = f"precision='auto' chose 'bf16-mixed' because {reason}."
    elif opt_level in ("O0", "O1"):
        advice = "Use precision='32-true' for fp32's speed here."
    else:
        advice = (
            f"opt_level={opt_level!r} keeps the weights in a half type; precision='32-true' with opt_level='O1' trains"
            " at fp32's speed here."
        )
    return (
        "lightning_mp: this CPU has no native bf16 (no AVX512-BF16 or AMX), so 'bf16-mixed' is emulated and can be"
        f" 10-100x slower than fp32. {advice}"
    )


def choose_precision(device_type: str, opt_level: str = "O1") -> tuple[ResolvedPrecision, str]:
    """Pick the precision for ``precision="auto"`` on this machine's ``device_type`` and say why.

    Returns:
        ``(precision, reason)``, for example ``("bf16-mixed", "the CPU (with AVX512-BF16 or AMX) runs bf16 ...")``.

    """
    return precision_for(DeviceCapabilities.detect(device_type), opt_level)
