"""Natural text for calibration and evaluation, with a document-level split.

What it is: the default corpus (the reStructuredText sources of the Python 3.11 documentation,
Debian package `python3.11-doc`), user files (.txt, .md, .rst, .jsonl with a "text" field, or a
folder of them), light markup cleaning, a deterministic split by document id so calibration and
evaluation never share a document, and token segments. What it is not: a downloader; the
default corpus comes from the system package manager (`make` installs it). The other named text
domains, which are evaluation text only, live in `domains.py`.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ridgefill.errors import RidgefillError

DEFAULT_CORPUS_DIR = Path("/usr/share/doc/python3.11/html/_sources")
DEFAULT_CORPUS_ID = "debian:python3.11-doc"
TEXT_SUFFIXES = (".txt", ".md", ".rst")
# Of 10 hash buckets: 3 are evaluation-only, 1 is held out for choosing lambda, 6 calibrate.
SPLIT_OF_BUCKET = ("eval",) * 3 + ("heldout",) + ("calib",) * 6
SPLITS = ("calib", "heldout", "eval")

_ROLE = re.compile(r":[\w:+-]+:`!?~?([^`<]*?)(?:\s*<[^>]*>)?`")
_DIRECTIVE = re.compile(r"^\s*\.\. .*$")
_UNDERLINE = re.compile(r"^\s*([=\-~^*#+\"'`])\1{3,}\s*$")


@dataclass(frozen=True)
class Document:
    id: str  # path relative to the corpus root, stable across machines
    text: str

    @property
    def split(self) -> str:
        """ "calib", "heldout" or "eval", fixed by a hash of the id (never by position in a list)."""
        return SPLIT_OF_BUCKET[int(hashlib.sha1(self.id.encode()).hexdigest(), 16) % 10]


@dataclass(frozen=True)
class Corpus:
    id: str
    documents: tuple[Document, ...]
    domain: str | None = None  # the named domain (`domains.DOMAINS`), None for the user's own files
    eval_only: bool = False  # every document is evaluation text; it has no calibration part

    def part(self, split: str) -> list[Document]:
        """The documents of one split. An evaluation-only corpus has only "eval" (all of it): asking
        it for calibration or held-out text is an error, so no fit or tuner can read it."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
        if self.eval_only:
            if split != "eval":
                raise RidgefillError(
                    f"{self.id} is evaluation text only; calibration and held-out text come from the docs domain"
                )
            return list(self.documents)
        return [d for d in self.documents if d.split == split]

    def describe(self) -> str:
        """e.g. "prose (debian:r-cran-janeaustenr)", or the user corpus's id."""
        return f"{self.domain} ({self.id})" if self.domain else self.id


def clean_rst(text: str) -> str:
    """Strip reStructuredText markup that is not prose: roles, directives, heading rules."""
    lines = []
    for line in text.splitlines():
        if _DIRECTIVE.match(line) or _UNDERLINE.match(line):
            continue
        lines.append(_ROLE.sub(r"\1", line).replace("``", ""))
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def _read_file(path: Path, root: Path) -> Iterator[Document]:
    rel = str(path.relative_to(root)) if path != root else path.name
    if path.suffix == ".jsonl":
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise RidgefillError(f"{path}:{i + 1}: expected a JSON object with a 'text' field") from None
            yield Document(f"{rel}#{i}", str(text))
    else:
        text = path.read_text(encoding="utf-8", errors="replace")
        yield Document(rel, clean_rst(text) if ".rst" in path.name else text)


def load_corpus(source: str | Path | None = None, min_chars: int = 2000) -> Corpus:
    """Load documents from the default corpus or a user file or folder.

    Args:
        source: None for the default corpus, else a file or a folder (searched recursively).
        min_chars: documents shorter than this are dropped (tables of contents, stubs).
    """
    if source is None:
        root, corpus_id = DEFAULT_CORPUS_DIR, DEFAULT_CORPUS_ID
        if not root.is_dir():
            raise RidgefillError(
                f"the default calibration corpus is missing ({root}); install it with "
                "`apt-get install python3.11-doc` (as root; `make demo` does this) or pass --corpus PATH"
            )
    else:
        root, corpus_id = Path(source).expanduser(), f"user:{Path(source).name}"
        if not root.exists():
            raise RidgefillError(f"corpus not found: {root}")
    if root.is_file():
        files = [root]
    else:
        files = sorted(
            p for p in root.rglob("*") if p.is_file() and (p.suffix in (*TEXT_SUFFIXES, ".jsonl") or ".rst" in p.name)
        )
    docs = tuple(d for f in files for d in _read_file(f, root.parent if root.is_file() else root))
    docs = tuple(d for d in docs if len(d.text) >= min_chars)
    if not docs:
        raise RidgefillError(f"no usable documents (>= {min_chars} characters) in {root}")
    return Corpus(corpus_id, docs, domain="docs" if source is None else None)


def token_segments(
    tokenizer, docs: list[Document], segment_tokens: int, max_tokens: int, per_doc: int | None = None
) -> tuple[list[list[int]], list[str]]:
    """Cut documents into segments of exactly `segment_tokens` tokens, up to `max_tokens` in all.

    Documents are joined with the tokenizer's EOS, in an order fixed by a hash of their ids (so a
    short budget still mixes topics rather than taking one section of the corpus). At most
    `per_doc` tokens (default: one segment) are taken from each document, for variety.
    Returns (segments, ids of the documents used).
    """
    per_doc = per_doc or segment_tokens
    sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream: list[int] = []
    used: list[str] = []
    for d in sorted(docs, key=lambda d: hashlib.sha1(d.id.encode()).hexdigest()):
        if len(stream) >= max_tokens:
            break
        stream += tokenizer(d.text, add_special_tokens=False)["input_ids"][:per_doc] + sep
        used.append(d.id)
    n_seg = min(len(stream), max_tokens) // segment_tokens
    if n_seg == 0:
        raise RidgefillError(f"the corpus has only {len(stream)} tokens; need at least one segment of {segment_tokens}")
    return [stream[i * segment_tokens : (i + 1) * segment_tokens] for i in range(n_seg)], used
