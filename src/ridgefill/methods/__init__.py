"""Prefill methods, chosen by name from a registry.

What it is: the name -> function table every entry point (generate, bench, eval, serve) uses.
Each method takes an `Engine`, a (1, N) prompt, and optional fitted maps and settings, and
returns a `PrefillResult` whose cache the stock model decodes from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from transformers import DynamicCache

from ridgefill.engine import Engine, LowerState, PrefillResult
from ridgefill.errors import RidgefillError
from ridgefill.fit.maps import MAP_METHODS, find_maps
from ridgefill.methods.fill import FILL_METHODS, FillSettings, prefill_fill
from ridgefill.methods.gate import GateSettings, prefill_tokengate

PrefillFn = Callable[..., PrefillResult]

__all__ = [
    "FILL_METHODS",
    "METHODS",
    "FillSettings",
    "GateSettings",
    "get_method",
    "parse_method",
    "prefill_kwargs",
    "run_prefill",
    "settings_for",
]


def _exact(
    engine: Engine,
    input_ids: torch.Tensor,
    logit_rows: torch.Tensor | None = None,
    lower: LowerState | None = None,
    cache: DynamicCache | None = None,
    **_: Any,
) -> PrefillResult:
    return engine.prefill_exact(input_ids, logit_rows, lower, cache)


def _fill(method: str, label: str | None = None) -> PrefillFn:
    def run(engine: Engine, input_ids: torch.Tensor, **kwargs: Any) -> PrefillResult:
        res = prefill_fill(engine, input_ids, method=method, **kwargs)
        res.method = label or method
        return res

    run.__name__ = f"prefill_{(label or method).replace('-', '_')}"
    return run


METHODS: dict[str, PrefillFn] = {
    "exact": _exact,
    **{m: _fill(m) for m in FILL_METHODS},
    "tokengate": prefill_tokengate,
    # Three tiers (issue 6): gate-chosen rows run fully, the middle is ridge-filled, the rest dropped.
    "gated-ridge": _fill("ridge", "gated-ridge"),
}

# Settings class of each method that takes settings, and the defaults that make it that method.
SETTINGS: dict[str, tuple[type, dict[str, Any]]] = {
    **{m: (FillSettings, {}) for m in FILL_METHODS},
    "gated-ridge": (FillSettings, {"query_rows": 256, "drop": 0.5}),
    "tokengate": (GateSettings, {}),
}
# Which fitted maps a method reads.
MAPS_OF = {**{m: m for m in MAP_METHODS}, "gated-ridge": "ridge"}


def get_method(name: str) -> PrefillFn:
    try:
        return METHODS[name]
    except KeyError:
        raise RidgefillError(f"unknown prefill method {name!r}; choose one of {', '.join(METHODS)}") from None


def settings_for(method: str, **values: Any) -> FillSettings | GateSettings | None:
    """The method's settings from `values` (keys its settings class lacks are ignored), over the
    method's own defaults; None for exact."""
    from dataclasses import fields

    get_method(method)
    if method not in SETTINGS:
        return None
    cls, defaults = SETTINGS[method]
    names = {f.name for f in fields(cls)}
    return cls(**{**defaults, **{k: v for k, v in values.items() if k in names}})


def parse_method(spec: str) -> tuple[str, dict[str, Any]]:
    """`name[:key=value...]` -> (method name, settings overrides), each value converted to its
    settings field's type (`none` -> None); unknown names, keys and bad values are refused."""
    from dataclasses import fields

    name, *opts = spec.split(":")
    get_method(name)
    known = {f.name: f.type for f in fields(SETTINGS[name][0])} if name in SETTINGS else {}
    over: dict[str, Any] = {}
    for opt in opts:
        key, eq, value = opt.partition("=")
        if not eq or key not in known:
            raise RidgefillError(
                f"bad method option {opt!r} in {spec!r}; use key=value with key in {', '.join(known) or '(none)'}"
            )
        try:
            over[key] = None if value == "none" else (float(value) if "float" in str(known[key]) else int(value))
        except ValueError:
            raise RidgefillError(f"bad value in {opt!r} (method {spec!r})") from None
    return name, over


def prefill_kwargs(lm, method: str, settings: FillSettings | GateSettings | None, maps_dir=None) -> dict[str, Any]:
    """What `run_prefill` needs for `method`: nothing for exact, its settings, plus the fitted maps
    (from `maps_dir`, default the model's cache folder) for the methods that read them."""
    get_method(method)
    if method not in SETTINGS:
        return {}
    settings = settings if settings is not None else settings_for(method)
    if not isinstance(settings, SETTINGS[method][0]):
        raise RidgefillError(f"method {method!r} takes {SETTINGS[method][0].__name__}, not {type(settings).__name__}")
    settings.check(lm.num_layers)
    if isinstance(settings, GateSettings) and settings.gate_layer is None:
        settings = replace(settings, gate_layer=settings.layer(lm.num_layers))
    kwargs: dict[str, Any] = {"settings": settings}
    if method in MAPS_OF:
        kwargs["maps"] = find_maps(lm, MAPS_OF[method], settings.split, maps_dir)
    return kwargs


def run_prefill(engine: Engine, input_ids: torch.Tensor, method: str = "exact", **kwargs: Any) -> PrefillResult:
    """Run the named prefill method on a (1, N) prompt."""
    return get_method(method)(engine, input_ids, **kwargs)
