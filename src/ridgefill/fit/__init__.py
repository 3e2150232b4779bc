"""Fitting fill maps in closed form, and the map files they are stored in."""

from ridgefill.fit.maps import FillMaps, fingerprint, load_maps, save_maps

__all__ = ["FillMaps", "fingerprint", "load_maps", "save_maps"]
