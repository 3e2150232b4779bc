"""Map files: fitted fill maps as safetensors plus a JSON header.

What it is: the `FillMaps` bundle (one method, one split, a (d+1, out) matrix per deep layer,
bias in the last row), a model fingerprint, atomic saving, and strict loading: a map for another
model, a corrupt or crafted file, a tensor of the wrong name, type or shape, or a non-finite map
fails with a one-line `MapError` naming the file. What it is not: fitting (fit/ridge.py) or
applying maps (methods/fill.py).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ridgefill.errors import MapError
from ridgefill.files import atomic_path
from ridgefill.models.loading import LoadedModel

FORMAT_VERSION = 1  # float32 `layer.<i>` tensors; the header as JSON under the metadata key "ridgefill"
MAP_METHODS = ("ridge", "kva")
_TENSOR_NAME = re.compile(r"layer\.([0-9]+)")
_HEADER_OBJECTS = ("model", "fit", "corpus", "tuned")  # header keys whose values are JSON objects


def fingerprint(lm: LoadedModel) -> dict:
    """Architecture, dimensions and a hash of a few weight tensors: enough to tell models apart."""
    cfg = lm.model.config
    parts = lm.parts
    return {
        "architecture": lm.parts.arch,
        "num_layers": lm.num_layers,
        "hidden_size": int(cfg.hidden_size),
        "num_kv_heads": int(cfg.num_key_value_heads),
        "head_dim": int(lm.parts.layers[0].head_dim),
        "vocab_size": int(cfg.vocab_size),
        "weights_sha256": weights_digest(
            parts.embed.weight, parts.layers[0].k_proj.weight, parts.layers[-1].v_proj.weight
        ),
    }


def weights_digest(embed: torch.Tensor, first_k: torch.Tensor, last_v: torch.Tensor) -> str:
    """Hash of the first 64 embedding rows, layer 0's K projection and the last layer's V projection
    (as float32 values: the same model loaded at another dtype hashes differently)."""
    h = hashlib.sha256()
    for t in (embed[:64], first_k, last_v):
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:24]


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

    def stacked(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """All deep layers side by side, for one fused GEMM: (d, L*out) weight and (L*out,) bias,
        in `dtype` on `device` (cached per pair)."""
        key = (dtype, str(device))
        if key not in self._stacked:
            w = torch.cat([self.weights[i] for i in self.layers], dim=1).to(device)
            self._stacked[key] = (w[:-1].to(dtype).contiguous(), w[-1].to(dtype).contiguous())
        return self._stacked[key]

    def predict(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """Ridge maps: the predicted input of deep `layer` from split states x (..., d), in x's dtype."""
        if self.method != "ridge" or layer not in self.weights:
            raise MapError(f"these {self.method} maps at split {self.split} predict no input of layer {layer}")
        w = self.weights[layer].to(x.device, x.dtype)
        return x @ w[:-1] + w[-1]

    def check_model(self, lm: LoadedModel) -> None:
        """Refuse maps fitted on another model, of the wrong shape, or not covering every deep layer."""
        want = self.header.get("model", {})
        have = fingerprint(lm)
        if want != have:
            diff = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
            raise MapError(
                f"these {self.method} maps were fitted on another model "
                f"({want.get('architecture')}, {want.get('num_layers')} layers; differs in {', '.join(diff)}); "
                f"fit maps for {lm.name} with `ridgefill fit --model {lm.name}`"
            )
        self.check_dims(lm.num_layers, have["hidden_size"], have["num_kv_heads"], have["head_dim"])

    def check_dims(self, num_layers: int, hidden_size: int, num_kv_heads: int, head_dim: int) -> None:
        """Refuse maps whose layers or matrix shapes do not fit a model of these dimensions:
        one map per layer split+1..num_layers-1, each (hidden_size + 1, out) with out = hidden_size
        (ridge) or 2 * num_kv_heads * head_dim (kva)."""
        rows, out = hidden_size + 1, hidden_size if self.method == "ridge" else 2 * num_kv_heads * head_dim
        for i in self.layers:
            if tuple(self.weights[i].shape) != (rows, out):
                raise MapError(
                    f"the {self.method} map of layer {i} is {tuple(self.weights[i].shape)}, but this model needs "
                    f"({rows}, {out}) (hidden size {hidden_size}, {num_kv_heads} KV heads of {head_dim})"
                )
        # Layer `split` itself reads the exact split state; maps start one layer deeper.
        expected = list(range(self.split + 1, num_layers))
        if self.layers != expected:
            raise MapError(f"maps cover layers {self.layers}, but split {self.split} needs {expected}")


def default_maps_dir(lm: LoadedModel) -> Path:
    """Where `ridgefill fit` writes maps by default, keyed by the model's fingerprint."""
    return maps_dir(lm.name, fingerprint(lm)["weights_sha256"])


def maps_dir(model_name: str, weights_sha256: str) -> Path:
    """The cache folder of a model's maps, named by the model and its `weights_digest`."""
    from ridgefill.models.loading import cache_dir

    return cache_dir() / "maps" / f"{model_name}-{weights_sha256[:12]}"


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
    """Write a map file (safetensors; the header is stored as JSON in its metadata), atomically."""
    path = Path(path)
    header = {**maps.header, "method": maps.method, "split": maps.split, "format_version": FORMAT_VERSION}
    tensors = {f"layer.{i}": w.float().contiguous() for i, w in maps.weights.items()}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"ridgefill": json.dumps(header)})
    return path


def load_maps(path: str | Path, lm: LoadedModel | None = None) -> FillMaps:
    """Read and validate a map file; with `lm`, also check it was fitted on that model.

    Always checked: the file is safetensors with a JSON-object header whose `method` is a map
    method and `split` a layer index; its tensors are float32 matrices named `layer.<i>`, all of
    one (d+1, out) shape, finite, on consecutive layers from split+1; where the header names the
    model's dimensions, the shapes and layers fit them. With `lm`, against the model itself.
    Every failure is a `MapError` whose one line starts with the file's path.
    """
    path = Path(path)
    if not path.is_file():
        raise MapError(f"map file not found: {path}")
    try:
        maps = _parse(*_read(path))
        if lm is not None:
            maps.check_model(lm)
    except MapError as e:
        raise MapError(f"{path}: {e}") from None
    return maps


def _read(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The JSON header and the tensors of a map file, or a `MapError` saying why not."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # safetensors and torch raise several types for a crafted file
        raise MapError(f"not a ridgefill map file (corrupt or foreign): {type(e).__name__}: {e}") from None
    if "ridgefill" not in meta:
        raise MapError("not a ridgefill map file: its metadata has no ridgefill header")
    try:
        header = json.loads(meta["ridgefill"])
    except (ValueError, RecursionError) as e:
        raise MapError(f"its ridgefill header is not valid JSON: {type(e).__name__}: {e}") from None
    if not isinstance(header, dict):
        raise MapError(f"its ridgefill header is a JSON {type(header).__name__}, not an object")
    return header, tensors


def _parse(header: dict, tensors: dict[str, torch.Tensor]) -> FillMaps:
    """`FillMaps` from a header and tensors, checking everything that needs no model."""
    method, split = header.get("method"), header.get("split")
    if not isinstance(method, str) or method not in MAP_METHODS:
        raise MapError(f"the header's method {method!r} is not one of {', '.join(MAP_METHODS)}")
    if not isinstance(split, int) or isinstance(split, bool) or split < 0:
        raise MapError(f"the header's split {split!r} is not a layer index")
    if header.get("format_version", FORMAT_VERSION) != FORMAT_VERSION:
        raise MapError(f"map format version {header['format_version']!r}; this ridgefill reads {FORMAT_VERSION}")
    for key in _HEADER_OBJECTS:
        if key in header and not isinstance(header[key], dict):
            raise MapError(f"the header's {key!r} is not a JSON object")
    if not tensors:
        raise MapError("it holds no maps")
    weights: dict[int, torch.Tensor] = {}
    for name, w in tensors.items():
        m = _TENSOR_NAME.fullmatch(name)
        if m is None:
            raise MapError(f"tensor {name!r} is not named layer.<index>")
        i = int(m.group(1))
        if i in weights:
            raise MapError(f"two tensors hold the map of layer {i}")
        if w.dtype != torch.float32 or w.dim() != 2:
            raise MapError(f"{name} is a {w.dim()}-D {w.dtype} tensor, not a float32 matrix")
        if not torch.isfinite(w).all():
            raise MapError(f"{name} contains NaN or infinite values; refit the maps")
        weights[i] = w
    shapes = sorted({tuple(w.shape) for w in weights.values()})
    rows, out = shapes[0]
    odd = out != rows - 1 if method == "ridge" else out % 2 == 1  # ridge: (d+1, d); kva: (d+1, 2 * K/V width)
    if len(shapes) > 1 or rows < 2 or out < 1 or odd:
        raise MapError(f"its maps are {', '.join(map(str, shapes))}: not {method} maps of one (d+1, out) shape")
    maps = FillMaps(method, split, weights, header)
    if maps.layers != list(range(split + 1, split + 1 + len(weights))):
        raise MapError(f"maps cover layers {maps.layers}, but split {split} needs consecutive layers from {split + 1}")
    dims = [header.get("model", {}).get(k) for k in ("num_layers", "hidden_size", "num_kv_heads", "head_dim")]
    if all(isinstance(v, int) and not isinstance(v, bool) for v in dims):
        maps.check_dims(*dims)
    return maps
