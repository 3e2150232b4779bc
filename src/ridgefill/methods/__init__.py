"""Prefill methods, chosen by name from a registry.

What it is: the name -> function table every entry point (generate, bench, eval, serve) uses.
Each method takes an `Engine`, a (1, N) prompt, and optional fitted maps and settings, and
returns a `PrefillResult` whose cache the stock model decodes from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import DynamicCache

from ridgefill.engine import Engine, LowerState, PrefillResult
from ridgefill.errors import RidgefillError
from ridgefill.methods.fill import FILL_METHODS, FillSettings, prefill_fill

PrefillFn = Callable[..., PrefillResult]

__all__ = ["FILL_METHODS", "METHODS", "FillSettings", "get_method", "prefill_kwargs", "run_prefill"]


def _exact(
    engine: Engine,
    input_ids: torch.Tensor,
    logit_rows: torch.Tensor | None = None,
    lower: LowerState | None = None,
    cache: DynamicCache | None = None,
    **_: Any,
) -> PrefillResult:
    return engine.prefill_exact(input_ids, logit_rows, lower, cache)


def _fill(method: str) -> PrefillFn:
    def run(engine: Engine, input_ids: torch.Tensor, **kwargs: Any) -> PrefillResult:
        return prefill_fill(engine, input_ids, method=method, **kwargs)

    run.__name__ = f"prefill_{method}"
    return run


METHODS: dict[str, PrefillFn] = {"exact": _exact, **{m: _fill(m) for m in FILL_METHODS}}


def get_method(name: str) -> PrefillFn:
    try:
        return METHODS[name]
    except KeyError:
        raise RidgefillError(f"unknown prefill method {name!r}; choose one of {', '.join(METHODS)}") from None


def prefill_kwargs(lm, method: str, settings: FillSettings, maps_dir=None) -> dict[str, Any]:
    """What `run_prefill` needs for `method`: nothing for exact, settings for a fill, plus the
    fitted maps (from `maps_dir`, default the model's cache folder) for ridge and kva."""
    from ridgefill.fit.maps import MAP_METHODS, find_maps

    get_method(method)
    if method not in FILL_METHODS:
        return {}
    settings.check(lm.num_layers)
    kwargs: dict[str, Any] = {"settings": settings}
    if method in MAP_METHODS:
        kwargs["maps"] = find_maps(lm, method, settings.split, maps_dir)
    return kwargs


def run_prefill(engine: Engine, input_ids: torch.Tensor, method: str = "exact", **kwargs: Any) -> PrefillResult:
    """Run the named prefill method on a (1, N) prompt."""
    return get_method(method)(engine, input_ids, **kwargs)
