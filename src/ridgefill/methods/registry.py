"""The method table: each prefill method's function, settings class, defaults and maps.

What it is: data, looked up by name. What it is not: resolution (methods/resolve.py), which
checks settings and loads maps before anything runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ridgefill.engine import Engine, PrefillResult
from ridgefill.errors import RidgefillError
from ridgefill.methods.fill import FILL_METHODS, FillSettings, prefill_fill
from ridgefill.methods.gate import GateSettings, model_settings, prefill_tokengate


@dataclass(frozen=True)
class MethodInfo:
    """One prefill method.

    Attributes:
        run: (engine, input_ids, settings, maps, *, logit_rows, lower, cache) -> PrefillResult.
        settings: its settings class (None: it takes no settings).
        defaults: settings values that make it this method (gated-ridge is ridge with these).
        per_model: model name -> the settings measured for that model, which the method runs
            when named with no settings of its own (tokengate: data/tokengate.json).
        maps: the kind of fitted maps it always reads (None: none, or only as its settings say:
            `reads_maps` on the settings class).
        about: one line for `--help` and errors.
    """

    run: Callable[..., PrefillResult]
    settings: type | None = None
    defaults: dict[str, Any] = field(default_factory=dict)
    maps: str | None = None
    about: str = ""
    per_model: Callable[[str], dict[str, Any]] | None = None


def _exact(engine: Engine, input_ids: torch.Tensor, settings: None, maps: None, **rows: Any) -> PrefillResult:
    return engine.prefill_exact(input_ids, rows.get("logit_rows"), rows.get("lower"), rows.get("cache"))


def _fill(method: str, label: str) -> Callable[..., PrefillResult]:
    def run(engine: Engine, input_ids: torch.Tensor, settings: FillSettings, maps, **rows: Any) -> PrefillResult:
        res = prefill_fill(engine, input_ids, method=method, maps=maps, settings=settings, **rows)
        res.method = label
        return res

    run.__name__ = f"prefill_{label.replace('-', '_')}"
    return run


def _gate(engine: Engine, input_ids: torch.Tensor, settings: GateSettings, maps, **rows: Any) -> PrefillResult:
    return prefill_tokengate(engine, input_ids, settings, maps, **rows)


_ABOUT = {
    "identity": "deep layers read the split state as their input",
    "ridge": "RidgeFill: a fitted map predicts every deep layer's input",
    "kva": "fitted maps predict every deep layer's K and V",
}

METHODS: dict[str, MethodInfo] = {
    "exact": MethodInfo(_exact, about="every layer on every row"),
    **{
        m: MethodInfo(_fill(m, m), FillSettings, maps=None if m == "identity" else m, about=_ABOUT[m])
        for m in FILL_METHODS
    },
    "tokengate": MethodInfo(
        _gate, GateSettings, about="rows the gate drops stop at the gate layer", per_model=model_settings
    ),
    "gated-ridge": MethodInfo(
        _fill("ridge", "gated-ridge"),
        FillSettings,
        {"query_rows": 256, "drop": 0.5},
        "ridge",
        "question-chosen rows run fully, the middle is ridge-filled, the rest dropped",
    ),
}


def get_method(name: str) -> MethodInfo:
    try:
        return METHODS[name]
    except KeyError:
        raise RidgefillError(
            f"unknown prefill method {name!r}; choose one of {', '.join([*METHODS, 'tuned'])}"
        ) from None


def reads_maps(info: MethodInfo, settings: Any) -> str | None:
    """The kind of fitted maps a method reads with these settings (None: none)."""
    return info.maps or getattr(settings, "reads_maps", None)


def maps_read(method: str, settings: dict[str, Any], num_layers: int | None = None) -> tuple[str, int | None] | None:
    """(kind, split) of the fitted maps `method` reads with the settings values `settings` (None:
    it reads none): the fill's split, or the gate layer of a gate scoring at a predicted deeper
    layer. The split is None where the settings leave it to the model and `num_layers` is not given."""
    info = get_method(method)
    if info.settings is None:
        return None
    s = info.settings(**{**info.defaults, **settings})
    s = s if num_layers is None else s.at(num_layers)
    kind = reads_maps(info, s)
    return None if kind is None else (kind, getattr(s, s.MAPS_AT))
