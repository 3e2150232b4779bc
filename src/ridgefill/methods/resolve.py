"""One way to name a prefill: (model, method, settings, maps) -> a ready `Prefill`.

What it is: `resolve_prefill`, used by the CLI, the Python API, the server, `patch`, the lm-eval
adapter, eval and bench. It picks the default method (`tuned` where the model has a tuned
configuration, else exact), reads `tuned` (methods/tuned.py: length buckets from a bundle or the
configuration shipped for an embedded model), checks every setting by name and type against the
method's settings class (an unknown or ill-typed one is an error that lists the valid ones),
resolves the split, and loads the maps the method reads, fitting them on first use when none are
cached. What it is not: the methods themselves (methods/fill.py, methods/gate.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from ridgefill.engine import Engine, LowerState, PrefillResult
from ridgefill.errors import MapError, RidgefillError
from ridgefill.fit.maps import FillMaps, default_maps_dir, load_maps, maps_filename
from ridgefill.methods.fill import FillSettings
from ridgefill.methods.gate import GateSettings
from ridgefill.methods.registry import METHODS, get_method, maps_read, reads_maps
from ridgefill.methods.tuned import (
    TUNED,
    check_calibration,
    default_method,
    for_length,
    has_tuned,
    shipped_defaults,
    tuned_config,
    tuned_path,
)
from ridgefill.models.loading import LoadedModel

log = logging.getLogger(__name__)

Settings = FillSettings | GateSettings


@dataclass(frozen=True)
class Prefill:
    """A resolved prefill: the method that runs, its checked settings and its maps.

    Attributes:
        label: what it was asked as (`tuned`, `ridge:query_rows=256`, `exact`).
        method: the registry method that runs (`tuned` resolves to one).
        settings: the method's settings with every default resolved; None for exact.
        maps: the fitted maps it reads, or None.
        by_length: for a configuration tuned per prompt length, ((up_to, prefill), ...) in
            ascending `up_to` (the last None: any longer prompt); `run` picks by the prompt's
            length, and method/settings/maps above are the first bucket's. Empty otherwise.
    """

    label: str
    method: str
    settings: Settings | None = None
    maps: FillMaps | None = field(default=None, compare=False)
    by_length: tuple[tuple[int | None, Prefill], ...] = ()

    def for_length(self, n: int) -> Prefill:
        """The prefill that runs a prompt of `n` tokens."""
        return for_length(self.by_length, n, self)

    @property
    def variants(self) -> list[Prefill]:
        """Every configuration this prefill may run: its length buckets, or itself."""
        return [p for _, p in self.by_length] or [self]

    def run(
        self,
        engine: Engine,
        input_ids: torch.Tensor,
        *,
        logit_rows: torch.Tensor | None = None,
        lower: LowerState | None = None,
        cache: DynamicCache | None = None,
    ) -> PrefillResult:
        """Prefill a (1, N) prompt. `logit_rows`: positions whose logits to return (default the
        last); `lower`: layers already run on this prompt; `cache`: an empty stock cache to fill."""
        me = self.for_length(int(input_ids.shape[-1]))
        info = get_method(me.method)
        return info.run(engine, input_ids, me.settings, me.maps, logit_rows=logit_rows, lower=lower, cache=cache)

    @property
    def split(self) -> int | None:
        """The layer where this prefill departs from exact (None for exact)."""
        if isinstance(self.settings, GateSettings):
            return self.settings.gate_layer
        return None if self.settings is None else self.settings.split

    @property
    def runs_fully_below(self) -> int | None:
        """Layers every row runs densely before this method departs from exact (None: all of them)."""
        return None if self.settings is None else self.settings.dense_below

    def describe(self) -> str:
        """One line: the method and the settings that matter, e.g. `ridge split 18, tail 512`."""
        if self.by_length:
            return "; ".join(
                f"{'up to ' + str(up_to) if up_to else 'longer'}: {p.describe()}" for up_to, p in self.by_length
            )
        s = self.settings
        if s is None:
            return self.method
        if isinstance(s, GateSettings):
            refine = "" if s.refine_layer is None else f", then layer {s.refine_layer} keeps {s.refine_keep:g}"
            return f"{self.method} gate layer {s.gate_layer}, keep {s.keep:g}{refine}, tail {s.tail}"
        extra = (f", {s.query_rows} query rows" if s.query_rows else "") + (f", drop {s.drop:g}" if s.drop else "")
        return f"{self.method} split {s.split}, tail {s.tail}{extra}"


# ----- settings: names and types -----


def _field_types(cls: type) -> dict[str, str]:
    return {f.name: str(f.type) for f in fields(cls)}


def _fits(value: Any, type_name: str) -> bool:
    if value is None:
        return "None" in type_name
    if isinstance(value, bool):
        return False
    if "float" in type_name:
        return isinstance(value, (int, float))
    return isinstance(value, int)


def check_values(method: str, cls: type | None, values: dict[str, Any]) -> None:
    """Refuse settings that `method`'s settings class lacks or that have the wrong type."""
    if cls is None:
        if values:
            raise RidgefillError(f"method {method!r} takes no settings; got {', '.join(sorted(values))}")
        return
    types = _field_types(cls)
    for key, value in values.items():
        if key not in types:
            raise RidgefillError(f"unknown setting {key!r} for method {method!r}; valid settings: {', '.join(types)}")
        if not _fits(value, types[key]):
            raise RidgefillError(f"setting {key!r} of method {method!r} must be {types[key]}, got {value!r}")


def _typed(method: str, cls: type | None, key: str, text: str) -> Any:
    types = _field_types(cls) if cls is not None else {}
    if key not in types:
        valid = ", ".join(types) or "(none)"
        raise RidgefillError(f"unknown setting {key!r} for method {method!r}; valid settings: {valid}")
    if text.lower() == "none":
        return None
    try:
        return float(text) if "float" in types[key] else int(text)
    except ValueError:
        raise RidgefillError(f"setting {key!r} of method {method!r} must be {types[key]}, got {text!r}") from None


def parse_method(spec: str) -> tuple[str, dict[str, Any]]:
    """`name[:key=value...]` -> (method name, settings), each value typed by its settings field
    (`none` -> None); unknown methods, keys and bad values are refused. `tuned` takes fill settings."""
    name, *opts = spec.split(":")
    cls = FillSettings if name == TUNED else get_method(name).settings
    over: dict[str, Any] = {}
    for opt in opts:
        key, eq, value = opt.partition("=")
        if not eq:
            raise RidgefillError(f"bad method option {opt!r} in {spec!r}; use key=value")
        over[key] = _typed(name, cls, key, value)
    return name, over


# ----- maps -----


def _maps_for(
    lm: LoadedModel, kind: str, split: int, maps: FillMaps | Path | str | None, fit_missing: bool, corpus: str | None
) -> FillMaps:
    """The `kind` maps (ridge or kva): given, a map file, or from a folder (default: the model's
    cache folder, keyed by its weights and so by dtype), fitted there on first use."""
    if isinstance(maps, FillMaps):
        found = maps
    elif maps is not None and Path(maps).is_file():
        found = load_maps(maps, lm)
    elif maps is not None and not Path(maps).exists() and Path(maps).suffix:
        raise MapError(f"map file not found: {maps}")
    else:
        folder = Path(maps) if maps is not None else default_maps_dir(lm)
        path = folder / maps_filename(lm.name, kind, split)
        if not path.is_file():
            if not fit_missing:
                raise MapError(
                    f"no {kind} maps for split {split} in {folder}; "
                    f"run `ridgefill fit --model {lm.name} --splits {split}` first"
                )
            fit_first_use(lm, kind, split, folder, corpus)
        found = load_maps(path, lm)
    if found.method != kind:
        raise MapError(f"these maps are for {found.method!r}; this method reads {kind!r} maps")
    found.check_model(lm)
    return found


def fit_first_use(lm: LoadedModel, kind: str, split: int, folder: Path, corpus: str | None = None) -> None:
    """Fit `kind` maps at `split` into `folder` (progress bar on stderr), as `ridgefill fit` would."""
    from ridgefill.fit.ridge import FitConfig, fit_from_corpus

    log.warning("fitting %s maps for %s at split %d once (cached in %s) ...", kind, lm.name, split, folder)
    fit_from_corpus(lm, FitConfig(splits=(split,), methods=(kind,)), corpus=corpus, out_dir=folder)


def applicable(spec: str, values: dict[str, Any]) -> dict[str, Any]:
    """Of settings meant for several methods at once (a command's `--tail`, a server's options),
    those that `spec`'s settings class has and that are given; none for `tuned`, which keeps its
    tuned settings unless its spec names them (`tuned:tail=1024`)."""
    name = spec.split(":")[0]
    if name == TUNED:
        return {}
    cls = get_method(name).settings
    have = set(_field_types(cls)) if cls is not None else set()
    return {k: v for k, v in values.items() if v is not None and k in have}


# ----- the resolver -----


def changed_settings(settings: Settings) -> dict[str, Any]:
    """The fields of a settings object that differ from its class's defaults."""
    return {f.name: getattr(settings, f.name) for f in fields(settings) if getattr(settings, f.name) != f.default}


def _as_values(settings: Settings | dict | None) -> dict[str, Any]:
    if settings is None:
        return {}
    if is_dataclass(settings):  # only what differs from the class defaults counts as asked
        return changed_settings(settings)
    if isinstance(settings, dict):
        return dict(settings)
    raise RidgefillError(f"settings must be a settings object or a dict, not {type(settings).__name__}")


def resolve_prefill(
    lm: LoadedModel,
    method: str | None = None,
    *,
    settings: Settings | dict | None = None,
    maps: FillMaps | Path | str | None = None,
    fit_missing: bool = True,
    corpus: str | None = None,
    shared: dict[str, Any] | None = None,
    **overrides: Any,
) -> Prefill:
    """Turn a method name and its settings into a ready `Prefill` for `lm`.

    Args:
        method: a method name, optionally with settings (`ridge:query_rows=256:tail=512`), or
            `tuned`; None: `tuned` where the model has a tuned configuration (or the given maps
            are a tuned bundle), the given maps' own method, else exact.
        settings: a settings object (the fields that differ from its defaults) or dict;
            `overrides` (keyword settings such as `split=12`) and the name's own `key=value`
            settings win over it, in that order. A method given none of these runs the
            settings measured for the model where there are any (tokengate: data/tokengate.json);
            named settings start from the method's defaults instead.
        shared: settings meant for several methods at once (a command's `--tail`): applied under
            all the others where this method has them; `tuned` keeps its own (logged).
        maps: fitted maps, a map file (its split wins), a tuned bundle, or a folder (default: the
            model's cache folder).
        fit_missing: fit missing maps into the folder on first use (else refuse).
        corpus: calibration text for a first-use fit (default: the Python 3.11 docs).
    Raises:
        RidgefillError: an unknown method or setting, a value of the wrong type or out of range,
            maps that are missing, corrupt or for another model.
    """
    if method is None and maps is not None and not isinstance(maps, FillMaps) and Path(maps).is_file():
        maps = load_maps(maps, lm)  # read once: it decides the default method and is then used
    if method is not None:
        label = method
    elif isinstance(maps, FillMaps):  # given maps: a tuned bundle runs tuned, plain maps their own method
        label = TUNED if TUNED in maps.header else maps.method
    else:
        label = default_method(lm, maps)
    name, from_name = parse_method(label)
    given = {k: v for k, v in (shared or {}).items() if v is not None}
    if name == TUNED and given:
        log.warning("tuned keeps its tuned settings; not applying %s (name them as tuned:key=value)", given)
    named = {**_as_values(settings), **overrides, **from_name}
    values = {**applicable(name, given), **named}
    if name != TUNED:
        # The model's measured settings serve the method named alone; named settings start from
        # the method's own defaults, so that a spelled-out configuration means the same everywhere.
        measured = {} if named or settings is not None else measured_settings(lm, name)
        return _resolve(lm, label, name, {**measured, **values}, values, maps, fit_missing, corpus, measured)
    cfg = tuned_config(lm, maps)
    known = {k: t for b in cfg.buckets for k, t in _field_types(get_method(b.method).settings or FillSettings).items()}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise RidgefillError(f"unknown setting {unknown[0]!r} for method 'tuned'; valid settings: {', '.join(known)}")
    chosen = []
    for b in cfg.buckets:
        # The bundle carries its own split's maps; a bucket at another split reads the folder's.
        # A bucket takes the settings asked that its method has; `values` are all named by the
        # caller (shared ones never reach tuned), so a None clears a setting, as for any method.
        cls = get_method(b.method).settings  # None for an exact bucket: it takes none
        asked = {k: v for k, v in values.items() if cls is not None and k in _field_types(cls)}
        check_values(b.method, get_method(b.method).settings, {**b.settings, **asked})
        read = maps_read(b.method, {**b.settings, **asked}, lm.num_layers)
        own = cfg.maps is not None and read == (cfg.maps.method, cfg.maps.split)
        where = cfg.maps if own else cfg.folder
        one = _resolve(lm, label, b.method, {**b.settings, **asked}, asked, where, fit_missing, corpus)
        if cfg.maps is None and one.maps is not None:  # shipped settings on the user's own maps
            check_calibration(lm.name, one.maps, lm.dtype_name)
        chosen.append((b.up_to, one))
    first = chosen[0][1]
    return first if len(chosen) == 1 else replace(first, by_length=tuple(chosen))


def measured_settings(lm: LoadedModel, name: str) -> dict[str, Any]:
    """The settings measured for `lm` that method `name` runs under the caller's own ({}: none)."""
    per_model = get_method(name).per_model
    return per_model(lm.name) if per_model is not None else {}


def _resolve(
    lm: LoadedModel,
    label: str,
    name: str,
    values: dict[str, Any],
    asked: dict[str, Any],
    maps: FillMaps | Path | str | None,
    fit_missing: bool,
    corpus: str | None,
    measured: dict[str, Any] | None = None,
) -> Prefill:
    """One method with its settings `values` (`asked`: those the caller named; `measured`: those
    of `values` that come from the model's measured defaults) and maps."""
    info = get_method(name)
    check_values(name, info.settings, values)
    if info.settings is None:
        return Prefill(label, name)
    resolved = info.settings(**{**info.defaults, **values})
    try:
        resolved.check(lm.num_layers)
    except RidgefillError as e:
        if not measured:
            raise
        spelled = ":".join(f"{k}={v}" for k, v in measured.items())
        raise RidgefillError(
            f"{e} (plain {name} on {lm.name} runs its measured {spelled}, here under the command's own options)"
        ) from None
    resolved = resolved.at(lm.num_layers)
    kind = reads_maps(info, resolved)
    if kind is None:
        return Prefill(label, name, resolved)
    at = resolved.MAPS_AT  # the settings field the maps' split must match: split or gate_layer
    found = _maps_for(lm, kind, getattr(resolved, at), maps, fit_missing, corpus)
    if found.split != getattr(resolved, at):
        if asked.get(at) is not None:
            raise MapError(
                f"the {kind} maps given are for split {found.split}, not the {at} {getattr(resolved, at)} asked"
            )
        resolved = replace(resolved, **{at: found.split})
        resolved.check(lm.num_layers)
    return Prefill(label, name, resolved, found)


def run_prefill(
    engine: Engine,
    input_ids: torch.Tensor,
    method: str = "exact",
    *,
    settings: Settings | None = None,
    maps: FillMaps | None = None,
    logit_rows: torch.Tensor | None = None,
    lower: LowerState | None = None,
    cache: DynamicCache | None = None,
) -> PrefillResult:
    """Run a registry method with settings and maps already in hand (no files are read): the
    low-level path for code that resolved them itself. `settings` must be the method's class."""
    info = get_method(method)
    if info.settings is None:
        if settings is not None or maps is not None:
            raise RidgefillError(f"method {method!r} takes no settings or maps")
    else:
        settings = info.settings(**info.defaults) if settings is None else settings
        if not isinstance(settings, info.settings):
            raise RidgefillError(f"method {method!r} takes {info.settings.__name__}, not {type(settings).__name__}")
        settings = settings.at(engine.parts.num_layers)
    if reads_maps(info, settings) is None and maps is not None:
        raise RidgefillError(f"method {method!r} reads no maps with these settings")
    return Prefill(method, method, settings, maps).run(
        engine, input_ids, logit_rows=logit_rows, lower=lower, cache=cache
    )


__all__ = [
    "METHODS",
    "TUNED",
    "Prefill",
    "applicable",
    "check_values",
    "default_method",
    "fit_first_use",
    "has_tuned",
    "measured_settings",
    "parse_method",
    "resolve_prefill",
    "run_prefill",
    "shipped_defaults",
    "tuned_path",
]
