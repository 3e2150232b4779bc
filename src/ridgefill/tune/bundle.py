"""Tuned map bundles: the chosen split's maps with the tuner's configuration in the header.

What it is: `write_bundle` saves the ridge maps of the chosen split as a normal map file whose
JSON header also holds `tuned` (method, settings, budgets, what the tuner measured and the
command); `load_tuned` reads one back as (method, prefill kwargs), checking it belongs to the
model. The CLI's method name `tuned` resolves through it. What it is not: the search.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from ridgefill.errors import MapError
from ridgefill.fit.maps import FillMaps, default_maps_dir, load_maps, save_maps
from ridgefill.methods.fill import FillSettings
from ridgefill.models.loading import LoadedModel


def tuned_path(lm: LoadedModel, folder: Path | None = None) -> Path:
    """Where `ridgefill tune` writes the bundle by default: next to the model's fitted maps."""
    return (Path(folder) if folder is not None else default_maps_dir(lm)) / f"{lm.name}.tuned.safetensors"


def write_bundle(maps: FillMaps, tuned: dict, path: Path) -> Path:
    """Save `maps` with `tuned` (needs `method` and `settings`) added to the header."""
    if tuned.get("settings", {}).get("split") != maps.split:
        raise MapError(f"the tuned split {tuned.get('settings', {}).get('split')} is not the maps' split {maps.split}")
    return save_maps(FillMaps(maps.method, maps.split, maps.weights, {**maps.header, "tuned": tuned}), path)


def load_tuned(lm: LoadedModel, path: Path | None = None) -> tuple[str, dict]:
    """(method, kwargs for `run_prefill`/`generate`) from a tuned bundle (default: `tuned_path`)."""
    path = Path(path) if path is not None else tuned_path(lm)
    if path.is_dir():
        path = tuned_path(lm, path)
    if not path.is_file():
        raise MapError(f"no tuned bundle at {path}; run `ridgefill tune --model {lm.name}` first")
    maps = load_maps(path, lm)
    tuned = maps.header.get("tuned")
    if not isinstance(tuned, dict) or "settings" not in tuned:
        raise MapError(f"{path} is a map file without a tuned configuration; pass the bundle `ridgefill tune` wrote")
    known = {f.name for f in fields(FillSettings)}
    settings = FillSettings(**{k: v for k, v in tuned["settings"].items() if k in known})
    settings.check(lm.num_layers)
    return tuned["method"], {"maps": maps, "settings": settings}
