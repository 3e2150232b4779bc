"""`ridgefill eval`: every sample under every method, paired against exact, resumable.

What it is: RULER samples are built once per (task, length) with the model's tokenizer and
chat template (answer prefix inside the assistant turn); each sample runs under `exact` and every
chosen method with the same prompt, greedy; the layers all of them run in full are computed once
per prompt and shared (each method's TTFT still counts them). Per-sample results are appended to
a JSONL cache, so an interrupted run resumes. The report gives scores per task, length, depth bucket and method,
each method's paired difference from exact with a 95% bootstrap interval, and the points ridge
recovers over identity for needles inside the filled region. What it is not: a sample generator
(ruler.py) or a prefill method.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ridgefill.engine import Engine
from ridgefill.errors import RidgefillError
from ridgefill.eval import ruler
from ridgefill.eval.ppl import MethodSpec, shared_lower
from ridgefill.fit.maps import fingerprint
from ridgefill.generation import encode_prompt, generate_batch, prompt_text
from ridgefill.models.loading import LoadedModel

DEPTH_BUCKETS = ("0-20", "20-40", "40-60", "60-80", "80-100")
DECODE = (
    "greedy, RULER's tokens_to_generate; the methods of one prompt whose caches hold the same keys decode as one "
    "batch of the stock forward (each record's decode_batch; records without it decoded alone)"
)


@dataclass(frozen=True)
class Prepared:
    sample: ruler.Sample
    input_ids: torch.Tensor  # (1, N)
    depth: float  # relative token position of the first queried needle (0..1)
    needle_pos: int  # its token position
    size: int  # haystack units that fit the length

    @property
    def key(self) -> str:
        return hashlib.sha1(self.input_ids.numpy().tobytes()).hexdigest()[:16]


def _needle_token_pos(lm: LoadedModel, sample: ruler.Sample) -> int:
    """Token position where the needle holding the first answer starts (from token offsets)."""
    needle = next(n for n in sample.needles if sample.answers[0] in n)
    text, special = prompt_text(lm, sample.text, answer_prefix=sample.answer_prefix)
    at = text.index(needle)
    offsets = lm.tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)["offset_mapping"]
    return next(i for i, (_, end) in enumerate(offsets) if end > at)


def prepare(lm: LoadedModel, task: str, length: int, count: int, seed: int, essay: list[str]) -> list[Prepared]:
    """Build `count` samples of `task` whose prompts fill `length` tokens less the answer budget."""
    if task not in ruler.TASKS:
        raise RidgefillError(f"unknown task {task!r}; choose from {', '.join(ruler.TASKS)}")
    if length > lm.context_length:
        raise RidgefillError(f"length {length} exceeds {lm.name}'s context of {lm.context_length}")
    budget = length - ruler.TOKENS_TO_GENERATE[task]
    essay_task = task in ruler.NIAH_TASKS and ruler.NIAH_TASKS[task].haystack == "essay"
    out = []
    for i in range(count):
        state = seed * 1_000_003 + ruler.TASKS.index(task) * 10_007 + i

        def make(size: int, state=state, i=i) -> ruler.Sample:
            rng = random.Random(state)
            if task == "vt":
                return ruler.vt_sample(size, rng, example_size=20, index=i)
            return ruler.niah_sample(task, size, rng, essay, index=i)

        def count_tokens(size: int) -> int:
            s = make(size)
            return int(encode_prompt(lm, s.text, answer_prefix=s.answer_prefix).shape[1])

        hi = len(essay) if essay_task else length
        size = ruler.fit_size(count_tokens, budget, hi, guess=out[-1].size if out else None)
        s = make(size)
        ids = encode_prompt(lm, s.text, answer_prefix=s.answer_prefix)
        pos = _needle_token_pos(lm, s)
        out.append(Prepared(s, ids, pos / ids.shape[1], pos, size))
    return out


def spec_settings(spec: MethodSpec) -> dict:
    """A method's full settings as written in results files: its name, every settings field and
    the split of the maps it reads."""
    settings, maps = spec.kwargs.get("settings"), spec.kwargs.get("maps")
    out = {"method": spec.method, **(asdict(settings) if is_dataclass(settings) else {})}
    if maps is not None:
        out["maps_split"] = maps.split
    return out


def config_key(lm: LoadedModel, spec: MethodSpec) -> str:
    """What a cached record was computed with: model weights, dtype, method, its settings and the
    header of the maps it read. A cache entry is reused only under the same key, so re-running with
    another split, tail, dtype or refitted maps recomputes instead of reusing stale records."""
    kw = spec.kwargs
    settings, maps = kw.get("settings"), kw.get("maps")
    what = {
        "model": fingerprint(lm)["weights_sha256"],
        "dtype": str(lm.dtype),
        "method": spec.method,
        "settings": asdict(settings) if is_dataclass(settings) else settings,
        "maps": None if maps is None else {"method": maps.method, "split": maps.split, "header": maps.header},
    }
    return hashlib.sha1(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _bootstrap_ci(diffs: list[float], seed: int = 0, rounds: int = 2000) -> list[float]:
    if not diffs:
        return [0.0, 0.0]
    t = torch.tensor(diffs, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    means = t[torch.randint(len(t), (rounds, len(t)), generator=g)].mean(1)
    return [round(float(means.quantile(0.025)), 2), round(float(means.quantile(0.975)), 2)]


def run_eval(
    lm: LoadedModel,
    tasks: list[str],
    lengths: list[int],
    samples: int,
    specs: list[MethodSpec],
    essay: list[str],
    cache_path: Path,
    seed: int = 42,
    tail: int | None = None,
) -> list[dict]:
    """Run every (task, length, sample, method); return per-sample records (cached in JSONL)."""
    if specs[0].label != "exact":
        raise RidgefillError("the first method must be exact: every score is paired against it")
    done: dict[tuple, dict] = {}
    if cache_path.is_file():
        for line in cache_path.read_text().splitlines():
            r = json.loads(line)
            done[(r["task"], r["length"], r["index"], r["method"], r["prompt"], r.get("config"))] = r
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    configs = {s.label: config_key(lm, s) for s in specs}
    records = []
    jobs = [(t, n) for t in tasks for n in lengths]
    bar = tqdm(total=len(jobs) * samples * len(specs), desc=f"eval {lm.name}", unit="run")
    with cache_path.open("a") as cache_file:
        for task, n in jobs:
            for p in prepare(lm, task, n, samples, seed, essay):
                todo = [s for s in specs if (task, n, p.sample.index, s.label, p.key, configs[s.label]) not in done]
                # The layers every method runs in full are run once per prompt and shared; each
                # method's TTFT still counts them (lower.seconds).
                lower = shared_lower(Engine(lm), p.input_ids, todo) if len(todo) > 1 else None
                shared_s = lower.seconds if lower else 0.0
                max_new = ruler.TOKENS_TO_GENERATE[task]
                runs = [(s.method, {"lower": lower, **s.kwargs}) for s in todo]
                outs = dict(zip([s.label for s in todo], generate_batch(lm, p.input_ids, runs, max_new), strict=True))
                for spec in specs:
                    key = (task, n, p.sample.index, spec.label, p.key, configs[spec.label])
                    if key not in done:
                        res = outs[spec.label]
                        done[key] = {
                            "task": task,
                            "length": n,
                            "index": p.sample.index,
                            "method": spec.label,
                            "prompt": p.key,
                            "config": configs[spec.label],
                            "prompt_tokens": int(p.input_ids.shape[1]),
                            "depth": round(p.depth, 4),
                            "needle_pos": p.needle_pos,
                            "filled": tail is not None and p.needle_pos < p.input_ids.shape[1] - tail,
                            "score": 100 * ruler.string_match_all(res.text, p.sample.answers),
                            "prediction": res.text,
                            "answers": p.sample.answers,
                            "ttft_s": round(res.ttft_s + shared_s, 4),
                            "run_s": round(res.ttft_s + res.decode_s + shared_s / len(todo), 4),
                            "decode_batch": res.decode_batch,
                        }
                        cache_file.write(json.dumps(done[key]) + "\n")
                        cache_file.flush()
                    records.append(done[key])
                    bar.update()
    bar.close()
    return records


def _paired(rows: dict[tuple, dict], exact: dict[tuple, dict]) -> dict:
    """Score, paired delta vs exact with its bootstrap CI, and median paired TTFT ratio of some records."""
    paired = [rows[k]["score"] - exact[k]["score"] for k in rows if k in exact]
    speed = sorted(exact[k]["ttft_s"] / rows[k]["ttft_s"] for k in rows if k in exact and rows[k]["ttft_s"] > 0)
    scores = [r["score"] for r in rows.values()]
    return {
        "samples": len(rows),
        "score": round(sum(scores) / len(scores), 2),
        "delta_vs_exact": round(sum(paired) / len(paired), 2) if paired else None,
        "ci95": _bootstrap_ci(paired),
        "exact_score": round(sum(exact[k]["score"] for k in rows if k in exact) / len(paired), 2) if paired else None,
        # Paired per prompt; a reused cache may pair different processes (bench is the clean figure).
        "ttft_speedup": round(speed[len(speed) // 2], 3) if speed else None,
    }


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
    return {"samples": len(filled), "score": round(sum(filled) / len(filled), 2) if filled else None}


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
