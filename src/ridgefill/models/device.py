"""Where and in what precision a model computes: the `auto` choices, made in one place.

What it is: `pick_device` (CUDA when present) and `pick_dtype`: bf16 on CUDA, on CPUs with AMX
tiles for bf16 (read from /proc/cpuinfo), and on CPUs with AVX512-BF16 alone where a short matmul
probe runs bf16 at least `BF16_PROBE_GAIN` times faster than fp32; fp32 elsewhere. Why the probe:
the flag alone does not tell. Measured exact prefill with `ridgefill bench`: on a Xeon with AMX,
bf16 is about 3x faster than fp32 (SmolLM2-135M); on a Xeon with AVX512-BF16 but no AMX about 1.6x
slower (SmolLM2-135M, 2K tokens: 3.87 s against 2.38 s); on an AMD EPYC with AVX512-BF16 2.1x
faster (Qwen2.5-0.5B, 4K tokens: 14.4 s against 30.1 s), where the probe's matmul is 2.1x faster
too. What it is not: a benchmark; results record the CPU and its bf16 flags (results.py) so a
reader can tell which baseline a ratio used.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import torch

from ridgefill.errors import RidgefillError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
AMX_FLAGS = frozenset({"amx_bf16"})
BF16_PROBE_GAIN = 1.3


def cpuinfo_field(key: str, cpuinfo: str | None = None) -> str | None:
    """The first `key` line's value in `cpuinfo` (default: /proc/cpuinfo); None when absent."""
    try:
        text = cpuinfo if cpuinfo is not None else Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith(key)), None)


def cpu_model() -> str:
    return cpuinfo_field("model name") or platform.processor() or platform.machine()


def _has_flags(wanted: frozenset[str], cpuinfo: str | None) -> bool | None:
    """Whether the CPU lists any of `wanted` among its flags (None: no flags line to read)."""
    flags = cpuinfo_field("flags", cpuinfo)
    return None if flags is None else bool(wanted & set(flags.split()))


def cpu_bf16(cpuinfo: str | None = None) -> bool | None:
    """Whether the CPU has native bf16 arithmetic (AVX512-BF16 or AMX-BF16; None: cannot tell),
    from `cpuinfo` (default: /proc/cpuinfo)."""
    return _has_flags(BF16_FLAGS, cpuinfo)


def cpu_amx(cpuinfo: str | None = None) -> bool | None:
    """Whether the CPU has AMX bf16 tiles, where bf16 matmuls run fastest (None: cannot tell)."""
    return _has_flags(AMX_FLAGS, cpuinfo)


def pick_device(device: str = "auto") -> torch.device:
    """`auto`: the first CUDA device when one is present, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise RidgefillError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RidgefillError(f"device {device!r} asked for, but torch sees no CUDA device here")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise RidgefillError(f"device {device!r} asked for, but torch sees {torch.cuda.device_count()} CUDA device(s)")
    if dev.type not in ("cpu", "cuda"):
        raise RidgefillError(f"device {device!r} is not supported; use auto, cpu, cuda or cuda:N")
    return dev


@lru_cache(maxsize=1)
def bf16_matmul_gain() -> float:
    """How many times faster a model-sized CPU matmul (1024 x 896 by 896 x 2048) runs in bf16 than
    in fp32 here: best of three after one warm-up, well under a second in all."""

    def best(dt: torch.dtype) -> float:
        a, w = torch.randn(1024, 896).to(dt), torch.randn(2048, 896).to(dt)
        torch.nn.functional.linear(a, w)
        times = []
        for _ in range(3):
            t = time.perf_counter()
            torch.nn.functional.linear(a, w)
            times.append(time.perf_counter() - t)
        return min(times)

    return best(torch.float32) / best(torch.bfloat16)


def cpu_prefers_bf16(cpuinfo: str | None = None, gain: Callable[[], float] = bf16_matmul_gain) -> bool:
    """Whether bf16 is the faster exact baseline on this CPU: AMX, or AVX512-BF16 where the probe
    `gain` reaches `BF16_PROBE_GAIN`."""
    if cpu_amx(cpuinfo):
        return True
    return bool(cpu_bf16(cpuinfo)) and gain() >= BF16_PROBE_GAIN


def pick_dtype(
    dtype: str, device: torch.device, cpuinfo: str | None = None, gain: Callable[[], float] = bf16_matmul_gain
) -> torch.dtype:
    """`auto`: bf16 on CUDA (fp16 on a GPU without bf16) and on CPUs where bf16 is faster
    (`cpu_prefers_bf16`), else fp32."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_prefers_bf16(cpuinfo, gain) else torch.float32
    if dtype not in DTYPES:
        raise RidgefillError(f"unknown dtype {dtype!r}; choose auto or one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def synchronize(device: torch.device) -> None:
    """Wait for `device` to finish its queued work, so a wall-clock time covers it (CUDA is async)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
