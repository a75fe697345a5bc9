"""What the hardware runs fast, for ``precision="auto"``.

bf16 has fp32's exponent range, so it needs no loss scaling and cannot overflow where fp32 would not: it is the
better half type wherever the hardware multiplies it natively. That is CUDA GPUs of compute capability 8.0 or
higher (Ampere on), and CPUs with AVX512-BF16 or AMX. Elsewhere bf16 is emulated and can be far slower than fp32,
so "auto" picks fp16 with loss scaling on older GPUs and plain fp32 on such CPUs.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

_CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX), read from the kernel's CPU flags."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return any(flag in flags for flag in _CPU_BF16_FLAGS)
    return False


def device_has_native_bf16(device_type: str) -> bool:
    """Whether ``device_type`` ("cpu", "cuda", ...) runs bf16 matrix products natively."""
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
    if device_type == "cpu":
        return cpu_has_native_bf16()
    return device_type == "xpu"


def choose_precision(device_type: str) -> tuple[str, str]:
    """Pick the precision for ``precision="auto"`` and say why.

    Returns:
        ``(precision, reason)``, for example ``("bf16-mixed", "the CPU has AVX512-BF16 or AMX")``.

    """
    if device_has_native_bf16(device_type):
        if device_type == "cuda":
            major, minor = torch.cuda.get_device_capability()
            return "bf16-mixed", f"the GPU (compute capability {major}.{minor}) runs bf16 natively"
        return "bf16-mixed", f"the {device_type.upper()} runs bf16 natively (AVX512-BF16 or AMX)"
    if device_type in ("cuda", "mps"):
        return "16-mixed", f"the {device_type.upper()} has no fast bf16, so fp16 with dynamic loss scaling"
    return "32-true", f"the {device_type.upper()} has no native bf16 (no AVX512-BF16 or AMX) and fp16 is slow there"
