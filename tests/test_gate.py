"""TokenGate and block-sparse attention: keep-everything paths equal exact/dense; the gate does what it says."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from conftest import make_tiny
from ridgefill.bench.flops import exact_macs, plan_macs
from ridgefill.engine import Engine
from ridgefill.errors import RidgefillError
from ridgefill.methods import FillSettings, GateSettings, resolve_prefill, run_prefill
from ridgefill.methods.gate import length_threshold
from ridgefill.methods.select import top_blocks
from ridgefill.models import hf
from ridgefill.ops.sparse import block_layout, block_sparse_attend
from test_fill import _assert_same, _ids, fit_tiny_llama


def _qkv(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(1, 4, n, 16, generator=g),
        torch.randn(1, 2, n, 16, generator=g),
        torch.randn(1, 2, n, 16, generator=g),
    )


@pytest.mark.parametrize("n,block", [(64, 16), (100, 16), (7, 16), (130, 32)])
def test_block_sparse_with_every_block_equals_dense(n, block):
    q, k, v = _qkv(n)
    nb = -(-n // block)
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
    sparse = block_sparse_attend(q, k, v, torch.ones(nb, nb, dtype=torch.bool), block, 0.25)
    torch.testing.assert_close(sparse, dense, atol=1e-5, rtol=0)


def test_block_sparse_equals_dense_with_the_block_mask():
    n, block = 100, 16
    q, k, v = _qkv(n, seed=1)
    layout = block_layout(q, k, block, 0.25, keep=0.4)
    expanded = layout.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :n]
    mask = expanded & torch.ones(n, n, dtype=torch.bool).tril()
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(block_sparse_attend(q, k, v, layout, block, 0.25), ref, atol=1e-5, rtol=0)


def test_block_layout_keeps_sinks_local_and_diagonal():
    q, k, _ = _qkv(256, seed=2)
    layout = block_layout(q, k, 16, 0.25, keep=0.3, sink_blocks=1, local_blocks=1)
    nb = 16
    assert not torch.triu(layout, diagonal=1).any()
    assert layout[:, 0].all() and layout.diagonal().all() and layout.diagonal(-1).all()
    kept = layout.sum(1)
    assert (kept <= torch.clamp(torch.ceil(0.3 * torch.arange(1, nb + 1)).long(), min=3)).all()
    assert kept[-1] < nb  # something was dropped
    assert block_layout(q, k, 16, 0.25, keep=1.0).equal(torch.ones(nb, nb, dtype=torch.bool).tril())
    with pytest.raises(ValueError, match="keep"):
        block_layout(q, k, 16, 0.25, keep=0.0)


def test_top_blocks_takes_the_best_blocks_until_enough_rows():
    scores = torch.zeros(40)
    scores[33], scores[5] = 2.0, 1.0
    cand = torch.ones(40, dtype=torch.bool)
    cand[:2] = False
    m = top_blocks(scores, cand, rows=10, block=8)
    assert m.nonzero().squeeze(1).tolist() == list(range(2, 8)) + list(range(32, 40))
    assert not top_blocks(scores, cand, rows=0, block=8).any()
    assert top_blocks(scores, cand, rows=100, block=8).equal(cand)


def _gate(**kw) -> GateSettings:
    base = {"gate_layer": 1, "block": 8, "sink": 2, "local": 4, "tail": 4, "min_length": 0, "min_select": 0}
    return GateSettings(**{**base, **kw})


def test_keep_all_gate_equals_exact(tiny):
    ids = _ids(60)
    eng = Engine(tiny)
    res = run_prefill(eng, ids, "tokengate", settings=_gate(keep=1.0))
    assert not res.ran_exact and len(res.plan.full) == 60
    _assert_same(res, eng.prefill_exact(ids), tiny.num_layers)


def test_keep_all_gate_with_every_sparse_block_equals_exact(tiny):
    ids = _ids(60)
    eng = Engine(tiny)
    res = run_prefill(eng, ids, "tokengate", settings=_gate(keep=1.0, sparse_keep=1.0 - 1e-9))
    assert res.plan.lower_pairs or tiny.parts.layers[0].sliding_window
    _assert_same(res, eng.prefill_exact(ids), tiny.num_layers)


def _reference_step(eng: Engine, ids: torch.Tensor, kept: torch.Tensor, gate: int) -> torch.Tensor:
    """Logits of the last row of `ids` when layers >= gate see only `kept` rows plus that row."""
    n = ids.shape[1]
    st = eng.run_lower(ids, gate)
    pos = torch.cat([kept, torch.tensor([n - 1])])
    h = st.h[:, pos]
    for i in range(gate, eng.parts.num_layers):
        h, *_ = eng.layer(i, h, pos, st.tables)
    return eng.logits(h[0, -1:])


def test_decode_after_gating_sees_exactly_the_kept_rows(tiny):
    """The stock model decodes from the gated cache; the step must equal attending to the kept rows only."""
    n = 64
    ids = _ids(n + 1)
    eng = Engine(tiny)
    res = run_prefill(eng, ids[:, :n], "tokengate", settings=_gate(keep=0.5))
    kept = res.plan.full
    assert 0 < len(kept) < n and res.cache.get_seq_length() == n
    assert hf.cache_kv(res.cache, 0)[0].shape[2] == n or tiny.parts.layers[0].sliding_window
    with torch.inference_mode():
        logits, _ = hf.stock_forward(tiny.model, ids[:, n:], res.cache)
        ref = _reference_step(eng, ids, kept, 1)
    torch.testing.assert_close(logits[0, -1:].float(), ref, atol=1e-4, rtol=0)


def test_gate_reports_its_scores_and_the_needle_rank(tiny):
    """Eval's needle diagnostics work for tokengate: a needle in the best-scoring block ranks first and is kept."""
    from ridgefill.eval.adapter import needle_rows

    ids = _ids(64)
    res = run_prefill(Engine(tiny), ids, "tokengate", settings=_gate(keep=0.5))
    scores, cand = res.diagnostics["row_scores"], res.diagnostics["score_candidates"]
    assert scores.shape == (64,) and cand.dtype == torch.bool and not cand[-1]
    best = int(scores.masked_fill(~cand, float("-inf")).argmax())
    info = needle_rows(res, (best, best + 1))
    assert info == {"needle_full": 1.0, "needle_rank": 1}


def test_length_gate_sends_short_prompts_to_exact(tiny):
    ids = _ids(60)
    eng = Engine(tiny)
    res = run_prefill(eng, ids, "tokengate", settings=_gate(keep=0.25, min_length=61))
    assert res.ran_exact and "length gate" in res.reason
    _assert_same(res, eng.prefill_exact(ids), tiny.num_layers)
    assert not run_prefill(eng, ids, "tokengate", settings=_gate(keep=0.25, min_length=60)).ran_exact
    assert length_threshold("no-such-model") == 0


@pytest.mark.parametrize(
    "settings,match",
    [
        (dict(keep=0.0), "keep"),
        (dict(keep=1.5), "keep"),
        (dict(sparse_keep=0.0), "sparse_keep"),
        (dict(gate_layer=3), "gate layer 3"),
        (dict(gate_layer=0), "gate layer 0"),
        (dict(block=0), "block"),
    ],
)
def test_bad_gate_settings_are_refused(settings, match):
    lm = make_tiny("llama")
    with pytest.raises(RidgefillError, match=match):
        run_prefill(Engine(lm), _ids(60), "tokengate", settings=_gate(**settings))
    with pytest.raises(RidgefillError, match="drop"):
        run_prefill(Engine(lm), _ids(60), "identity", settings=FillSettings(split=1, drop=1.0))


def test_gated_fill_drops_rows_and_decodes(tiny):
    ids = _ids(80)
    eng = Engine(tiny)
    base = FillSettings(split=1, sink=2, tail=8, outlier_factor=None, block=8)
    plain = run_prefill(eng, ids, "identity", settings=base)
    scored = run_prefill(eng, ids, "identity", settings=FillSettings(**{**base.__dict__, "drop": 0.5}))
    assert scored.plan.filled <= plain.plan.filled // 2 + 8
    deep = hf.cache_kv(scored.cache, tiny.num_layers - 1)[0].shape[2]
    assert deep == len(scored.plan.full) + scored.plan.filled or tiny.parts.layers[-1].sliding_window
    assert scored.cache.get_seq_length() == 80
    with torch.inference_mode():
        logits, _ = hf.stock_forward(tiny.model, ids[:, -1:], scored.cache)
    assert torch.isfinite(logits).all()


def test_plan_macs():
    from dataclasses import replace

    from ridgefill.engine import Plan

    lm = make_tiny("llama")
    n = 64
    everything = Plan(split=1, full=torch.arange(n), filled=0, fill="none")
    assert plan_macs(lm.parts, n, everything) == exact_macs(lm.parts, n)
    half = torch.arange(0, n, 2)
    gated = Plan(split=1, full=half, filled=0, fill="none", deep_keys=half)
    assert plan_macs(lm.parts, n, gated) < exact_macs(lm.parts, n)
    assert plan_macs(lm.parts, n, replace(everything, lower_pairs=[10])) < exact_macs(lm.parts, n)
    # Scoring at a predicted layer maps every row (d + 1 by d) and projects its keys there.
    d, lp = lm.parts.hidden_size, lm.parts.layers[2]
    extra = n * ((d + 1) * d + d * lp.num_kv_heads * lp.head_dim)
    assert plan_macs(lm.parts, n, replace(gated, score_layer=2)) == plan_macs(lm.parts, n, gated) + extra


def test_server_offers_tokengate_and_gated_ridge_with_maps(tmp_path):
    from ridgefill.serve import ServeConfig

    lm = make_tiny("llama")
    cfg = ServeConfig.for_model(lm, maps=tmp_path)  # an empty folder: no maps
    assert {"exact", "identity", "tokengate"} <= set(cfg.methods) and "gated-ridge" not in cfg.methods
    assert cfg.default_method == "exact"  # a tiny model has no tuned configuration
    assert cfg.methods["tokengate"].settings.gate_layer == 1


@pytest.mark.parametrize("arch", ["gemma3_text", "mistral"])
def test_gating_keeps_what_a_sliding_window_cache_must_hold(arch):
    """A sliding-window layer's cache keeps its last window - 1 rows as if contiguous: the gate must not
    drop any of them, even with a tail and local window shorter than the window (here 2 + 0 < 8)."""
    lm = make_tiny(arch)
    n = 64
    ids = _ids(n + 1)
    eng = Engine(lm)
    res = run_prefill(eng, ids[:, :n], "tokengate", settings=_gate(keep=0.3, local=0, tail=2))
    kept = res.plan.full
    assert set(range(n - 7, n)) <= set(kept.tolist())
    with torch.inference_mode():
        logits, _ = hf.stock_forward(lm.model, ids[:, n:], res.cache)
        ref = _reference_step(eng, ids, kept, 1)
    torch.testing.assert_close(logits[0, -1:].float(), ref, atol=1e-4, rtol=0)
    filled = run_prefill(eng, ids[:, :n], "identity", settings=FillSettings(split=1, sink=2, tail=2, drop=0.9, block=8))
    assert set(range(n - 7, n)) <= set(filled.plan.deep_keys.tolist())


def test_settings_of_the_wrong_kind_are_refused():
    from ridgefill.methods import resolve_prefill

    lm = make_tiny("llama")
    with pytest.raises(RidgefillError, match="takes GateSettings, not FillSettings"):
        run_prefill(Engine(lm), _ids(40), "tokengate", settings=FillSettings(split=1))
    with pytest.raises(RidgefillError, match="unknown setting 'local'.*valid settings: split"):
        resolve_prefill(lm, "gated-ridge", split=1, local=9)
    assert resolve_prefill(lm, "tokengate", sink=2).settings.gate_layer == 1


def test_a_shared_block_sparse_lower_pass_gives_the_same_fill(tiny):
    """The tuner shares one block-sparse pass among candidates: reusing it must change nothing,
    and a dense continuation must never start from it."""
    from ridgefill.methods.gate import run_lower

    ids = _ids(96)
    eng = Engine(tiny)
    s = FillSettings(split=1, sink=2, tail=8, outlier_factor=None, block=16, sparse_keep=0.5)
    alone = run_prefill(eng, ids, "identity", settings=s)
    shared, pairs = run_lower(eng, ids, 1, 0.5, 16, None)
    assert shared.sparse == (0.5, 16) and pairs == shared.pairs
    again = run_prefill(eng, ids, "identity", settings=s, lower=shared)
    assert torch.equal(alone.logits, again.logits)
    assert again.plan.lower_pairs == alone.plan.lower_pairs
    other, _ = run_lower(eng, ids, 1, 0.25, 16, shared)  # another keep: not reused
    assert other is not shared
    dense = eng.run_lower(ids, 1, start=shared)  # dense: recomputed, not continued
    assert dense is not shared and dense.sparse is None
    if tiny.parts.layers[0].sliding_window is None:  # block-sparse applies to full-attention layers
        assert not torch.equal(dense.h, shared.h)


class _EveryTenthEndsASentence:
    """A tokenizer stand-in for the tiny models: ids divisible by 10 decode to a full stop."""

    def __len__(self) -> int:
        return 256

    def batch_decode(self, ids):
        return ["." if i[0] % 10 == 0 else "x" for i in ids]


def test_sentence_gate_keeps_whole_sentences_and_runs_them_fully(tiny):
    """With `sentence`, the gate keeps the sentence around each best-scoring token whole; kept rows
    run every layer (their last-row logits equal attending to exactly those rows); keep-all is exact."""
    from dataclasses import replace

    from ridgefill.methods.select import sentence_around, sentence_ends, token_scores

    lm = replace(tiny, tokenizer=_EveryTenthEndsASentence())
    n = 96
    ids = _ids(n)
    ids[0, ::7] = 30  # a sentence end every 7 tokens
    eng = Engine(lm)
    s = _gate(keep=0.4, sentence=8, window=2, query_last=8)
    res = run_prefill(eng, ids, "tokengate", settings=s)
    kept = set(res.plan.full.tolist())
    assert not res.ran_exact and len(kept) < n
    st = eng.run_lower(ids, 1)
    scores = token_scores(eng, 1, st.h, st.tables, 8)
    always = set(range(2)) | set(range(n - 8, n))
    best = max((p for p in range(n) if p not in always), key=lambda p: float(scores[p]))
    lo, hi = sentence_around(sentence_ends(eng, ids), best, 8)
    assert set(range(lo, hi)) - always <= kept  # the best token's whole sentence survives
    with torch.inference_mode():
        ref = _reference_step(eng, ids, res.plan.full[:-1], 1)  # the last row is always kept
    torch.testing.assert_close(res.logits, ref, atol=1e-4, rtol=0)
    everything = run_prefill(eng, ids, "tokengate", settings=replace(s, keep=1.0))
    _assert_same(everything, eng.prefill_exact(ids), tiny.num_layers)
    with pytest.raises(RidgefillError, match="sentence must be >= 0"):
        run_prefill(eng, ids, "tokengate", settings=replace(s, sentence=-1))


@pytest.fixture(scope="module")
def fitted():
    return fit_tiny_llama()


def _naive_scores(eng: Engine, layer: int, h: torch.Tensor, last: int, pool: int, top: int = 0) -> torch.Tensor:
    """Row scores computed one head and one query at a time (per row, the mean over every query or
    over its `top` largest weights, sorted explicitly), pooled by an explicit loop."""
    n = h.shape[1]
    lp = eng.parts.layers[layer]
    tables = eng.rope(n, h)
    cos, sin = tables[lp.layer_type]
    x = lp.input_norm(h)
    q = eng.project_q(layer, x, cos, sin)[0]  # (H, N, hd)
    k = eng.project_kv(layer, x, cos, sin)[0][0]  # (Hkv, N, hd)
    group = q.shape[0] // k.shape[0]
    per_head = []
    for head in range(q.shape[0]):
        rows = []
        for t in range(n - last, n):
            logits = (k[head // group, : t + 1] @ q[head, t]) * lp.scaling
            rows.append(torch.cat([logits.softmax(-1), torch.zeros(n - t - 1)]))
        att = torch.stack(rows)  # (last, N)
        if top:
            att = torch.tensor([sorted(att[:, j].tolist(), reverse=True)[:top] for j in range(n)]).T
        per_head.append(att.mean(0))
    best = torch.stack(per_head).amax(0)
    half = pool // 2
    return torch.stack([best[max(0, i - half) : i + half + 1].mean() for i in range(n)])


def test_predicted_layer_scores_equal_a_naive_reference(fitted):
    """Scoring at a deeper layer reads that layer's queries and keys on the ridge map's prediction
    of its input from the gate layer's state, then pools; a loop over heads and queries agrees."""
    from ridgefill.methods.select import row_scores

    lm, maps, _ = fitted
    eng = Engine(lm)
    ids = _ids(50)
    with torch.inference_mode():
        st = eng.run_lower(ids, 1)
        got = row_scores(eng, 1, st.h, st.tables, 6, maps=maps["ridge"], score_layer=2, pool=3)
        w = maps["ridge"].weights[2]
        predicted = st.h @ w[:-1] + w[-1]  # the map's rows multiply the state, its last row is the bias
        want = _naive_scores(eng, 2, predicted, 6, 3)
        own = row_scores(eng, 1, st.h, st.tables, 6)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert not torch.allclose(got, own)  # a deeper layer scores differently from the gate layer


def test_scores_from_the_queries_that_attend_most_equal_a_naive_reference(fitted):
    """query_top: per head, each row's score is the mean of its `top` largest query weights (1: the
    max); a top as large as the query count is the plain mean. Read by the gate and its checks."""
    from ridgefill.methods.select import row_scores

    lm, maps, _ = fitted
    eng = Engine(lm)
    ids = _ids(50)
    with torch.inference_mode():
        st = eng.run_lower(ids, 1)
        for top in (1, 2):
            got = row_scores(eng, 1, st.h, st.tables, 6, pool=3, top=top)
            torch.testing.assert_close(got, _naive_scores(eng, 1, st.h, 6, 3, top), atol=1e-5, rtol=0)
        got = row_scores(eng, 1, st.h, st.tables, 6, maps=maps["ridge"], score_layer=2, top=2)
        w = maps["ridge"].weights[2]
        torch.testing.assert_close(got, _naive_scores(eng, 2, st.h @ w[:-1] + w[-1], 6, 1, 2), atol=1e-5, rtol=0)
        mean = row_scores(eng, 1, st.h, st.tables, 6)
        torch.testing.assert_close(row_scores(eng, 1, st.h, st.tables, 6, top=6), mean)
        assert not torch.allclose(row_scores(eng, 1, st.h, st.tables, 6, top=1), mean)
        st = eng.run_lower(_ids(64), 1)
        want = row_scores(eng, 1, st.h, st.tables, 64, top=1)
    res = run_prefill(eng, _ids(64), "tokengate", settings=_gate(keep=0.5, query_top=1))
    torch.testing.assert_close(res.diagnostics["row_scores"], want)
    with pytest.raises(RidgefillError, match="query_top must be >= 0"):
        _gate(query_top=-1).check(3)


def test_gate_scoring_at_a_predicted_layer_keeps_rows_that_run_fully(fitted):
    """The gate scoring at a deeper layer: keep-all equals exact; kept rows run every layer; the
    maps it needs are read through the resolver and refused when missing or at another split."""
    lm, maps, _ = fitted
    eng = Engine(lm)
    ids = _ids(64)
    s = _gate(keep=0.5, score_layer=2, pool=3)
    res = run_prefill(eng, ids, "tokengate", settings=s, maps=maps["ridge"])
    assert not res.ran_exact and 0 < len(res.plan.full) < 64
    with torch.inference_mode():
        ref = _reference_step(eng, ids, res.plan.full[:-1], 1)
    torch.testing.assert_close(res.logits, ref, atol=1e-4, rtol=0)
    from dataclasses import replace

    everything = run_prefill(eng, ids, "tokengate", settings=replace(s, keep=1.0), maps=maps["ridge"])
    _assert_same(everything, eng.prefill_exact(ids), lm.num_layers)
    resolved = resolve_prefill(lm, "tokengate:gate_layer=1:score_layer=2", maps=maps["ridge"])
    assert resolved.maps is maps["ridge"] and resolve_prefill(lm, "tokengate:gate_layer=1").maps is None
    with pytest.raises(RidgefillError, match="reads ridge maps fitted at split 1; given none"):
        run_prefill(eng, ids, "tokengate", settings=s)
    with pytest.raises(RidgefillError, match="given kva maps"):
        run_prefill(eng, ids, "tokengate", settings=s, maps=maps["kva"])
    with pytest.raises(RidgefillError, match="reads no maps"):
        run_prefill(eng, ids, "tokengate", settings=_gate(), maps=maps["ridge"])


@pytest.mark.parametrize(
    "settings,match",
    [
        (dict(score_layer=1), "score_layer 1 must be above the gate layer 1"),
        (dict(score_layer=9), "score_layer 9"),
        (dict(pool=2), "pool must be an odd"),
        (dict(pool=0), "pool must be an odd"),
    ],
)
def test_bad_scoring_settings_are_refused(settings, match):
    with pytest.raises(RidgefillError, match=match):
        run_prefill(Engine(make_tiny("llama")), _ids(60), "tokengate", settings=_gate(**settings))


def _naive_subset_scores(eng: Engine, layer: int, h: torch.Tensor, pos: torch.Tensor, last: int) -> torch.Tensor:
    """Scores of rows at prompt positions `pos` (inputs h, (1, T, d)) among themselves: one head
    and one query at a time, each query seeing the rows at or before it, RoPE at true positions."""
    lp = eng.parts.layers[layer]
    cos, sin = eng.rope(int(pos.max()) + 1, h)[lp.layer_type]
    x = lp.input_norm(h)
    q = eng.project_q(layer, x, cos[:, pos], sin[:, pos])[0]  # (H, T, hd)
    k = eng.project_kv(layer, x, cos[:, pos], sin[:, pos])[0][0]  # (Hkv, T, hd)
    t, group = len(pos), q.shape[0] // k.shape[0]
    per_head = []
    for head in range(q.shape[0]):
        rows = []
        for j in range(t - last, t):
            w = ((k[head // group, : j + 1] @ q[head, j]) * lp.scaling).softmax(-1)
            rows.append(torch.cat([w, torch.zeros(t - j - 1)]))
        per_head.append(torch.stack(rows).mean(0))
    return torch.stack(per_head).amax(0)


def test_scores_among_a_subset_of_rows_equal_a_naive_reference(tiny):
    """The second stage scores the rows the gate kept among themselves at their true positions."""
    from ridgefill.methods.select import token_score_sets

    eng = Engine(tiny)
    ids = _ids(60)
    pos = torch.cat([torch.arange(0, 20), torch.arange(33, 60)])
    with torch.inference_mode():
        st = eng.run_lower(ids, 1)
        h = st.h[:, pos]
        got = token_score_sets(eng, 1, h, st.tables, 6, (0,), pos=pos)[0]
        want = _naive_subset_scores(eng, 1, h, pos, 6)
        whole = token_score_sets(eng, 1, st.h, st.tables, 6, (0,))[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert got.shape == (len(pos),) and not torch.allclose(got, whole[pos])


def _two_stage_reference(eng: Engine, ids: torch.Tensor, middle: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """Logits of the last row when layer 1 sees only `middle` rows and layer 2 only `full` rows."""
    st = eng.run_lower(ids, 1)
    h, *_ = eng.layer(1, st.h[:, middle], middle, st.tables)
    at = torch.searchsorted(middle, full)
    h, *_ = eng.layer(2, h[:, at], full, st.tables)
    return eng.logits(h[0, -1:])


@pytest.mark.parametrize("sentence", [0, 8])
def test_two_stage_gate_narrows_at_the_refine_layer(tiny, sentence):
    """A second gate at refine_layer keeps the best of the first gate's rows by that layer's own
    scores among those rows; they run every layer, the others stop there; keep-all equals exact."""
    from dataclasses import replace

    from ridgefill.eval.adapter import needle_rows
    from ridgefill.methods.gate import always_kept

    lm = replace(tiny, tokenizer=_EveryTenthEndsASentence())
    n = 96
    ids = _ids(n)
    ids[0, ::7] = 30  # a sentence end every 7 tokens
    eng = Engine(lm)
    s = _gate(keep=0.5, refine_layer=2, refine_keep=0.25, sentence=sentence, window=2, query_last=8)
    res = run_prefill(eng, ids, "tokengate", settings=s)
    middle, full = res.plan.middle, res.plan.full
    assert res.plan.refine == 2 and len(full) < len(middle) < n
    assert bool(torch.isin(full, middle).all())
    assert hf.cache_kv(res.cache, 1)[0].shape[2] == len(middle) or tiny.parts.layers[1].sliding_window
    assert hf.cache_kv(res.cache, 2)[0].shape[2] == len(full) or tiny.parts.layers[2].sliding_window
    always = always_kept(n, s.sink, s.local, s.tail)
    with torch.inference_mode():
        st = eng.run_lower(ids, 1)
        h, *_ = eng.layer(1, st.h[:, middle], middle, st.tables)
        scores = _naive_subset_scores(eng, 2, h, middle, s.query_last).masked_fill(always[middle], -1.0)
        ref = _two_stage_reference(eng, ids, middle, full)
    assert int(middle[int(scores.argmax())]) in full.tolist()  # the second stage's best row survives
    # Eval's needle ranks: the second score covers the first stage's rows only.
    rs, cand = res.diagnostics["refine_scores"], res.diagnostics["refine_candidates"]
    assert cand.tolist() == [i in middle.tolist() and not always[i] for i in range(n)]
    assert bool(torch.isinf(rs[~torch.isin(torch.arange(n), middle)]).all())
    best = int(rs.masked_fill(~cand, float("-inf")).argmax())
    assert needle_rows(res, (best, best + 1))["needle_rank_refine"] == 1
    dropped = next(i for i in range(n) if i not in middle.tolist())
    assert "needle_rank_refine" not in needle_rows(res, (dropped, dropped + 1))
    torch.testing.assert_close(res.logits, ref, atol=1e-4, rtol=0)
    everything = run_prefill(eng, ids, "tokengate", settings=replace(s, keep=1.0, refine_keep=1.0))
    _assert_same(everything, eng.prefill_exact(ids), tiny.num_layers)
    once = plan_macs(tiny.parts, n, replace(res.plan, refine=None, middle=None))
    assert once < plan_macs(tiny.parts, n, res.plan) < exact_macs(tiny.parts, n)


@pytest.mark.parametrize(
    "settings,match",
    [
        (dict(refine_layer=1), "refine_layer 1 must be above the gate layer 1"),
        (dict(refine_layer=3), "refine_layer 3"),
        (dict(refine_layer=2, refine_keep=0.0), "refine_keep"),
        (dict(refine_layer=2, keep=0.25, refine_keep=0.5), "refine_keep 0.5 must not exceed keep 0.25"),
    ],
)
def test_bad_refine_settings_are_refused(settings, match):
    with pytest.raises(RidgefillError, match=match):
        run_prefill(Engine(make_tiny("llama")), _ids(60), "tokengate", settings=_gate(**settings))


def test_plain_tokengate_runs_the_models_measured_settings(monkeypatch):
    from ridgefill.methods import gate, tuned

    lm = make_tiny("llama")  # 3 layers
    measured = {"gate_layer": 1, "keep": 0.5, "refine_layer": 2, "refine_keep": 0.25, "sentence": 8}
    monkeypatch.setattr(gate, "_model_table", lambda: {lm.name: {"min_length": 0, "settings": measured}})
    s = resolve_prefill(lm, "tokengate").settings
    assert (s.gate_layer, s.keep, s.refine_layer, s.refine_keep, s.sentence) == (1, 0.5, 2, 0.25, 8)
    # A command's shared options apply over them; named settings start from the generic gate.
    s = resolve_prefill(lm, "tokengate", shared={"tail": 4}).settings
    assert (s.keep, s.refine_layer, s.tail, s.sentence) == (0.5, 2, 4, 8)
    for named in ({"method": "tokengate:keep=0.375"}, {"method": "tokengate", "keep": 0.375}):
        s = resolve_prefill(lm, **named).settings
        assert s == GateSettings(keep=0.375).at(lm.num_layers)
    assert resolve_prefill(lm, "tokengate", settings=GateSettings()).settings == GateSettings().at(lm.num_layers)
    # A shared option that clashes with a measured setting: the error names what was measured.
    with pytest.raises(RidgefillError, match=r"refine_layer 2 must be above the gate layer 2 .*measured gate_layer=1"):
        resolve_prefill(lm, "tokengate", shared={"gate_layer": 2})
    # A tuned bucket runs what was tuned, not the model's gate defaults.
    bucket = {"method": "tokengate", "settings": {"keep": 0.25}}
    monkeypatch.setattr(tuned, "shipped_defaults", lambda: {lm.name: bucket})
    s = resolve_prefill(lm, "tuned").settings
    assert (s.keep, s.refine_layer, s.sentence) == (0.25, None, 0)
    # A model without measured settings runs the generic gate.
    monkeypatch.setattr(gate, "_model_table", lambda: {})
    assert resolve_prefill(lm, "tokengate").settings == GateSettings().at(lm.num_layers)


def test_the_shipped_gate_settings_are_valid_for_their_models():
    import re

    from ridgefill.methods import gate
    from ridgefill.methods.resolve import check_values
    from ridgefill.models.registry import KNOWN_MODELS

    layers = {m.name: int(re.search(r"(\d+) layers", m.description).group(1)) for m in KNOWN_MODELS.values()}
    table = gate._model_table()
    assert set(table) <= set(layers)
    for name, entry in table.items():
        assert entry["min_length"] >= 0 and entry["measured_by"]
        if "settings" in entry:
            check_values("tokengate", GateSettings, entry["settings"])
            GateSettings(**entry["settings"]).check(layers[name])
            assert entry["chosen_by"]["commands"]


@pytest.mark.parametrize("sentence", [0, 8])
def test_each_gate_selects_at_least_min_select_rows(tiny, sentence):
    ids = _ids(120)
    ids[0, ::7] = 30  # a sentence end every 7 tokens
    eng = Engine(replace(tiny, tokenizer=_EveryTenthEndsASentence()))
    # keep=0.05 is 6 rows: the sinks, local window and tail (10 rows) already fill it.
    one = _gate(keep=0.05, sentence=sentence, window=2)
    assert len(run_prefill(eng, ids, "tokengate", settings=one).plan.full) == 10
    for floor in (16, 40):
        res = run_prefill(eng, ids, "tokengate", settings=replace(one, min_select=floor))
        assert floor + 10 <= len(res.plan.full) < floor + 10 + (17 if sentence else 8)  # whole spans or blocks
    two = _gate(keep=0.5, refine_layer=2, refine_keep=0.05, sentence=sentence, window=2, min_select=24)
    res = run_prefill(eng, ids, "tokengate", settings=two)
    assert 34 <= len(res.plan.full) < 34 + (17 if sentence else 8) and len(res.plan.middle) >= 60
    with pytest.raises(RidgefillError, match="min_select must be >= 0"):
        _gate(min_select=-1).check(tiny.num_layers)
