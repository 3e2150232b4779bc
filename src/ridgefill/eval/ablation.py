"""Ablation tables (experimental): rows gathered from several `ridgefill eval` results files.

What it is: one row per (results file, method, length): the method's full settings, the needle
tasks pooled and paired against exact on the same prompts (score, delta with 95% CI), the
tail-perplexity increase and the TTFT ratio measured in that same run, and the command that
made it. What it is not: a runner. Every figure comes from a results file as it was written (or,
for files older than the pooled row, from their per-sample cache, checked against the file).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, fields
from pathlib import Path

from ridgefill.errors import RidgefillError
from ridgefill.eval.report import speed_cell
from ridgefill.eval.runner import read_records, summarise
from ridgefill.methods import FillSettings, get_method, parse_method

# A fill field a results file predates is read at its default (which is what those runs computed).
FILL_DEFAULTS = {f.name: f.default for f in fields(FillSettings)}

KNOBS = (
    "split",
    "tail",
    "sink",
    "query_rows",
    "query_window",
    "query_sentence",
    "query_pool",
    "query_layer",
    "query_top",
    "drop_top",
    "drop",
    "sparse_keep",
    "resume",
)


def label_settings(label: str, settings: dict) -> dict:
    """A method label (`name[:key=value...]`, as `eval --methods` takes it) read back into its full
    settings: the run's own options (split, sink, tail) under the label's overrides."""
    values = {k: settings[k] for k in ("split", "sink", "tail") if k in settings}
    try:
        name, over = parse_method(label)
    except RidgefillError as e:
        raise RidgefillError(f"cannot read method label {label!r}: {e}") from None
    info = get_method(name)
    if info.settings is None:
        return {"method": name}
    known = {f.name for f in fields(info.settings)}
    s = info.settings(**{k: v for k, v in {**info.defaults, **values, **over}.items() if k in known})
    return {"method": name, **asdict(s)}


def direction(s: dict) -> str:
    """Which retrieval direction a configuration tests, from its settings."""
    parts = []
    if s.get("query_rows"):
        parts.append("query-aware rows")
    if s.get("drop"):
        parts.append("dropped bulk rows")
    if s.get("sparse_keep", 1) < 1 and s["method"] != "tokengate":
        parts.append("sparse lower layers")
    if s.get("tail", 256) != 256 or s.get("sink", 4) != 4:
        parts.append("tail/sinks")
    if s.get("resume") is not None:
        parts.append("resumed top layers")
    if (s.get("maps_calib") or {}).get("facts"):
        parts.append("facts in calibration")
    if s["method"] == "kva":
        parts.append("fit in K/V space")
    base = "plain fill" if s["method"] in ("identity", "ridge") else s["method"]
    return " + ".join(parts) if parts else base


def _cache_of(doc: dict, path: Path) -> Path:
    """The per-sample cache a results file was computed with: its command's `--cache` (relative to
    the working folder, else to the repository that holds `results/`), else the file beside it."""
    words = shlex.split(doc.get("command", ""))
    named = next((Path(b) for a, b in zip(words, words[1:], strict=False) if a == "--cache"), None)
    if named is None:
        return path.with_suffix(".samples.jsonl")
    if named.is_absolute() or named.is_file():
        return named
    root = next((p.parent for p in path.resolve().parents if p.name == "results"), None)
    return root / named if root is not None else named


def _pooled_from_cache(doc: dict, path: Path) -> list[dict]:
    """`niah_pooled` for a results file written before it existed, from its per-sample cache,
    after checking that the cache reproduces the file's per-task scores."""
    cache = _cache_of(doc, path)
    if not cache.is_file():
        raise RidgefillError(f"{path} has no pooled needle row and its cache {cache} is missing")
    wanted = {(r["method"], r["task"], r["length"]): r["samples"] for r in doc["results"]}
    groups: dict[str, dict[str | None, list[dict]]] = {}  # method -> config -> records, in cache order
    for r in read_records(cache):
        n = wanted.get((r["method"], r["task"], r["length"]))
        if n is not None and r["index"] < n:
            groups.setdefault(r["method"], {}).setdefault(r.get("config"), []).append(r)

    def reproduces(records: list[dict], method: str) -> bool:
        got = {(r["method"], r["task"], r["length"]): (r["samples"], r["score"]) for r in summarise(records)["results"]}
        return all(
            got.get((r["method"], r["task"], r["length"])) == (r["samples"], r["score"])
            for r in doc["results"]
            if r["method"] == method
        )

    # A shared cache may also hold later runs of the same label (refitted maps, other settings):
    # each method takes the first configuration, in cache order, that reproduces the file.
    chosen: list[dict] = []
    for method in sorted(groups, key=lambda m: m != "exact"):  # exact first: the others pair with it
        base = [r for r in chosen if r["method"] == "exact"]
        pick = next((recs for recs in groups[method].values() if reproduces(base + recs, method)), None)
        if pick is None:
            raise RidgefillError(f"{cache} does not reproduce {path} ({method}): rerun its command")
        chosen += pick
    missing = {r["method"] for r in doc["results"]} - set(groups)
    if missing:
        raise RidgefillError(f"{cache} does not reproduce {path} ({', '.join(sorted(missing))}): rerun its command")
    summary = summarise(chosen)
    return summary["niah_pooled"]


def rows(path: str | Path) -> list[dict]:
    """The ablation rows of one eval results file (every method but exact)."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
        methods, settings, command = doc["methods"], doc["settings"], doc["command"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise RidgefillError(f"{path} is not a `ridgefill eval` results file ({e})") from None
    pooled = doc.get("niah_pooled") or _pooled_from_cache(doc, path)
    by_label = doc.get("method_settings") or {m: label_settings(m, settings) for m in methods}
    ppl = {(p["method"], p["length"]): p for p in doc.get("ppl", [])}
    out = []
    for r in sorted(pooled, key=lambda r: (r["length"], methods.index(r["method"]))):
        if r["method"] == "exact":
            continue
        p = ppl.get((r["method"], r["length"]), {})
        s = by_label[r["method"]]  # fill settings recorded before a field existed get its old meaning
        out.append(
            {
                "model": doc["model"],
                "method": r["method"],
                "fill": s["method"],
                "direction": direction(s),
                **{k: s.get(k, FILL_DEFAULTS.get(k) if "query_rows" in s else None) for k in KNOBS},
                "calibration": _calibration(s.get("maps_calib")),
                "length": r["length"],
                "tasks": r["tasks"],
                "samples": r["samples"],
                "niah": r["score"],
                "exact_niah": r["exact_score"],
                "delta_vs_exact": r["delta_vs_exact"],
                "ci95": r["ci95"],
                "ppl_increase_pct": p.get("ppl_increase_pct"),
                "ppl_docs": p.get("docs"),
                "ttft_speedup": r.get("ttft_speedup"),
                "settings": s,
                "source": str(path),
                "command": command,
            }
        )
    return out


def _compute_settings(settings: dict) -> dict:
    """What a configuration computes: its method and settings, with fields a file predates at
    their defaults; the maps' calibration is left out (it changes no cost)."""
    out = {k: v for k, v in settings.items() if k not in ("maps_calib", "maps_split")}
    if "query_rows" in out:  # a fill configuration
        out = {**FILL_DEFAULTS, **out}
    return out


def attach_bench(table: list[dict], bench_files: list[str | Path]) -> list[dict]:
    """Each row's clean TTFT from `ridgefill bench` results files: the bench row of the same model,
    length and computed configuration, from the first file listed that has one (`bench_speedup`, its
    min-max, FLOP bound and source); rows without one get none. The eval side figure stays beside it
    (often n/a: exact's records came from another run's cache)."""
    runs = []
    for path in map(Path, bench_files):
        try:
            doc = json.loads(path.read_text())
            config = doc["config"]
            # bench files written before method_settings existed: settings from the labels
            settings = config.get("method_settings") or {
                m: label_settings(m, config) for m in config["methods"] if m != "tuned"
            }
            runs += [
                (doc["model"], r, _compute_settings(settings[r["method"]]), path)
                for r in doc["results"]
                if r["method"] in settings
            ]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise RidgefillError(f"{path} is not a `ridgefill bench` results file ({e})") from None
    for row in table:
        want = _compute_settings(row["settings"])
        hit = next(
            (
                (r, path)
                for model, r, got, path in runs
                if model == row["model"] and r["length"] == row["length"] and got == want
            ),
            None,
        )
        if hit is not None:
            r, path = hit
            row.update(
                bench_speedup=r["speedup"],
                bench_range=[r["speedup_min"], r["speedup_max"]],
                bench_flop_bound=r.get("flop_bound"),
                bench_source=str(path),
            )
    return table


def _bench_cell(r: dict) -> str:
    if r.get("bench_speedup") is None:
        return "-"
    lo, hi = r["bench_range"]
    bound = f" (bound {r['bench_flop_bound']:.2f}x)" if r.get("bench_flop_bound") else ""
    return f"{r['bench_speedup']:.2f}x [{lo:.2f}-{hi:.2f}]{bound}"


def _calibration(calib: dict | None) -> str | None:
    """The maps' calibration as the table shows it, e.g. "16K" or "16K + 16 facts/seg"; None when
    the results file predates the record (or the method reads no maps)."""
    if not calib or not calib.get("tokens"):
        return None
    text = f"{calib['tokens'] // 1024}K"
    return text + (f" + {calib['facts']} facts/seg" if calib.get("facts") else "")


def _knob(value) -> str:
    return "-" if value is None else f"{value:g}"


def markdown(table: list[dict]) -> str:
    """The ablation table: one line per row, the settings first, then the paired figures."""
    head = [
        "model",
        "direction",
        "fill",
        *KNOBS,
        "calibration",
        "n",
        "NIAH",
        "exact",
        "delta [95% CI]",
        "tail PPL",
        "TTFT x",
        "TTFT x (bench)",
        "source",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table:
        ppl = "" if r["ppl_increase_pct"] is None else f"{r['ppl_increase_pct']:+.1f}% ({r['ppl_docs']} docs)"
        speed = speed_cell(r)
        delta = f"{r['delta_vs_exact']:+.1f} [{r['ci95'][0]:+.1f}, {r['ci95'][1]:+.1f}]"
        knobs = [_knob(r[k]) for k in KNOBS]
        cells = [
            r["model"],
            r["direction"],
            r["fill"],
            *knobs,
            r.get("calibration") or "-",
            str(r["samples"]),
            f"{r['niah']:.1f}",
            f"{r['exact_niah']:.1f}",
        ]
        lines.append("| " + " | ".join([*cells, delta, ppl, speed, _bench_cell(r), Path(r["source"]).name]) + " |")
    return "\n".join(lines)
