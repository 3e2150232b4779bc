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

from dataclasses import asdict, dataclass, replace
from typing import ClassVar

import torch
from transformers import DynamicCache

from ridgefill.engine import Engine, LowerState, Plan, PrefillResult
from ridgefill.errors import RidgefillError
from ridgefill.fit.maps import FillMaps
from ridgefill.fit.ridge import fit_rows
from ridgefill.methods.lower import check_fraction, run_lower, sliding_rows
from ridgefill.methods.select import check_pool, pick_spans, row_score_sets, sentence_ends, top_blocks
from ridgefill.models import hf
from ridgefill.ops.attention import apply_rope

FILL_METHODS = ("identity", "ridge", "kva")


def default_split(num_layers: int) -> int:
    """The split layer when none is given: half the layers."""
    return num_layers // 2


@dataclass(frozen=True)
class FillSettings:
    """Where to split and which rows run fully.

    Attributes:
        split: layers [0, split) run on every row; deeper layers fill bulk rows (None: half the
            layers, `default_split`; maps carry their own split, which wins).
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
        query_pool: each query score is averaged over this many neighbouring tokens before the
            spans (and `drop`'s blocks) are chosen (odd; 1: none; methods/select.py `pool_scores`).
        query_layer: None scores with the split layer's attention. A deeper layer scores with
            that layer's attention, on its input as the ridge maps predict it from the split state
            (tokengate's `score_layer`; ridge only). A layer or two above the split ranks the
            needle the question names above its look-alikes more often than the split layer.
            A layer below the split scores on its own exact input, taken as the lower layers run
            (any fill method; dense lower layers only): on SmolLM2 an early layer's pooled score
            finds needles in prose that the split layer's misses.
        query_top: per head, a row's score is the mean attention of the `query_top` queries that
            attend to it most (0: of all `query_last` queries; 1: the largest). A needle that only
            the question's key tokens find (one of several look-alike key-value lines) keeps a
            high score instead of being averaged away by the rest of the question.
        drop_top: the same reduction for `drop`'s blocks alone (None: `query_top`). Spans by the
            few queries that find a needle (query_top 1) and the drop by the whole question's mean
            (drop_top 0) keep the needle and the context the rest of the question reads.
        drop: the three-tier `gated-ridge`: this fraction of the bulk rows, the lowest-scoring
            blocks of `block` tokens by the query rows' score (reduced by `drop_top`), is neither
            filled nor run in the deep layers (absent from their cache, as in methods/gate.py); 0
            disables. Rows within a sliding window of the prompt's end are filled, never dropped.
        sparse_keep: fraction of causal key blocks the layers below the split attend to
            (block-sparse, methods/gate.py); 1 is dense.
        block: tokens per block for `drop` and `sparse_keep`.
        resume: experimental. Layers [resume, num_layers) run every row again
            (every kept row, with `drop`). Bulk rows enter layer `resume` with the fill's prediction
            of its input (the split state for identity), rescaled to the full rows' median RMS
            there (the maps predict a direction: see FitConfig.normed_targets). Only layers
            [split, resume) are filled. None fills up to the top; kva (no input prediction) refuses it.
    """

    split: int | None = None
    sink: int = 4
    tail: int = 256
    outlier_factor: float | None = 8.0
    query_rows: int = 0
    query_window: int = 32
    query_last: int = 64
    query_sentence: int = 0
    query_pool: int = 1
    query_layer: int | None = None
    query_top: int = 0
    drop_top: int | None = None
    drop: float = 0.0
    sparse_keep: float = 1.0
    block: int = 64
    resume: int | None = None

    MAPS_AT: ClassVar[str] = "split"  # the settings field the maps' split must match

    @property
    def dense_below(self) -> int:
        """Layers every row runs densely, as exact does, before this fill reads a state of its own
        (0 with sparse attention below the split; the query layer when it scores below the split)."""
        if self.sparse_keep < 1:
            return 0
        return self.query_layer if self.scores_below else self.split

    @property
    def scores_below(self) -> bool:
        """Whether the query rows are scored at a layer below the split, on its exact input."""
        q, split = self.query_layer, self.split
        return bool(self.query_rows or self.drop) and q is not None and split is not None and q < split

    @property
    def scores_above(self) -> bool:
        """Whether the query rows are scored at a layer above the split, on the maps' prediction."""
        q, split = self.query_layer, self.split
        return bool(self.query_rows or self.drop) and q is not None and split is not None and q > split

    @property
    def reads_sentences(self) -> bool:
        """Whether these settings find sentence ends, which reads the tokenizer's vocabulary."""
        return bool(self.query_rows and self.query_sentence)

    def at(self, num_layers: int) -> FillSettings:
        """These settings with the split resolved for a model of `num_layers` layers."""
        return self if self.split is not None else replace(self, split=default_split(num_layers))

    def check(self, num_layers: int) -> None:
        if self.split is not None and not 0 <= self.split <= num_layers:
            raise RidgefillError(f"split {self.split} is outside 0..{num_layers}")
        if self.sink < 0 or self.tail < 1:
            raise RidgefillError("sink must be >= 0 and tail >= 1 (the last token always runs fully)")
        if self.query_rows < 0 or self.query_window < 1 or self.query_last < 1 or self.query_sentence < 0:
            raise RidgefillError("query_rows and query_sentence must be >= 0, query_window and query_last >= 1")
        check_pool("query_pool", self.query_pool)
        for name in ("query_top", "drop_top"):
            if (getattr(self, name) or 0) < 0:
                raise RidgefillError(f"{name} must be >= 0 (0: the mean over every query), got {getattr(self, name)}")
        split = default_split(num_layers) if self.split is None else self.split
        if self.query_layer is not None and not (0 <= self.query_layer < num_layers and self.query_layer != split):
            raise RidgefillError(
                f"query_layer {self.query_layer} must be another layer than the split {split}, in 0..{num_layers - 1}"
                " (omit it to score at the split)"
            )
        if self.query_layer is not None and self.query_layer < split and self.sparse_keep < 1:
            raise RidgefillError(
                f"query_layer {self.query_layer} below the split reads dense lower layers; sparse_keep must be 1"
            )
        if not 0 <= self.drop < 1 or self.block < 1:
            raise RidgefillError(f"drop must be in [0, 1) and block >= 1, got drop {self.drop}, block {self.block}")
        check_fraction("sparse_keep", self.sparse_keep)
        if self.resume is not None and not split < self.resume <= num_layers:
            raise RidgefillError(f"resume {self.resume} must be above the split {self.split} and at most {num_layers}")

    def top(self, num_layers: int) -> int:
        """First layer where every row runs again (num_layers when nothing resumes)."""
        return num_layers if self.resume is None else self.resume


def full_rows(h_split: torch.Tensor, n: int, s: FillSettings) -> torch.Tensor:
    """Sorted positions that run every layer: sinks, tail and (optionally) outliers. h_split: (n, d)."""
    full = torch.zeros(n, dtype=torch.bool, device=h_split.device)
    full[: s.sink] = True
    full[max(0, n - s.tail) :] = True
    if s.outlier_factor is not None:
        full |= ~fit_rows(h_split, 0, s.outlier_factor)
    return full.nonzero().squeeze(1)


def _bulk_kv(
    engine: Engine,
    method: str,
    x: torch.Tensor,
    pos: torch.Tensor,
    split: int,
    maps: FillMaps | None,
    tables,
    top: int,
) -> tuple[dict[int, tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]:
    """K/V of the bulk rows for deep layers split..top-1, and the predicted input of layer `top`
    ((1, Nb, d); None when top is the last layer + 1). x: (1, Nb, d) split states at positions `pos`."""
    parts = engine.parts
    out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    deep = list(range(split + 1, top))
    resume_in = None

    def rope(i):
        cos, sin = tables[parts.layers[i].layer_type]
        return cos[:, pos], sin[:, pos]

    # Layer `split` reads the split state itself: its bulk K/V are exact.
    out[split] = engine.project_kv(split, parts.layers[split].input_norm(x), *rope(split))
    if method == "identity":
        for i in deep:
            out[i] = engine.project_kv(i, parts.layers[i].input_norm(x), *rope(i))
        return out, (x if top < parts.num_layers else None)
    w, b = maps.stacked(x.dtype, x.device)
    width = w.shape[1] // (parts.num_layers - split - 1)
    upto = (min(top, parts.num_layers - 1) - split) * width  # layers split+1..top (top's input only to resume)
    y = torch.addmm(b[:upto], x[0], w[:, :upto])  # (Nb, layers * out): the deep layers in one GEMM
    if top < parts.num_layers:
        resume_in = y[None, :, upto - width :]
    for j, i in enumerate(deep):
        yi = y[None, :, j * width : (j + 1) * width]  # (1, Nb, out)
        if method == "ridge":
            out[i] = engine.project_kv(i, parts.layers[i].input_norm(yi), *rope(i))
        else:  # kva: (1, Nb, 2*H*hd) -> pre-RoPE K and V
            lp = parts.layers[i]
            k, v = yi.view(1, -1, 2, lp.num_kv_heads, lp.head_dim).unbind(2)
            out[i] = apply_rope(k.transpose(1, 2), *rope(i)), v.transpose(1, 2).contiguous()
    return out, resume_in


@torch.inference_mode()
def prefill_fill(
    engine: Engine,
    input_ids: torch.Tensor,
    method: str = "ridge",
    maps: FillMaps | None = None,
    settings: FillSettings | None = None,
    *,
    logit_rows: torch.Tensor | None = None,
    lower: LowerState | None = None,
    cache: DynamicCache | None = None,
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
    s = (settings or FillSettings()).at(engine.parts.num_layers)
    if method != "identity":
        if maps is None:
            raise RidgefillError(f"method {method!r} needs fitted maps (`ridgefill fit`, then --maps)")
        if maps.method != method:
            raise RidgefillError(f"these maps are for {maps.method!r}, not {method!r}")
        maps.check_model(engine.lm)
        s = replace(s, split=maps.split)
    if s.scores_above and method != "ridge":
        raise RidgefillError(
            f"query_layer {s.query_layer} above the split scores on the ridge maps' prediction; {method!r} makes none"
        )
    if method == "kva" and s.resume is not None:
        raise RidgefillError("kva predicts K/V, not layer inputs, so it cannot resume full layers (resume)")
    parts = engine.parts
    s.check(parts.num_layers)
    n = engine.check_prompt(input_ids)
    if s.split >= parts.num_layers - 1 or n <= s.sink + s.tail:
        res = engine.prefill_exact(input_ids, logit_rows, lower, cache)
        return res.as_exact(method, asdict(s), "nothing to fill (short prompt or split at the top)")
    score_in = None  # the query layer's exact input, when it scores below the split
    if s.scores_below:
        lower = engine.run_lower(input_ids, s.query_layer, start=lower)
        score_in = lower.h
    st, pairs = run_lower(engine, input_ids, s.split, s.sparse_keep, s.block, lower)
    t0, a0 = engine.clock(), engine.attn_seconds
    h, tables = st.h, st.tables
    cache = engine.cache_from(st.kv, into=cache)
    full = torch.zeros(n, dtype=torch.bool, device=h.device)
    full[full_rows(h[0], n, s)] = True
    bulk = ~full
    diagnostics = {}
    if s.query_rows or s.drop:
        drop_top = s.query_top if s.drop_top is None else s.drop_top
        scores, drop_scores = row_score_sets(
            engine,
            s.split if score_in is None else s.query_layer,
            h if score_in is None else score_in,
            tables,
            s.query_last,
            maps=maps,
            score_layer=s.query_layer if s.scores_above else None,
            pool=s.query_pool,
            tops=(s.query_top, drop_top),
        )
        diagnostics = {"row_scores": scores, "score_candidates": bulk}  # eval's needle rank
        if s.query_rows:
            ends = sentence_ends(engine, input_ids) if s.reads_sentences else None
            full |= pick_spans(scores, ~full, s.query_rows, s.query_window, ends, s.query_sentence)
        bulk = ~full
        if s.drop:
            # Bulk rows a sliding-window cache must hold are filled, never dropped (methods/gate.py).
            held = bulk.clone()
            held[: max(0, n - sliding_rows(engine, s.split))] = False
            want = round((1 - s.drop) * int(bulk.sum())) - int(held.sum())
            bulk = held | top_blocks(drop_scores, bulk & ~held, max(0, want), s.block)
    fpos, bpos = full.nonzero().squeeze(1), bulk.nonzero().squeeze(1)
    kept = None if s.drop == 0 else (full | bulk).nonzero().squeeze(1)
    top = s.top(parts.num_layers)
    filled, resume_in = _bulk_kv(engine, method, h[:, bpos], bpos, s.split, maps, tables, top)
    hfull = h[:, fpos]
    for i in range(s.split, top):
        hfull, k, v, _ = engine.layer(i, hfull, fpos, tables, extra_kv=(*filled.pop(i), bpos))
        hf.cache_update(cache, k, v, i, true_length=None if kept is None else n)
    out_pos = fpos  # rows whose final states `hfull` holds: every row when top layers resume
    if resume_in is not None:
        hfull, out_pos = _resume(
            engine, hfull, fpos, resume_in, bpos, s, tables, cache, n if kept is not None else None
        )
    logits, rows = engine.logits_at(hfull, out_pos, logit_rows, "were filled, not run fully")
    plan = Plan(
        split=s.split,
        full=fpos,
        filled=len(bpos),
        fill=method,
        deep_keys=kept,
        lower_pairs=pairs,
        resume=s.resume,
        score_layer=s.query_layer if s.scores_above else None,
    )
    return PrefillResult(
        cache,
        logits,
        rows,
        n,
        st.seconds + engine.clock() - t0,
        method,
        ran_exact=False,
        plan=plan,
        attn_seconds=st.attn_seconds + engine.attn_seconds - a0,
        settings=asdict(s),
        diagnostics=diagnostics,
    )


def _resume(
    engine: Engine,
    hfull: torch.Tensor,
    fpos: torch.Tensor,
    resume_in: torch.Tensor,
    bpos: torch.Tensor,
    s: FillSettings,
    tables,
    cache: DynamicCache,
    true_length: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layers [s.resume, L) on every row: full rows carry on from their states, bulk rows start from
    the predicted input `resume_in` (1, Nb, d) at the full rows' median RMS. Returns the final states
    of all rows and their sorted positions."""
    rms = hfull[0].float().pow(2).mean(-1).sqrt()[fpos >= s.sink]  # sinks carry massive activations
    scale = rms.median() if rms.numel() else resume_in.float().pow(2).mean(-1).sqrt().median()
    bulk_in = resume_in * (scale / resume_in.float().pow(2).mean(-1, keepdim=True).sqrt().clamp(min=1e-6))
    pos, order = torch.cat([fpos, bpos]).sort()
    h = torch.cat([hfull, bulk_in.to(hfull.dtype)], dim=1)[:, order]  # (1, F + Nb, d) in position order
    for i in range(s.top(engine.parts.num_layers), engine.parts.num_layers):
        h, k, v, _ = engine.layer(i, h, pos, tables)
        hf.cache_update(cache, k, v, i, true_length=true_length)
    return h, pos
