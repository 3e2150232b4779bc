"""`ridgefill eval`'s run loop and summary: every sample under every method, paired against exact.

What it is: for each task and length, the task's samples are made once (fitted with the adapter's
tokeniser) and each runs under `exact` and every other method of the adapter with the same prompt.
Per-sample results are appended to a JSONL cache keyed by prompt and method configuration, so an
interrupted run resumes; a record cut short by the interruption is skipped and its sample rerun.
The summary gives scores per task, length, depth bucket and method, each method's paired
difference from exact with a 95% bootstrap interval, the needle tasks pooled, and the points ridge
recovers over identity for needles inside the filled region. It is written against the two
interfaces of `api.py` only. What it is not: a task (`ruler.py`, `dummy.py`) or a model/method
adapter (`adapter.py`, `dummy.py`).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ridgefill.errors import RidgefillError, check_lengths
from ridgefill.eval import ruler
from ridgefill.eval.api import Adapter, Task
from ridgefill.files import append_jsonl, read_jsonl

DEPTH_BUCKETS = ("0-20", "20-40", "40-60", "60-80", "80-100")


def bootstrap_ci(diffs: list[float], seed: int = 0, rounds: int = 2000, digits: int | None = 2) -> list[float]:
    """95% percentile-bootstrap interval of the mean of `diffs` (rounded to `digits`, None: not)."""
    if not diffs:
        return [0.0, 0.0]
    t = torch.tensor(diffs, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    means = t[torch.randint(len(t), (rounds, len(t)), generator=g)].mean(1)
    lo, hi = float(means.quantile(0.025)), float(means.quantile(0.975))
    return [lo, hi] if digits is None else [round(lo, digits), round(hi, digits)]


# What a cached record must hold to be keyed and summarised (`config` may be absent, as in
# records written before it existed); a line without them is skipped and its sample rerun.
RECORD_FIELDS: dict[str, type | tuple[type, ...]] = {
    "task": str,
    "length": int,
    "index": int,
    "method": str,
    "prompt": str,
    "config": (str, type(None)),
    "score": (int, float),
    "depth": (int, float, type(None)),
    "ttft_s": (int, float),
}


def read_records(path: Path) -> list[dict]:
    """The records of a per-sample JSONL cache, in file order; unreadable lines are skipped with a
    warning (`files.read_jsonl`), so their samples count as not yet run."""
    return read_jsonl(path, RECORD_FIELDS)


def run_eval(
    adapter: Adapter,
    tasks: Sequence[Task],
    lengths: list[int],
    samples: int,
    cache_path: Path,
    seed: int = 42,
    tail: int | None = None,
) -> list[dict]:
    """Run every (task, length, sample, method) of `adapter`; return per-sample records (cached in
    JSONL). `tail`: rows the methods run in full at the end of the prompt, for the filled-region
    figure (a record is `filled` when its needle sits before them)."""
    if not adapter.methods or adapter.methods[0] != "exact":
        raise RidgefillError("the first method must be exact: every score is paired against it")
    check_lengths(lengths, adapter.name, adapter.context_length)
    done: dict[tuple, dict] = {}
    for r in read_records(cache_path) if cache_path.is_file() else []:
        done[(r["task"], r["length"], r["index"], r["method"], r["prompt"], r.get("config"))] = r
    configs = {m: adapter.config(m) for m in adapter.methods}
    run = uuid.uuid4().hex[:12]  # which records were timed in this process (see `_paired`)
    records = []
    jobs = [(t, n) for t in tasks for n in lengths]
    bar = tqdm(total=len(jobs) * samples * len(configs), desc=f"eval {adapter.name}", unit="run")
    with append_jsonl(cache_path) as cache:
        for task, n in jobs:
            for sample in task.samples(adapter.count_tokens, n, samples, seed):
                p = adapter.prompt(sample)
                keys = {m: (task.name, n, sample.index, m, p.key, c) for m, c in configs.items()}
                todo = [m for m in configs if keys[m] not in done]
                outs = adapter.generate(sample, todo, task.max_new_tokens) if todo else {}
                for m, k in keys.items():
                    if k not in done:
                        res = outs[m]
                        done[k] = {
                            "task": task.name,
                            "length": n,
                            "index": sample.index,
                            "method": m,
                            "prompt": p.key,
                            "config": k[-1],
                            "prompt_tokens": p.tokens,
                            "depth": None if p.needle_pos is None else round(p.needle_pos / p.tokens, 4),
                            "needle_pos": p.needle_pos,
                            "filled": tail is not None and p.needle_pos is not None and p.needle_pos < p.tokens - tail,
                            "score": task.score(res.text, sample),
                            "prediction": res.text,
                            "answers": sample.answers,
                            "ttft_s": res.ttft_s,
                            "run_s": res.run_s,
                            "decode_batch": res.decode_batch,
                            "run": run,
                            **res.info,
                        }
                        cache(done[k])
                    records.append(done[k])
                    bar.update()
    bar.close()
    return records


def _paired(rows: dict[tuple, dict], exact: dict[tuple, dict]) -> dict:
    """Score, paired delta vs exact with its bootstrap CI, and median paired TTFT ratio of some records."""
    paired = [rows[k]["score"] - exact[k]["score"] for k in rows if k in exact]
    # TTFT ratios only from prompts whose exact and method records were timed in one run: a reused
    # cache can hold exact's records from another run, on a busier or idler machine. Records
    # written before runs had ids (both without one) pair as they always did.
    same_run = [k for k in rows if k in exact and exact[k].get("run") == rows[k].get("run")]
    speed = sorted(exact[k]["ttft_s"] / rows[k]["ttft_s"] for k in same_run if rows[k]["ttft_s"] > 0)
    scores = [r["score"] for r in rows.values()]
    return {
        "samples": len(rows),
        "score": round(sum(scores) / len(scores), 2),
        "delta_vs_exact": round(sum(paired) / len(paired), 2) if paired else None,
        "ci95": bootstrap_ci(paired),
        "exact_score": round(sum(exact[k]["score"] for k in rows if k in exact) / len(paired), 2) if paired else None,
        # A side figure (decode and scoring share the process); `ridgefill bench` is the clean one.
        "ttft_speedup": round(speed[len(speed) // 2], 3) if speed else None,
        "ttft_pairs": len(speed),
        "needle_rows": needle_breakdown(rows, exact),
    }


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 2) if xs else None


def needle_breakdown(rows: dict[tuple, dict], exact: dict[tuple, dict]) -> dict | None:
    """Scores split by whether a method ran the needle's rows fully (all, part or none of its
    tokens), beside exact's on the same prompts, and the needle's rank under the row score (median,
    90th percentile; `rank_refine_*` under a two-stage gate's second score, where records carry
    one), from records that carry `needle_full` / `needle_rank`; None without them."""
    known = [k for k, r in rows.items() if r.get("needle_full") is not None]
    if not known:
        return None
    kinds = {"full": lambda f: f == 1, "part": lambda f: 0 < f < 1, "none": lambda f: f == 0}
    out: dict = {}
    for kind, test in kinds.items():
        ks = [k for k in known if test(rows[k]["needle_full"])]
        out[kind] = {
            "prompts": len(ks),
            "score": _mean([rows[k]["score"] for k in ks if rows[k].get("score") is not None]),
            "exact_score": _mean([exact[k]["score"] for k in ks if k in exact]),
        }
    for field, name in (("needle_rank", "rank"), ("needle_rank_refine", "rank_refine")):
        ranks = [rows[k][field] for k in known if rows[k].get(field) is not None]
        if ranks or field == "needle_rank":
            out[f"{name}_median"], out[f"{name}_p90"] = rank_stats(ranks)
    return out


def rank_stats(ranks: list[int]) -> tuple[int | None, int | None]:
    """(median, 90th percentile) of needle ranks; (None, None) without any."""
    ranks = sorted(ranks)
    if not ranks:
        return None, None
    return ranks[len(ranks) // 2], ranks[min(len(ranks) - 1, int(0.9 * len(ranks)))]


def breakdown_case(c: dict) -> str:
    """One case of `needle_breakdown` as text: "92.0 vs exact 100.0" ("-" with no scored prompts)."""
    if not c["prompts"] or c["score"] is None:
        return "-"
    return f"{c['score']:.1f} vs exact " + ("-" if c["exact_score"] is None else f"{c['exact_score']:.1f}")


def summarise(records: list[dict]) -> dict:
    """Per (method, task, length): score, paired delta vs exact with CI, by depth bucket; and per
    (method, length) the NIAH tasks pooled (`niah_pooled`: every needle prompt counts once)."""
    by: dict[tuple, dict[tuple, dict]] = {}
    for r in records:
        by.setdefault((r["method"], r["task"], r["length"]), {})[(r["task"], r["index"], r["prompt"])] = r
    results = []
    for (method, task, n), rows in sorted(by.items()):
        buckets: dict[str, list[float]] = {b: [] for b in DEPTH_BUCKETS}
        for r in rows.values():
            if r["depth"] is not None:
                buckets[DEPTH_BUCKETS[min(4, int(r["depth"] * 5))]].append(r["score"])
        results.append(
            {
                "method": method,
                "task": task,
                "length": n,
                **_paired(rows, by.get(("exact", task, n), {})),
                "by_depth": {b: (round(sum(v) / len(v), 1) if v else None) for b, v in buckets.items()},
                "filled_region": _filled_score(rows.values()),
            }
        )
    pooled: dict[tuple, dict[tuple, dict]] = {}
    for (method, task, n), rows in by.items():
        if task in ruler.NIAH_TASKS:
            pooled.setdefault((method, n), {}).update(rows)
    niah = []
    for (method, n), rows in pooled.items():
        tasks = sorted({k[0] for k in rows})
        niah.append({"method": method, "length": n, "tasks": tasks, **_paired(rows, pooled.get(("exact", n), {}))})
    return {"results": results, "niah_pooled": niah}


def _filled_score(rows) -> dict:
    filled = [r["score"] for r in rows if r.get("filled")]
    return {"samples": len(filled), "score": _mean(filled)}


def recovered_over_identity(results: list[dict], method: str = "ridge") -> list[dict]:
    """The paper's figure: `method` minus identity, within the filled region, per task and length."""
    idx = {(r["method"].split("@")[0], r["task"], r["length"]): r for r in results}
    out = []
    for (m, task, n), r in idx.items():
        ident = idx.get(("identity", task, n))
        if (
            m == method
            and ident
            and r["filled_region"]["score"] is not None
            and ident["filled_region"]["score"] is not None
        ):
            pts = r["filled_region"]["score"] - ident["filled_region"]["score"]
            out.append({"task": task, "length": n, "points": round(pts, 2), "samples": r["filled_region"]["samples"]})
    return out
