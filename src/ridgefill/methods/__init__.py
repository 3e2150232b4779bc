"""Prefill methods: the registry and the one resolver every entry point uses.

What it is: the name -> `MethodInfo` table (the function, its settings class and the defaults that
make it that method, the maps it reads) and `resolve_prefill`, which turns (model, method name,
settings, maps) into a ready `Prefill`. The CLI, the Python API, the server, `patch`, the lm-eval
adapter, eval and bench go through it (the tuner, which builds its own candidates, calls
`run_prefill`). Each method takes an `Engine`, a (1, N) prompt and its checked settings and maps,
and returns a `PrefillResult` whose cache the stock model decodes from.
"""

from __future__ import annotations

from ridgefill.methods.fill import FILL_METHODS, FillSettings, default_split
from ridgefill.methods.gate import GateSettings
from ridgefill.methods.registry import METHODS, MethodInfo, get_method
from ridgefill.methods.resolve import (
    Prefill,
    default_method,
    has_tuned,
    parse_method,
    resolve_prefill,
    run_prefill,
)

__all__ = [
    "FILL_METHODS",
    "METHODS",
    "FillSettings",
    "GateSettings",
    "MethodInfo",
    "Prefill",
    "default_method",
    "default_split",
    "get_method",
    "has_tuned",
    "parse_method",
    "resolve_prefill",
    "run_prefill",
]
