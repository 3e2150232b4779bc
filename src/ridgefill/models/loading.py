"""Load a model by short name, Hugging Face directory, or GGUF file.

What it is: name resolution, GGUF dequantisation cached as safetensors (keyed by the file's
hash), the compute dtype and device (`auto`: models/device.py), and the `LoadedModel` bundle
the rest of the package takes. What it is not: a hub client or an installer: checkpoints are read
with `local_files_only`, and a missing embedded model is an error that says how to pull it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ridgefill.errors import RidgefillError, UnknownModelError
from ridgefill.models import hf
from ridgefill.models.device import pick_device, pick_dtype
from ridgefill.models.registry import DEFAULT_MODEL, KNOWN_MODELS, assemble, get_embedded, is_installed, sha256_file

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """ridgefill's cache root: `$RIDGEFILL_CACHE`, else `~/.cache/ridgefill`."""
    return Path(os.environ.get("RIDGEFILL_CACHE") or Path.home() / ".cache" / "ridgefill")


@dataclass
class LoadedModel:
    """A stock transformers model with its tokenizer and our flat view of its modules."""

    model: torch.nn.Module
    tokenizer: object
    name: str
    parts: hf.ModelParts

    @property
    def context_length(self) -> int:
        return self.parts.context_length

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def dtype_name(self) -> str:
        """The compute dtype as results and messages name it: float32, bfloat16, float16."""
        return str(self.dtype).removeprefix("torch.")

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def num_layers(self) -> int:
        return self.parts.num_layers


def _check_hf_dir(path: Path) -> None:
    try:
        cfg = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types for a bad config
        raise RidgefillError(f"could not read model config in {path}: {e}") from None
    arch = getattr(cfg, "model_type", "?")
    if arch not in hf.SUPPORTED_ARCHITECTURES:
        supported = ", ".join(sorted(hf.SUPPORTED_ARCHITECTURES))
        raise hf.UnsupportedArchitectureError(f"unsupported architecture {arch!r}; supported: {supported}")


def _dequantised_dir(gguf: Path) -> Path:
    """Dequantise a GGUF once into a safetensors checkpoint in the cache; return its folder.

    The folder is built beside its final name and its marker `ridgefill.json` written last, so a
    folder with a marker was complete when written. It is still checked on every use (marker,
    config, every safetensors file the size its header says): a damaged one is logged and rebuilt.
    """
    from ridgefill.files import safetensors_problem, write_text

    if not gguf.is_file():
        raise RidgefillError(f"GGUF file not found: {gguf}")
    with gguf.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise RidgefillError(f"{gguf} is not a GGUF file (bad magic bytes); is it corrupt or truncated?")
    digest = sha256_file(gguf, desc=f"hashing {gguf.name}")[:20]
    target = cache_dir() / "dequantized" / digest
    marker = target / "ridgefill.json"

    def problem() -> str | None:
        try:
            if json.loads(marker.read_text()).get("sha256_prefix") != digest:
                return "its ridgefill.json names another GGUF"
            json.loads((target / "config.json").read_text())
            index = target / "model.safetensors.index.json"  # a sharded checkpoint names its shards
            shards = {str(w) for w in json.loads(index.read_text())["weight_map"].values()} if index.is_file() else ()
        except (OSError, ValueError, RecursionError, AttributeError, KeyError, TypeError) as e:
            return f"{type(e).__name__}: {e}"
        weights = sorted({p.name for p in target.glob("*.safetensors")}.union(shards))
        if not weights:
            return "it holds no safetensors weights"
        return next(filter(None, (safetensors_problem(target / w) for w in weights)), None)

    if marker.is_file():
        why = problem()
        if why is None:
            return target
        log.warning("the dequantised cache %s is damaged (%s); rebuilding it from %s", target, why, gguf)
    log.info("dequantising %s into %s (once; takes 20-60 s)", gguf, target)
    tmp = target.with_name(digest + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except hf.UnsupportedArchitectureError:
        raise
    except Exception as e:  # a truncated or foreign GGUF fails deep inside the reader
        raise RidgefillError(f"could not load GGUF {gguf}: {type(e).__name__}: {e}") from None
    hf.check_supported(model)
    # The dequantised weights are plain floats; keeping the GGUF marker would make transformers
    # look for the GGUF again when loading the cache.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    write_text(tmp / marker.name, json.dumps({"source": str(gguf), "sha256_prefix": digest}))
    shutil.rmtree(target, ignore_errors=True)
    tmp.replace(target)
    return target


def resolve(name_or_path: str) -> tuple[Path, str]:
    """Map a short name, directory or GGUF path to a local HF checkpoint folder and a label."""
    if name_or_path in KNOWN_MODELS:
        em = get_embedded(name_or_path)
        if not is_installed(em):
            raise RidgefillError(f"{em.name} is not installed; run `ridgefill models pull {em.name}`")
        return _dequantised_dir(assemble(em, cache_dir())), em.name
    path = Path(name_or_path).expanduser()
    if path.suffix.lower() == ".gguf" or path.is_file():
        return _dequantised_dir(path), path.name
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise RidgefillError(f"{path} has no config.json; not a Hugging Face model directory")
        _check_hf_dir(path)
        return path, path.name
    get_embedded(name_or_path)  # raises with the list of known names
    raise UnknownModelError(name_or_path)  # pragma: no cover


def load_model(name_or_path: str = DEFAULT_MODEL, dtype: str = "auto", device: str = "auto") -> LoadedModel:
    """Load a supported causal LM for the engine. Nothing is downloaded or installed.

    Args:
        name_or_path: a short name (`ridgefill models list`), a HF model folder, or a .gguf file.
        dtype: "auto" (bf16 on CUDA and on CPUs where it runs faster, else fp32; models/device.py),
            "float32" (what the equivalence tests use), "bfloat16" or "float16".
        device: "auto" (CUDA when present), "cpu", "cuda" or "cuda:N".
    Raises:
        RidgefillError: an unknown name, a missing embedded model (with the command that pulls
            it), an unsupported architecture, a corrupt file, an unknown dtype or device.
    """
    dev = pick_device(device)
    torch_dtype = pick_dtype(dtype, dev)
    folder, label = resolve(name_or_path)
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch_dtype, attn_implementation="sdpa", local_files_only=True
    )
    model.to(dev).eval()
    return LoadedModel(model=model, tokenizer=tok, name=label, parts=hf.model_parts(model))
