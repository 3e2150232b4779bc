"""`ridgefill bench`: TTFT of exact and fill methods, interleaved in one process.

What it is: for each prompt length, every method runs on the same prompt, in an order rotated
each repeat, after a warm-up. Reported per method: median/min/max prefill seconds, the speedup
against exact (ratio of medians, with min/max of the per-repeat paired ratios), the FLOP-model
bound and the measured fraction of it, tokens/s and peak memory above the start of the call.
What it is not: an accuracy measurement; `ridgefill ppl` and `ridgefill eval` give those.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ridgefill.bench.flops import exact_macs, fill_macs
from ridgefill.bench.memory import PeakRSS
from ridgefill.engine import Engine
from ridgefill.errors import RidgefillError
from ridgefill.fit.maps import MAP_METHODS, FillMaps
from ridgefill.fit.ridge import layer_inputs
from ridgefill.methods import FILL_METHODS, FillSettings, get_method, run_prefill
from ridgefill.methods.fill import full_rows
from ridgefill.models.loading import LoadedModel


@dataclass(frozen=True)
class BenchConfig:
    lengths: tuple[int, ...] = (1024, 2048, 4096, 8192)
    methods: tuple[str, ...] = ("exact", "identity", "ridge", "kva")
    split: int = 15
    sink: int = 4
    tail: int = 256
    repeats: int = 3
    warmup: int = 1


def _full_rows(engine: Engine, ids: torch.Tensor, s: FillSettings) -> list[int]:
    """The rows a fill runs fully; outliers depend on the split state, so the lower layers run once."""
    n = ids.shape[1]
    if n <= s.sink + s.tail or s.split >= engine.parts.num_layers - 1:
        return list(range(n))
    h_split = layer_inputs(engine, ids, upto=s.split)[-1]
    return full_rows(h_split[0], n, s).tolist()


def _flop_bound(engine: Engine, n: int, method: str, split: int, full: list[int]) -> float:
    if method == "exact" or len(full) == n:
        return 1.0
    return exact_macs(engine.parts, n) / fill_macs(engine.parts, n, method, split, full)


def run_bench(
    lm: LoadedModel, cfg: BenchConfig, prompts: dict[int, list[int]], maps: dict[str, FillMaps]
) -> list[dict]:
    """Time every method at every length; `prompts[length]` is the token list used."""
    for m in cfg.methods:
        get_method(m)
        if m in MAP_METHODS and m not in maps:
            raise RidgefillError(f"method {m!r} needs maps for split {cfg.split}")
    if "exact" not in cfg.methods:
        raise RidgefillError("bench compares against exact: include it in --methods")
    engine = Engine(lm)
    s = FillSettings(cfg.split, cfg.sink, cfg.tail)
    rows = []
    total = len(cfg.lengths) * (cfg.repeats + cfg.warmup) * len(cfg.methods)
    bar = tqdm(total=total, desc=f"bench {lm.name}", unit="run")
    for n in cfg.lengths:
        if n > lm.context_length:
            raise RidgefillError(f"length {n} exceeds {lm.name}'s context of {lm.context_length}")
        ids = torch.tensor([prompts[n]])
        times: dict[str, list[float]] = {m: [] for m in cfg.methods}
        peaks: dict[str, float] = dict.fromkeys(cfg.methods, 0.0)
        for rep in range(cfg.warmup + cfg.repeats):
            order = cfg.methods[rep % len(cfg.methods) :] + cfg.methods[: rep % len(cfg.methods)]
            for m in order:
                kwargs = {"settings": s, "maps": maps.get(m)} if m in FILL_METHODS else {}
                with PeakRSS() as mem:
                    seconds = run_prefill(engine, ids, m, **kwargs).seconds
                if rep >= cfg.warmup:
                    times[m].append(seconds)
                    peaks[m] = max(peaks[m], mem.peak_mb)
                bar.update()
        ex = times["exact"]
        full = _full_rows(engine, ids, s)
        for m in cfg.methods:
            t = times[m]
            ratios = [e / x for e, x in zip(ex, t, strict=True)]
            bound = _flop_bound(engine, n, m, cfg.split, full)
            speed = statistics.median(ex) / statistics.median(t)
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
                    "tokens_per_s": round(n / statistics.median(t), 1),
                    "peak_mem_mb": round(peaks[m], 1),
                    "full_rows": n if m == "exact" else len(full),
                    "repeats": cfg.repeats,
                }
            )
    bar.close()
    return rows
