"""Map files: fitted fill maps as safetensors plus a JSON header.

What it is: the `FillMaps` bundle (one method, one split, a (d+1, out) matrix per deep layer,
bias in the last row), a model fingerprint, and strict loading: a map for another model, a
corrupt file, or a non-finite map fails with a clear `MapError`. What it is not: fitting
(fit/ridge.py) or applying maps (methods/fill.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ridgefill.errors import MapError
from ridgefill.models.loading import LoadedModel

FORMAT_VERSION = 1
MAP_METHODS = ("ridge", "kva")


def fingerprint(lm: LoadedModel) -> dict:
    """Architecture, dimensions and a hash of a few weight tensors: enough to tell models apart."""
    cfg = lm.model.config
    h = hashlib.sha256()
    probes = [lm.parts.embed.weight[:64], lm.parts.layers[0].k_proj.weight, lm.parts.layers[-1].v_proj.weight]
    for t in probes:
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return {
        "architecture": lm.parts.arch,
        "num_layers": lm.num_layers,
        "hidden_size": int(cfg.hidden_size),
        "num_kv_heads": int(cfg.num_key_value_heads),
        "head_dim": int(lm.parts.layers[0].head_dim),
        "vocab_size": int(cfg.vocab_size),
        "weights_sha256": h.hexdigest()[:24],
    }


@dataclass
class FillMaps:
    """Fitted maps from the split layer's hidden state to every deeper layer.

    `weights[l]` is (d+1, out): rows 0..d-1 multiply the split state, row d is the bias.
    ridge: out = d (the layer's input). kva: out = 2 * H_kv * head_dim (pre-RoPE K, then V).
    """

    method: str
    split: int
    weights: dict[int, torch.Tensor]
    header: dict = field(default_factory=dict)
    _stacked: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.method not in MAP_METHODS:
            raise MapError(f"unknown map method {self.method!r}; expected one of {MAP_METHODS}")

    @property
    def layers(self) -> list[int]:
        return sorted(self.weights)

    def stacked(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """All deep layers side by side, for one fused GEMM: (d, L*out) weight and (L*out,) bias."""
        if dtype not in self._stacked:
            w = torch.cat([self.weights[i] for i in self.layers], dim=1)
            self._stacked[dtype] = (w[:-1].to(dtype).contiguous(), w[-1].to(dtype).contiguous())
        return self._stacked[dtype]

    def check_model(self, lm: LoadedModel) -> None:
        """Refuse maps fitted on another model, or not covering every deep layer."""
        want = self.header.get("model", {})
        have = fingerprint(lm)
        if want != have:
            diff = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
            raise MapError(
                f"these {self.method} maps were fitted on another model "
                f"({want.get('architecture')}, {want.get('num_layers')} layers; differs in {', '.join(diff)}); "
                f"fit maps for {lm.name} with `ridgefill fit --model {lm.name}`"
            )
        # Layer `split` itself reads the exact split state; maps start one layer deeper.
        expected = list(range(self.split + 1, lm.num_layers))
        if self.layers != expected:
            raise MapError(f"maps cover layers {self.layers}, but split {self.split} needs {expected}")


def default_maps_dir(lm: LoadedModel) -> Path:
    """Where `ridgefill fit` writes maps by default, keyed by the model's fingerprint."""
    from ridgefill.models.loading import cache_dir

    return cache_dir() / "maps" / f"{lm.name}-{fingerprint(lm)['weights_sha256'][:12]}"


def maps_filename(model_name: str, method: str, split: int) -> str:
    return f"{model_name}.{method}.s{split}.safetensors"


def find_maps(lm: LoadedModel, method: str, split: int, folder: Path | None = None) -> FillMaps:
    """Load the maps for (method, split) from `folder` (default: this model's cache folder)."""
    folder = Path(folder) if folder is not None else default_maps_dir(lm)
    path = folder / maps_filename(lm.name, method, split)
    if not path.is_file():
        raise MapError(
            f"no {method} maps for split {split} in {folder}; "
            f"run `ridgefill fit --model {lm.name} --splits {split}` first"
        )
    return load_maps(path, lm)


def calib_info(maps: FillMaps) -> dict:
    """What the maps were fitted on: calibration tokens, facts spliced per segment, corpus id."""
    fit = maps.header.get("fit", {})
    return {
        "tokens": fit.get("calib_tokens"),
        "facts": fit.get("facts", 0),
        "corpus": maps.header.get("corpus", {}).get("id"),
    }


def save_maps(maps: FillMaps, path: Path) -> Path:
    """Write a map file (safetensors; the header is stored as JSON in its metadata)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = {**maps.header, "method": maps.method, "split": maps.split, "format_version": FORMAT_VERSION}
    tensors = {f"layer.{i}": w.float().contiguous() for i, w in maps.weights.items()}
    tmp = path.with_name(path.name + ".partial")
    save_file(tensors, str(tmp), metadata={"ridgefill": json.dumps(header)})
    tmp.replace(path)
    return path


def load_maps(path: str | Path, lm: LoadedModel | None = None) -> FillMaps:
    """Read and validate a map file; with `lm`, also check it was fitted on that model."""
    path = Path(path)
    if not path.is_file():
        raise MapError(f"map file not found: {path}")
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
        header = json.loads(meta["ridgefill"])
        method, split = header["method"], int(header["split"])
    except (SafetensorError, OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        raise MapError(f"{path} is not a ridgefill map file (corrupt or foreign): {type(e).__name__}: {e}") from None
    weights = {}
    for name, w in tensors.items():
        if not torch.isfinite(w).all():
            raise MapError(f"{path}: {name} contains NaN or infinite values; refit the maps")
        weights[int(name.split(".")[1])] = w
    maps = FillMaps(method, split, weights, header)
    if lm is not None:
        maps.check_model(lm)
    return maps
