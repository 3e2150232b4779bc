"""`ridgefill.patch`: the user's own model, whose prefill runs our method; `unpatch` restores it."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.streamers import BaseStreamer

import ridgefill
from conftest import make_tiny
from ridgefill.engine import Engine
from ridgefill.errors import MapError, RidgefillError
from ridgefill.fit.ridge import FitConfig, fit_maps
from ridgefill.generation import stream_tokens
from ridgefill.methods import FillSettings, run_prefill
from test_fill import _byte_segments, _ids

SETTINGS = dict(split=1, sink=2, tail=8)


def _greedy(model, ids, k=8, **kw):
    out = model.generate(ids, max_new_tokens=k, do_sample=False, pad_token_id=0, **kw)
    return out[0, ids.shape[1] :].tolist()


def _ours(lm, ids, method, k=8, **kw):
    pre = run_prefill(Engine(lm), ids, method, **kw)
    return list(stream_tokens(lm, ids, pre, k))


@pytest.fixture(scope="module")
def fitted_llama():
    lm = make_tiny("llama")
    cfg = FitConfig(splits=(1,), segment_tokens=96)
    maps, _ = fit_maps(lm, _byte_segments(6, 96), _byte_segments(2, 96, offset=6000), cfg)
    return lm, {m.method: m for m in maps}


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_patched_exact_generate_equals_stock(arch):
    lm = make_tiny(arch)
    ids = _ids(48)
    want = _greedy(lm.model, ids)
    ridgefill.patch(lm.model, method="exact")
    assert _greedy(lm.model, ids) == want
    state = ridgefill.patch_state(lm.model)
    assert state.ours == 1 and state.stock == 7  # one prefill of ours, then stock decode steps


def test_patched_ridge_equals_library_ridge_and_unpatch_restores(fitted_llama):
    lm, maps = fitted_llama
    ids = _ids(64)
    with torch.no_grad():
        before = lm.model(ids).logits
    s = FillSettings(**SETTINGS)
    want = _ours(lm, ids, "ridge", maps=maps["ridge"], settings=s)
    ridgefill.patch(lm.model, maps["ridge"], method="ridge", sink=2, tail=8)
    try:
        assert _greedy(lm.model, ids) == want
        with torch.no_grad():
            out = lm.model(ids)  # all rows asked: real logits on full rows, NaN on filled ones
        assert torch.isnan(out.logits[0, 2:56]).all() and not torch.isnan(out.logits[0, 56:]).any()
        torch.testing.assert_close(out.logits[0, -1], before[0, -1], atol=5.0, rtol=0)  # same scale
        with torch.no_grad():
            last = lm.model(ids, logits_to_keep=1).logits
        assert last.shape == (1, 1, 256)
        torch.testing.assert_close(last[0, 0], out.logits[0, -1], atol=1e-5, rtol=0)
    finally:
        ridgefill.unpatch(lm.model)
    assert "forward" not in lm.model.__dict__ and ridgefill.patch_state(lm.model) is None
    with torch.no_grad():
        assert torch.equal(lm.model(ids).logits, before)  # bit for bit


def test_short_prompts_labels_and_embeddings_take_the_stock_path():
    lm = make_tiny("llama")
    ridgefill.patch(lm.model, method="identity", **SETTINGS)
    short = _ids(10)  # <= sink + tail
    _greedy(lm.model, short, k=3)
    with torch.no_grad():
        lm.model(_ids(48), labels=_ids(48))
        lm.model(inputs_embeds=lm.model.get_input_embeddings()(_ids(48)))
    state = ridgefill.patch_state(lm.model)
    assert state.ours == 0 and state.stock == 5


def test_refusals(fitted_llama):
    lm, maps = fitted_llama
    other = make_tiny("qwen2")
    with pytest.raises(MapError, match="fitted on another model"):
        ridgefill.patch(other.model, maps["ridge"], method="ridge")
    with pytest.raises(RidgefillError, match="no ridge maps for split"):
        ridgefill.patch(other.model, method="ridge")  # no tokenizer to fit them with: refused, not fitted
    with pytest.raises(RidgefillError, match="unknown prefill method"):
        ridgefill.patch(other.model, method="magic")
    with pytest.raises(RidgefillError, match="unknown setting 'splt'.*valid settings: split"):
        ridgefill.patch(other.model, method="identity", splt=1)
    with pytest.raises(RidgefillError, match="setting 'tail' of method 'identity' must be int"):
        ridgefill.patch(other.model, method="identity", tail="8")
    with pytest.raises(RidgefillError, match="takes no settings"):
        ridgefill.patch(other.model, method="exact", tail=8)
    with pytest.raises(RidgefillError, match="not patched"):
        ridgefill.unpatch(other.model)
    ridgefill.patch(other.model, method="identity", **SETTINGS)
    with pytest.raises(RidgefillError, match="already patched"):
        ridgefill.patch(other.model, method="identity")
    with pytest.raises(RidgefillError, match="batch size 1"), torch.no_grad():
        other.model(torch.cat([_ids(48), _ids(48)]))
    mask = torch.ones(1, 48, dtype=torch.long)
    mask[0, :3] = 0
    with pytest.raises(RidgefillError, match="padding"), torch.no_grad():
        other.model(_ids(48), attention_mask=mask)


class _Collect(BaseStreamer):
    def __init__(self):
        self.tokens = []

    def put(self, value):
        self.tokens.append(value.reshape(-1).tolist())

    def end(self):
        pass


@pytest.mark.slow
def test_smollm2_patched_generate(smollm2, smollm2_maps):
    from ridgefill.fit.maps import find_maps
    from ridgefill.generation import encode_prompt

    text = " ".join(f"Note {i}: the locker code for room {i} is {i * 37 % 1000}." for i in range(40))
    ids = encode_prompt(smollm2, text + "\nWhat is the locker code for room 5?")
    want_exact = _greedy(smollm2.model, ids, k=10)
    ridgefill.patch(smollm2.model, method="exact")
    try:
        streamer = _Collect()
        assert _greedy(smollm2.model, ids, k=10, streamer=streamer) == want_exact
        assert sum(streamer.tokens[1:], []) == want_exact  # the streamer saw every new token
        sampled = smollm2.model.generate(ids, max_new_tokens=5, do_sample=True, top_p=0.9, temperature=0.7)
        assert sampled.shape[1] == ids.shape[1] + 5 or sampled[0, -1] in ridgefill.generation.eos_ids(smollm2)
    finally:
        ridgefill.unpatch(smollm2.model)
    maps = find_maps(smollm2, "ridge", 15, smollm2_maps)
    ref = ridgefill.generate(smollm2, ids, "ridge", max_new_tokens=10, maps=maps, settings=FillSettings(15, 4, 64))
    ridgefill.patch(smollm2.model, maps, method="ridge", tail=64)
    try:
        assert _greedy(smollm2.model, ids, k=10) == ref.token_ids[:10] or ref.token_ids[
            -1
        ] in ridgefill.generation.eos_ids(smollm2)
        assert ridgefill.patch_state(smollm2.model).ours == 1
    finally:
        ridgefill.unpatch(smollm2.model)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_patched_dropping_methods_decode_as_our_own_generate(arch):
    """Methods that drop rows from the deep layers' cache (tokengate, ridge with `drop`, as the
    tuned configurations use) decode through transformers' generate as through ours."""
    lm = make_tiny(arch)
    ids = _ids(96)
    gate = dict(gate_layer=1, keep=0.5, block=8, local=8, tail=8, query_last=8, min_length=0, min_select=0)
    for method, settings in (("tokengate", gate), ("identity", dict(SETTINGS, query_rows=8, drop=0.5, block=8))):
        want = _ours(lm, ids, method, settings=ridgefill.resolve_prefill(lm, method, **settings).settings)
        ridgefill.patch(lm.model, method=method, **settings)
        try:
            assert _greedy(lm.model, ids) == want, method
            assert ridgefill.patch_state(lm.model).ours == 1
        finally:
            ridgefill.unpatch(lm.model)
