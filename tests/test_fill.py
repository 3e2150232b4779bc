"""Fill prefill: nothing skipped == exact; each fill path does what it says; map files are strict."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import make_tiny
from ridgefill.engine import Engine
from ridgefill.errors import MapError, RidgefillError
from ridgefill.fit.maps import FillMaps, fingerprint, load_maps, save_maps
from ridgefill.fit.ridge import FitConfig, fit_maps
from ridgefill.methods import FillSettings, Prefill, resolve_prefill, run_prefill
from ridgefill.models import hf
from ridgefill.ops.attention import apply_rope

TEXT = (Path(__file__).parent / "data" / "calib.txt").read_text()


def _byte_segments(n: int, length: int, offset: int = 0) -> list[list[int]]:
    """Natural English as UTF-8 byte tokens: the tiny models have a 256-token vocabulary."""
    data = list(TEXT.encode())
    return [data[offset + i * length : offset + (i + 1) * length] for i in range(n)]


def _ids(n: int) -> torch.Tensor:
    return torch.tensor(_byte_segments(1, n, offset=777))


def _assert_same(a, b, num_layers):
    torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=0)
    for i in range(num_layers):
        for x, y in zip(hf.cache_kv(a.cache, i), hf.cache_kv(b.cache, i), strict=True):
            torch.testing.assert_close(x, y, atol=1e-4, rtol=0)


def fit_tiny_llama():
    """A tiny llama with its ridge and kva maps at split 1 (by method) and the fit report."""
    lm = make_tiny("llama")
    maps, report = fit_maps(
        lm, _byte_segments(6, 96), _byte_segments(2, 96, offset=6000), FitConfig(splits=(1,), segment_tokens=96)
    )
    return lm, {m.method: m for m in maps}, report


@pytest.fixture(scope="module")
def fitted():
    return fit_tiny_llama()


def test_split_at_top_equals_exact(tiny):
    ids = _ids(40)
    eng = Engine(tiny)
    res = run_prefill(eng, ids, "identity", settings=FillSettings(split=tiny.num_layers, sink=2, tail=4))
    assert res.ran_exact
    _assert_same(res, eng.prefill_exact(ids), tiny.num_layers)


def test_tail_covering_prompt_equals_exact(tiny):
    ids = _ids(30)
    eng = Engine(tiny)
    res = run_prefill(eng, ids, "identity", settings=FillSettings(split=1, sink=2, tail=30))
    assert res.ran_exact
    _assert_same(res, eng.prefill_exact(ids), tiny.num_layers)


def test_identity_fill_keeps_shallow_layers_and_full_rows_exact(tiny):
    n, tail, sink = 48, 8, 2
    ids = _ids(n)
    eng = Engine(tiny)
    exact = eng.prefill_exact(ids)
    res = run_prefill(eng, ids, "identity", settings=FillSettings(split=1, sink=sink, tail=tail, outlier_factor=None))
    assert not res.ran_exact and res.plan.filled == n - sink - tail
    k_res, v_res = hf.cache_kv(res.cache, 0)
    k_ex, v_ex = hf.cache_kv(exact.cache, 0)
    torch.testing.assert_close(k_res, k_ex, atol=1e-5, rtol=0)  # layer below the split: all rows exact
    # Layer `split` reads the split state itself, so every row's K/V there is exact too.
    for x, y in zip(hf.cache_kv(res.cache, 1), hf.cache_kv(exact.cache, 1), strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=0)
    # Deep layers: the sink rows see only themselves, so they stay exact; bulk rows differ.
    k_deep, _ = hf.cache_kv(res.cache, tiny.num_layers - 1)
    k_deep_ex, _ = hf.cache_kv(exact.cache, tiny.num_layers - 1)
    torch.testing.assert_close(k_deep[:, :, :sink], k_deep_ex[:, :, :sink], atol=1e-5, rtol=0)
    assert res.cache.get_seq_length() == n


def test_ridge_with_identity_maps_equals_identity_fill(fitted):
    lm, maps, _ = fitted
    d = lm.parts.hidden_size
    eye = torch.cat([torch.eye(d), torch.zeros(1, d)])
    ident = FillMaps("ridge", 1, {i: eye for i in maps["ridge"].layers}, maps["ridge"].header)
    ids = _ids(64)
    s = FillSettings(split=1, sink=2, tail=8)
    eng = Engine(lm)
    _assert_same(
        run_prefill(eng, ids, "ridge", maps=ident, settings=s), run_prefill(eng, ids, "identity", settings=s), 3
    )


def test_kva_writes_mapped_keys_for_bulk_rows(fitted):
    lm, maps, _ = fitted
    kva = maps["kva"]
    ids = _ids(64)
    s = FillSettings(split=1, sink=2, tail=8, outlier_factor=None)
    eng = Engine(lm)
    res = run_prefill(eng, ids, "kva", maps=kva, settings=s)
    # Recompute layer 2's bulk keys by hand from the split state.
    with torch.no_grad():
        h = eng.embed(ids)
        tables = eng.rope(64, h)
        h, *_ = eng.layer(0, h, torch.arange(64), tables)
        bulk = torch.arange(2, 56)
        w = kva.weights[2]
        y = h[0, bulk] @ w[:-1] + w[-1]
        lp = lm.parts.layers[2]
        k = y[:, : lp.num_kv_heads * lp.head_dim].view(1, -1, lp.num_kv_heads, lp.head_dim).transpose(1, 2)
        cos, sin = tables[lp.layer_type]
        k = apply_rope(k, cos[:, bulk], sin[:, bulk])
    torch.testing.assert_close(hf.cache_kv(res.cache, 2)[0][:, :, 2:56], k, atol=1e-5, rtol=0)


def test_fit_beats_identity_on_heldout(fitted):
    _, maps, report = fitted
    for layer, entry in report["splits"][1]["ridge"].items():
        assert entry["heldout_rel_err"] < entry["identity_rel_err"], layer
    assert set(maps) == {"ridge", "kva"}
    assert maps["ridge"].weights[2].shape == (65, 64)
    assert maps["kva"].weights[2].shape == (65, 2 * 2 * 16)


def test_calibration_facts_keep_segment_length_and_headers(fitted, smollm2):
    """Facts are spliced in, not appended; a fit without them keeps the header it always had."""
    from ridgefill.fit.facts import with_facts

    tok = smollm2.tokenizer
    segs = [tok(TEXT[i * 3000 : (i + 1) * 3000], add_special_tokens=False)["input_ids"][:256] for i in range(3)]
    mixed = with_facts(tok, segs, 4, seed=1)
    assert [len(s) for s in mixed] == [256] * 3 and mixed != segs
    assert mixed == with_facts(tok, segs, 4, seed=1) and with_facts(tok, segs, 0) is segs
    assert mixed[0][:16] == segs[0][:16]  # the sinks the fit skips are left alone
    text = tok.decode(mixed[0])
    assert sum(w in text for w in ("access code", "Note:", "Record", "registered", '": ', "locker")) >= 1
    assert "special magic" not in text  # never RULER's needle sentence
    _, maps, _ = fitted
    assert "facts" not in maps["ridge"].header["fit"]
    lm = make_tiny("llama")
    with pytest.raises(RidgefillError, match="facts"):
        fit_maps(lm, _byte_segments(2, 96), _byte_segments(1, 96), FitConfig(splits=(1,), segment_tokens=96, facts=-1))


def test_map_file_round_trip_and_errors(fitted, tmp_path):
    lm, maps, _ = fitted
    path = save_maps(maps["ridge"], tmp_path / "m.safetensors")
    back = load_maps(path, lm)
    assert back.header["model"] == fingerprint(lm) and back.split == 1
    torch.testing.assert_close(back.weights[2], maps["ridge"].weights[2])
    with pytest.raises(MapError, match="fitted on another model"):
        load_maps(path, make_tiny("llama", seed=1))
    with pytest.raises(MapError, match="fitted on another model"):
        run_prefill(Engine(make_tiny("qwen2")), _ids(64), "ridge", maps=back)
    bad = tmp_path / "corrupt.safetensors"
    bad.write_bytes(path.read_bytes()[:100])
    with pytest.raises(MapError, match="corrupt"):
        load_maps(bad)
    nan = FillMaps("ridge", 1, {2: torch.full((65, 64), float("nan"))}, back.header)
    with pytest.raises(MapError, match="NaN"):
        load_maps(save_maps(nan, tmp_path / "nan.safetensors"))
    with pytest.raises(MapError, match="not found"):
        load_maps(tmp_path / "missing.safetensors")


def test_bad_settings_are_refused(fitted):
    lm, maps, _ = fitted
    eng = Engine(lm)
    with pytest.raises(RidgefillError, match="needs fitted maps"):
        run_prefill(eng, _ids(64), "ridge")
    with pytest.raises(RidgefillError, match="for 'kva', not 'ridge'"):
        run_prefill(eng, _ids(64), "ridge", maps=maps["kva"])
    with pytest.raises(RidgefillError, match="split 9"):
        run_prefill(eng, _ids(64), "identity", settings=FillSettings(split=9))
    with pytest.raises(RidgefillError, match="filled"):
        run_prefill(eng, _ids(64), "identity", settings=FillSettings(split=1, tail=4), logit_rows=torch.tensor([10]))
    with pytest.raises(RidgefillError, match="unknown prefill method"):
        run_prefill(eng, _ids(64), "magic")


def test_shared_lower_layers_give_the_same_prefill(fitted):
    """A paired evaluation runs the common lower layers once; every method must come out unchanged."""
    lm, maps, _ = fitted
    ids = _ids(64)
    eng = Engine(lm)
    s = FillSettings(split=1, sink=2, tail=8)
    lower = eng.run_lower(ids, 1)
    for method, kw in [("exact", {}), ("identity", {"settings": s}), ("ridge", {"settings": s, "maps": maps["ridge"]})]:
        alone = run_prefill(eng, ids, method, **kw)
        shared = run_prefill(eng, ids, method, lower=lower, **kw)
        _assert_same(shared, alone, lm.num_layers)
        assert shared.seconds >= lower.seconds
    # Decoding from a cache built on the shared state must not write into it.
    k0 = lower.kv[0][0].clone()
    with torch.inference_mode():
        hf.stock_forward(lm.model, ids[:, -1:], run_prefill(eng, ids, "exact", lower=lower).cache)
    assert torch.equal(lower.kv[0][0], k0)
    # A lower state for another prompt, or above the split, is not reused.
    other = eng.run_lower(_ids(64).flip(1), 1)
    _assert_same(run_prefill(eng, ids, "exact", lower=other), eng.prefill_exact(ids), lm.num_layers)
    assert eng.run_lower(ids, 2, start=lower).upto == 2


def test_pick_spans_centres_windows_on_peaks():
    from ridgefill.methods.select import pick_spans

    scores = torch.zeros(64)
    scores[10], scores[50], scores[52] = 3.0, 2.0, 1.0
    cand = torch.ones(64, dtype=torch.bool)
    cand[60:] = False
    m = pick_spans(scores, cand, rows=16, window=8)
    assert m.nonzero().squeeze(1).tolist() == list(range(6, 14)) + list(range(46, 54))  # 52 fell inside 50's span
    assert not pick_spans(scores, torch.zeros(64, dtype=torch.bool), 16, 8).any()


def test_pick_spans_cover_the_sentence_around_a_peak():
    from ridgefill.methods.select import pick_spans, sentence_around

    ends = torch.zeros(64, dtype=torch.bool)
    ends[[9, 30, 40]] = True  # sentences [10, 31), [31, 41), [41, 64)
    assert sentence_around(ends, 20, 32) == (10, 31)
    assert sentence_around(ends, 30, 32) == (10, 31)  # the end token belongs to its sentence
    assert sentence_around(ends, 20, 4) == (16, 25)  # no end within reach: reach either side
    assert sentence_around(ends, 50, 32) == (41, 64)
    scores = torch.zeros(64)
    scores[20], scores[45] = 3.0, 2.0
    cand = torch.ones(64, dtype=torch.bool)
    m = pick_spans(scores, cand, rows=16, window=4, ends=ends, reach=32)
    assert m.nonzero().squeeze(1).tolist() == list(range(10, 31))  # one sentence reached the budget
    m = pick_spans(scores, cand, rows=22, window=4, ends=ends, reach=32)
    assert m.nonzero().squeeze(1).tolist() == list(range(10, 31)) + list(range(41, 64))
    # reach 0 is the plain windows
    assert torch.equal(pick_spans(scores, cand, 8, 4, ends, 0), pick_spans(scores, cand, 8, 4))


def test_sentence_ends_read_the_tokenizer(smollm2):
    from ridgefill.methods.select import _SENTENCE_END_IDS, sentence_ends

    eng = Engine(smollm2)
    text = "Grass is green. The sky is blue\nand so on. " * 12 + "One of the special magic numbers is: 12345. Fine."
    ids = smollm2.tokenizer(text, return_tensors="pt").input_ids
    ends = sentence_ends(eng, ids)
    texts = [smollm2.tokenizer.decode([int(i)]) for i in ids[0]]
    assert ends.tolist() == [("." in t or "\n" in t) for t in texts] and int(ends.sum()) == 3 * 12 + 2
    table = _SENTENCE_END_IDS[smollm2.tokenizer]  # decoded once per tokenizer, not per engine
    assert torch.equal(sentence_ends(Engine(smollm2), ids), ends) and _SENTENCE_END_IDS[smollm2.tokenizer] is table
    s = FillSettings(split=15, sink=2, tail=4, outlier_factor=None, query_rows=4, query_window=2, query_sentence=32)
    res = run_prefill(eng, ids, "identity", settings=s)
    full = res.plan.full[2:]  # past the sinks; the tail ends the prompt's last sentence
    assert len(full) > 4 + 2  # more than the tail and one window
    # the chosen rows are whole sentences: each run of full rows starts after an end and stops at one
    runs = full.tolist()
    gaps = [(a, b) for a, b in zip(runs[:-1], runs[1:], strict=True) if b != a + 1]
    starts, stops = [runs[0]] + [b for _, b in gaps], [a for a, _ in gaps] + [runs[-1]]
    assert all(bool(ends[p - 1]) for p in starts if p > 2) and all(bool(ends[p]) for p in stops)
    with pytest.raises(RidgefillError, match="query_sentence"):
        FillSettings(split=1, query_sentence=-1).check(3)


def test_query_rows_covering_the_prompt_equal_exact(tiny):
    ids = _ids(48)
    eng = Engine(tiny)
    s = FillSettings(split=1, sink=2, tail=4, outlier_factor=None, query_rows=96, query_window=2)
    res = run_prefill(eng, ids, "identity", settings=s)
    assert res.plan.filled == 0
    _assert_same(res, eng.prefill_exact(ids), tiny.num_layers)


# Query rows on a 96-token prompt: 2 sinks and 8 tail rows; the candidates are the rows between.
QUERY = FillSettings(split=1, sink=2, tail=8, outlier_factor=None, query_rows=8, query_window=8, query_last=8)
QUERY_CANDIDATES = torch.tensor([False] * 2 + [True] * 86 + [False] * 8)


def _split_scores(lm):
    """(engine, ids, raw split-layer scores of the last 8 queries) for the 96-token prompt."""
    from ridgefill.methods.select import token_scores

    ids = _ids(96)
    eng = Engine(lm)
    st = eng.run_lower(ids, 1)
    return eng, ids, token_scores(eng, 1, st.h, st.tables, last=8)


def test_query_rows_find_the_rows_the_question_attends_to(fitted):
    """The chosen rows are the ones with the most attention from the last queries at the split layer."""
    from ridgefill.methods.select import pick_spans

    eng, ids, scores = _split_scores(fitted[0])
    assert scores.shape == (96,) and bool((scores >= 0).all()) and float(scores.max()) <= 1.0
    res = run_prefill(eng, ids, "identity", settings=QUERY)
    assert len(res.plan.full) == 2 + 8 + 8 and res.plan.filled == 96 - 18
    cand = QUERY_CANDIDATES
    chosen = pick_spans(scores, cand, 8, 8)
    peak = int(scores.masked_fill(~cand, -1).argmax())
    assert chosen[peak] and chosen.sum() == 8
    # The chosen rows really ran every layer: their deep K/V differ from the identity fill's.
    plain = run_prefill(eng, ids, "identity", settings=FillSettings(split=1, sink=2, tail=8, outlier_factor=None))
    k_q, k_p = hf.cache_kv(res.cache, 2)[0], hf.cache_kv(plain.cache, 2)[0]
    assert not torch.allclose(k_q[:, :, peak], k_p[:, :, peak])
    with pytest.raises(RidgefillError, match="query_rows"):
        FillSettings(split=1, query_rows=-1).check(3)


def test_query_pool_chooses_spans_on_pooled_scores(fitted):
    """With query_pool the spans (and eval's needle rank) read each score averaged over neighbours."""
    from ridgefill.methods.select import pick_spans, pool_scores

    eng, ids, raw = _split_scores(fitted[0])
    pooled = pool_scores(raw, 5)
    loop = torch.stack([raw[max(0, i - 2) : i + 3].mean() for i in range(96)])
    torch.testing.assert_close(pooled, loop)
    res = run_prefill(eng, ids, "ridge", maps=fitted[1]["ridge"], settings=replace(QUERY, query_pool=5))
    torch.testing.assert_close(res.diagnostics["row_scores"], pooled)
    want = pick_spans(pooled, QUERY_CANDIDATES, 8, 8) | ~QUERY_CANDIDATES
    assert res.plan.full.tolist() == want.nonzero().squeeze(1).tolist()
    for bad in (0, 2):
        with pytest.raises(RidgefillError, match="query_pool must be an odd"):
            replace(QUERY, query_pool=bad).check(3)


def test_query_layer_scores_on_the_maps_prediction_of_a_deeper_layer(fitted):
    """query_layer: the spans are chosen on the scores of that layer's attention over the ridge
    maps' prediction of its input (reduced over the queries by query_top); ridge only."""
    from ridgefill.methods.select import pick_spans, row_scores

    lm, maps, _ = fitted
    eng, ids, _ = _split_scores(lm)
    s = replace(QUERY, query_layer=2, query_top=2)
    res = run_prefill(eng, ids, "ridge", maps=maps["ridge"], settings=s)
    with torch.inference_mode():
        st = eng.run_lower(ids, 1)
        want = row_scores(eng, 1, st.h, st.tables, 8, maps=maps["ridge"], score_layer=2, top=2)
    torch.testing.assert_close(res.diagnostics["row_scores"], want)
    picked = pick_spans(want, QUERY_CANDIDATES, 8, 8) | ~QUERY_CANDIDATES
    assert res.plan.full.tolist() == picked.nonzero().squeeze(1).tolist() and res.plan.score_layer == 2
    with pytest.raises(RidgefillError, match="'identity' makes none"):
        run_prefill(eng, ids, "identity", settings=s)
    with pytest.raises(RidgefillError, match="query_layer 1 must be another layer than the split 1"):
        replace(s, query_layer=1).check(3)
    with pytest.raises(RidgefillError, match="query_top must be >= 0"):
        replace(s, query_top=-1).check(3)


def test_query_layer_below_the_split_scores_on_its_exact_input(fitted):
    """query_layer below the split: the spans are chosen on that layer's attention over its exact
    input, taken as the lower layers run, for every fill method; a pass shared with exact stops
    there, and continuing from it changes nothing."""
    from ridgefill.methods.select import pick_spans, row_scores

    lm, maps, _ = fitted
    eng, ids = Engine(lm), _ids(96)
    s = replace(QUERY, query_layer=0, query_pool=3)
    with torch.inference_mode():
        st = eng.run_lower(ids, 0)
        want = row_scores(eng, 0, st.h, st.tables, 8, pool=3)
    picked = pick_spans(want, QUERY_CANDIDATES, 8, 8) | ~QUERY_CANDIDATES
    for method, m in (("identity", None), ("ridge", maps["ridge"]), ("kva", maps["kva"])):
        res = run_prefill(eng, ids, method, maps=m, settings=s)
        torch.testing.assert_close(res.diagnostics["row_scores"], want)
        assert res.plan.full.tolist() == picked.nonzero().squeeze(1).tolist() and res.plan.score_layer is None
    assert s.scores_below and not s.scores_above and s.dense_below == 0 and QUERY.dense_below == 1
    alone = run_prefill(eng, ids, "ridge", maps=maps["ridge"], settings=s)
    shared = run_prefill(eng, ids, "ridge", maps=maps["ridge"], settings=s, lower=eng.run_lower(ids, 0))
    torch.testing.assert_close(shared.logits, alone.logits, rtol=0, atol=0)
    with pytest.raises(RidgefillError, match="sparse_keep must be 1"):
        replace(s, sparse_keep=0.5).check(3)


def test_drop_top_reduces_the_queries_for_the_dropped_blocks_alone(fitted):
    """drop_top: the spans read the scores reduced by query_top, the dropped blocks the scores
    reduced by drop_top (None: query_top), both from the one attention computation."""
    from ridgefill.methods.select import pick_spans, row_scores, top_blocks

    lm, maps, _ = fitted
    eng, ids, _ = _split_scores(lm)
    with torch.inference_mode():
        st = eng.run_lower(ids, 1)
        by = {top: row_scores(eng, 1, st.h, st.tables, 8, top=top) for top in (0, 1)}
    full = pick_spans(by[1], QUERY_CANDIDATES, 8, 8) | ~QUERY_CANDIDATES
    picks = {top: top_blocks(by[top], ~full, round(0.5 * int((~full).sum())), 8) for top in (0, 1)}
    assert not torch.equal(picks[0], picks[1])  # the two reductions keep different blocks here
    for drop_top, want_top in ((0, 0), (None, 1), (1, 1)):
        s = replace(QUERY, query_top=1, drop_top=drop_top, drop=0.5, block=8)
        res = run_prefill(eng, ids, "ridge", maps=maps["ridge"], settings=s)
        torch.testing.assert_close(res.diagnostics["row_scores"], by[1])
        assert res.plan.full.tolist() == full.nonzero().squeeze(1).tolist()
        kept = picks[want_top] | full
        assert res.plan.deep_keys.tolist() == kept.nonzero().squeeze(1).tolist(), drop_top
    with pytest.raises(RidgefillError, match="drop_top must be >= 0"):
        replace(s, drop_top=-1).check(3)


def test_method_variants_parse_into_settings(fitted):
    import argparse

    from ridgefill.cli.common import method_prefill

    lm, _, _ = fitted
    args = argparse.Namespace(split=1, sink=4, tail=256, query_rows=None, maps=None)
    spec = method_prefill(lm, "identity:query_rows=128:tail=64:outlier_factor=none", args)
    assert spec.label == "identity:query_rows=128:tail=64:outlier_factor=none" and spec.method == "identity"
    assert spec.settings == FillSettings(1, 4, 64, None, 128)
    for bad in ("identity:depth=3", "identity:tail=x", "identity:tail", "magic", "exact:tail=3"):
        with pytest.raises(RidgefillError):
            method_prefill(lm, bad, args)


def test_batched_decode_equals_one_by_one(tiny):
    """Eval decodes the methods of one prompt as one stock batch; per row it is plain greedy, and a
    cache holding fewer keys (dropped rows) decodes on its own."""
    from dataclasses import replace

    from ridgefill.generation import generate, generate_batch
    from ridgefill.methods import GateSettings

    class Bytes:  # the tiny models read UTF-8 bytes
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode(errors="replace")

    tiny = replace(tiny, tokenizer=Bytes())
    ids = _ids(96)
    fill = resolve_prefill(tiny, "identity", split=1, sink=2, tail=8, outlier_factor=None)
    gate = GateSettings(gate_layer=1, keep=0.5, block=8, local=8, tail=8, query_last=8, min_length=0, min_select=0)
    exact = Prefill("exact", "exact")
    runs = [exact, fill, exact, resolve_prefill(tiny, "tokengate", settings=gate)]
    batch = generate_batch(tiny, ids, runs, max_new_tokens=12)
    for pre, got in zip(runs, batch, strict=True):
        one = generate(tiny, ids, prefill=pre, max_new_tokens=12)
        assert got.token_ids == one.token_ids, pre.label
        assert got.ttft_s > 0 and got.decode_s >= 0
    assert batch[0].token_ids == batch[2].token_ids
    full = [hf.batch_signature(layer) for layer in batch[0].prefill.cache.layers]
    if any(keys == ids.shape[1] for (keys, _), _ in full):  # (all-sliding tiny Mistral holds windows only)
        assert [hf.batch_signature(layer) for layer in batch[3].prefill.cache.layers] != full
        with pytest.raises(RidgefillError, match="same keys"):
            hf.stack_caches([batch[0].prefill.cache, batch[3].prefill.cache])


def test_resumed_top_layers_run_every_row(tiny):
    """`resume`: from that layer up every (kept) row runs again. At the resume layer itself the bulk
    K/V equal the fill's (its input norm ignores the rescale, but for its eps), bulk rows now have logits, the cache
    holds every row, and the FLOP model counts the resumed layers at full cost."""
    from ridgefill.bench.flops import plan_macs

    ids = _ids(96)
    eng = Engine(tiny)
    plain = FillSettings(split=1, sink=2, tail=8, outlier_factor=None)
    base = run_prefill(eng, ids, "identity", settings=plain)
    top = run_prefill(
        eng, ids, "identity", settings=FillSettings(split=1, sink=2, tail=8, outlier_factor=None, resume=3)
    )
    _assert_same(top, base, 3)  # resume at the top resumes nothing
    res = run_prefill(
        eng, ids, "identity", settings=FillSettings(split=1, sink=2, tail=8, outlier_factor=None, resume=2),
        logit_rows=torch.tensor([40, 95]),
    )  # fmt: skip
    for i in range(3):
        for x, y in zip(hf.cache_kv(res.cache, i), hf.cache_kv(base.cache, i), strict=True):
            torch.testing.assert_close(x, y, atol=2e-3, rtol=2e-3)  # the norm's eps sees the new scale
    torch.testing.assert_close(res.logits[1:], base.logits, atol=2e-3, rtol=2e-3)
    assert res.logits.shape[0] == 2 and len(res.plan.full) == 10 and res.plan.resume == 2
    with pytest.raises(RidgefillError, match="filled"):
        run_prefill(eng, ids, "identity", settings=plain, logit_rows=torch.tensor([40]))
    parts, plan = tiny.parts, res.plan
    assert (
        plan_macs(parts, 96, replace(plan, resume=3))
        < plan_macs(parts, 96, plan)
        < plan_macs(parts, 96, replace(plan, resume=1))
    )
    # with dropped rows, resumed layers hold the kept rows only, at the prompt's true length
    dropped = FillSettings(split=1, sink=2, tail=8, outlier_factor=None, drop=0.5, block=8, resume=2)
    got = run_prefill(eng, ids, "identity", settings=dropped)
    assert hf.cache_kv(got.cache, 2)[0].shape[2] == len(got.plan.deep_keys) < 96 or any(
        lp.sliding_window for lp in parts.layers
    )
    for bad in (1, 4):
        with pytest.raises(RidgefillError, match="resume"):
            FillSettings(split=1, resume=bad).check(3)


def test_kva_cannot_resume(fitted):
    lm, maps, _ = fitted
    with pytest.raises(RidgefillError, match="cannot resume"):
        run_prefill(Engine(lm), _ids(64), "kva", maps=maps["kva"], settings=FillSettings(split=1, tail=8, resume=2))
