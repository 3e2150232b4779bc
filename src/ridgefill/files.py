"""Crash-safe files: whole files replaced atomically, append-only JSONL read tolerantly.

What it is: `atomic_path` (the one way ridgefill writes a whole file: into a temporary file in
the target's folder, flushed to disk, then `os.replace`d over the target, so a reader sees the
old file or the new one and never half of either; on failure the temporary file is removed),
`write_text`/`write_bytes` on top of it, and the pair for append-only caches: `append_jsonl`
(each record one write, on a line of its own) and `read_jsonl` (a cut or corrupt line is skipped
with one warning, so the work it recorded is simply done again); and `safetensors_problem`, which
tells a whole safetensors file from one cut short. What it is not: a file format (results.py,
fit/maps.py) or a lock: two processes writing one path race, the last replace wins.
"""

from __future__ import annotations

import json
import logging
import math
import os
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

TEMP_SUFFIX = ".tmp"


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (POSIX; where folders cannot be opened, skip it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; when the block ends normally, the file written
    there replaces `path` in one step. If the block raises, `path` is left as it was.

    The temporary name is hidden and ends in `.tmp` (`.results.json.1f2e3d4c.tmp`), so what a
    killed process leaves behind is never taken for the real file. Parent folders are made.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}{TEMP_SUFFIX}")
    try:
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Atomically make `path` hold exactly `data`."""
    path = Path(path)
    with atomic_path(path) as tmp:
        # O_EXCL: the name is fresh; mode 0o666 lets the umask decide, as for any new file.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    return path


def write_text(path: str | Path, text: str) -> Path:
    """Atomically make `path` hold `text` (UTF-8)."""
    return write_bytes(path, text.encode("utf-8"))


def read_jsonl(path: str | Path, fields: Mapping[str, type | tuple[type, ...]] | None = None) -> list[dict]:
    """The records of an append-only JSONL file, in file order.

    A line that is not a JSON object, or that fails `fields`, is skipped; one warning counts them.
    A process killed mid-append leaves such a line, and its record is best treated as never
    written. `fields` maps a key to the type(s) its value must have; a key whose types include
    `type(None)` may be absent, and a float must be finite.
    """
    path = Path(path)
    records, bad = [], 0
    for line in path.read_bytes().split(b"\n"):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:  # JSONDecodeError and UnicodeDecodeError both are
            bad += 1
            continue
        if not isinstance(record, dict) or not _has_fields(record, fields or {}):
            bad += 1
            continue
        records.append(record)
    if bad:
        log.warning(
            "%s: skipped %d unreadable line(s) (cut short or corrupt); their records count as missing",
            path,
            bad,
        )
    return records


def _has_fields(record: dict, fields: Mapping[str, type | tuple[type, ...]]) -> bool:
    for key, types in fields.items():
        value = record.get(key)
        if not isinstance(value, types) or (isinstance(value, float) and not math.isfinite(value)):
            return False
    return True


@contextmanager
def append_jsonl(path: str | Path) -> Iterator[Callable[[dict], None]]:
    """Open `path` for appending and yield `add(record)`, which writes one JSON line.

    If the file does not end in a newline (its last append was cut short), the first record
    starts on a fresh line, so the cut line stays one bad line instead of spoiling this one.
    Each record goes out in one write and is flushed at once.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab") as f:
        if os.fstat(f.fileno()).st_size > 0:
            with path.open("rb") as r:
                r.seek(-1, os.SEEK_END)
                if r.read(1) != b"\n":
                    f.write(b"\n")

        def add(record: dict) -> None:
            f.write((json.dumps(record) + "\n").encode("utf-8"))
            f.flush()

        yield add


def safetensors_problem(path: str | Path) -> str | None:
    """Why the safetensors file at `path` is not whole, or None when it is.

    The format is an 8-byte little-endian header length, a JSON header giving every tensor's
    `data_offsets` into the data that follows, then the data; a file whose size is not exactly
    what its header describes was cut short (or is foreign). Only the header is read.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little")
            if len(head) < 8 or n > size - 8:
                return f"{path.name} is {size} bytes, shorter than its header (truncated)"
            header = json.loads(f.read(n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except OSError as e:
        return f"{path.name} cannot be read: {e}"
    except (ValueError, RecursionError, AttributeError, KeyError, TypeError, IndexError) as e:
        return f"{path.name} has no readable safetensors header ({type(e).__name__}: {e})"
    if 8 + n + end != size:
        return f"{path.name} is {size} bytes, but its header describes {8 + n + end} (truncated or foreign)"
    return None
