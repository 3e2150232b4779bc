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


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_bf16(cpuinfo: str | None = None) -> bool | None:
    """Whether the CPU has native bf16 arithmetic (AVX512-BF16 or AMX-BF16; None: cannot tell),
    from `cpuinfo` (default: /proc/cpuinfo). Where it does, bf16 is usually the faster exact baseline."""
    try:
        text = cpuinfo if cpuinfo is not None else Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), None)
    return None if flags is None else bool({"avx512_bf16", "amx_bf16"} & set(flags))


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
