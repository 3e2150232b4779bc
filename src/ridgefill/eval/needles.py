"""`ridgefill experimental needles`: does a skipping method run the needle's rows, and how does it rank them?

What it is: RULER needle prompts, each prefilled (no decode) under the chosen methods; per prompt
and method the share of the needle's tokens that ran every layer and the needle's rank under the
split-layer row score (`adapter.needle_rows`). Given an eval cache, each record is joined with that
method's and exact's scores on the same prompt (same configuration key), so the misses split by
cause: the needle not selected, partly selected, or selected and still missed. With `layers`, it
instead asks where the model finds the needle: the needle's rank under the gate's row score at each
named layer's own attention, from one dense pass per prompt, the evidence for choosing a gate's
layers per model. What it is not: an evaluation (nothing is decoded; scores come from the cache
when given).
"""

from __future__ import annotations

from pathlib import Path

from tqdm.auto import tqdm

from ridgefill.engine import Engine
from ridgefill.eval.adapter import config_key, needle_rank, needle_rows, prepare, prompt_key
from ridgefill.eval.ppl import shared_lower
from ridgefill.eval.runner import breakdown_case, needle_breakdown, rank_stats, read_records
from ridgefill.methods import Prefill
from ridgefill.methods.gate import GateSettings, always_kept
from ridgefill.methods.select import row_score_sets
from ridgefill.models.loading import LoadedModel


def _scored(path: Path | None) -> dict[tuple, dict]:
    return {} if path is None else {(r["prompt"], r["method"], r.get("config")): r for r in read_records(path)}


def needle_records(
    lm: LoadedModel,
    specs: list[Prefill],
    tasks: list[str],
    length: int,
    samples: int,
    essay: list[str],
    seed: int = 42,
    scores: Path | None = None,
) -> list[dict]:
    """One record per (prompt, method): `needle_full`, `needle_rank` and, from the `scores` eval
    cache, `score` (None when the cache holds no record of that prompt and configuration). Exact's
    cached scores come as records of method "exact"."""
    engine, cached = Engine(lm), _scored(scores)
    configs = {s.label: config_key(lm, s) for s in [Prefill("exact", "exact"), *specs]}
    out = []
    bar = tqdm(total=len(tasks) * samples, desc=f"needles {lm.name}", unit="prompt")
    for task in tasks:
        for p in prepare(lm, task, length, samples, seed, essay):
            key = prompt_key(p.input_ids)
            base = {"task": task, "length": length, "index": p.sample.index, "prompt": key, "depth": round(p.depth, 4)}
            ex = cached.get((key, "exact", configs["exact"]))
            if ex is not None:
                out.append({**base, "method": "exact", "score": ex["score"]})
            span = (p.needle_pos, p.needle_end)
            lower = shared_lower(engine, p.input_ids, specs)
            for s in specs:
                res = s.run(engine, p.input_ids, lower=lower)
                hit = cached.get((key, s.label, configs[s.label]))
                rec = {**base, "method": s.label, **needle_rows(res, span)}
                out.append({**rec, "score": None if hit is None else hit["score"]})
            bar.update()
    bar.close()
    return out


# The query reductions a layer's ranks are reported under (methods/select.py `reduce_queries`).
LAYER_SCORES = {"top query": 1, "mean": 0}


def layer_rank_records(
    lm: LoadedModel,
    tasks: list[str],
    length: int,
    samples: int,
    essay: list[str],
    layers: list[int],
    seed: int = 42,
) -> list[dict]:
    """One record per prompt: `ranks`, per layer in `layers` and per query reduction in
    `LAYER_SCORES`, the needle's rank under the gate's row score at that layer's own attention
    (`query_last` queries, as `GateSettings` defaults them), among the rows a gate may drop (its
    default sinks, local window and tail excluded). `layers` ascending; they run once per prompt,
    densely."""
    engine, g = Engine(lm), GateSettings()
    out = []
    bar = tqdm(total=len(tasks) * samples, desc=f"layer ranks {lm.name}", unit="prompt")
    for task in tasks:
        for p in prepare(lm, task, length, samples, seed, essay):
            n, span = p.input_ids.shape[1], (p.needle_pos, p.needle_end)
            candidates = ~always_kept(n, g.sink, g.local, g.tail, engine.device)
            st, ranks = None, {}
            for layer in layers:
                st = engine.run_lower(p.input_ids, layer, start=st)
                sets = row_score_sets(engine, layer, st.h, st.tables, g.query_last, tops=tuple(LAYER_SCORES.values()))
                ranks[str(layer)] = {
                    name: needle_rank(sc, candidates, span) for name, sc in zip(LAYER_SCORES, sets, strict=True)
                }
            key = prompt_key(p.input_ids)
            out.append(
                {
                    "task": task,
                    "length": length,
                    "index": p.sample.index,
                    "prompt": key,
                    "depth": round(p.depth, 4),
                    "ranks": ranks,
                }
            )
            bar.update()
    bar.close()
    return out


def summarise_layer_ranks(records: list[dict]) -> list[dict]:
    """Per layer and query reduction over all prompts: median, 90th percentile and worst rank, and
    how many prompts ranked the needle first."""
    out = []
    for layer in records[0]["ranks"] if records else []:
        for name in LAYER_SCORES:
            ranks = [r["ranks"][layer][name] for r in records]
            median, p90 = rank_stats(ranks)
            row = {"layer": int(layer), "score": name, "prompts": len(ranks), "median": median, "p90": p90}
            out.append(row | {"worst": max(ranks), "first": sum(x == 1 for x in ranks)})
    return out


def layers_markdown(summary: list[dict]) -> str:
    lines = ["| layer | score | prompts | median rank | 90th pct | worst | ranked first |", "|" + "---|" * 7]
    for r in summary:
        cells = (r[k] for k in ("layer", "score", "prompts", "median", "p90", "worst", "first"))
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def summarise_needles(records: list[dict]) -> list[dict]:
    """Per method, per task and pooled over tasks: where the needle's rows ran, its rank, and
    (with scores) each case's score beside exact's on the same prompts."""
    exact = {(r["task"], r["index"], r["prompt"]): r for r in records if r["method"] == "exact"}
    methods = list(dict.fromkeys(r["method"] for r in records if r["method"] != "exact"))
    tasks = list(dict.fromkeys(r["task"] for r in records))
    out = []
    for m in methods:
        for task in [*tasks, "pooled"]:
            rows = {
                (r["task"], r["index"], r["prompt"]): r
                for r in records
                if r["method"] == m and task in (r["task"], "pooled")
            }
            out.append({"method": m, "task": task, "prompts": len(rows), **(needle_breakdown(rows, exact) or {})})
    return out


def markdown(summary: list[dict]) -> str:
    lines = [
        "| method | task | prompts | needle ran fully | partly | not at all | median rank | 90th pct rank |"
        " score if fully | partly | not at all |",
        "|" + "---|" * 11,
    ]

    for r in summary:
        if "full" not in r:
            continue
        counts = " | ".join(str(r[k]["prompts"]) for k in ("full", "part", "none"))
        scores = " | ".join(breakdown_case(r[k]) for k in ("full", "part", "none"))
        rank = f"{r['rank_median']} | {r['rank_p90']}" if r["rank_median"] is not None else "- | -"
        lines.append(f"| {r['method']} | {r['task']} | {r['prompts']} | {counts} | {rank} | {scores} |")
    return "\n".join(lines)
