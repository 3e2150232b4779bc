"""Named text domains for evaluation: where each one's files come from and how to read them.

What it is: a table of domains (`DOMAINS`), each a Debian package installed by name, the place
its files land, the reader that turns them into documents, and its corpus id; `load_domain`
returns one as a `Corpus`. `docs` (the Python 3.11 documentation) is the default corpus of
`corpus.py`, the only domain with calibration text: its hash split gives calibration, held-out and
evaluation documents. Every other domain is evaluation text only (`Corpus.eval_only`): all of its
documents are evaluation documents, and asking it for calibration or held-out text is an error, so
maps stay fitted on `docs`. What it is not: an installer or a downloader (`make corpus` installs
the packages; a missing one is an error that names the install command).
"""

from __future__ import annotations

import re
import struct
import subprocess
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ridgefill.corpus import DEFAULT_CORPUS_DIR, DEFAULT_CORPUS_ID, Corpus, Document, load_corpus
from ridgefill.errors import RidgefillError

MIN_CHARS = 2000  # as `load_corpus`: shorter documents (stubs, front matter) are dropped

# Project Gutenberg's header and footer markers, old and new wording ("*** START OF THE PROJECT
# GUTENBERG EBOOK EMMA ***", "*** END OF THIS PROJECT GUTENBERG EBOOK ...", "End of the Project
# Gutenberg EBook of ...").
_PG_START = re.compile(r"^\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.IGNORECASE | re.MULTILINE)
_PG_END = re.compile(
    r"^(\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$", re.IGNORECASE | re.MULTILINE
)
_CHAPTER = re.compile(r"^\s*chapter\s+([0-9]+|[ivxlc]+)\.?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Domain:
    """A kind of text, its Debian package and how to read it.

    `version` is the package version the domain was written against (for `docs` and `code`, a
    Debian 12 security update `+deb12uN` of it may be what apt installs; `corpus_info` records the
    installed one). `read` turns `root` into documents.
    """

    name: str
    text: str  # what kind of text, for humans
    package: str
    version: str
    root: Path  # where the package puts the files `read` reads
    corpus_id: str
    install: str  # the exact command that installs the package
    read: Callable[[Domain], tuple[Document, ...]]
    calibration: bool = False  # True only for docs: its hash split holds the calibration text


def strip_gutenberg(text: str) -> str:
    """The text between Project Gutenberg's START and END markers (the licence and the
    transcriber's header are outside them); text without markers is returned as it is."""
    start = _PG_START.search(text)
    if start:
        text = text[start.end() :]
    end = _PG_END.search(text)
    if end:
        text = text[: end.start()]
    return text.strip()


def unwrap(lines: list[str]) -> str:
    """Hard-wrapped lines (Gutenberg's ~70 columns) joined into paragraphs, one blank line between."""
    paras, cur = [], []
    for line in [*lines, ""]:
        if line.strip():
            cur.append(line.strip())
        elif cur:
            paras.append(" ".join(cur))
            cur = []
    return "\n\n".join(paras)


def r_character_vectors(path: Path) -> list[list[str]]:
    """The character vectors of an R lazy-load database (`data/Rdata.rdb`), in file order.

    Each entry is a 4-byte big-endian length and a zlib stream holding one object in R's
    serialization format, version 3 (R Internals, "Serialization Formats"): "X\\n", three ints,
    the native encoding's name, then the object. Only plain character vectors (STRSXP, type 16,
    without attributes) are read; anything else is an error.
    """
    raw, pos, out = path.read_bytes(), 0, []
    while pos < len(raw):
        d = zlib.decompressobj()
        try:
            obj = d.decompress(raw[pos + 4 :])
        except zlib.error as e:
            raise RidgefillError(f"{path}: not an R lazy-load database ({e})") from None
        pos = len(raw) - len(d.unused_data)
        if obj[:2] != b"X\n" or struct.unpack(">i", obj[2:6])[0] != 3:
            raise RidgefillError(f"{path}: expected R serialization format 3")
        i = 14 + 4 + struct.unpack(">i", obj[14:18])[0]  # past the header and the encoding's name
        flags, n = struct.unpack(">ii", obj[i : i + 8])
        if flags != 16:
            raise RidgefillError(f"{path}: expected plain character vectors, found SEXP flags {flags:#x}")
        i += 8
        strings = []
        for _ in range(n):
            _, size = struct.unpack(">ii", obj[i : i + 8])
            i += 8
            if size < 0:  # NA_character_
                strings.append("")
                continue
            strings.append(obj[i : i + size].decode("utf-8", errors="replace"))
            i += size
        out.append(strings)
    return out


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def read_austen(domain: Domain) -> tuple[Document, ...]:
    """One document per chapter of Jane Austen's six novels (janeaustenr's line vectors, Gutenberg
    markers stripped, lines unwrapped); ids `<novel>/<chapter number in the book, 01...>`.
    The text before the first chapter (title page, the author's advertisement) is left out."""
    docs = []
    for lines in r_character_vectors(domain.root / "Rdata.rdb"):
        lines = strip_gutenberg("\n".join(lines)).splitlines()
        title = _slug(next(x for x in lines if x.strip()))
        starts = [i for i, x in enumerate(lines) if _CHAPTER.match(x)]
        for k, (a, b) in enumerate(zip(starts, [*starts[1:], len(lines)], strict=True)):
            docs.append(Document(f"{title}/{k + 1:02d}", unwrap(lines[a + 1 : b])))
    return tuple(docs)


def package_files(package: str) -> list[Path]:
    """The files dpkg lists for an installed package ([] when dpkg has no such package)."""
    try:
        listed = subprocess.run(["dpkg-query", "-L", package], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return [Path(x) for x in listed.splitlines() if x.strip()]


def installed_version(package: str) -> str | None:
    """The version dpkg has installed, or None."""
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True)
    except OSError:
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def read_stdlib(domain: Domain) -> tuple[Document, ...]:
    """One document per Python source file the package installs under `root`, as written (code
    has no boilerplate to strip); the regression-test folders are left out. Ids are paths
    relative to `root`. The files come from the package's own list, so that modules other packages
    add to the same folder (distutils, lib2to3, venv) never change the set."""
    skip = {"test", "tests", "idle_test"}
    files = sorted(
        p
        for p in package_files(domain.package)
        if p.suffix == ".py" and p.is_relative_to(domain.root) and not skip & set(p.relative_to(domain.root).parts)
    )
    if not files:
        raise _missing(domain)
    return tuple(
        Document(str(p.relative_to(domain.root)), p.read_text(encoding="utf-8", errors="replace"))
        for p in files
        if p.is_file()
    )


def read_docs(domain: Domain) -> tuple[Document, ...]:
    return load_corpus(None).documents


DOMAINS: dict[str, Domain] = {
    d.name: d
    for d in (
        Domain(
            "docs",
            "technical documentation: the reStructuredText sources of the Python 3.11 documentation",
            "python3.11-doc",
            "3.11.2-6",
            DEFAULT_CORPUS_DIR,
            DEFAULT_CORPUS_ID,
            "apt-get install --no-install-recommends python3.11-doc",
            read_docs,
            calibration=True,
        ),
        Domain(
            "prose",
            "literary prose: Jane Austen's six novels (public domain), one document per chapter",
            "r-cran-janeaustenr",
            "1.0.0-1",
            Path("/usr/lib/R/site-library/janeaustenr/data"),
            "debian:r-cran-janeaustenr",
            "apt-get install --no-install-recommends r-cran-janeaustenr=1.0.0-1",
            read_austen,
        ),
        Domain(
            "code",
            "source code: the Python 3.11 standard library's modules, one document per file",
            "libpython3.11-stdlib",
            "3.11.2-6",
            Path("/usr/lib/python3.11"),
            "debian:libpython3.11-stdlib",
            "apt-get install --no-install-recommends libpython3.11-stdlib",
            read_stdlib,
        ),
    )
}


def _missing(domain: Domain) -> RidgefillError:
    return RidgefillError(
        f"text domain {domain.name!r} needs Debian's {domain.package} ({domain.root} is missing); install it with "
        f"`{domain.install}` (as root; `make corpus` does this)"
    )


def get_domain(name: str) -> Domain:
    if name not in DOMAINS:
        raise RidgefillError(f"unknown text domain {name!r}; choose from {', '.join(DOMAINS)}")
    return DOMAINS[name]


def load_domain(name: str) -> Corpus:
    """A domain's documents as a `Corpus`: docs with its calibration/held-out/evaluation split,
    any other domain evaluation text only."""
    domain = get_domain(name)
    if not domain.root.exists():
        raise _missing(domain)
    if domain.calibration:
        return load_corpus(None)
    docs = tuple(d for d in domain.read(domain) if len(d.text) >= MIN_CHARS)
    if not docs:
        raise RidgefillError(f"no usable documents (>= {MIN_CHARS} characters) in {domain.root}")
    return Corpus(domain.corpus_id, docs, domain=domain.name, eval_only=True)


def corpus_info(corpus: Corpus) -> dict:
    """What a results file records about its text: domain, corpus id, package and installed
    version (named domains), and how many evaluation documents there were to draw from."""
    info: dict = {"domain": corpus.domain, "id": corpus.id}
    if corpus.domain in DOMAINS:
        domain = DOMAINS[corpus.domain]
        info.update(package=domain.package, version=installed_version(domain.package) or domain.version)
    info["eval_documents"] = len(corpus.part("eval"))
    return info
