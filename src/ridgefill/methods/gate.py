"""TokenGate: training-free token gating in prefill, and the sparse attention the gated methods share.

What it is: layers below the gate layer run on every row (optionally with block-sparse attention,
`sparse_keep` < 1). At the gate layer, every token is scored by the attention the prompt's last
`query_last` tokens pay it (methods/select.py, the signal GemFilter and MInference's last-queries
index use; optionally paid at a deeper layer, on the ridge map's prediction of that layer's input
from the gate layer's state, and pooled over neighbouring tokens); the highest-scoring blocks of
`block` tokens, the sinks, a local window before the tail (widened, where a sliding-window layer
sits above the gate, to the window that layer's cache keeps) and the tail itself continue; the
other rows stop there. From the gate layer up, the kept
rows attend only to each other (dense attention over the kept subset, which is block-sparse
attention whose kept blocks are the gate's).

Two stages (`refine_layer`): a cheap early gate keeps a generous share, and at a deeper layer the
kept rows are scored again by that layer's own attention among themselves, the signal that finds
a needle best (in 10 multikey prompts on Qwen2.5-0.5B layer 11 ranks it first, layer 6 anywhere
from 1st to 240th), and narrowed to `refine_keep` of the prompt. Rows the second stage drops stop
there, as at the gate.

Dropped tokens' KV: absent from the gate layer and above. The cache holds every row for the
layers below the gate and only the kept rows above it, so decode sees exactly what the prompt's
last rows saw in prefill. Positions are untouched (RoPE uses true positions; a sliding-window
layer's cache keeps the prompt's true length), so decoding continues at position N.

Per-model defaults (data/tokengate.json): where a model's gate settings were measured (the layers
where it finds a needle, the share it keeps), `tokengate` named with no settings runs them
(`model_settings`); named settings start from the generic gate above. Length gate: prompts shorter
than `min_length` run exact, since gating short prompts costs more than it saves; the default is
the per-model threshold measured by `ridgefill bench` (same file). What it is not: a fill;
`gated-ridge` (methods/fill.py with `drop`) composes the gate with RidgeFill.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, replace
from importlib import resources
from typing import ClassVar

import torch
from transformers import DynamicCache

from ridgefill.engine import Engine, LowerState, Plan, PrefillResult
from ridgefill.errors import RidgefillError
from ridgefill.fit.maps import FillMaps
from ridgefill.methods.lower import check_fraction, run_lower, sliding_rows
from ridgefill.methods.select import (
    check_pool,
    check_score_maps,
    pick_spans,
    pool_scores,
    row_scores,
    sentence_ends,
    token_score_sets,
    top_blocks,
)
from ridgefill.models import hf


@dataclass(frozen=True)
class GateSettings:
    """Where the gate sits and what it keeps.

    Attributes:
        gate_layer: rows the gate drops stop before this layer (None: a quarter of the layers).
        keep: fraction in (0, 1] of the prompt's rows that continue past the gate, always-kept rows
            included.
        block: tokens per gate block and per sparse-attention block.
        sink, local, tail: the first tokens, the tokens before the tail, and the last tokens;
            always kept.
        query_last: how many of the last tokens score the others.
        sparse_keep: fraction in (0, 1] of causal key blocks the layers below the gate attend to
            (1: dense attention there).
        min_length: prompts shorter than this run exact (None: the model's measured threshold).
        sentence: 0 keeps whole blocks of `block` tokens, the best-scoring first. Above 0 the gate
            keeps sentences instead: around each of the best-scoring tokens, a span of `window`
            tokens widened to the sentence holding it (at most this many tokens either side; see
            methods/select.py `pick_spans`), best first, until the keep budget is spent. A
            sentence (a needle) then survives whole however the blocks fall.
        window: tokens of a span around each peak, with `sentence`.
        score_layer: None scores with the gate layer's own attention. A deeper layer scores with
            that layer's attention, computed on its input as the ridge maps fitted at split
            `gate_layer` predict it from the gate layer's state (read or fitted like RidgeFill's).
            Early layers attend by surface form; a deeper layer's queries find the needle.
        pool: each token's score is averaged over this many neighbouring tokens (odd; 1: none).
        query_top: per head, a token's score is the mean attention of the `query_top` queries
            that attend to it most (0: of all `query_last` queries; 1: the largest;
            methods/select.py `reduce_queries`).
        refine_layer: None gates once. A deeper layer gates a second time: the rows kept at the
            gate are scored by this layer's attention (on their true inputs, among themselves;
            same `query_last`, `query_top`, `pool` and span rule) and narrowed to `refine_keep`.
        refine_keep: fraction in (0, `keep`] of the prompt's rows that continue past
            `refine_layer`, always-kept rows included.
        min_select: each gate keeps at least this many rows beyond the always-kept ones (where it
            has that many to choose from), whatever `keep` or `refine_keep` allow: on a short
            prompt the sinks, local window and tail alone may fill the share, which would leave
            the question nothing to choose.
    """

    MAPS_AT: ClassVar[str] = "gate_layer"  # the settings field the maps' split must match

    gate_layer: int | None = None
    keep: float = 0.25
    block: int = 64
    sink: int = 4
    local: int = 256
    tail: int = 256
    query_last: int = 64
    sparse_keep: float = 1.0
    min_length: int | None = None
    sentence: int = 0
    window: int = 16
    score_layer: int | None = None
    pool: int = 1
    query_top: int = 0
    refine_layer: int | None = None
    refine_keep: float = 0.125
    min_select: int = 256

    @property
    def dense_below(self) -> int | None:
        """Layers every row runs densely, as exact does (None until the gate layer is resolved)."""
        return (self.gate_layer if self.sparse_keep >= 1 else 0) if self.gate_layer is not None else None

    def layer(self, num_layers: int) -> int:
        return max(1, num_layers // 4) if self.gate_layer is None else self.gate_layer

    @property
    def reads_sentences(self) -> bool:
        """Whether these settings find sentence ends, which reads the tokenizer's vocabulary."""
        return self.sentence > 0

    @property
    def reads_maps(self) -> str | None:
        """The kind of fitted maps these settings read: ridge maps to score at a deeper layer."""
        return None if self.score_layer is None else "ridge"

    def at(self, num_layers: int) -> GateSettings:
        """These settings with the gate layer resolved for a model of `num_layers` layers."""
        return self if self.gate_layer is not None else replace(self, gate_layer=self.layer(num_layers))

    def check(self, num_layers: int) -> None:
        g = self.layer(num_layers)
        if not 1 <= g < num_layers:
            raise RidgefillError(f"gate layer {g} is outside the model's 1..{num_layers - 1}")
        check_fraction("keep", self.keep)
        check_fraction("sparse_keep", self.sparse_keep)
        if self.block < 1 or self.sink < 0 or self.local < 0 or self.tail < 1 or self.query_last < 1:
            raise RidgefillError("block, tail and query_last must be >= 1; sink and local >= 0")
        if self.min_select < 0:
            raise RidgefillError(f"min_select must be >= 0, got {self.min_select}")
        if self.sentence < 0 or self.window < 1:
            raise RidgefillError("sentence must be >= 0 and window >= 1")
        if self.score_layer is not None and not g < self.score_layer < num_layers:
            raise RidgefillError(
                f"score_layer {self.score_layer} must be above the gate layer {g} and below {num_layers}"
            )
        check_pool("pool", self.pool)
        if self.refine_layer is not None:
            if not g < self.refine_layer < num_layers:
                raise RidgefillError(
                    f"refine_layer {self.refine_layer} must be above the gate layer {g} and below {num_layers}"
                )
            check_fraction("refine_keep", self.refine_keep)
            if self.refine_keep > self.keep:
                raise RidgefillError(f"refine_keep {self.refine_keep} must not exceed keep {self.keep}")
        if self.query_top < 0:
            raise RidgefillError(f"query_top must be >= 0 (0: the mean over every query), got {self.query_top}")


@functools.cache
def _model_table() -> dict:
    return json.loads(resources.files("ridgefill").joinpath("data/tokengate.json").read_text())["models"]


def length_threshold(model_name: str) -> int:
    """The measured length below which gating loses to exact for this model (0 when unmeasured)."""
    return int(_model_table().get(model_name, {}).get("min_length", 0))


def model_settings(model_name: str) -> dict:
    """The gate settings measured for this model, which plain `tokengate` runs ({} when unmeasured)."""
    return dict(_model_table().get(model_name, {}).get("settings", {}))


def always_kept(n: int, sink: int, local: int, tail: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(N,) bool: the sinks, the local window before the tail, and the tail."""
    keep = torch.zeros(n, dtype=torch.bool, device=device)
    keep[:sink] = True
    keep[max(0, n - tail - local) :] = True
    return keep


@torch.inference_mode()
def prefill_tokengate(
    engine: Engine,
    input_ids: torch.Tensor,
    settings: GateSettings | None = None,
    maps: FillMaps | None = None,
    *,
    logit_rows: torch.Tensor | None = None,
    lower: LowerState | None = None,
    cache: DynamicCache | None = None,
) -> PrefillResult:
    """TokenGate prefill of a (1, N) prompt; see the module docstring.

    Args:
        maps: ridge maps fitted at split `gate_layer`, read only with `score_layer`.
        logit_rows: positions whose logits to return (must be kept rows); default the last.
        lower: dense layers already run on this prompt, reused when below the gate.
        cache: an empty stock cache to fill (default: a new one).
    """
    s = settings or GateSettings()
    parts = engine.parts
    s.check(parts.num_layers)
    n = engine.check_prompt(input_ids)
    g = s.layer(parts.num_layers)
    if s.score_layer is not None:
        check_score_maps(maps, g, s.score_layer)
        maps.check_model(engine.lm)
    min_length = length_threshold(engine.lm.name) if s.min_length is None else s.min_length
    local = max(s.local, sliding_rows(engine, g) - s.tail)  # widened to cover a sliding window
    ran = {**asdict(s), "gate_layer": g, "min_length": min_length, "local_kept": local}
    if n < min_length or n <= s.sink + local + s.tail:
        res = engine.prefill_exact(input_ids, logit_rows, lower, cache)
        return res.as_exact("tokengate", ran, f"below the length gate ({min_length} tokens)")
    st, pairs = run_lower(engine, input_ids, g, s.sparse_keep, s.block, lower)
    t0, a1 = engine.clock(), engine.attn_seconds
    cache = engine.cache_from(st.kv, into=cache)
    scores = row_scores(
        engine, g, st.h, st.tables, s.query_last, maps=maps, score_layer=s.score_layer, pool=s.pool, top=s.query_top
    )
    always = always_kept(n, s.sink, local, s.tail, engine.device)
    ends = sentence_ends(engine, input_ids) if s.reads_sentences else None
    kpos = _select(s, scores, always, ~always, s.keep, ends)
    h, middle = st.h[:, kpos], None
    diagnostics = {"row_scores": scores, "score_candidates": ~always}  # eval's needle ranks
    for i in range(g, parts.num_layers):
        if i == s.refine_layer:
            h, kpos, middle, refined = _refine(engine, s, h, kpos, st.tables, always, ends)
            diagnostics |= refined
        h, k, v, _ = engine.layer(i, h, kpos, st.tables)
        hf.cache_update(cache, k, v, i, true_length=n)
    logits, rows = engine.logits_at(h, kpos, logit_rows, "the gate dropped")
    return PrefillResult(
        cache,
        logits,
        rows,
        n,
        st.seconds + engine.clock() - t0,
        "tokengate",
        ran_exact=False,
        plan=Plan(
            split=g,
            full=kpos,
            filled=0,
            fill="none",
            deep_keys=kpos,
            lower_pairs=pairs,
            score_layer=s.score_layer,
            refine=None if middle is None else s.refine_layer,
            middle=middle,
        ),
        attn_seconds=st.attn_seconds + engine.attn_seconds - a1,
        settings=ran,
        diagnostics=diagnostics,
    )


def _select(
    s: GateSettings,
    scores: torch.Tensor,
    always: torch.Tensor,
    candidates: torch.Tensor,
    keep: float,
    ends: torch.Tensor | None,
) -> torch.Tensor:
    """Sorted positions of the rows that continue: `always` and, by `scores` (N,), the best
    `candidates` up to `keep` of the prompt in all, and at least `s.min_select` of them (sentence
    spans with `ends`, else blocks)."""
    budget = max(s.min_select, int(keep * scores.shape[0]) - int(always.sum()))
    if ends is not None:
        chosen = pick_spans(scores, candidates, budget, s.window, ends, s.sentence)
    else:
        chosen = top_blocks(scores, candidates, budget, s.block)
    return (always | chosen).nonzero().squeeze(1)


def _refine(
    engine: Engine,
    s: GateSettings,
    h: torch.Tensor,
    kpos: torch.Tensor,
    tables,
    always: torch.Tensor,
    ends: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The second stage at `refine_layer`: rows `kpos` (inputs h, (1, T, d)) scored by that layer's
    attention among themselves and narrowed to `refine_keep`. Returns (h, kpos) of the rows that
    continue, the rows that ran up to here, and eval's diagnostics: the scores (N,), -inf on rows
    that stopped before, and the candidates they chose among."""
    compact = token_score_sets(engine, s.refine_layer, h, tables, s.query_last, (s.query_top,), pos=kpos)[0]
    scores = torch.full(always.shape, float("-inf"), device=h.device, dtype=compact.dtype)
    scores[kpos] = pool_scores(compact, s.pool)
    candidates = torch.zeros_like(always)
    candidates[kpos] = True
    candidates &= ~always
    nxt = _select(s, scores, always, candidates, s.refine_keep, ends)
    at = torch.searchsorted(kpos, nxt)
    return h[:, at], nxt, kpos, {"refine_scores": scores, "refine_candidates": candidates}
