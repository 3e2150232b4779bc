"""The evaluation's task and adapter interfaces, spelled out by the dummy implementations.

A new task or adapter should pass what the dummies pass here: samples fit the token budget and
are reproducible, the run loop pairs every method with exact, resumes from its cache, and reruns
only what a changed configuration invalidates.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ridgefill.cli import main
from ridgefill.errors import RidgefillError
from ridgefill.eval import passkey, ruler
from ridgefill.eval.api import Adapter, Task
from ridgefill.eval.dummy import FILLER, DummyAdapter, DummyTask
from ridgefill.eval.runner import run_eval, summarise
from ridgefill.methods import Prefill

ESSAY = tuple(ruler.essay_sentences([f"Sentence {i} is about the river." for i in range(2000)]))


def test_implementations_satisfy_the_interfaces():
    from conftest import make_tiny
    from ridgefill.eval.adapter import EngineAdapter

    tasks = (DummyTask(), ruler.RulerTask("niah_single_2", ESSAY), ruler.RulerTask("vt"), passkey.PasskeyTask(ESSAY))
    for task in tasks:
        assert isinstance(task, Task)
    assert isinstance(DummyAdapter(), Adapter)
    assert isinstance(EngineAdapter(make_tiny("llama"), [Prefill("exact", "exact")]), Adapter)


@pytest.mark.parametrize(
    "task", [DummyTask(), ruler.RulerTask("niah_single_1"), ruler.RulerTask("vt"), passkey.PasskeyTask(ESSAY)]
)
def test_samples_fill_the_budget_and_are_seeded(task):
    adapter = DummyAdapter()
    budget = 600 - task.max_new_tokens
    samples = task.samples(adapter.count_tokens, 600, 5, seed=3)
    for s in samples:
        n = adapter.count_tokens(s)
        assert budget - 40 < n <= budget  # the largest haystack that fits
        assert adapter.prompt(s).needle_pos is not None
    assert task.samples(adapter.count_tokens, 600, 5, seed=3) == samples
    assert task.samples(adapter.count_tokens, 600, 5, seed=4) != samples


def test_dummy_task_is_maximal_and_scores_by_containment():
    task, adapter = DummyTask(), DummyAdapter()
    (s,) = task.samples(adapter.count_tokens, 300, 1, seed=0)
    assert adapter.count_tokens(s) + len(FILLER.split()) > 300 - task.max_new_tokens
    key = s.answers[0]
    assert task.score(f" {key}.", s) == 100.0 and task.score(" 12.", s) == 0.0


def test_passkey_spreads_its_depths_and_scores_the_key(tmp_path):
    from ridgefill.eval.tasks import make_task

    task, adapter = make_task("passkey", ESSAY), DummyAdapter()
    samples = task.samples(adapter.count_tokens, 1000, 12, seed=0)
    words = [s.text.split() for s in samples]
    where = [w.index("pass") / len(w) for w in words]  # the needle's first word, as a share of the prompt
    assert where[0] < 0.05 and where[9] > 0.95 and sorted(where[:10]) == where[:10]
    assert abs(where[10] - where[0]) < 0.05  # the 11th sample starts the depths again
    keys = [s.answers[0] for s in samples]
    assert len(set(keys)) == 12 and all(
        len(k) == 5 and k in s.needles[0] and s.needles[0] in s.text for k, s in zip(keys, samples, strict=True)
    )
    assert task.score(f" {keys[0]}.", samples[0]) == 100.0 and task.score(" 12345.", samples[0]) == 0.0
    recs = run_eval(adapter, [task], [1000], 10, tmp_path / "c.jsonl", tail=64)
    by = {(r["method"], r["index"]): r["score"] for r in recs}
    assert [by["forgetful", i] for i in range(10)] == [0.0] * 9 + [100.0]  # only the last depth is in the tail
    with pytest.raises(RidgefillError, match="unknown task 'passkeys'; choose from niah_single_1.*passkey"):
        make_task("passkeys", ESSAY)
    with pytest.raises(RidgefillError, match="needs essay sentences"):
        make_task("passkey", ())


def test_run_pairs_every_method_with_exact(tmp_path):
    adapter = DummyAdapter(tail=64)
    recs = run_eval(adapter, [DummyTask()], [512], 30, tmp_path / "c.jsonl", tail=64)
    assert len(recs) == 60 and len(adapter.generated) == 60
    forgetful = [r for r in recs if r["method"] == "forgetful"]
    # What the dummy defines: it answers only needles in the last 64 tokens; those are not "filled".
    seen = [r["needle_pos"] >= r["prompt_tokens"] - 64 for r in forgetful]
    assert [not s for s in seen] == [r["filled"] for r in forgetful]
    assert 0 < sum(seen) < len(seen)
    rows = {r["method"]: r for r in summarise(recs)["results"]}
    want = 100 * sum(seen) / len(seen)
    assert rows["exact"]["score"] == 100.0 and rows["exact"]["delta_vs_exact"] == 0.0
    assert rows["forgetful"]["score"] == round(want, 2) and rows["forgetful"]["delta_vs_exact"] == round(want - 100, 2)
    lo, hi = rows["forgetful"]["ci95"]
    assert lo <= want - 100 <= hi < 0
    assert rows["forgetful"]["filled_region"]["score"] == 0.0
    assert rows["forgetful"]["ttft_speedup"] == pytest.approx(recs[0]["prompt_tokens"] / 64, rel=0.05)
    assert rows["forgetful"]["by_depth"]["80-100"] > rows["forgetful"]["by_depth"]["0-20"] == 0.0
    # Method diagnostics reach the records and the summary: scores split by where the needle's rows ran.
    needle = rows["forgetful"]["needle_rows"]
    assert needle["full"] == {"prompts": sum(seen), "score": 100.0, "exact_score": 100.0}
    assert needle["none"] == {"prompts": len(seen) - sum(seen), "score": 0.0, "exact_score": 100.0}
    assert needle["part"]["prompts"] == 0 and rows["exact"]["needle_rows"] is None


def test_run_resumes_and_reruns_only_changed_configurations(tmp_path):
    cache = tmp_path / "c.jsonl"
    first = run_eval(DummyAdapter(), [DummyTask()], [256], 4, cache, tail=64)
    again = DummyAdapter()
    assert run_eval(again, [DummyTask()], [256], 4, cache, tail=64) == first and again.generated == []
    # An interrupted run: the last two records never reached the cache.
    lines = cache.read_text().splitlines()
    cache.write_text("\n".join(lines[:-2]) + "\n")
    resumed = DummyAdapter()
    again = run_eval(resumed, [DummyTask()], [256], 4, cache, tail=64)
    assert [{**r, "run": None} for r in again] == [{**r, "run": None} for r in first]
    assert resumed.generated == [(3, "exact"), (3, "forgetful")]
    assert [r["run"] == first[0]["run"] for r in again] == [True] * 6 + [False] * 2
    # Another tail is another configuration of `forgetful`: it reruns, exact is reused.
    other = DummyAdapter(tail=128)
    mixed = run_eval(other, [DummyTask()], [256], 4, cache, tail=128)
    assert {m for _, m in other.generated} == {"forgetful"} and len(other.generated) == 4
    assert len(cache.read_text().splitlines()) == 12
    # Scores pair with the cached exact records; TTFT does not (timed in another process).
    rows = {r["method"]: r for r in summarise(mixed)["results"]}
    assert rows["forgetful"]["delta_vs_exact"] is not None
    assert rows["forgetful"]["ttft_speedup"] is None and rows["forgetful"]["ttft_pairs"] == 0
    assert {r["method"]: r for r in summarise(first)["results"]}["forgetful"]["ttft_pairs"] == 4


def test_ruler_tasks_run_behind_any_adapter(tmp_path):
    tasks = [ruler.RulerTask(t, ESSAY) for t in ("niah_single_1", "niah_multikey_1", "vt")]
    recs = run_eval(DummyAdapter(), tasks, [1024], 3, tmp_path / "c.jsonl", tail=64)
    summary = summarise(recs)
    assert {(r["method"], r["task"]): r["score"] for r in summary["results"] if r["method"] == "exact"} == {
        ("exact", "niah_single_1"): 100.0,
        ("exact", "niah_multikey_1"): 100.0,
        ("exact", "vt"): 100.0,
    }
    pooled = {r["method"]: r for r in summary["niah_pooled"]}
    assert pooled["forgetful"]["samples"] == 6  # vt is not a needle task


def test_bad_runs_are_refused(tmp_path):
    with pytest.raises(RidgefillError, match="exceeds dummy's context of 4096"):
        run_eval(DummyAdapter(), [DummyTask()], [8192], 1, tmp_path / "c.jsonl")
    flipped = DummyAdapter()
    flipped.methods = ["forgetful", "exact"]
    with pytest.raises(RidgefillError, match="first method must be exact"):
        run_eval(flipped, [DummyTask()], [256], 1, tmp_path / "c.jsonl")
    with pytest.raises(RidgefillError, match="unknown task 'niah_single_9'; choose from niah_single_1"):
        ruler.RulerTask("niah_single_9")
    with pytest.raises(RidgefillError, match="needs essay sentences"):
        ruler.RulerTask("niah_single_2")


@pytest.mark.slow
def test_a_new_task_runs_on_the_engine(smollm2, tmp_path):
    from ridgefill.eval.adapter import EngineAdapter
    from ridgefill.generation import encode_prompt
    from ridgefill.methods import FillSettings

    settings = FillSettings(split=15, tail=32, query_rows=32, query_window=16)
    ident = Prefill("identity", "identity", settings)
    adapter = EngineAdapter(smollm2, [Prefill("exact", "exact"), ident])
    task = DummyTask()
    samples = task.samples(adapter.count_tokens, 256, 2, seed=42)
    recs = run_eval(adapter, [task], [256], 2, tmp_path / "c.jsonl", tail=32)
    assert {r["prompt"] for r in recs} == {adapter.prompt(s).key for s in samples} and len(recs) == 4
    for s in samples:
        ids = encode_prompt(smollm2, s.text, answer_prefix=s.answer_prefix)[0].tolist()
        p = adapter.prompt(s)
        assert p.tokens == len(ids) <= 256 - task.max_new_tokens
        assert "pass key is" in smollm2.tokenizer.decode(ids[p.needle_pos : p.needle_pos + 8])
    assert all(r["prediction"] and r["ttft_s"] > 0 for r in recs)
    # The fill records say whether the needle's rows ran fully and how the row score ranked it.
    for r in recs:
        if r["method"] == "exact":
            assert "needle_full" not in r
        else:
            assert 0 <= r["needle_full"] <= 1 and r["needle_rank"] >= 1


def test_needle_rows_reads_the_fill_plan():
    from ridgefill.engine import Plan, PrefillResult
    from ridgefill.eval.adapter import needle_rows

    scores = torch.tensor([0.0, 0.9, 0.1, 0.5, 0.7, 0.2, 0.3, 0.0])
    cand = torch.tensor([False, True, True, True, True, True, True, False])
    plan = Plan(split=1, full=torch.tensor([0, 3, 4, 7]), filled=4, fill="ridge")

    def result(ran_exact=False, diagnostics=None):
        diagnostics = {"row_scores": scores, "score_candidates": cand} if diagnostics is None else diagnostics
        return PrefillResult(
            None, torch.zeros(1, 2), torch.tensor([7]), 8, 0.1, "ridge", ran_exact, plan, diagnostics=diagnostics
        )

    assert needle_rows(result(), (3, 6)) == {"needle_full": round(2 / 3, 3), "needle_rank": 2}  # 0.9 beats 0.7
    assert needle_rows(result(ran_exact=True), (3, 6)) == {}
    assert needle_rows(result(diagnostics={}), (0, 1)) == {"needle_full": 1.0}
    assert needle_rows(result(), None) == {}


def test_eval_cli_refuses_bad_input(capsys, tmp_path, smollm2_maps):
    code = main(["eval", "--tasks", "niah_single_1,niah_nope", "--lengths", "512"])
    assert code == 2 and "unknown task(s) niah_nope" in capsys.readouterr().err
    code = main(["eval", "--tasks", "niah_single_1", "--lengths", "9000"])
    assert code == 2 and "length 9000 exceeds" in capsys.readouterr().err
    code = main(["bench", "--lengths", "1024,9000", "--methods", "exact,ridge"])
    assert code == 2 and "length 9000 exceeds smollm2-135m's context" in capsys.readouterr().err
    # Maps whose header names other weights are refused before any sample runs.
    from ridgefill.fit.maps import load_maps, maps_filename, save_maps

    name = maps_filename("smollm2-135m", "ridge", 15)
    maps = load_maps(smollm2_maps / name)
    maps.header["model"] = {**maps.header["model"], "weights_sha256": "0" * 24}
    save_maps(maps, tmp_path / "wrong" / name)
    argv = ["eval", "--tasks", "niah_single_1", "--lengths", "512", "--methods", "ridge", "--split", "15"]
    code = main([*argv, "--maps", str(tmp_path / "wrong"), "--out", str(tmp_path / "e.json")])
    assert code == 2 and "fitted on another model" in capsys.readouterr().err
    assert not (tmp_path / "e.json").exists()


def _two_prompt_eval(tmp_path, method: str) -> tuple[list[str], Path]:
    """Eval's options for 2 `niah_single_2` prompts under exact and `method` (no length), and the
    cache of their records at 512 tokens."""
    from ridgefill.corpus import DEFAULT_CORPUS_DIR

    if not DEFAULT_CORPUS_DIR.is_dir():
        pytest.skip("needs Debian's python3.11-doc (`make` installs it)")
    common = ["--tasks", "niah_single_2", "--samples", "2", "--split", "15", "--methods", method]
    assert main(["eval", "--lengths", "512", *common, "--out", str(tmp_path / "e.json")]) == 0
    return common, tmp_path / "e.samples.jsonl"


def test_needles_agrees_with_the_eval_records(tmp_path, capsys):
    common, cache = _two_prompt_eval(tmp_path, "identity:query_rows=64:query_window=16:tail=64")
    assert (
        main(
            [
                "experimental",
                "needles",
                "--length",
                "512",
                *common,
                "--scores",
                str(cache),
                "--out",
                str(tmp_path / "n.json"),
            ]
        )
        == 0
    )
    assert "| identity:query_rows=64:query_window=16:tail=64 | pooled | 2 |" in capsys.readouterr().out
    evals = {(r["prompt"], r["method"]): r for r in map(json.loads, cache.read_text().splitlines())}
    got = json.loads((tmp_path / "n.json").read_text())
    for r in got["records"]:  # the prefill-only path sees what the eval saw, and joins its scores
        e = evals[(r["prompt"], r["method"])]
        assert r["score"] == e["score"]
        if r["method"] != "exact":
            assert (r["needle_full"], r["needle_rank"]) == (e["needle_full"], e["needle_rank"])
    assert len(got["records"]) == 4


def test_needles_refuses_bad_input(capsys, tmp_path):
    assert main(["experimental", "needles", "--tasks", "vt"]) == 2
    assert "not needle task(s): vt" in capsys.readouterr().err
    assert main(["experimental", "needles", "--samples", "1", "--scores", str(tmp_path / "none.jsonl")]) == 2
    assert "eval cache not found" in capsys.readouterr().err


def test_needles_ranks_per_layer_as_the_gate_at_that_layer_does(tmp_path, capsys):
    from ridgefill.corpus import DEFAULT_CORPUS_DIR

    if not DEFAULT_CORPUS_DIR.is_dir():
        pytest.skip("needs Debian's python3.11-doc (`make` installs it)")
    common = ["experimental", "needles", "--tasks", "niah_single_2", "--samples", "2", "--length", "1024"]
    assert main([*common, "--layers", "3,7-8", "--out", str(tmp_path / "l.json")]) == 0
    assert "| 7 | top query | 2 |" in capsys.readouterr().out
    layers = json.loads((tmp_path / "l.json").read_text())
    gates = {f"tokengate:gate_layer={g}:min_length=0:query_top={t}": (g, t) for g in (3, 8) for t in (0, 1)}
    assert main([*common, "--methods", ",".join(gates), "--out", str(tmp_path / "g.json")]) == 0
    got = json.loads((tmp_path / "g.json").read_text())["records"]
    assert len(layers["records"]) == 2 and len(got) == 8
    by_prompt = {r["prompt"]: r["ranks"] for r in layers["records"]}
    assert all(sorted(ranks) == ["3", "7", "8"] for ranks in by_prompt.values())
    for r in got:  # one dense pass ranks the needle exactly as a gate at that layer scores it
        g, t = gates[r["method"]]
        assert by_prompt[r["prompt"]][str(g)]["top query" if t else "mean"] == r["needle_rank"]
    summary = {(s["layer"], s["score"]): s for s in layers["summary"]}
    assert summary[(7, "mean")]["prompts"] == 2 and summary[(7, "mean")]["worst"] >= summary[(7, "mean")]["median"]


def test_needles_refuses_layers_with_methods_or_outside_the_model(capsys):
    assert main(["experimental", "needles", "--layers", "4-11", "--methods", "ridge"]) == 2
    assert "drop --methods" in capsys.readouterr().err
    assert main(["experimental", "needles", "--layers", "20-40", "--samples", "1"]) == 2
    assert "layers must lie within 1..29" in capsys.readouterr().err


class _ByteTokenizer:
    def encode(self, text, add_special_tokens=False):
        return list(text.encode())


def test_answer_logprobs_from_one_prompt_pass_match_the_whole_sequence_teacher_forced(tiny):
    from dataclasses import replace

    from ridgefill.eval.margins import answer_logprobs

    lm = replace(tiny, tokenizer=_ByteTokenizer())
    prompt = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(3))
    texts = ["7391", "7", "7318", ""]
    got = answer_logprobs(lm, prompt, texts)
    for text, (tokens, logps) in zip(texts, got, strict=True):
        assert tokens == list(text.encode()) and len(logps) == len(tokens)
        if not tokens:
            continue
        with torch.no_grad():  # the stock forward over prompt and answer at once
            whole = lm.model(input_ids=torch.cat([prompt, torch.tensor([tokens])], 1)).logits[0, 39:-1]
        want = torch.log_softmax(whole.float(), -1)[range(len(tokens)), tokens]
        torch.testing.assert_close(torch.tensor(logps), want, atol=2e-4, rtol=0)


def test_margins_sets_exacts_log_probabilities_of_both_answers_where_they_part(tmp_path, capsys):
    method = "identity:tail=64"
    common, cache = _two_prompt_eval(tmp_path, method)
    rows = [json.loads(line) for line in cache.read_text().splitlines()]
    exact = {r["prompt"]: r for r in rows if r["method"] == "exact"}
    # The method's answer to the first prompt becomes exact's with its third character changed and
    # the other score; on the second prompt it scores as exact did, so only the first differs.
    changed = None
    for r in rows:
        e = exact[r["prompt"]]
        if r["method"] == method and changed is None:
            text = e["prediction"]
            r["prediction"] = text[:2] + ("7" if text[2:3] != "7" else "3") + text[3:]
            r["score"], changed = 100.0 - e["score"], r
        elif r["method"] == method:
            r["score"] = e["score"]
    cache.write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    argv = [
        "experimental",
        "margins",
        "--length",
        "512",
        *common,
        "--cache",
        str(cache),
        "--out",
        str(tmp_path / "m.json"),
    ]
    assert main(argv) == 0
    assert f"| niah_single_2 | {changed['index']} |" in capsys.readouterr().out
    (got,) = json.loads((tmp_path / "m.json").read_text())["records"]
    assert got["prompt"] == changed["prompt"] and got["method"]["prediction"] == changed["prediction"]
    j = got["parting_token"]
    # Teacher-forced on the same prompt, both answers share their log-probabilities up to where they
    # part; there, exact's greedy token is at least as likely as the changed one.
    assert j is not None and got["exact_logprobs"][:j] == got["method_logprobs"][:j]
    assert got["exact_token"] != got["method_token"] and got["margin_nats"] >= 0
    assert got["margin_nats"] == round(got["exact_logprobs"][j] - got["method_logprobs"][j], 4)
    assert main([*argv[:-2], "--methods", f"exact,{method},identity"]) == 2
    assert "name one method besides exact" in capsys.readouterr().err

    # The same prompts scored again by the model at the other dtype: the same tokens part, and the
    # other copy's log-probabilities are its own, close to the cache's dtype but not the same numbers.
    dtype = json.loads((tmp_path / "e.json").read_text())["settings"]["dtype"]
    other = "bfloat16" if dtype == "float32" else "float32"
    assert main([*argv, "--rescore-dtype", other]) == 0
    assert f"exact's margin in {other} (nats)" in capsys.readouterr().out
    doc = json.loads((tmp_path / "m.json").read_text())
    (again,) = doc["records"]
    assert (doc["dtype"], doc["rescore_dtype"]) == (dtype, other)
    assert {k: again[k] for k in got} == got
    re = again["rescored"]
    assert re["dtype"] == other and re["parting_token"] == j
    assert re["margin_nats"] == round(re["exact_logprobs"][j] - re["method_logprobs"][j], 4)
    for side in ("exact_logprobs", "method_logprobs"):
        mine, theirs = re[side], got[side]
        assert len(mine) == len(theirs) and mine != theirs
        torch.testing.assert_close(torch.tensor(mine), torch.tensor(theirs), atol=0.5, rtol=0)
    assert main([*argv, "--rescore-dtype", dtype]) == 2
    assert f"--rescore-dtype {dtype} is the dtype the cache was computed in" in capsys.readouterr().err
