"""Our engine behind the evaluation's `api.Adapter` interface.

What it is: a loaded model and its labelled prefill methods (`Prefill`, "exact" first). Prompts
go through the model's chat template with the answer prefix inside the assistant turn (RULER's
layout); every method answers greedily; the layers all methods of a prompt run in full are computed
once and shared (each method's TTFT still counts them). Also `prepare`, RULER prompts as token ids
for the tuner. What it is not: scoring or the run loop (`runner.py`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, is_dataclass

import torch

from ridgefill.engine import Engine, PrefillResult
from ridgefill.errors import RidgefillError
from ridgefill.eval.api import Generation, Prompt, Sample
from ridgefill.eval.ppl import shared_lower
from ridgefill.eval.ruler import RulerTask
from ridgefill.fit.maps import calib_info, fingerprint
from ridgefill.generation import encode_prompt, generate_batch, prompt_text
from ridgefill.methods import Prefill
from ridgefill.methods.resolve import changed_settings
from ridgefill.models.loading import LoadedModel

DECODE = (
    "greedy, RULER's tokens_to_generate; the methods of one prompt whose caches hold the same keys decode as one "
    "batch of the stock forward (each record's decode_batch; records without it decoded alone)"
)


# Version of what a cached record's key holds; records under another version are recomputed.
CACHE_SCHEMA = 2


def spec_settings(spec: Prefill) -> dict:
    """A method's full settings as written in results files: its name, every settings field, and
    the split and calibration (tokens, facts per segment, corpus) of the maps it reads; per length
    bucket for a configuration tuned per length."""
    if spec.by_length:
        return {"method": spec.label, "by_length": [{"up_to": u, **spec_settings(p)} for u, p in spec.by_length]}
    settings, maps = spec.settings, spec.maps
    out = {"method": spec.method, **(asdict(settings) if is_dataclass(settings) else {})}
    if maps is not None:
        out["maps_split"] = maps.split
        out["maps_calib"] = calib_info(maps)
    return out


def config_key(lm: LoadedModel, spec: Prefill) -> str:
    """What a cached record was computed with: model weights, dtype, method, its settings and the
    header of the maps it read. A cache entry is reused only under the same key, so re-running with
    another split, tail, dtype or refitted maps recomputes instead of reusing stale records.
    Settings at their defaults are left out, so that adding a setting keeps the records computed
    without it."""

    def computed(p: Prefill) -> dict:
        maps = p.maps
        return {
            "method": p.method,
            "settings": None if p.settings is None else changed_settings(p.settings),
            "maps": None if maps is None else {"method": maps.method, "split": maps.split, "header": maps.header},
        }

    what = {"schema": CACHE_SCHEMA, "model": fingerprint(lm)["weights_sha256"], "dtype": str(lm.dtype)}
    if spec.by_length:
        what["by_length"] = [[up_to, computed(p)] for up_to, p in spec.by_length]
    else:
        what.update(computed(spec))
    return hashlib.sha1(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:12]


def needle_span(lm: LoadedModel, sample: Sample) -> tuple[int, int] | None:
    """Token positions [start, end) of the needle holding the first answer (from token offsets)."""
    needle = next((n for n in sample.needles if sample.answers and sample.answers[0] in n), None)
    if needle is None:
        return None
    text, special = prompt_text(lm, sample.text, answer_prefix=sample.answer_prefix)
    at = text.index(needle)
    offsets = lm.tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)["offset_mapping"]
    inside = [i for i, (a, b) in enumerate(offsets) if b > at and a < at + len(needle)]
    return inside[0], inside[-1] + 1


def needle_rows(res: PrefillResult, span: tuple[int, int] | None) -> dict:
    """Did a skipping method run the needle's rows fully, and how did its row score rank the needle?

    `needle_full`: the fraction of the needle's tokens that ran every layer (fill: full rows;
    tokengate: kept rows); absent when the method ran every row (exact, or a prompt too short to
    skip). `needle_rank`: 1 + the candidate rows the query score (fill: at the split layer;
    tokengate: at the gate layer) put above the needle's best token; absent without that score.
    `needle_rank_refine`: the same under a two-stage gate's second score, among the rows its first
    stage kept; absent when none of the needle's tokens got that far.
    """
    if span is None or res.ran_exact or res.plan is None:
        return {}
    full = res.plan.full.cpu()
    lo, hi = span
    ran = torch.zeros(hi - lo, dtype=torch.bool)
    inside = full[(full >= lo) & (full < hi)] - lo
    ran[inside] = True
    out = {"needle_full": round(float(ran.float().mean()), 3)}
    for name, scores_key, cand_key in _RANKS:
        scores, cand = res.diagnostics.get(scores_key), res.diagnostics.get(cand_key)
        rank = None if scores is None else needle_rank(scores, cand, span)
        if rank is not None:
            out[name] = rank
    return out


def needle_rank(scores: torch.Tensor, candidates: torch.Tensor, span: tuple[int, int]) -> int | None:
    """1 + the `candidates` rows whose score (N,) beats the best of the needle's tokens (`span`,
    [start, end)); None when every needle token scores -inf (rows that stopped before this score)."""
    scores, candidates = scores.float().cpu(), candidates.cpu()
    best = scores[span[0] : span[1]].max()
    if best == float("-inf"):
        return None
    return int((scores.masked_fill(~candidates, float("-inf")) > best).sum()) + 1


# (record field, diagnostics score key, diagnostics candidate-mask key) of each needle rank.
_RANKS = (
    ("needle_rank", "row_scores", "score_candidates"),
    ("needle_rank_refine", "refine_scores", "refine_candidates"),
)


def _encode(lm: LoadedModel, sample: Sample) -> torch.Tensor:
    return encode_prompt(lm, sample.text, answer_prefix=sample.answer_prefix)  # (1, N)


def prompt_key(ids: torch.Tensor) -> str:
    return hashlib.sha1(ids.numpy().tobytes()).hexdigest()[:16]


class EngineAdapter:
    """`api.Adapter` for a loaded model and its methods."""

    def __init__(self, lm: LoadedModel, specs: Sequence[Prefill]):
        if not specs or specs[0].label != "exact":
            raise RidgefillError("the first method must be exact: every score is paired against it")
        labels = [s.label for s in specs]
        if len(set(labels)) != len(labels):
            raise RidgefillError(f"method labels must differ: {', '.join(labels)}")
        self.lm, self.specs = lm, {s.label: s for s in specs}
        self.name, self.context_length, self.methods = lm.name, lm.context_length, labels
        self._configs = {s.label: config_key(lm, s) for s in specs}
        self._last: tuple[Sample, torch.Tensor, tuple[int, int] | None] | None = None

    def _tokenized(self, sample: Sample) -> tuple[torch.Tensor, tuple[int, int] | None]:
        """Token ids and needle span of `sample`; the last sample's are kept, since the run loop
        asks `prompt` and then `generate` for the same one."""
        if self._last is None or self._last[0] is not sample:
            self._last = (sample, _encode(self.lm, sample), needle_span(self.lm, sample))
        return self._last[1], self._last[2]

    def count_tokens(self, sample: Sample) -> int:
        return int(_encode(self.lm, sample).shape[1])

    def prompt(self, sample: Sample) -> Prompt:
        ids, span = self._tokenized(sample)
        return Prompt(prompt_key(ids), int(ids.shape[1]), None if span is None else span[0])

    def config(self, method: str) -> str:
        return self._configs[method]

    def generate(self, sample: Sample, methods: Sequence[str], max_new_tokens: int) -> dict[str, Generation]:
        ids, span = self._tokenized(sample)
        todo = [self.specs[m] for m in methods]
        # The layers every method runs in full are run once per prompt and shared.
        lower = shared_lower(Engine(self.lm), ids, todo) if len(todo) > 1 else None
        shared_s = lower.seconds if lower else 0.0
        out = {}
        for spec, res in zip(todo, generate_batch(self.lm, ids, todo, max_new_tokens, lower), strict=True):
            out[spec.label] = Generation(
                res.text,
                ttft_s=round(res.ttft_s + shared_s, 4),
                run_s=round(res.ttft_s + res.decode_s + shared_s / len(todo), 4),
                decode_batch=res.decode_batch,
                info=needle_rows(res.prefill, span),
            )
        return out


@dataclass(frozen=True)
class Prepared:
    """A RULER sample as token ids, for callers that prefill themselves (the tuner)."""

    sample: Sample
    input_ids: torch.Tensor  # (1, N)
    depth: float  # relative token position of the first queried needle (0..1)
    needle_pos: int  # its token position
    needle_end: int  # one past its last token


def prepare(lm: LoadedModel, task: str, length: int, count: int, seed: int, essay: list[str]) -> list[Prepared]:
    """`count` samples of RULER `task` whose prompts fill `length` tokens less the answer budget."""
    if length > lm.context_length:
        raise RidgefillError(f"length {length} exceeds {lm.name}'s context of {lm.context_length}")
    out = []
    for s in RulerTask(task, tuple(essay)).samples(lambda s: int(_encode(lm, s).shape[1]), length, count, seed):
        ids = _encode(lm, s)
        pos, end = needle_span(lm, s)
        out.append(Prepared(s, ids, pos / ids.shape[1], pos, end))
    return out
