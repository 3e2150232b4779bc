"""Tuned map bundles: the chosen split's maps with the tuner's configuration in the header.

What it is: `write_bundle` saves the ridge maps of the chosen split as a normal map file whose
JSON header also holds `tuned` (method, settings, budgets, what the tuner measured and the
command); `load_tuned` reads one back as (method, prefill kwargs), checking it belongs to the
model. Without a bundle, an embedded model falls back to the configuration the tuner chose on
the development machine (data/tuned.json) with the user's own fitted maps. The CLI's method name
`tuned` resolves through it. What it is not: the search.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from ridgefill.errors import MapError
from ridgefill.fit.maps import FillMaps, default_maps_dir, load_maps, save_maps
from ridgefill.methods import prefill_kwargs, settings_for
from ridgefill.models.loading import LoadedModel


def tuned_path(lm: LoadedModel, folder: Path | None = None) -> Path:
    """Where `ridgefill tune` writes the bundle by default: next to the model's fitted maps."""
    return (Path(folder) if folder is not None else default_maps_dir(lm)) / f"{lm.name}.tuned.safetensors"


def write_bundle(maps: FillMaps, tuned: dict, path: Path) -> Path:
    """Save `maps` with `tuned` (needs `method` and `settings`) added to the header."""
    if tuned.get("settings", {}).get("split") != maps.split:
        raise MapError(f"the tuned split {tuned.get('settings', {}).get('split')} is not the maps' split {maps.split}")
    return save_maps(FillMaps(maps.method, maps.split, maps.weights, {**maps.header, "tuned": tuned}), path)


def shipped_defaults() -> dict:
    """Per embedded model, the configuration `ridgefill tune` chose here, with its figures."""
    return json.loads(resources.files("ridgefill").joinpath("data/tuned.json").read_text())["models"]


def load_tuned(lm: LoadedModel, where: Path | None = None) -> tuple[str, dict]:
    """(method, kwargs for `run_prefill`/`generate`) for the method name `tuned`.

    `where`: a bundle file, or a map folder (default: the model's cache folder). In a folder, the
    bundle `ridgefill tune` wrote wins; else the shipped default for this model, with the maps
    of its split from that folder.
    """
    path = Path(where) if where is not None else None
    if path is not None and not path.is_dir():
        if not path.is_file():
            raise MapError(f"no tuned bundle at {path}; run `ridgefill tune --model {lm.name}` first")
        return _from_bundle(lm, path)
    bundle = tuned_path(lm, path)
    if bundle.is_file():
        return _from_bundle(lm, bundle)
    tuned = shipped_defaults().get(lm.name)
    if tuned is None:
        raise MapError(f"no tuned bundle at {bundle} and no shipped default for {lm.name}; run `ridgefill tune`")
    method = tuned["method"]
    return method, prefill_kwargs(lm, method, settings_for(method, **tuned["settings"]), path)


def _from_bundle(lm: LoadedModel, path: Path) -> tuple[str, dict]:
    maps = load_maps(path, lm)
    tuned = maps.header.get("tuned")
    if not isinstance(tuned, dict) or "settings" not in tuned:
        raise MapError(f"{path} is a map file without a tuned configuration; pass the bundle `ridgefill tune` wrote")
    settings = settings_for(tuned["method"], **tuned["settings"])
    settings.check(lm.num_layers)
    return tuned["method"], {"maps": maps, "settings": settings}
