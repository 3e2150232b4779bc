"""`ridgefill tune`: the fastest fill configuration whose NIAH loss and perplexity rise stay in budget.

What it is: a two-stage search over `tune.space` candidates on a tuning set drawn from the corpus's
held-out split with its own seed, never from the evaluation split that `ridgefill eval` (the final
check) reads:
  1. tail perplexity and TTFT of every candidate on `ppl_docs` documents, paired against exact;
     candidates over the perplexity budget stop here (they can never be chosen);
  2. NIAH (`tasks` x `samples`) on the survivors, paired against exact; a candidate whose loss runs
     far past the budget stops early.
Per prompt, the layers below each split run once and are shared (dense ones continue from each
other; block-sparse ones once per sparse setting): exact continues from the deepest dense state,
each candidate from its own, and every TTFT counts the shared layers it used, so speed is a
same-prompt, same-run ratio (median over prompts). Decoding stops once every answer is in the
text, which cannot change `string_match_all`. What it is not: the final check (`ridgefill eval`
on the evaluation split) or the report (tune/report.py).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from ridgefill.bench.flops import exact_macs, plan_macs
from ridgefill.engine import Engine, LowerState
from ridgefill.errors import RidgefillError
from ridgefill.eval import ruler
from ridgefill.eval.adapter import Prepared
from ridgefill.eval.ppl import increase_pct, scored_nll, tail_rows
from ridgefill.eval.runner import bootstrap_ci
from ridgefill.fit.maps import FillMaps
from ridgefill.generation import stream_tokens
from ridgefill.methods import run_prefill
from ridgefill.methods.gate import run_lower
from ridgefill.models.loading import LoadedModel
from ridgefill.tune.space import Candidate

log = logging.getLogger(__name__)

EVAL_SEED = 42  # `ridgefill eval`'s default seed: the tuning set must not reuse its needles
NIAH = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1")


@dataclass(frozen=True)
class TuneConfig:
    """Budgets and the size of the tuning set.

    Attributes:
        budget_niah: most NIAH points (mean over tuning samples, 0-100) a choice may lose to exact.
        budget_ppl: most tail-perplexity increase (%) over exact a choice may have.
        length: prompt tokens of every tuning prompt.
        samples: NIAH samples per task.
        ppl_docs: documents for tail perplexity; ppl_tail: tokens scored at each one's end.
        seed: sample seed (must differ from the final check's).
        max_new_tokens: decode cap for NIAH answers (RULER's 128 costs time on wrong answers only).
        early_out: a candidate stops NIAH once its loss exceeds the budget by this many points...
        min_samples: ...after at least this many samples.
        screen: candidates measured in stage 2 when none meets the perplexity budget (the
            speed/perplexity frontier, so the report still shows the trade-off).
        wave: stage 2 measures this many candidates at a time, fastest first, and stops after
            the first wave in which one meets both budgets.
        ppl_upper: hold the upper end of the tail-perplexity increase's 95% interval (bootstrap
            over the documents) against the budget instead of its mean: fewer documents cannot
            pass a configuration on luck.
    """

    budget_niah: float = 2.0
    budget_ppl: float = 5.0
    length: int = 4096
    samples: int = 6
    tasks: tuple[str, ...] = NIAH
    ppl_docs: int = 4
    ppl_tail: int = 256
    seed: int = 7
    max_new_tokens: int = 48
    early_out: float = 20.0
    min_samples: int = 8
    screen: int = 6
    wave: int = 12
    ppl_upper: bool = False

    def check(self) -> None:
        if self.seed == EVAL_SEED:
            raise RidgefillError(f"seed {EVAL_SEED} is the final check's; tune on another seed")
        if self.samples < 1 or self.ppl_docs < 1:
            raise RidgefillError("samples and ppl_docs must be at least 1")
        if self.budget_niah < 0 or self.budget_ppl < 0:
            raise RidgefillError("budgets must be >= 0")
        if self.ppl_tail < 2 or self.ppl_tail >= self.length:
            raise RidgefillError(f"ppl_tail must be in [2, length), got {self.ppl_tail}")


@dataclass(eq=False)
class Trial:
    """What one candidate measured so far."""

    candidate: Candidate
    nll: list[float] = field(default_factory=list)  # tail NLL per document
    ppl_speed: list[float] = field(default_factory=list)  # exact s / candidate s, per document
    niah: list[tuple[float, float]] = field(default_factory=list)  # (exact, candidate) per sample
    speed: list[float] = field(default_factory=list)  # exact TTFT / candidate TTFT, per NIAH prompt
    bound: list[float] = field(default_factory=list)  # FLOP bound per NIAH prompt
    stopped: str | None = None

    @property
    def niah_loss(self) -> float | None:
        return sum(e - c for e, c in self.niah) / len(self.niah) if self.niah else None

    def ppl_increase(self, exact_nll: list[float]) -> float:
        return increase_pct(sum(self.nll) / len(self.nll), sum(exact_nll) / len(exact_nll))

    def ppl_ci(self, exact_nll: list[float]) -> list[float]:
        """95% bootstrap interval of the perplexity increase (%), resampling the documents."""
        diffs = [c - e for c, e in zip(self.nll, exact_nll, strict=True)]
        return [round(increase_pct(d, 0.0), 2) for d in bootstrap_ci(diffs, digits=None)]

    def ppl_judged(self, exact_nll: list[float], cfg: TuneConfig) -> float:
        """The perplexity figure held against the budget: the mean, or the interval's upper end."""
        return self.ppl_ci(exact_nll)[1] if cfg.ppl_upper else self.ppl_increase(exact_nll)

    def speedup(self) -> float:
        return statistics.median(self.speed or self.ppl_speed)


LowerKey = tuple[int, float, int]  # (split, sparse_keep, block); dense states have keep 1 and block 0


def _lower_key(c: Candidate) -> LowerKey:
    s = c.settings
    return (c.lower, 1.0, 0) if s.sparse_keep >= 1 else (c.lower, s.sparse_keep, s.block)


def _lowers(
    engine: Engine, ids: torch.Tensor, keys: set[LowerKey]
) -> tuple[dict[LowerKey, LowerState], LowerState | None]:
    """The layers below each candidate's split, run once per distinct (split, sparse_keep, block):
    dense states continue from one another; block-sparse ones are run on their own. Also returns
    the deepest dense state (None when every key is block-sparse), for exact to continue from."""
    out: dict[LowerKey, LowerState] = {}
    st = None
    for key in sorted(k for k in keys if k[1] >= 1):
        st = engine.run_lower(ids, key[0], start=st)
        out[key] = st
    for key in sorted(k for k in keys if k[1] < 1):
        out[key], _ = run_lower(engine, ids, key[0], key[1], key[2], None)
    return out, st


def _answer(lm: LoadedModel, ids: torch.Tensor, pre, answers: list[str], max_new: int) -> float:
    """Greedy answer's `string_match_all` score (0-100), stopping once every answer is in the text."""
    toks: list[int] = []
    text = ""
    for tok in stream_tokens(lm, ids, pre, max_new):
        toks.append(tok)
        text = lm.tokenizer.decode(toks, skip_special_tokens=True)
        if ruler.string_match_all(text, answers) == 1.0:
            break
    return 100 * ruler.string_match_all(text, answers)


def run_search(
    lm: LoadedModel,
    cfg: TuneConfig,
    candidates: list[Candidate],
    maps: dict[int, FillMaps],
    prompts: list[Prepared],
    docs: list[list[int]],
    progress: Callable[..., None] | None = None,
    checkpoint: Callable[[dict], None] | None = None,
) -> dict:
    """Both stages; returns exact's figures, one row per candidate and the chosen label (or None).

    `maps[split]`: ridge maps for every split a candidate reads (`Candidate.maps_split`).
    `progress(n, stage, remaining=None)` is
    called after each run (exact or candidate) with the number of runs just done; at the start of
    each NIAH wave, `remaining` estimates the runs left (waves shrink the first estimate).
    `checkpoint(result)` receives the result so far (`complete` False) after the perplexity stage
    and after each NIAH wave, so a long search shows what it has measured before it ends.
    """
    cfg.check()
    short = [c.label for c in candidates if c.settings.tail < cfg.ppl_tail]
    if short:
        raise RidgefillError(
            f"ppl_tail {cfg.ppl_tail} scores rows that {', '.join(short)} fill; lower it to the least tail"
        )
    engine = Engine(lm)
    n = cfg.length
    exact_cost = exact_macs(engine.parts, n)
    trials = {c.label: Trial(c) for c in candidates}
    tick = progress or (lambda k, stage, remaining=None: None)
    save = checkpoint or (lambda partial: None)
    t0 = time.perf_counter()

    def prefill(c: Candidate, ids: torch.Tensor, lower: dict[LowerKey, LowerState], rows: torch.Tensor | None = None):
        m = None if c.maps_split is None else maps[c.maps_split]
        return run_prefill(
            engine, ids, c.method, settings=c.settings, maps=m, lower=lower[_lower_key(c)], logit_rows=rows
        )

    # Stage 1: tail perplexity and speed on every candidate.
    exact_nll = []
    rows = tail_rows(n, cfg.ppl_tail)
    for doc in docs:
        ids = torch.tensor([doc])
        lower, deepest = _lowers(engine, ids, {_lower_key(c) for c in candidates})
        ex = engine.prefill_exact(ids, rows, deepest)
        exact_nll.append(scored_nll(ex, ids))
        tick(1, "perplexity")
        for t in trials.values():
            res = prefill(t.candidate, ids, lower, rows)
            t.nll.append(scored_nll(res, ids))
            t.ppl_speed.append(ex.seconds / res.seconds)
            tick(1, "perplexity")
    over = [t for t in trials.values() if t.ppl_judged(exact_nll, cfg) > cfg.budget_ppl]
    judged = "tail PPL's 95% upper end" if cfg.ppl_upper else "tail PPL"
    for t in over:
        t.stopped = f"{judged} +{t.ppl_judged(exact_nll, cfg):.1f}% is over the {cfg.budget_ppl:g}% budget"
    live = [t for t in trials.values() if t.stopped is None]
    if not live:
        live = _speed_ppl_frontier(list(trials.values()), exact_nll)[: cfg.screen]
        for t in live:
            t.stopped = None
        log.warning("no candidate meets the perplexity budget; measuring NIAH on the %d-point frontier", len(live))

    # Stage 2: NIAH, paired against exact on the same prompts: the fastest survivors first, `wave`
    # at a time, until one meets both budgets (slower ones could no longer be chosen).
    exact_scores: dict[int, float] = {}

    def niah_wave(wave: list[Trial]) -> None:
        for j, p in enumerate(prompts):
            running = [t for t in wave if t.stopped is None]
            if not running:
                return
            ids = p.input_ids
            lower, deepest = _lowers(engine, ids, {_lower_key(t.candidate) for t in running})
            ex = engine.prefill_exact(ids, None, deepest)
            if j not in exact_scores:
                exact_scores[j] = _answer(lm, ids, ex, p.sample.answers, cfg.max_new_tokens)
            tick(1, "NIAH")
            for t in running:
                res = prefill(t.candidate, ids, lower)
                t.niah.append((exact_scores[j], _answer(lm, ids, res, p.sample.answers, cfg.max_new_tokens)))
                t.speed.append(ex.seconds / res.seconds)
                plan = None if res.ran_exact else res.plan
                t.bound.append(1.0 if plan is None else exact_cost / plan_macs(engine.parts, n, plan))
                tick(1, "NIAH")
                loss = t.niah_loss
                if len(t.niah) >= cfg.min_samples and loss > cfg.budget_niah + cfg.early_out:
                    t.stopped = f"NIAH loss {loss:.1f} points after {len(t.niah)} samples (early out)"

    def result(pending: list[Trial], final: bool) -> dict:
        rows_out = [_row(t, exact_nll, cfg, len(prompts)) for t in trials.values()]
        for r, t in zip(rows_out, trials.values(), strict=True):
            if t in pending and not final:
                r["stopped"] = "NIAH pending (a later wave)"
        chosen = choose(rows_out)
        _mark_frontier(rows_out)
        return {
            "exact": {
                "tail_nll": round(sum(exact_nll) / len(exact_nll), 5),
                "tail_nll_docs": [round(x, 5) for x in exact_nll],
                "niah_score": round(sum(exact_scores.values()) / len(exact_scores), 2) if exact_scores else None,
                "niah_samples": len(exact_scores),
            },
            "candidates": rows_out,
            "chosen": chosen,
            "complete": final,
            "search_seconds": round(time.perf_counter() - t0, 1),
        }

    pending = sorted(live, key=lambda t: -t.speedup())
    save(result(pending, final=False))
    while pending:
        wave, pending = pending[: cfg.wave], pending[cfg.wave :]
        tick(0, "NIAH", remaining=len(prompts) * (1 + len(wave)))
        niah_wave(wave)
        save(result(pending, final=False))
        if any(_row(t, exact_nll, cfg, len(prompts))["within_budget"] for t in wave):
            break
    for t in pending:
        t.stopped = "NIAH not run: a faster configuration met both budgets"
    return result([], final=True)


def choose(rows: list[dict]) -> str | None:
    """The fastest row within both budgets (None when no row is)."""
    ok = [r for r in rows if r["within_budget"]]
    return max(ok, key=lambda r: r["speedup"])["label"] if ok else None


def _speed_ppl_frontier(trials: list[Trial], exact_nll: list[float]) -> list[Trial]:
    """Candidates no other beats on both speed and perplexity, fastest first."""
    pts = [(t, t.speedup(), t.ppl_increase(exact_nll)) for t in trials]
    front = [a for a in pts if not any(b[1] >= a[1] and b[2] <= a[2] and b != a for b in pts)]
    return [t for t, _, _ in sorted(front, key=lambda x: -x[1])]


def _row(t: Trial, exact_nll: list[float], cfg: TuneConfig, prompts: int) -> dict:
    complete = t.stopped is None and len(t.niah) == prompts
    loss = t.niah_loss
    ppl = t.ppl_increase(exact_nll)
    return {
        "label": t.candidate.label,
        "method": t.candidate.method,
        "settings": asdict(t.candidate.settings),
        "speedup": round(t.speedup(), 3),
        "speed_from": "NIAH prompts" if t.speed else "perplexity documents",
        "speed_prompts": len(t.speed or t.ppl_speed),
        "speedup_min": round(min(t.speed or t.ppl_speed), 3),
        "speedup_max": round(max(t.speed or t.ppl_speed), 3),
        "flop_bound": round(statistics.median(t.bound), 3) if t.bound else None,
        "ppl_increase_pct": round(ppl, 2),
        "ppl_ci95": t.ppl_ci(exact_nll),
        "niah_loss": None if loss is None else round(loss, 2),
        "niah_samples": len(t.niah),
        "niah_score": round(sum(c for _, c in t.niah) / len(t.niah), 2) if t.niah else None,
        "stopped": t.stopped,
        "within_budget": complete and loss <= cfg.budget_niah and t.ppl_judged(exact_nll, cfg) <= cfg.budget_ppl,
    }


def _mark_frontier(rows: list[dict]) -> None:
    """`frontier`: NIAH was measured in full and no other such row is at least as fast, as accurate
    on NIAH and as good on perplexity (and better on one)."""
    full = [r for r in rows if r["stopped"] is None and r["niah_loss"] is not None]

    def beats(b: dict, a: dict) -> bool:
        ge = b["speedup"] >= a["speedup"] and b["niah_loss"] <= a["niah_loss"]
        ge = ge and b["ppl_increase_pct"] <= a["ppl_increase_pct"]
        gt = b["speedup"] > a["speedup"] or b["niah_loss"] < a["niah_loss"]
        return ge and (gt or b["ppl_increase_pct"] < a["ppl_increase_pct"])

    for r in rows:
        r["frontier"] = r in full and not any(beats(b, r) for b in full if b is not r)


def tuning_set(lm: LoadedModel, cfg: TuneConfig, corpus: str | None = None) -> tuple[list[Prepared], list[list[int]]]:
    """NIAH prompts (tasks interleaved, so an early out sees every task) and perplexity documents,
    both from the corpus's held-out split: the final check reads the evaluation split."""
    from ridgefill.corpus import load_corpus, token_segments
    from ridgefill.eval.adapter import prepare

    cfg.check()
    if cfg.length > lm.context_length:
        raise RidgefillError(f"length {cfg.length} exceeds {lm.name}'s context of {lm.context_length}")
    held = load_corpus(corpus).part("heldout")
    essay = ruler.essay_sentences([d.text for d in held])
    per_task = [prepare(lm, t, cfg.length, cfg.samples, cfg.seed, essay) for t in cfg.tasks]
    prompts = [p for group in zip(*per_task, strict=True) for p in group]
    docs, _ = token_segments(lm.tokenizer, held, cfg.length, cfg.length * cfg.ppl_docs, per_doc=cfg.length)
    if len(docs) < cfg.ppl_docs:
        raise RidgefillError(f"the held-out split holds only {len(docs)} documents of {cfg.length} tokens")
    return prompts, docs[: cfg.ppl_docs]
