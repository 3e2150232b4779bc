"""The `tuned` method's configurations: what `ridgefill tune` chose, per model and prompt length.

What it is: reading a tuned configuration from a bundle (`ridgefill tune` writes the chosen maps
with the configuration in their header) or from the configurations shipped for the embedded
models (data/tuned.json), as a list of length buckets: each bucket holds the method and settings
for prompts up to `up_to` tokens (the last bucket: any longer prompt). A configuration chosen at
one length is one bucket. Bucket bounds between tuned lengths sit at their geometric mean
(`length_bounds`). What it is not: resolution into a runnable prefill (methods/resolve.py).
"""

from __future__ import annotations

import functools
import json
import logging
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ridgefill.errors import MapError
from ridgefill.fit.maps import FillMaps, calib_info, default_maps_dir, load_maps
from ridgefill.models.loading import LoadedModel

log = logging.getLogger(__name__)

TUNED = "tuned"


def for_length(by_length, n: int, default):
    """The entry of `by_length` ((up_to, value), ...) that serves a prompt of `n` tokens: the first
    whose `up_to` holds it (None: any length); `default` where there is none."""
    return next((v for up_to, v in by_length if up_to is None or n <= up_to), default)


def ascending_bounds(bounds: list) -> bool:
    """Whether length buckets' `up_to` bounds are well formed: ascending, the last one None."""
    return bool(bounds) and bounds[-1] is None and None not in bounds[:-1] and bounds[:-1] == sorted(set(bounds[:-1]))


@dataclass(frozen=True)
class Bucket:
    """One tuned configuration: `method` with `settings` for prompts of at most `up_to` tokens
    (None: no upper bound)."""

    up_to: int | None
    method: str
    settings: dict


@dataclass(frozen=True)
class TunedConfig:
    """A model's tuned buckets (ascending `up_to`, the last unbounded), the bundle's maps (None for
    a shipped configuration) and the folder the other buckets' maps come from (None: the cache)."""

    buckets: tuple[Bucket, ...]
    maps: FillMaps | None
    folder: Path | None
    source: str


def tuned_path(lm: LoadedModel, folder: Path | None = None) -> Path:
    """Where `ridgefill tune` writes a model's bundle by default: next to its fitted maps."""
    return (Path(folder) if folder is not None else default_maps_dir(lm)) / f"{lm.name}.tuned.safetensors"


@functools.cache
def shipped_defaults() -> dict:
    """Per embedded model, the configuration `ridgefill tune` chose, with its measured figures."""
    return json.loads(resources.files("ridgefill").joinpath("data/tuned.json").read_text())["models"]


def shipped_calib_tokens(name: str) -> int | None:
    """The calibration tokens the maps behind `name`'s shipped configuration were fitted on, where it
    names them (`calib_tokens`); None: the fit's own default."""
    entry = shipped_defaults().get(name)
    n = entry.get("calib_tokens") if isinstance(entry, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def check_calibration(name: str, maps: FillMaps, dtype: str) -> None:
    """Warn (once per model and split) where cached maps were fitted on less calibration text than
    the maps the shipped configuration was measured with: they run, with a larger fill error."""
    want = shipped_calib_tokens(name)
    have = calib_info(maps)["tokens"]
    if want is not None and isinstance(have, int) and have < want:
        _say_calibration(name, maps.method, maps.split, have, want, dtype)


@functools.cache
def _say_calibration(name: str, method: str, split: int, have: int, want: int, dtype: str) -> None:
    log.warning(
        "the %s maps of %s at split %d were fitted on %d calibration tokens; its tuned configuration was measured "
        "with maps fitted on %d: refit them with `ridgefill fit --model %s --dtype %s --splits %d --methods %s`",
        *(method, name, split, have, want, name, dtype, split, method),
    )


def has_tuned(lm: LoadedModel, maps: Path | str | None = None) -> bool:
    """Whether `tuned` resolves for this model: a bundle in the map folder (`maps`, default the
    cache folder), or a shipped default."""
    where = Path(maps) if maps is not None else None
    return tuned_path(lm, where).is_file() or lm.name in shipped_defaults()


def default_method(lm: LoadedModel, maps: Path | str | None = None) -> str:
    """`tuned` where the model has a tuned configuration, else `exact` (logged once per model, with
    how to tune)."""
    if has_tuned(lm, maps):
        return TUNED
    _say_untuned(lm.name)
    return "exact"


@functools.cache
def _say_untuned(name: str) -> None:
    log.warning("no tuned configuration for %s; prefilling exactly (`ridgefill tune --model ...` makes one)", name)


def length_bounds(lengths: list[int]) -> list[int | None]:
    """Upper bounds of the buckets for configurations tuned at ascending `lengths`: the geometric
    mean of neighbours (4096, 8192, 16384 -> 5793, 11585, None)."""
    return [round(math.sqrt(a * b)) for a, b in zip(lengths, lengths[1:], strict=False)] + [None]


def buckets(entry: object, where: str) -> tuple[Bucket, ...]:
    """The buckets of a tuned entry: `{"method", "settings", ...}` (one configuration for every
    length) or `{"by_length": [{"up_to", "method", "settings", ...}, ...]}`; malformed -> MapError."""

    def one(item: object, up_to: object) -> Bucket:
        ok = isinstance(item, dict) and isinstance(item.get("method"), str) and isinstance(item.get("settings"), dict)
        if not ok or not (up_to is None or isinstance(up_to, int) and not isinstance(up_to, bool) and up_to > 0):
            raise MapError(f"{where}: a tuned configuration needs a method, settings and a positive up_to (or null)")
        return Bucket(up_to, item["method"], dict(item["settings"]))

    if not isinstance(entry, dict):
        raise MapError(f"{where}: the tuned configuration is not an object")
    if "by_length" not in entry:
        return (one(entry, None),)
    items = entry["by_length"]
    if not isinstance(items, list) or not items:
        raise MapError(f"{where}: by_length must be a non-empty list")
    out = tuple(one(item, item.get("up_to") if isinstance(item, dict) else 0) for item in items)
    bounds = [b.up_to for b in out]
    if not ascending_bounds(bounds):
        raise MapError(f"{where}: by_length needs ascending up_to bounds, the last one null")
    return out


def tuned_config(lm: LoadedModel, maps: FillMaps | Path | str | None) -> TunedConfig:
    """`tuned` for `lm`: a bundle (given as maps or a file), the bundle in a folder (default: the
    model's cache folder), else the shipped configuration with maps from that folder."""
    if isinstance(maps, FillMaps):
        return _from_bundle(maps, "the given maps", None)
    where = Path(maps) if maps is not None else None
    if where is not None and not where.is_dir():
        if not where.is_file():
            raise MapError(f"no tuned bundle at {where}; run `ridgefill tune --model {lm.name}` first")
        return _from_bundle(load_maps(where, lm), str(where), where.parent)
    bundle = tuned_path(lm, where)
    if bundle.is_file():
        return _from_bundle(load_maps(bundle, lm), str(bundle), bundle.parent)
    entry = shipped_defaults().get(lm.name)
    if entry is None:
        raise MapError(f"no tuned bundle at {bundle} and no shipped configuration for {lm.name}; run `ridgefill tune`")
    return TunedConfig(buckets(entry, f"the shipped configuration of {lm.name}"), None, where, "shipped")


def _from_bundle(maps: FillMaps, where: str, folder: Path | None) -> TunedConfig:
    entry = maps.header.get(TUNED)
    if entry is None:
        raise MapError(f"{where} is a map file without a tuned configuration; pass the bundle `ridgefill tune` wrote")
    recorded = entry.get("maps_folder") if isinstance(entry, dict) else None
    if isinstance(recorded, str) and Path(recorded).is_dir():
        folder = Path(recorded)  # where the tuner found the other splits' maps
    return TunedConfig(buckets(entry, where), maps, folder, where)
