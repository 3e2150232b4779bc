"""Tuned map bundles: the chosen split's maps with the tuner's configuration in the header.

What it is: `write_bundle` saves the ridge maps of the chosen split as a normal map file whose
JSON header also holds `tuned` (method, settings, budgets, what the tuner measured and the
command). Reading one back is the resolver's job (`resolve_prefill(lm, "tuned")`,
methods/resolve.py), which also falls back to the configuration shipped for an embedded model
(data/tuned.json). What it is not: the search.
"""

from __future__ import annotations

from pathlib import Path

from ridgefill.errors import MapError
from ridgefill.fit.maps import FillMaps, save_maps
from ridgefill.methods.tuned import buckets, shipped_defaults, tuned_path
from ridgefill.tune.space import maps_split

__all__ = ["shipped_defaults", "tuned_path", "write_bundle"]


def write_bundle(maps: FillMaps, tuned: dict, path: Path) -> Path:
    """Save `maps` with `tuned` added to the header: one configuration (`method`, `settings`) or
    length buckets (`by_length`, methods/tuned.py), one of which must read these maps' split
    unless none reads maps (token gates scoring at their own layer). Buckets at other splits read
    the maps in `tuned["maps_folder"]` (the tuner records it)."""
    entries = [e for e in buckets(tuned, str(path)) if maps_split(e.method, e.settings) is not None]
    if entries and not any(maps_split(e.method, e.settings) == maps.split for e in entries):
        splits = sorted({e.settings.get("split") for e in entries}, key=str)
        raise MapError(f"the tuned split(s) {splits} do not include the maps' split {maps.split}")
    return save_maps(FillMaps(maps.method, maps.split, maps.weights, {**maps.header, "tuned": tuned}), path)
