"""generate() on the real embedded model: chat template, greedy, stock decode."""

from __future__ import annotations

import pytest
import torch

import ridgefill
from ridgefill.demo import needle_prompt


@pytest.mark.slow
def test_generate_matches_stock_generate(smollm2):
    ids = ridgefill.encode_prompt(smollm2, "Name three colours of the rainbow.")
    ours = ridgefill.generate(smollm2, ids, max_new_tokens=16)
    with torch.no_grad():
        ref = smollm2.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    assert ours.token_ids == ref[0, ids.shape[1] :].tolist()
    assert ours.prefill.tokens_per_s > 0 and ours.ttft_s > 0


@pytest.mark.slow
def test_demo_needle_is_found_by_exact(smollm2):
    prompt = needle_prompt(smollm2, target_tokens=1500)
    res = ridgefill.generate(smollm2, prompt.input_ids, max_new_tokens=10)
    assert prompt.answer in res.text
