"""How the vLLM plugin sorts a scheduler step's rows (pure torch: runs without vLLM)."""

from __future__ import annotations

from dataclasses import replace

import torch

from ridgefill.methods.fill import FillSettings
from ridgefill.vllm.step import prompt_step, split_rows, whole_prompt


def step_of(chunks: list[tuple[int, int]], prompt_lens: list[int]):
    """A step scheduling positions [a, b) of each request."""
    positions = torch.cat([torch.arange(a, b) for a, b in chunks])
    qsl = torch.tensor([0, *torch.tensor([b - a for a, b in chunks]).cumsum(0).tolist()])
    return positions, qsl, torch.tensor(prompt_lens)


def test_tail_counts_from_the_prompts_end_across_chunks_and_decode_rows_run_fully():
    # Request 0: chunk [256, 512) of a 700-token prompt (tail 200 starts at 500).
    # Request 1: one decode step at position 450 of a 450-token prompt.
    # Request 2: its whole 40-token prompt.
    positions, qsl, plens = step_of([(256, 512), (450, 451), (0, 40)], [700, 450, 40])
    plan = prompt_step(positions, qsl, plens)
    s = FillSettings(sink=4, tail=200, outlier_factor=None)
    rows = split_rows(plan, lambda n: s, torch.ones(len(positions), 8))
    full = set(rows.full.tolist())
    assert full == set(range(244, 256)) | {256} | set(range(257, 297))  # tail of 0, decode of 1, all of 2
    assert set(rows.bulk.tolist()) == set(range(0, 244))
    # Runs never join two requests, even where their rows touch.
    assert rows.run_req.tolist() == [0, 1, 2] and rows.run_len.tolist() == [12, 1, 40]
    assert whole_prompt(plan, 2) == (257, 297) and whole_prompt(plan, 0) is None


def test_a_decode_only_step_is_the_stock_forward_and_outliers_run_fully():
    positions, qsl, plens = step_of([(700, 701), (450, 451)], [700, 450])
    assert prompt_step(positions, qsl, plens) is None
    positions, qsl, plens = step_of([(0, 300)], [300])
    stream = torch.ones(300, 8)
    stream[100] *= 50  # a massive activation
    rows = split_rows(prompt_step(positions, qsl, plens), lambda n: FillSettings(sink=4, tail=16), stream)
    assert 100 in rows.full.tolist() and 101 in rows.bulk.tolist()


def test_query_pool_prefers_a_sentence_to_a_lone_spike():
    positions, qsl, plens = step_of([(0, 200)], [200])
    plan = prompt_step(positions, qsl, plens)
    s = FillSettings(sink=0, tail=8, outlier_factor=None, query_rows=8, query_window=8)

    def scores(a: int, b: int) -> torch.Tensor:
        sc = torch.zeros(b - a)
        sc[50] = 1.0  # one token
        sc[120:127] = 0.5  # a sentence the question attends to throughout
        return sc

    plain = split_rows(plan, lambda n: s, torch.ones(200, 8), scores)
    pooled = split_rows(plan, lambda n: replace(s, query_pool=7), torch.ones(200, 8), scores)
    assert 50 in plain.full.tolist() and 123 not in plain.full.tolist()
    assert 123 in pooled.full.tolist() and 50 not in pooled.full.tolist()


def test_query_rows_pick_spans_only_for_prompts_scheduled_whole():
    positions, qsl, plens = step_of([(0, 200), (100, 200)], [200, 300])
    plan = prompt_step(positions, qsl, plens)
    s = FillSettings(sink=0, tail=8, outlier_factor=None, query_rows=16, query_window=16)
    asked = []

    def scores(a: int, b: int) -> torch.Tensor:
        asked.append((a, b))
        sc = torch.zeros(b - a)
        sc[50] = 1.0
        return sc

    rows = split_rows(plan, lambda n: s, torch.ones(300, 8), scores)
    assert asked == [(0, 200)]  # request 1's prompt is split across steps
    assert set(range(42, 58)) <= set(rows.full.tolist())


def test_every_vllm_setting_has_a_command_line_option():
    from ridgefill.cli import _parser
    from ridgefill.vllm.config import SETTINGS

    for argv in (["vllm-serve", "smollm2-135m"], ["vllm-bench", "--model", "smollm2-135m"]):
        args = _parser().parse_args(argv)
        assert [k for k in SETTINGS if not hasattr(args, k)] == []
