"""Query-aware full rows: the bulk tokens the prompt's last tokens attend to run every layer.

What it is: before the deep layers, the queries of the prompt's last `last` tokens (where the
question sits) are scored against every key at the split layer (per-head softmax, mean over
those queries, max over heads); spans of `window` tokens centred on the highest-scoring tokens
become full rows, up to `rows` of them. At split 15 of SmolLM2 the needle's best token ranks
first among 3.8K bulk tokens in most NIAH samples; at layers 6-12 it ranks 40-130th. Peers use
the same signal (GemFilter, MInference's last-64-queries index, CacheBlend). Optionally a span
also covers the sentence around its peak (`reach` tokens either side at most), so a needle longer
than the window (a UUID is ~40 tokens) runs fully as a whole. What it is not: a token dropper;
unselected rows are still filled.

The same score serves TokenGate (methods/gate.py), which scores at an early, cheap layer. There
`row_scores` can score with a deeper layer instead, on the ridge map's prediction of that layer's
input from the early state (`FillMaps.predict`), and can average each score over its neighbours
(SnapKV-style pooling) so that a sentence outranks an isolated token.
"""

from __future__ import annotations

import weakref

import torch

from ridgefill.engine import Engine
from ridgefill.errors import RidgefillError
from ridgefill.fit.maps import FillMaps


def reduce_queries(att: torch.Tensor, top: int = 0) -> torch.Tensor:
    """(N,) row scores from per-head attention weights att (H, Q, N): per head, the mean over the
    Q queries (top 0) or over the `top` largest of them, then the max over heads. The mean favours
    rows the whole question attends to; a small `top` (1: the max) also keeps a row that only a
    few question tokens find, such as the one needle whose key a question names."""
    per_head = att.mean(1) if top <= 0 else att.topk(min(top, att.shape[1]), dim=1).values.mean(1)
    return per_head.amax(0)


@torch.inference_mode()
def token_scores(engine: Engine, layer: int, h: torch.Tensor, tables, last: int, top: int = 0) -> torch.Tensor:
    """(N,) attention the last `last` rows pay each position at `layer` (`reduce_queries`).
    h: (1, N, d) its input."""
    return token_score_sets(engine, layer, h, tables, last, (top,))[0]


@torch.inference_mode()
def token_score_sets(
    engine: Engine,
    layer: int,
    h: torch.Tensor,
    tables,
    last: int,
    tops: tuple[int, ...],
    pos: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """`token_scores` for each query reduction in `tops`, from one attention computation.

    pos: (T,) ascending prompt positions of h's rows (default 0..T-1, the whole prompt); the last
    `last` of them query, each seeing the rows at or before its position."""
    n = h.shape[1]
    lp = engine.parts.layers[layer]
    cos, sin = tables[lp.layer_type]
    if pos is not None:
        cos, sin = cos[:, pos], sin[:, pos]
    idx = torch.arange(n, device=h.device) if pos is None else pos
    x = lp.input_norm(h)
    qs = slice(max(0, n - last), n)
    q = engine.project_q(layer, x[:, qs], cos[:, qs], sin[:, qs])  # (1, H, Q, hd)
    k, _ = engine.project_kv(layer, x, cos, sin)  # (1, Hkv, N, hd)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    att = (q @ k.transpose(-1, -2)) * lp.scaling  # (1, H, Q, N)
    att = att.masked_fill(idx[None, :] > idx[qs][:, None], float("-inf")).softmax(-1)
    return [reduce_queries(att[0], top) for top in tops]


def check_score_maps(maps: FillMaps | None, layer: int, score_layer: int) -> None:
    """Refuse maps that cannot predict `score_layer`'s input from `layer`'s state."""
    if maps is None or maps.method != "ridge" or maps.split != layer:
        have = "none" if maps is None else f"{maps.method} maps at split {maps.split}"
        raise RidgefillError(f"scoring at layer {score_layer} reads ridge maps fitted at split {layer}; given {have}")


def row_scores(
    engine: Engine, layer: int, h: torch.Tensor, tables, last: int, *, top: int = 0, **where
) -> torch.Tensor:
    """(N,) row scores from `h` (1, N, d), the input of `layer`, with one query reduction `top`
    (`reduce_queries`); `where`: maps, score_layer, pool as `row_score_sets` takes them."""
    return row_score_sets(engine, layer, h, tables, last, tops=(top,), **where)[0]


def row_score_sets(
    engine: Engine,
    layer: int,
    h: torch.Tensor,
    tables,
    last: int,
    *,
    maps: FillMaps | None = None,
    score_layer: int | None = None,
    pool: int = 1,
    tops: tuple[int, ...] = (0,),
) -> list[torch.Tensor]:
    """(N,) row scores from `h` (1, N, d), the input of `layer`, one per query reduction in `tops`
    (`reduce_queries`), from one attention computation: `token_scores` at `layer` itself, or, with
    `score_layer`, at that deeper layer on its input predicted from `h` by `maps` (ridge maps
    fitted at split `layer`); then averaged over `pool` neighbouring tokens (1: as is)."""
    if score_layer is None:
        sets = token_score_sets(engine, layer, h, tables, last, tops)
    else:
        check_score_maps(maps, layer, score_layer)
        sets = token_score_sets(engine, score_layer, maps.predict(h, score_layer), tables, last, tops)
    return [pool_scores(scores, pool) for scores in sets]


def pool_scores(scores: torch.Tensor, pool: int) -> torch.Tensor:
    """(N,) each score averaged over the `pool` tokens centred on it (odd; 1: as is; fewer at the
    ends), so that a sentence the question attends to throughout outranks an isolated token."""
    if pool <= 1:
        return scores
    return torch.nn.functional.avg_pool1d(scores[None, None], pool, 1, pool // 2, count_include_pad=False)[0, 0]


def check_pool(name: str, pool: int) -> None:
    if pool < 1 or pool % 2 == 0:
        raise RidgefillError(f"{name} must be an odd number of tokens >= 1, got {pool}")


SENTENCE_END = (".", "!", "?", "\n")


# Per tokenizer: which vocabulary ids hold a sentence end. Kept for the tokenizer's lifetime, not
# an engine's: eval, generate and the server build a new Engine per prompt.
_SENTENCE_END_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def sentence_ends(engine: Engine, input_ids: torch.Tensor) -> torch.Tensor:
    """Boolean (N,): tokens whose text holds a sentence end (. ! ? or a newline). input_ids: (1, N).

    The vocabulary is decoded once per tokenizer (1.8 s for Qwen's 151K vocabulary here)."""
    tok = engine.lm.tokenizer
    if tok is None:
        raise RidgefillError("sentence spans read the tokenizer's vocabulary; this model was given none")
    table = sentence_end_table(tok)
    return table[input_ids[0].cpu().clamp(0, len(table) - 1)].to(engine.device)


def sentence_end_table(tok) -> torch.Tensor:
    """(V,) bool: vocabulary ids whose text holds a sentence end, decoded once per tokenizer."""
    table = _SENTENCE_END_IDS.get(tok)
    if table is None:
        text = tok.batch_decode([[i] for i in range(len(tok))])
        table = _SENTENCE_END_IDS[tok] = torch.tensor([any(c in t for c in SENTENCE_END) for t in text])
    return table


def sentence_around(ends: torch.Tensor, p: int, reach: int) -> tuple[int, int]:
    """[lo, hi) of the sentence holding position p: just after the last end before p, through the
    first end at or after p; at most `reach` tokens either side of p where no end is that near."""
    n = ends.shape[0]
    lo, hi = max(0, p - reach), min(n, p + reach + 1)
    before = ends[lo:p].nonzero()
    after = ends[p:hi].nonzero()
    return (lo + int(before[-1]) + 1 if len(before) else lo), (p + int(after[0]) + 1 if len(after) else hi)


def pick_spans(
    scores: torch.Tensor,
    candidates: torch.Tensor,
    rows: int,
    window: int,
    ends: torch.Tensor | None = None,
    reach: int = 0,
) -> torch.Tensor:
    """Boolean (N,) mask: spans of `window` tokens centred on the highest-scoring candidate tokens.

    Peaks are taken in score order, each one outside the spans already chosen. Plain windows: at
    most rows // window spans. With sentence ends (`ends`, (N,) bool) and `reach` > 0 each span
    also covers the sentence around its peak (`sentence_around`), and spans are added until at
    least `rows` candidate rows are chosen. Either way a loop of a few steps, not one per row.
    """
    n = scores.shape[0]
    chosen = torch.zeros(n, dtype=torch.bool, device=scores.device)
    s = scores.masked_fill(~candidates, float("-inf")).clone()
    sentences = ends is not None and reach > 0
    for _ in range(n if sentences else max(1, rows // window)):
        p = int(s.argmax())
        if s[p] == float("-inf") or (sentences and int((chosen & candidates).sum()) >= rows):
            break
        lo, hi = max(0, p - window // 2), min(n, p + (window + 1) // 2)
        if sentences:
            a, b = sentence_around(ends, p, reach)
            lo, hi = min(lo, a), max(hi, b)
        chosen[lo:hi] = True
        s[lo:hi] = float("-inf")
    return chosen & candidates


def top_blocks(scores: torch.Tensor, candidates: torch.Tensor, rows: int, block: int) -> torch.Tensor:
    """Boolean (N,) mask: candidate rows of the highest-scoring aligned blocks of `block` tokens.

    A block's score is its best candidate's; blocks are taken best first until at least `rows`
    candidate rows are chosen (all of them when `rows` covers every candidate).
    """
    n = scores.shape[0]
    nb = -(-n // block)
    pad = nb * block - n
    s = torch.nn.functional.pad(scores.masked_fill(~candidates, float("-inf")), (0, pad), value=float("-inf"))
    c = torch.nn.functional.pad(candidates, (0, pad)).view(nb, block).sum(1)  # (nb,) candidates per block
    order = s.view(nb, block).amax(1).argsort(descending=True)
    upto = int(
        torch.searchsorted(c[order].cumsum(0), torch.tensor(rows, device=c.device))
    )  # blocks needed to reach `rows`
    chosen = torch.zeros(nb, dtype=torch.bool, device=scores.device)
    chosen[order[: upto + 1] if rows > 0 else order[:0]] = True
    chosen &= c > 0
    return chosen.repeat_interleave(block)[:n] & candidates
