"""Result files: every measurement is written as JSON with the command that made it.

What it is: one writer that stamps each payload with the exact command line, the date, the
package and library versions, and the machine (CPU model, threads), so a reader can rerun it.
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import shlex
from pathlib import Path

import torch
import transformers


def _cpuinfo(key: str, cpuinfo: str | None = None) -> str | None:
    """The first `key` line's value in `cpuinfo` (default: /proc/cpuinfo); None when absent."""
    try:
        text = cpuinfo if cpuinfo is not None else Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith(key)), None)


def _cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_bf16(cpuinfo: str | None = None) -> bool | None:
    """Whether the CPU has native bf16 arithmetic (AVX512-BF16 or AMX-BF16; None: cannot tell),
    from `cpuinfo` (default: /proc/cpuinfo). Where it does, bf16 is usually the faster exact baseline."""
    flags = _cpuinfo("flags", cpuinfo)
    return None if flags is None else bool({"avx512_bf16", "amx_bf16"} & set(flags.split()))


def environment() -> dict:
    from ridgefill import __version__

    return {
        "ridgefill": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_bf16": cpu_bf16(),
        "torch_threads": torch.get_num_threads(),
    }


def command_line(argv: list[str]) -> str:
    return "ridgefill " + shlex.join(argv)


def write_json(path: str | Path, payload: dict, argv: list[str]) -> Path:
    """Write `payload` with `command`, `date` and `environment` keys first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "command": command_line(argv),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "environment": environment(),
        **payload,
    }
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return path


def save_png(fig, path: str | Path) -> Path:
    """Write a matplotlib figure as a PNG (parent folders made) and close it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
