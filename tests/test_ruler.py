"""RULER generation, depth placement, length fitting and scoring."""

from __future__ import annotations

import random

import pytest
import torch

from ridgefill.eval import ruler
from ridgefill.eval.adapter import EngineAdapter, prepare
from ridgefill.eval.runner import run_eval, summarise
from ridgefill.methods import Prefill

ESSAY = ruler.essay_sentences([f"Sentence number {i} talks about the weather in the valley." for i in range(3000)])


def test_single_needle_wording_is_singular():
    s = ruler.niah_sample("niah_single_2", 200, random.Random(1), ESSAY)
    assert s.text.startswith("A special magic number is hidden within the following text. Make sure to memorize it.")
    assert "I will quiz you about the number afterwards.\n" in s.text
    key = s.needles[0].split(" for ")[1].split(" is:")[0]
    assert s.text.endswith(f"\nWhat is the special magic number for {key} mentioned in the provided text?")
    assert s.answer_prefix == f" The special magic number for {key} mentioned in the provided text is"
    assert s.needles == [f"One of the special magic numbers for {key} is: {s.answers[0]}."]
    assert len(s.answers[0]) == 7 and s.answers[0].isdigit()
    assert key in ruler.key_words() and "-" in key


def test_plural_tasks_keep_plural_wording():
    s = ruler.niah_sample("niah_multivalue", 200, random.Random(2), ESSAY)
    assert s.text.startswith("Some special magic numbers are hidden") and len(s.answers) == 4
    assert s.answer_prefix.endswith("mentioned in the provided text are")
    q = ruler.niah_sample("niah_multiquery", 200, random.Random(3), ESSAY)
    assert len(q.answers) == 4 and ", and " in q.answer_prefix
    u = ruler.niah_sample("niah_single_3", 200, random.Random(4), ESSAY)
    assert "special magic uuid for" in u.answer_prefix and len(u.answers[0]) == 36


def test_haystack_kinds():
    noise = ruler.niah_sample("niah_single_1", 50, random.Random(5), ESSAY)
    assert noise.text.count(ruler.NOISE) == 50
    multi = ruler.niah_sample("niah_multikey_1", 300, random.Random(6), ESSAY)
    assert len(multi.needles) == 4 and all(n in multi.text for n in multi.needles)
    dist = ruler.niah_sample("niah_multikey_2", 40, random.Random(7), ESSAY)
    assert dist.text.count("One of the special magic numbers for") == 41


def test_essay_depths_follow_the_40_point_grid():
    seen = set()
    for seed in range(40):
        s = ruler.niah_sample("niah_single_2", 1000, random.Random(seed), ESSAY)
        context = s.text.split("\n", 1)[1].rsplit("\n", 1)[0]
        sentences_before = context[: context.index(s.needles[0])].count(". ")
        depth = round(100 * sentences_before / 1000)
        assert min(abs(depth - d) for d in ruler.DEPTHS) <= 1, depth
        seen.add(depth)
    assert len(seen) > 15  # depths vary across samples


def test_vt_chain_and_one_shot_example():
    s = ruler.vt_sample(60, random.Random(8), example_size=10)
    assert len(s.answers) == 5 and all(len(a) == 5 for a in s.answers)
    value = s.needles[0].split("= ")[1]
    assert s.answer_prefix == (
        " Answer: According to the chain(s) of variable assignment in the text above, "
        f"5 variables are assgined the value {value}, they are: "
    )
    example, task = s.text.split("\n\n", 1)[0], s.text.split("\n\n", 1)[1]
    assert example.startswith("Memorize and track") and task.count("Memorize and track") == 1
    for a, b in zip(s.answers, s.answers[1:], strict=False):
        assert f"VAR {b} = VAR {a}" in s.text


@pytest.mark.parametrize(
    ("prediction", "answers", "score"),
    [
        ("The number is 1234567.", ["1234567"], 1.0),
        ("  nothing here \x00", ["1234567"], 0.0),
        ("ABCDE, fghij and KLMNO", ["abcde", "FGHIJ", "klmno", "PQRST"], 0.75),
        ("7654321", ["1234567", "7654321"], 0.5),
    ],
)
def test_string_match_all(prediction, answers, score):
    assert ruler.string_match_all(prediction, answers) == score


def test_fit_size_is_maximal():
    assert ruler.fit_size(lambda n: 10 * n + 5, 1000, 500) == 99
    # A guess (a sibling sample's size) gives the same answer from either side, with fewer counts.
    rng = random.Random(3)
    for _ in range(200):
        steps = [rng.randint(0, 40) for _ in range(rng.randint(1, 300))]
        prefix = [sum(steps[: i + 1]) for i in range(len(steps))]
        budget, hi = rng.randint(prefix[0], prefix[-1] + 50), len(steps)
        count = [0, *prefix].__getitem__
        want = ruler.fit_size(count, budget, hi)
        for guess in (2, want - 3, want, want + 1, want + 7, hi):
            assert ruler.fit_size(count, budget, hi, guess=guess) == want, (budget, guess)
    calls = []
    assert ruler.fit_size(lambda n: calls.append(n) or 10 * n, 1000, 100_000, guess=99) == 100
    assert len(calls) <= 4
    with pytest.raises(Exception, match="smallest haystack"):
        ruler.fit_size(lambda n: 10_000, 1000, 500)


@pytest.mark.slow
@pytest.mark.parametrize("task", ["niah_single_1", "niah_single_2", "vt"])
def test_prompts_fill_the_length_exactly(smollm2, task):
    length = 1024
    for p in prepare(smollm2, task, length, 2, 42, ESSAY):
        budget = length - ruler.TOKENS_TO_GENERATE[task]
        assert p.input_ids.shape[1] <= budget
        assert p.input_ids.shape[1] > budget - 40  # one more haystack unit would not fit
        # The needle's token position matches where its text sits in the decoded prompt.
        needle = next(n for n in p.sample.needles if p.sample.answers[0] in n)
        window = smollm2.tokenizer.decode(p.input_ids[0, p.needle_pos : p.needle_pos + 40])
        assert needle[:20] in window, (p.needle_pos, window)


@pytest.mark.slow
def test_exact_against_itself_has_zero_delta(smollm2, tmp_path):
    specs = [Prefill("exact", "exact"), Prefill("exact-again", "exact")]
    task = [ruler.RulerTask("niah_single_1")]
    recs = run_eval(EngineAdapter(smollm2, specs), task, [512], 2, tmp_path / "c.jsonl")
    again = next(r for r in summarise(recs)["results"] if r["method"] == "exact-again")
    assert again["delta_vs_exact"] == 0 and again["ci95"] == [0.0, 0.0]
    # Resuming reads the cache instead of running again.
    assert run_eval(EngineAdapter(smollm2, specs), task, [512], 2, tmp_path / "c.jsonl") == recs


def test_summary_pairs_ttft_per_prompt_within_one_run():
    recs = []
    # The last prompt's exact record came from another run (a reused cache): its time is not paired.
    for i, (e, m, run) in enumerate([(10.0, 5.0, "a"), (20.0, 10.0, "a"), (30.0, 10.0, "a"), (40.0, 1.0, "b")]):
        base = {"task": "t", "length": 8, "index": i, "prompt": str(i), "depth": 0.5, "score": 100.0}
        recs += [{**base, "method": "exact", "ttft_s": e, "run": run}, {**base, "method": "m", "ttft_s": m, "run": "a"}]
    rows = {r["method"]: r for r in summarise(recs)["results"]}
    assert rows["m"]["ttft_speedup"] == 2.0 and rows["m"]["ttft_pairs"] == 3 and rows["m"]["samples"] == 4
    assert rows["exact"]["ttft_speedup"] == 1.0
    # Records from before runs had ids pair as they always did: all four, median 3.0.
    legacy = {r["method"]: r for r in summarise([{k: v for k, v in r.items() if k != "run"} for r in recs])["results"]}
    assert legacy["m"]["ttft_speedup"] == 3.0 and legacy["m"]["ttft_pairs"] == 4


def test_cache_key_names_what_a_record_was_computed_with(monkeypatch):
    from conftest import make_tiny
    from ridgefill.eval.adapter import CACHE_SCHEMA, config_key
    from ridgefill.methods import FillSettings

    lm = make_tiny("llama")

    def key(model, split=1, tail=8, **kw):
        return config_key(model, Prefill("m", "identity", FillSettings(split=split, tail=tail, **kw)))

    assert key(lm) == key(lm)
    assert len({key(lm), key(lm, split=2), key(lm, tail=16), key(make_tiny("llama", dtype=torch.bfloat16))}) == 4
    assert key(lm, query_sentence=16) != key(lm)  # every settings field is part of the key
    assert key(lm, query_pool=1) == key(lm)  # a field at its default is not, so new fields keep old keys
    # The key carries the cache schema: records written under another one are recomputed.
    before = key(lm)
    monkeypatch.setattr("ridgefill.eval.adapter.CACHE_SCHEMA", CACHE_SCHEMA + 1)
    assert key(lm) != before
    assert key(make_tiny("llama", seed=1)) != key(lm)  # other weights


def test_niah_tasks_pool_per_method_and_pair_with_exact():
    recs = []
    for task, scores in [
        ("niah_single_1", [(100, 100), (100, 0)]),
        ("niah_multikey_1", [(0, 0), (100, 0)]),
        ("vt", [(100, 0)]),
    ]:
        for i, (e, m) in enumerate(scores):
            base = {
                "task": task,
                "length": 8,
                "index": i,
                "prompt": f"{task}{i}",
                "depth": 0.5,
                "ttft_s": 1.0,
                "run": "r",
            }
            recs += [{**base, "method": "exact", "score": float(e)}, {**base, "method": "m", "score": float(m)}]
    pooled = {r["method"]: r for r in summarise(recs)["niah_pooled"]}
    m = pooled["m"]
    assert m["tasks"] == ["niah_multikey_1", "niah_single_1"] and m["samples"] == 4  # vt is not a needle task
    assert (m["score"], m["exact_score"], m["delta_vs_exact"]) == (25.0, 75.0, -50.0)
    assert m["ci95"][0] < -50 < m["ci95"][1] <= 0
    from ridgefill.eval.report import niah_table

    table = niah_table(summarise(recs)["niah_pooled"], [{"method": "m", "length": 8, "ppl_increase_pct": 3.25}])
    assert "| m | 8 | 2 | 4 | 25.0 | 75.0 | -50.0 [" in table and "| +3.2% | 1.00x |" in table


def test_needle_breakdown_reads_the_same_in_the_eval_report_and_the_needles_table():
    from ridgefill.eval import needles, report
    from ridgefill.eval.runner import breakdown_case

    nr = {
        "full": {"prompts": 3, "score": 100.0, "exact_score": 100.0},
        "part": {"prompts": 0, "score": None, "exact_score": None},
        "none": {"prompts": 1, "score": 0.0, "exact_score": None},
        "rank_median": 2,
        "rank_p90": 9,
    }
    assert [breakdown_case(nr[k]) for k in ("full", "part", "none")] == ["100.0 vs exact 100.0", "-", "0.0 vs exact -"]
    (line,) = report.needle_lines([{"method": "ridge", "length": 4096, "needle_rows": nr}])
    want = "ridge @ 4096: needle rows ran full in 3 (100.0 vs exact 100.0), none in 1 (0.0 vs exact -)"
    assert line == want + "; median rank of the needle by row score 2"
    (two,) = report.needle_lines(
        [{"method": "tokengate", "length": 4096, "needle_rows": {**nr, "rank_refine_median": 1}}]
    )
    assert two.endswith("by row score 2, by the second gate's score 1")
    row = needles.markdown([{"method": "ridge", "task": "niah_single_1", "prompts": 4, **nr}]).splitlines()[-1]
    assert row == "| ridge | niah_single_1 | 4 | 3 | 0 | 1 | 2 | 9 | 100.0 vs exact 100.0 | - | 0.0 vs exact - |"


def test_needle_breakdown_ranks_both_gate_stages():
    from ridgefill.eval.runner import needle_breakdown

    ranks = [(5, 1), (9, 2), (300, None)]  # the third needle did not reach the second stage
    rows = {
        i: {"score": 100.0, "needle_full": 1.0, "needle_rank": r, **({"needle_rank_refine": q} if q else {})}
        for i, (r, q) in enumerate(ranks)
    }
    out = needle_breakdown(rows, {})
    assert (out["rank_median"], out["rank_refine_median"], out["rank_refine_p90"]) == (9, 2, 2)
    one_stage = needle_breakdown({0: {"score": 0.0, "needle_full": 0.0, "needle_rank": 3}}, {})
    assert one_stage["rank_median"] == 3 and "rank_refine_median" not in one_stage
