"""`ridgefill bench`: TTFT of exact and fill methods, interleaved in one process.

What it is: for each prompt length, every method runs on the same prompt, in an order rotated
each repeat, after a warm-up. Reported per method: median/min/max prefill seconds, the speedup
against exact (ratio of medians, with min/max of the per-repeat paired ratios), the FLOP-model
bound and the measured fraction of it, the time inside attention calls alone and its speedup,
tokens/s and peak memory above the start of the call.
What it is not: an accuracy measurement; `ridgefill ppl` and `ridgefill eval` give those.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ridgefill.bench.flops import exact_macs, plan_macs
from ridgefill.bench.memory import PeakRSS
from ridgefill.engine import Engine, Plan
from ridgefill.errors import RidgefillError, check_lengths
from ridgefill.methods import Prefill
from ridgefill.models.loading import LoadedModel


@dataclass(frozen=True)
class BenchConfig:
    lengths: tuple[int, ...] = (1024, 2048, 4096, 8192)
    repeats: int = 3
    warmup: int = 1
    # Warm-up runs use the prompt's first `warmup_length` tokens (None: the whole prompt). At 32K a
    # full-length warm-up of exact costs as much as a timed run; a 2K one loads the same kernels.
    warmup_length: int | None = None


def flop_bound(engine: Engine, n: int, plan: Plan | None) -> float:
    """Exact's MACs over this method's, for what its last run computed (None: it ran exact)."""
    if plan is None:
        return 1.0
    return exact_macs(engine.parts, n) / plan_macs(engine.parts, n, plan)


def run_bench(lm: LoadedModel, cfg: BenchConfig, prompts: dict[int, list[int]], specs: list[Prefill]) -> list[dict]:
    """Time every method at every length; `prompts[length]` is the token list used.

    `specs` must include a plain `exact` (label "exact"): every speedup is paired against it.
    """
    labels = [s.label for s in specs]
    if "exact" not in labels:
        raise RidgefillError("bench compares against exact: include it in --methods")
    check_lengths(cfg.lengths, lm.name, lm.context_length)
    engine = Engine(lm)
    rows = []
    total = len(cfg.lengths) * (cfg.repeats + cfg.warmup) * len(specs)
    bar = tqdm(total=total, desc=f"bench {lm.name}", unit="run")
    for n in cfg.lengths:
        ids = torch.tensor([prompts[n]])
        times: dict[str, list[float]] = {m: [] for m in labels}
        attn: dict[str, list[float]] = {m: [] for m in labels}
        peaks: dict[str, float] = dict.fromkeys(labels, 0.0)
        plans: dict[str, Plan | None] = {}
        for rep in range(cfg.warmup + cfg.repeats):
            order = specs[rep % len(specs) :] + specs[: rep % len(specs)]
            x = ids if rep >= cfg.warmup or cfg.warmup_length is None else ids[:, : cfg.warmup_length]
            for spec in order:
                with PeakRSS() as mem:
                    t0 = engine.clock()
                    res = spec.run(engine, x)
                    seconds = engine.clock() - t0
                if rep >= cfg.warmup:
                    plans[spec.label] = None if res.ran_exact else res.plan
                    times[spec.label].append(seconds)
                    attn[spec.label].append(res.attn_seconds)
                    peaks[spec.label] = max(peaks[spec.label], mem.peak_mb)
                bar.update()
        ex = times["exact"]
        for spec in specs:
            m = spec.label
            t = times[m]
            ratios = [e / x for e, x in zip(ex, t, strict=True)]
            bound = flop_bound(engine, n, plans[m])
            speed = statistics.median(ex) / statistics.median(t)
            attn_m = statistics.median(attn[m])
            rows.append(
                {
                    "length": n,
                    "method": m,
                    "median_s": round(statistics.median(t), 4),
                    "min_s": round(min(t), 4),
                    "max_s": round(max(t), 4),
                    "speedup": round(speed, 3),
                    "speedup_min": round(min(ratios), 3),
                    "speedup_max": round(max(ratios), 3),
                    "flop_bound": round(bound, 3),
                    "fraction_of_bound": round(speed / bound, 3),
                    "attn_median_s": round(attn_m, 4),
                    "attn_speedup": round(statistics.median(attn["exact"]) / attn_m, 3) if attn_m > 0 else None,
                    "tokens_per_s": round(n / statistics.median(t), 1),
                    "peak_mem_mb": round(peaks[m], 1),
                    "full_rows": n if plans[m] is None else len(plans[m].full),
                    "ran_exact": plans[m] is None,
                    "repeats": cfg.repeats,
                }
            )
    bar.close()
    return rows
