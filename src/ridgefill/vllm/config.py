"""RidgeFill's settings inside vLLM: flat `ridgefill_*` keys on the model's config.

What it is: the one place that turns vLLM's `hf_overrides` into checked fill settings and back
(`overrides`), and that checks a map file against a checkpoint's config and weights before vLLM
starts. What it is not: the mechanism (vllm/step.py) or vLLM's own options.

Keys (all optional but the map file for ridge and kva):
  ridgefill_method          ridge (default), identity, kva, or off (the stock model)
  ridgefill_maps            path of a map file from `ridgefill fit` (ridge, kva)
  ridgefill_split           the split layer for identity (maps carry their own)
  ridgefill_sink            the first tokens that run every layer
  ridgefill_tail            the last prompt tokens that run every layer
  ridgefill_outlier_factor  split-state norm over the median above which a row runs fully (0: off)
  ridgefill_query_rows      about this many more rows run fully, chosen by the attention the
                            prompt's last tokens pay them at the split layer (0: off); only for
                            prompts scheduled whole in one step (methods/select.py)
  ridgefill_query_window, ridgefill_query_last, ridgefill_query_sentence, ridgefill_query_pool,
  ridgefill_query_layer, ridgefill_query_top
                            as in FillSettings
  ridgefill_by_length       a configuration tuned per prompt length: a list of
                            {"up_to": N or null, <row settings>} in ascending up_to, the last
                            null; each request takes the first entry its prompt fits (at most
                            up_to tokens), whose row settings (`ROW_SETTINGS`) replace the flat
                            ones; the rest (split, sink, outliers, query layer and top) is shared
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ridgefill.errors import MapError, RidgefillError
from ridgefill.fit.maps import FillMaps, load_maps
from ridgefill.methods.fill import FILL_METHODS, FillSettings
from ridgefill.methods.tuned import ascending_bounds, for_length

METHODS = (*FILL_METHODS, "off")
PREFIX = "ridgefill_"
_KEYS = {
    "method": str,
    "maps": str,
    "split": int,
    "sink": int,
    "tail": int,
    "outlier_factor": float,
    "query_rows": int,
    "query_window": int,
    "query_last": int,
    "query_sentence": int,
    "query_pool": int,
    "query_layer": int,
    "query_top": int,
    "by_length": list,
}
PREFIX_CACHING = (
    "prefix caching would hand filled K/V to later requests as if exact; turn it off with RidgeFill "
    "(--no-enable-prefix-caching, enable_prefix_caching=False)"
)
SETTINGS = tuple(k for k in _KEYS if k not in ("method", "maps", "by_length"))  # the fill settings by name
# The settings that only pick a request's full rows (step.split_rows): they may change with the
# prompt length inside one engine; the others shape the model (which layers, maps and scores).
ROW_SETTINGS = ("tail", "query_rows", "query_window", "query_last", "query_sentence", "query_pool")
_DEFAULTS = FillSettings()

# Our architectures and the stock vLLM class each one extends.
ARCHITECTURES = {
    "LlamaForCausalLM": "RidgeFillLlamaForCausalLM",
    "MistralForCausalLM": "RidgeFillLlamaForCausalLM",
    "Qwen2ForCausalLM": "RidgeFillQwen2ForCausalLM",
}


@dataclass(frozen=True)
class VllmFill:
    """Checked fill settings for one model in vLLM."""

    method: str
    settings: FillSettings
    maps_path: str | None = None
    by_length: tuple[tuple[int | None, FillSettings], ...] = ()  # ((up_to, settings), ...), or none

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    def settings_for(self, prompt_len: int) -> FillSettings:
        """The settings of a request whose prompt has `prompt_len` tokens."""
        return for_length(self.by_length, prompt_len, self.settings)

    @property
    def every_settings(self) -> tuple[FillSettings, ...]:
        """The flat settings and each length bucket's: what the model must be ready to run."""
        return (self.settings, *(s for _, s in self.by_length))

    @property
    def query_rows(self) -> bool:
        return any(s.query_rows for s in self.every_settings)

    @property
    def reads_sentences(self) -> bool:
        return any(s.reads_sentences for s in self.every_settings)

    @classmethod
    def from_config(cls, config) -> VllmFill:
        """Read the `ridgefill_*` attributes of a (transformers) model config; refuse unknown
        keys, wrong types, a missing map file and a split the model does not have."""
        found = {k[len(PREFIX) :]: v for k, v in vars(config).items() if k.startswith(PREFIX)}
        unknown = sorted(set(found) - set(_KEYS))
        if unknown:
            valid = ", ".join(PREFIX + k for k in _KEYS)
            raise RidgefillError(f"unknown RidgeFill setting {PREFIX}{unknown[0]}; valid: {valid}")
        for key, value in found.items():
            if key == "by_length":
                continue
            want = _KEYS[key]
            ok = isinstance(value, want) or (want is float and isinstance(value, int))
            if not ok or isinstance(value, bool):
                raise RidgefillError(f"{PREFIX}{key} must be {want.__name__}, got {value!r}")
        method = found.get("method", "ridge")
        if method not in METHODS:
            raise RidgefillError(f"{PREFIX}method {method!r} is not one of {', '.join(METHODS)}")
        factor = found.get("outlier_factor", _DEFAULTS.outlier_factor)
        settings = FillSettings(
            split=found.get("split"),
            sink=found.get("sink", _DEFAULTS.sink),
            tail=found.get("tail", _DEFAULTS.tail),
            outlier_factor=None if not factor else float(factor),
            **{k: found[k] for k in SETTINGS if k.startswith("query_") and k in found},
        )
        maps_path = found.get("maps")
        reads_maps = method in ("ridge", "kva")
        if reads_maps and not maps_path:
            raise RidgefillError(f"{PREFIX}method {method} needs {PREFIX}maps: a map file from `ridgefill fit`")
        if method in ("identity", "off") and maps_path:
            raise RidgefillError(f"{PREFIX}maps is given but {PREFIX}method {method} reads no maps")
        num_layers = int(config.num_hidden_layers)
        by_length = _by_length(found.get("by_length"), settings, method)
        # With maps and no split given, the maps' split decides: `load_maps` checks query_layer at it.
        deferred = reads_maps and settings.split is None
        for s in (settings, *(b for _, b in by_length)):
            (replace(s, query_layer=None) if deferred else s).check(num_layers)
        if not deferred:
            _check_scoring(method, settings.at(num_layers))
        return cls(method, settings.at(num_layers), maps_path, tuple((u, b.at(num_layers)) for u, b in by_length))

    def load_maps(self, config) -> FillMaps | None:
        """The map file, checked against the config's dimensions; the settings take its split."""
        if self.maps_path is None:
            return None
        maps = load_maps(Path(self.maps_path))
        if maps.method != self.method:
            raise MapError(f"{self.maps_path}: these are {maps.method} maps, not {self.method}")
        if self.settings.split is not None and self.settings.split != maps.split and _split_given(config):
            raise MapError(
                f"{self.maps_path}: the maps are for split {maps.split}, not {PREFIX}split {self.settings.split}"
            )
        try:  # the maps' split wins: the settings must hold at it (a query_layer other than it)
            at_maps = replace(self.settings, split=maps.split)
            at_maps.check(int(config.num_hidden_layers))
            _check_scoring(self.method, at_maps)
        except RidgefillError as e:
            raise MapError(f"{self.maps_path}: the maps are for split {maps.split}: {e}") from None
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        try:
            maps.check_dims(int(config.num_hidden_layers), int(config.hidden_size), int(kv_heads), int(head_dim))
        except MapError as e:
            raise MapError(f"{self.maps_path}: not maps for this model: {e}") from None
        return maps

    def with_split(self, split: int) -> VllmFill:
        by_length = tuple((u, replace(s, split=split)) for u, s in self.by_length)
        return replace(self, settings=replace(self.settings, split=split), by_length=by_length)


def _check_scoring(method: str, settings: FillSettings) -> None:
    """Refuse a query layer above the split for a method whose maps predict no layer input (in any
    length bucket's query rows: the layer is shared, so it is refused even where the flat settings
    have none)."""
    q = settings.query_layer
    if q is not None and q > settings.split and method != "ridge":
        raise RidgefillError(
            f"{PREFIX}query_layer {settings.query_layer} above the split scores on the ridge maps' "
            f"prediction; {method} makes none (a layer below the split {settings.split} scores on its exact input)"
        )


def _by_length(entries: object, settings: FillSettings, method: str) -> tuple[tuple[int | None, FillSettings], ...]:
    """`ridgefill_by_length` checked: ((up_to, the flat settings with the entry's row settings), ...)."""
    if entries is None:
        return ()
    key = PREFIX + "by_length"
    if not isinstance(entries, list | tuple) or not entries or not all(isinstance(e, dict) for e in entries):
        raise RidgefillError(f'{key} must be a non-empty list of {{"up_to": N or null, <row settings>}}')
    if method == "off":
        raise RidgefillError(f"{key} is given but {PREFIX}method is off")
    bounds = [e.get("up_to") for e in entries]
    ints = all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in bounds[:-1])
    if "up_to" not in entries[-1] or not ints or not ascending_bounds(bounds):
        raise RidgefillError(f"{key} needs ascending positive up_to bounds, the last one null (any longer prompt)")
    out = []
    for entry in entries:
        rows = {k: v for k, v in entry.items() if k != "up_to"}
        for k, v in rows.items():
            if k not in ROW_SETTINGS:
                raise RidgefillError(
                    f"{key}: {k!r} cannot change with the prompt length; per length: {', '.join(ROW_SETTINGS)}"
                )
            if not isinstance(v, int) or isinstance(v, bool):
                raise RidgefillError(f"{key}: {k} must be int, got {v!r}")
        out.append((entry["up_to"], replace(settings, **rows)))
    return tuple(out)


def _split_given(config) -> bool:
    return getattr(config, PREFIX + "split", None) is not None


def overrides(
    architecture: str,
    method: str = "ridge",
    maps: str | Path | None = None,
    by_length: list[dict] | None = None,
    **settings,
) -> dict:
    """`hf_overrides` that turn RidgeFill on for a checkpoint of `architecture` (its config's
    first entry), e.g. overrides("LlamaForCausalLM", maps="m.safetensors", tail=512); `by_length`
    as `ridgefill_by_length`."""
    if architecture not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise RidgefillError(f"RidgeFill in vLLM does not support {architecture}; supported: {supported}")
    out = {"architectures": [ARCHITECTURES[architecture]], PREFIX + "method": method}
    if maps is not None:
        out[PREFIX + "maps"] = str(Path(maps).resolve())
    for key, value in settings.items():
        if key not in SETTINGS:
            raise RidgefillError(f"unknown RidgeFill setting {key!r}; valid: {', '.join(SETTINGS)}")
        if value is not None:
            out[PREFIX + key] = value
    if by_length is not None:
        out[PREFIX + "by_length"] = [dict(e) for e in by_length]
    return out
