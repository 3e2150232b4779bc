"""Fill prefill: RidgeFill, identity fill and KVA projection.

What it is: layers below the split run on every row. From the split state, the deep layers'
K/V for bulk rows are filled cheaply, in a few fused GEMMs and no per-row loop:
  - identity: the split state is every deep layer's input (through its own norm and K/V);
  - ridge: a fitted map predicts every deep layer's input (then its own norm and K/V);
  - kva: fitted maps predict every deep layer's pre-RoPE K and V directly.
Full rows (the first `sink` tokens, the last `tail` tokens, massive-activation outliers and,
with `query_rows`, the spans the prompt's last tokens attend to at the split layer) run every
layer exactly, attending to the filled K/V. What it is not: a decoder; decode steps are
the stock model reading the cache this fills.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace

import torch
from transformers import DynamicCache

from ridgefill.engine import Engine, LowerState, PrefillResult
from ridgefill.errors import RidgefillError
from ridgefill.fit.maps import FillMaps
from ridgefill.fit.ridge import fit_rows
from ridgefill.methods.gate import check_fraction, run_lower, sliding_rows
from ridgefill.methods.select import pick_spans, sentence_ends, token_scores, top_blocks
from ridgefill.models import hf
from ridgefill.ops.attention import apply_rope

FILL_METHODS = ("identity", "ridge", "kva")


# Settings fields added after results and caches were committed, with the value older records
# mean by leaving them out (eval cache keys omit them at that value; ablation rows fill them in).
ADDED_LATER = {"query_sentence": 0}


@dataclass(frozen=True)
class FillSettings:
    """Where to split and which rows run fully.

    Attributes:
        split: layers [0, split) run on every row; deeper layers fill bulk rows.
        sink: the first tokens, always full rows (attention sinks).
        tail: the last tokens, always full rows (they hold the question and feed decode).
        outlier_factor: bulk rows whose split-state norm exceeds this many times the median run
            fully, matching the rows the fit left out; None disables.
        query_rows: about this many more rows run fully, chosen by the attention the last
            `query_last` tokens pay them at the split layer (spans of `query_window` tokens
            around the peaks; see methods/select.py); 0 disables.
        query_sentence: a query span also covers the sentence around its peak, up to this many
            tokens either side of the peak (sentence ends: tokens holding . ! ? or a newline);
            0 disables.
        drop: the three-tier `gated-ridge`: this fraction of the bulk rows, the lowest-scoring
            blocks of `block` tokens by the same split-layer score, is neither filled nor run in
            the deep layers (absent from their cache, as in methods/gate.py); 0 disables. Rows
            within a sliding window of the prompt's end are filled, never dropped.
        sparse_keep: fraction of causal key blocks the layers below the split attend to
            (block-sparse, methods/gate.py); 1 is dense.
        block: tokens per block for `drop` and `sparse_keep`.
    """

    split: int = 15
    sink: int = 4
    tail: int = 256
    outlier_factor: float | None = 8.0
    query_rows: int = 0
    query_window: int = 32
    query_last: int = 64
    query_sentence: int = 0
    drop: float = 0.0
    sparse_keep: float = 1.0
    block: int = 64

    @property
    def dense_below(self) -> int:
        """Layers every row runs densely, as exact does (0 with sparse attention below the split)."""
        return self.split if self.sparse_keep >= 1 else 0

    def check(self, num_layers: int) -> None:
        if not 0 <= self.split <= num_layers:
            raise RidgefillError(f"split {self.split} is outside 0..{num_layers}")
        if self.sink < 0 or self.tail < 1:
            raise RidgefillError("sink must be >= 0 and tail >= 1 (the last token always runs fully)")
        if self.query_rows < 0 or self.query_window < 1 or self.query_last < 1 or self.query_sentence < 0:
            raise RidgefillError("query_rows and query_sentence must be >= 0, query_window and query_last >= 1")
        if not 0 <= self.drop < 1 or self.block < 1:
            raise RidgefillError(f"drop must be in [0, 1) and block >= 1, got drop {self.drop}, block {self.block}")
        check_fraction("sparse_keep", self.sparse_keep)


def full_rows(h_split: torch.Tensor, n: int, s: FillSettings) -> torch.Tensor:
    """Sorted positions that run every layer: sinks, tail and (optionally) outliers. h_split: (n, d)."""
    full = torch.zeros(n, dtype=torch.bool)
    full[: s.sink] = True
    full[max(0, n - s.tail) :] = True
    if s.outlier_factor is not None:
        full |= ~fit_rows(h_split, 0, s.outlier_factor)
    return full.nonzero().squeeze(1)


def _bulk_kv(
    engine: Engine, method: str, x: torch.Tensor, pos: torch.Tensor, split: int, maps: FillMaps | None, tables
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """K/V of the bulk rows for every deep layer. x: (1, Nb, d) split states at positions `pos`."""
    parts = engine.parts
    out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    deep = list(range(split + 1, parts.num_layers))

    def rope(i):
        cos, sin = tables[parts.layers[i].layer_type]
        return cos[:, pos], sin[:, pos]

    # Layer `split` reads the split state itself: its bulk K/V are exact.
    out[split] = engine.project_kv(split, parts.layers[split].input_norm(x), *rope(split))
    if method == "identity":
        for i in deep:
            out[i] = engine.project_kv(i, parts.layers[i].input_norm(x), *rope(i))
        return out
    w, b = maps.stacked(x.dtype)
    y = torch.addmm(b, x[0], w)  # (Nb, L_deep * out): every deep layer in one GEMM
    width = y.shape[1] // len(deep)
    for j, i in enumerate(deep):
        yi = y[None, :, j * width : (j + 1) * width]  # (1, Nb, out)
        if method == "ridge":
            out[i] = engine.project_kv(i, parts.layers[i].input_norm(yi), *rope(i))
        else:  # kva: (1, Nb, 2*H*hd) -> pre-RoPE K and V
            lp = parts.layers[i]
            k, v = yi.view(1, -1, 2, lp.num_kv_heads, lp.head_dim).unbind(2)
            out[i] = apply_rope(k.transpose(1, 2), *rope(i)), v.transpose(1, 2).contiguous()
    return out


@torch.inference_mode()
def prefill_fill(
    engine: Engine,
    input_ids: torch.Tensor,
    method: str = "ridge",
    maps: FillMaps | None = None,
    settings: FillSettings | None = None,
    logit_rows: torch.Tensor | None = None,
    lower: LowerState | None = None,
    cache: DynamicCache | None = None,
    **_: object,
) -> PrefillResult:
    """Fill prefill of a (1, N) prompt; see the module docstring.

    Args:
        maps: fitted maps for `ridge`/`kva` (their split wins over `settings.split`).
        logit_rows: positions whose logits to return (must be full rows); default the last.
        lower: layers already run on every row of this prompt (`Engine.run_lower`), reused when at
            or below the split; their time is counted in the result.
        cache: an empty stock cache to fill (default: a new one).
    """
    if method not in FILL_METHODS:
        raise RidgefillError(f"unknown fill method {method!r}; choose from {FILL_METHODS}")
    s = settings or FillSettings()
    if method != "identity":
        if maps is None:
            raise RidgefillError(f"method {method!r} needs fitted maps (`ridgefill fit`, then --maps)")
        if maps.method != method:
            raise RidgefillError(f"these maps are for {maps.method!r}, not {method!r}")
        maps.check_model(engine.lm)
        s = replace(s, split=maps.split)
    parts = engine.parts
    s.check(parts.num_layers)
    n = engine.check_prompt(input_ids)
    meta = {"settings": asdict(s)}
    if s.split >= parts.num_layers - 1 or n <= s.sink + s.tail:
        res = engine.prefill_exact(input_ids, logit_rows, lower, cache)
        res.method = method
        res.meta = {
            **meta,
            **res.meta,
            "ran_exact": True,
            "reason": "nothing to fill (short prompt or split at the top)",
        }
        return res
    st, pairs = run_lower(engine, input_ids, s.split, s.sparse_keep, s.block, lower)
    t0, a0 = time.perf_counter(), engine.attn_seconds
    h, tables = st.h, st.tables
    cache = engine.cache_from(st.kv, into=cache)
    full = torch.zeros(n, dtype=torch.bool)
    full[full_rows(h[0], n, s)] = True
    bulk = ~full
    if s.query_rows or s.drop:
        scores = token_scores(engine, s.split, h, tables, s.query_last)
        meta.update(row_scores=scores, score_candidates=bulk)  # for diagnostics (eval's needle rank)
        if s.query_rows:
            ends = sentence_ends(engine, input_ids) if s.query_sentence else None
            full |= pick_spans(scores, ~full, s.query_rows, s.query_window, ends, s.query_sentence)
        bulk = ~full
        if s.drop:
            # Bulk rows a sliding-window cache must hold are filled, never dropped (methods/gate.py).
            held = bulk.clone()
            held[: max(0, n - sliding_rows(engine, s.split))] = False
            want = round((1 - s.drop) * int(bulk.sum())) - int(held.sum())
            bulk = held | top_blocks(scores, bulk & ~held, max(0, want), s.block)
    fpos, bpos = full.nonzero().squeeze(1), bulk.nonzero().squeeze(1)
    kept = None if s.drop == 0 else (full | bulk).nonzero().squeeze(1)
    filled = _bulk_kv(engine, method, h[:, bpos], bpos, s.split, maps, tables)
    hfull = h[:, fpos]
    for i in range(s.split, parts.num_layers):
        hfull, k, v, _ = engine.layer(i, hfull, fpos, tables, extra_kv=(*filled.pop(i), bpos))
        hf.cache_update(cache, k, v, i, true_length=None if kept is None else n)
    logits, rows = engine.logits_at(hfull, fpos, logit_rows, "were filled, not run fully")
    plan = {
        "split": s.split,
        "full": fpos,
        "filled": len(bpos),
        "fill": method,
        "deep_keys": kept,
        "lower_pairs": pairs,
    }
    attn_s = st.attn_seconds + engine.attn_seconds - a0
    meta.update(
        ran_exact=False, full_rows=len(fpos), bulk_rows=len(bpos), full_positions=fpos, plan=plan, attn_s=attn_s
    )
    return PrefillResult(cache, logits, rows, n, st.seconds + time.perf_counter() - t0, method, meta)
