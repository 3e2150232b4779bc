"""Our exact prefill == the stock transformers forward, on every supported architecture."""

from __future__ import annotations

import pytest
import torch

from ridgefill.engine import Engine
from ridgefill.generation import stream_tokens
from ridgefill.models import hf

ATOL = 1e-4  # fp32; observed differences are ~1e-6


def _stock(lm, ids):
    with torch.no_grad():
        return hf.stock_forward(lm.model, ids)


@pytest.mark.parametrize("n", [5, 37])
def test_logits_and_cache_match_stock(tiny, n):
    ids = torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(n))
    res = Engine(tiny).prefill_exact(ids, logit_rows=torch.arange(n))
    ref_logits, ref_cache = _stock(tiny, ids)
    torch.testing.assert_close(res.logits, ref_logits[0].float(), atol=ATOL, rtol=0)
    for i in range(tiny.num_layers):
        k, v = hf.cache_kv(res.cache, i)
        rk, rv = hf.cache_kv(ref_cache, i)
        assert k.shape == rk.shape, f"layer {i}: cache kept {k.shape} vs stock {rk.shape}"
        torch.testing.assert_close(k, rk, atol=ATOL, rtol=0)
        torch.testing.assert_close(v, rv, atol=ATOL, rtol=0)
    assert res.cache.get_seq_length() == ref_cache.get_seq_length() == n


def test_default_logits_are_last_row_only(tiny):
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(1))
    res = Engine(tiny).prefill_exact(ids)
    assert res.logits.shape == (1, 256)
    assert res.logit_rows.tolist() == [19]


def test_prefill_then_stock_decode_equals_generate(tiny):
    ids = torch.randint(0, 256, (1, 23), generator=torch.Generator().manual_seed(2))
    tiny.model.generation_config.eos_token_id = None
    tiny.model.config.eos_token_id = None
    pre = Engine(tiny).prefill_exact(ids)
    ours = list(stream_tokens(tiny, ids, pre, max_new_tokens=12))
    with torch.no_grad():
        ref = tiny.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert ours == ref[0, ids.shape[1] :].tolist()


def test_row_subsets_see_only_their_positions(tiny):
    """Running the last rows alone against the earlier rows' K/V reproduces the full run."""
    n, cut = 30, 21
    ids = torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(3))
    eng = Engine(tiny)
    full = eng.prefill_exact(ids, logit_rows=torch.arange(n))
    with torch.no_grad():
        h = eng.embed(ids)
        tables = eng.rope(n, h)
        head, tail = torch.arange(cut), torch.arange(cut, n)
        h_head, h_tail = h[:, :cut], h[:, cut:]
        for i in range(tiny.num_layers):
            h_head, k, v, _ = eng.layer(i, h_head, head, tables)
            h_tail, *_ = eng.layer(i, h_tail, tail, tables, extra_kv=(k, v, head))
        torch.testing.assert_close(eng.logits(h_tail[0]), full.logits[cut:], atol=ATOL, rtol=0)


@pytest.mark.slow
def test_smollm2_matches_stock_at_1k(smollm2):
    n = 1024
    ids = torch.randint(0, smollm2.model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    res = Engine(smollm2).prefill_exact(ids, logit_rows=torch.arange(n - 8, n))
    ref_logits, ref_cache = _stock(smollm2, ids)
    torch.testing.assert_close(res.logits, ref_logits[0, -8:].float(), atol=ATOL, rtol=0)
    for i in range(smollm2.num_layers):
        torch.testing.assert_close(hf.cache_kv(res.cache, i)[0], hf.cache_kv(ref_cache, i)[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(hf.cache_kv(res.cache, i)[1], hf.cache_kv(ref_cache, i)[1], atol=ATOL, rtol=0)


def test_growing_cache_layer_holds_what_the_stock_layer_holds():
    from transformers.cache_utils import DynamicLayer

    g, d = hf.GrowingLayer(), DynamicLayer()
    gen = torch.Generator().manual_seed(0)
    for t in [70, 1, 1, 100, 1, 300]:  # past the headroom twice
        k, v = torch.randn(1, 2, t, 8, generator=gen), torch.randn(1, 2, t, 8, generator=gen)
        gk, gv = g.update(k, v)
        dk, dv = d.update(k, v)
        assert torch.equal(gk, dk) and torch.equal(gv, dv)
    g.crop(50 - g.get_seq_length())  # transformers 5 crops by a negative count
    d.crop(50 - d.get_seq_length())
    k = torch.randn(1, 2, 3, 8, generator=gen)
    assert torch.equal(g.update(k, k)[0], d.update(k, k)[0]) and g.get_seq_length() == 53


def test_decode_with_our_cache_equals_decode_with_the_stock_cache(tiny):
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(3))
    pre = Engine(tiny).prefill_exact(ids)
    _, stock = _stock(tiny, ids)  # the stock forward's own cache (stock layers throughout)
    ours = pre.cache
    full = [lp.sliding_window is None for lp in tiny.parts.layers]
    assert [isinstance(layer, hf.GrowingLayer) for layer in ours.layers] == full
    tok = torch.tensor([[int(pre.logits[-1].argmax())]])
    with torch.no_grad():
        for _ in range(12):
            a, ours = hf.stock_forward(tiny.model, tok, ours)
            b, stock = hf.stock_forward(tiny.model, tok, stock)
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
            tok = a[:, -1:].argmax(-1)
