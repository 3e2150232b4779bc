"""Result files: every measurement is written as JSON with the command that made it.

What it is: one writer that stamps each payload with the exact command line, the date, the
package and library versions, and the machine (CPU model, threads), so a reader can rerun it.
Files are replaced atomically (`files.atomic_path`): a run killed while writing, such as a tune
checkpoint cut short, leaves the previous file whole. What it is not: the atomic writer itself.
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import shlex
from pathlib import Path

import torch
import transformers

from ridgefill.files import atomic_path, write_text
from ridgefill.models.device import cpu_amx, cpu_bf16, cpu_model

__all__ = ["command_line", "cpu_bf16", "environment", "save_png", "write_json"]


def environment() -> dict:
    from ridgefill import __version__

    return {
        "ridgefill": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpu_bf16": cpu_bf16(),
        "cpu_amx": cpu_amx(),
        "torch_threads": torch.get_num_threads(),
    }


def command_line(argv: list[str]) -> str:
    return "ridgefill " + shlex.join(argv)


def write_json(path: str | Path, payload: dict, argv: list[str]) -> Path:
    """Write `payload` with `command`, `date` and `environment` keys first (atomically)."""
    doc = {
        "command": command_line(argv),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "environment": environment(),
        **payload,
    }
    return write_text(path, json.dumps(doc, indent=2, default=str) + "\n")


def save_png(fig, path: str | Path, tight: bool = True) -> Path:
    """Write a matplotlib figure as a PNG (atomically, parent folders made) and close it.
    `tight`: apply `tight_layout` first (off for figures laid out by hand, e.g. with a shared colorbar)."""
    import matplotlib.pyplot as plt

    path = Path(path)
    try:
        if tight:
            fig.tight_layout()
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=110, format="png")  # the temporary name has no .png to go by
    finally:
        plt.close(fig)
    return path
