"""Model loading and the transformers boundary."""

from ridgefill.models.loading import LoadedModel, cache_dir, load_model
from ridgefill.models.registry import DEFAULT_MODEL, KNOWN_MODELS

__all__ = ["DEFAULT_MODEL", "KNOWN_MODELS", "LoadedModel", "cache_dir", "load_model"]
