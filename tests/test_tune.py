"""The tuner: its search space, budgets, choice, frontier, bundle, and a search on SmolLM2."""

from __future__ import annotations

import json
import math

import pytest

from ridgefill.errors import MapError, RidgefillError
from ridgefill.methods.fill import FillSettings
from ridgefill.tune.search import TuneConfig, _mark_frontier, choose
from ridgefill.tune.space import Candidate, Space, grid


def test_grid_covers_splits_tails_and_knobs():
    cands = grid(Space(), 30)
    labels = [c.label for c in cands]
    assert len(labels) == len(set(labels))
    assert {c.settings.split for c in cands} == {10, 12, 15}
    for split in (10, 12, 15):  # plain ridge is the reference at every split
        assert f"ridge@{split}:tail=256" in labels
    assert all(c.settings.query_rows for c in cands if c.settings.drop)  # no drop without query rows
    assert {c.settings.tail for c in cands} == {256, 512}
    assert {c.settings.drop for c in cands} == {0.0, 0.5, 0.75}
    assert {c.settings.sparse_keep for c in cands} == {1.0, 0.5}
    assert {c.settings.query_rows for c in cands} == {0, 512}
    assert len(cands) == 3 * (1 + 2 * 1 * 3 * 2)
    assert not any(c.settings.query_sentence for c in cands)
    sent = grid(Space(splits=(10,), query_rows=(0, 512), query_sentence=64), 30)
    assert {(c.settings.query_rows > 0, c.settings.query_sentence) for c in sent} == {(False, 0), (True, 64)}
    assert "ridge@10:tail=256:query_rows=512:query_sentence=64" in [c.label for c in sent]
    pooled = grid(Space(splits=(10,), query_rows=(0, 512), drops=(), sparse_keeps=(1.0,), query_pool=7), 30)
    assert {(c.settings.query_rows > 0, c.settings.query_pool) for c in pooled} == {(False, 1), (True, 7)}
    assert "ridge@10:tail=256:query_rows=512:query_pool=7" in [c.label for c in pooled]
    above = grid(
        Space(splits=(10, 12), query_rows=(0, 512), drops=(), sparse_keeps=(1.0,), query_above=1, query_top=1), 30
    )
    assert {(c.settings.split, c.settings.query_layer, c.settings.query_top) for c in above} == {
        (10, None, 0),
        (10, 11, 1),
        (12, None, 0),
        (12, 13, 1),
    }
    assert "ridge@12:tail=256:query_rows=512:query_layer=13:query_top=1" in [c.label for c in above]
    split_top = grid(
        Space(splits=(10,), query_rows=(512,), drops=(0.75,), sparse_keeps=(1.0,), query_top=1, drop_top=0), 30
    )
    assert {(c.settings.drop, c.settings.drop_top) for c in split_top} == {(0.0, None), (0.75, 0)}
    assert "ridge@10:tail=256:query_rows=512:query_top=1:drop_top=0:drop=0.75" in [c.label for c in split_top]


def test_grid_adds_token_gates_that_read_maps_only_to_score():
    from ridgefill.methods.gate import GateSettings
    from ridgefill.tune.space import maps_split

    gates = (GateSettings(keep=0.3, sentence=64, score_layer=14), GateSettings(gate_layer=10, pool=7))
    cands = grid(Space(splits=(15,), query_rows=(0,), drops=(), sparse_keeps=(1.0,), gates=gates), 30)
    by = {c.label: c for c in cands}
    assert "tokengate@7:keep=0.3:sentence=64:score_layer=14" in by and "tokengate@10:keep=0.25:pool=7" in by
    scored, pooled = by["tokengate@7:keep=0.3:sentence=64:score_layer=14"], by["tokengate@10:keep=0.25:pool=7"]
    assert (scored.lower, scored.maps_split) == (7, 7) and (pooled.lower, pooled.maps_split) == (10, None)
    assert by["ridge@15:tail=256"].maps_split == by["ridge@15:tail=256"].lower == 15
    assert maps_split("gated-ridge", {"split": 12}) == 12 and maps_split("identity", {"split": 12}) is None
    with pytest.raises(RidgefillError, match="score_layer 5 must be above the gate layer 7"):
        grid(Space(splits=(15,), gates=(GateSettings(score_layer=5),)), 30)


def test_tune_cli_takes_token_gates_and_refuses_other_methods():
    from ridgefill.cli.tune import gate_candidates
    from ridgefill.methods.gate import GateSettings

    assert gate_candidates("tokengate:keep=0.3:score_layer=14, tokengate:pool=7") == (
        GateSettings(keep=0.3, score_layer=14),
        GateSettings(pool=7),
    )
    assert gate_candidates("") == ()
    crossed = gate_candidates("tokengate:keep=0.375|0.5:refine_layer=11:refine_keep=0.125|0.25, tokengate:keep=0.5")
    assert [(g.keep, g.refine_layer, g.refine_keep) for g in crossed] == [
        (0.375, 11, 0.125),
        (0.375, 11, 0.25),
        (0.5, 11, 0.125),
        (0.5, 11, 0.25),
        (0.5, None, 0.125),
    ]
    own = gate_candidates("tokengate, tokengate:keep=0.375", {"sentence": 64, "pool": 7})
    assert own == (GateSettings(sentence=64, pool=7), GateSettings(keep=0.375))  # plain: the model's own
    with pytest.raises(RidgefillError, match="bad method option"):
        gate_candidates("tokengate:keep")
    with pytest.raises(RidgefillError, match="takes tokengate configurations"):
        gate_candidates("ridge:tail=512")
    with pytest.raises(RidgefillError, match="unknown setting 'split'"):
        gate_candidates("tokengate:split=3")


def test_grid_and_config_refuse_bad_values():
    with pytest.raises(RidgefillError, match="nothing to fill"):
        grid(Space(splits=(29,)), 30)
    with pytest.raises(RidgefillError, match="drop"):
        grid(Space(splits=(10,), drops=(1.0,)), 30)
    with pytest.raises(RidgefillError, match="final check"):
        TuneConfig(seed=42).check()
    with pytest.raises(RidgefillError, match="budgets"):
        TuneConfig(budget_ppl=-1).check()


def _row(label, speed, loss, ppl, ok=True, stopped=None):
    return {
        "label": label,
        "speedup": speed,
        "niah_loss": loss,
        "ppl_increase_pct": ppl,
        "within_budget": ok,
        "stopped": stopped,
    }


def test_choice_is_fastest_within_budget_and_frontier_is_non_dominated():
    rows = [
        _row("fast-bad", 2.0, 10.0, 9.0, ok=False),
        _row("mid-ok", 1.7, 1.0, 4.0),
        _row("slow-ok", 1.4, 0.0, 2.0),
        _row("dominated", 1.3, 1.0, 4.0),
        _row("ppl-stage", 2.5, None, 30.0, ok=False, stopped="tail PPL over budget"),
    ]
    assert choose(rows) == "mid-ok"
    assert choose([r for r in rows if not r["within_budget"]]) is None
    _mark_frontier(rows)
    assert [r["label"] for r in rows if r["frontier"]] == ["fast-bad", "mid-ok", "slow-ok"]


def test_ppl_interval_over_documents_and_the_upper_end_option():
    from ridgefill.tune import report
    from ridgefill.tune.search import Trial, _row

    exact = [2.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    t = Trial(Candidate("ridge", FillSettings(split=15)), nll=[2.0, 2.01, 2.02, 2.03, 2.08, 2.12])
    lo, hi = t.ppl_ci(exact)
    assert lo < t.ppl_increase(exact) < hi and lo >= 0.0 and hi <= 100 * (math.exp(0.12) - 1)
    mean_cfg, upper_cfg = TuneConfig(budget_ppl=5.0), TuneConfig(budget_ppl=5.0, ppl_upper=True)
    assert t.ppl_judged(exact, mean_cfg) == t.ppl_increase(exact) < 5.0 < t.ppl_judged(exact, upper_cfg) == hi
    t.niah, t.speed = [(100.0, 100.0)], [1.5]
    assert _row(t, exact, mean_cfg, prompts=1)["within_budget"]
    row = _row(t, exact, upper_cfg, prompts=1)
    assert not row["within_budget"] and row["ppl_ci95"] == [lo, hi]
    result = {"exact": {"niah_score": 100.0, "niah_samples": 1, "tail_nll": 2.0}, "chosen": None}
    row["frontier"] = False
    text = report.table({**result, "candidates": [row]}, 2.0, 5.0, ppl_upper=True)
    assert f"[{lo:+.1f}, {hi:+.1f}]" in text and "upper end of its 95% interval" in text


@pytest.mark.slow
def test_search_pairs_against_exact_and_bundle_round_trips(smollm2, smollm2_maps, tmp_path):
    """A candidate whose query rows cover the whole prompt runs every row fully: it must match exact
    (no PPL increase, no NIAH loss) and be chosen under a near-zero budget; plain ridge must not.
    With waves of one, a second such candidate is not measured once the first met the budgets."""
    from ridgefill.fit.maps import find_maps
    from ridgefill.methods import resolve_prefill
    from ridgefill.tune.bundle import write_bundle
    from ridgefill.tune.search import run_search, tuning_set

    cfg = TuneConfig(budget_niah=0.0, budget_ppl=0.01, length=512, samples=1, ppl_docs=1, ppl_tail=64, wave=1)
    everything = Candidate("ridge", FillSettings(split=15, tail=128, query_rows=4096))
    also = Candidate("ridge", FillSettings(split=15, tail=256, query_rows=4096))
    plain = Candidate("ridge", FillSettings(split=15, tail=128))
    maps = {15: find_maps(smollm2, "ridge", 15, smollm2_maps)}
    prompts, docs = tuning_set(smollm2, cfg)
    assert len(prompts) == 4 and len(docs) == 1 and all(p.input_ids.shape[1] <= 512 for p in prompts)
    ticks = []
    cands = [plain, everything, also]

    def tick(k, stage, remaining=None):
        ticks.extend([stage] * k)

    saved = []
    res = run_search(smollm2, cfg, cands, maps, prompts, docs, tick, saved.append)
    assert [r["complete"] for r in saved] == [False, False] and res["complete"]
    first = {r["label"]: r for r in saved[0]["candidates"]}
    assert first[everything.label]["stopped"] == first[also.label]["stopped"] == "NIAH pending (a later wave)"
    rows = {r["label"]: r for r in res["candidates"]}
    full = rows[res["chosen"]]
    other = rows[({everything.label, also.label} - {res["chosen"]}).pop()]
    assert abs(full["ppl_increase_pct"]) < 0.01 and full["niah_loss"] == 0 and full["niah_samples"] == 4
    assert max(abs(x) for x in full["ppl_ci95"]) < 0.01 and len(res["exact"]["tail_nll_docs"]) == 1
    assert other["stopped"].startswith("NIAH not run") and other["niah_loss"] is None
    assert rows[plain.label]["stopped"].startswith("tail PPL") and rows[plain.label]["niah_loss"] is None
    assert ticks.count("perplexity") == 4 and ticks.count("NIAH") == 4 * 2

    path = write_bundle(maps[15], {"method": "ridge", "settings": full["settings"]}, tmp_path / "b.safetensors")
    pre = resolve_prefill(smollm2, "tuned", maps=path)
    assert pre.method == "ridge" and pre.settings == FillSettings(**full["settings"])
    with pytest.raises(MapError, match="do not include the maps' split 15"):
        write_bundle(maps[15], {"method": "ridge", "settings": {"split": 10}}, tmp_path / "c.safetensors")
    with pytest.raises(MapError, match="without a tuned configuration"):
        resolve_prefill(smollm2, "tuned", maps=smollm2_maps / "smollm2-135m.ridge.s15.safetensors")
    with pytest.raises(MapError, match="no tuned bundle"):
        resolve_prefill(smollm2, "tuned", maps=tmp_path / "missing")


@pytest.mark.slow
def test_search_can_choose_a_token_gate_and_its_bundle_resolves(smollm2, smollm2_maps, tmp_path):
    """A gate that keeps every row (scoring at a predicted deeper layer) equals exact and is chosen
    over plain ridge under near-zero budgets; its bundle carries the gate layer's maps, and a gate
    that reads no maps still makes a bundle (with any split's maps)."""
    from ridgefill.fit.maps import find_maps
    from ridgefill.methods import resolve_prefill
    from ridgefill.methods.gate import GateSettings
    from ridgefill.tune.bundle import write_bundle
    from ridgefill.tune.search import run_search, tuning_set

    cfg = TuneConfig(budget_niah=0.0, budget_ppl=0.01, length=512, samples=1, ppl_docs=1, ppl_tail=64)
    keep_all = GateSettings(gate_layer=15, keep=1.0, score_layer=20, pool=3, min_length=0)
    cands = [Candidate("ridge", FillSettings(split=15, tail=128)), Candidate("tokengate", keep_all)]
    maps = {15: find_maps(smollm2, "ridge", 15, smollm2_maps)}
    prompts, docs = tuning_set(smollm2, cfg)
    res = run_search(smollm2, cfg, cands, maps, prompts, docs)
    rows = {r["label"]: r for r in res["candidates"]}
    assert res["chosen"] == cands[1].label and rows[res["chosen"]]["method"] == "tokengate"
    gate = rows[res["chosen"]]
    assert abs(gate["ppl_increase_pct"]) < 0.01 and gate["niah_loss"] == 0 and gate["niah_samples"] == 4
    path = write_bundle(maps[15], {"method": "tokengate", "settings": gate["settings"]}, tmp_path / "g.safetensors")
    pre = resolve_prefill(smollm2, "tuned", maps=path)
    assert pre.method == "tokengate" and pre.settings == keep_all and pre.maps.split == 15
    own = {"method": "tokengate", "settings": {"gate_layer": 7, "keep": 0.5}}
    pre = resolve_prefill(smollm2, "tuned", maps=write_bundle(maps[15], own, tmp_path / "h.safetensors"))
    assert pre.method == "tokengate" and pre.maps is None and pre.settings.gate_layer == 7


@pytest.mark.slow
def test_tune_cli_writes_results_plot_and_a_bundle_generate_reads(smollm2_maps, tmp_path, capsys):
    from ridgefill.cli import main

    out, plot, bundle = tmp_path / "tune.json", tmp_path / "tune.png", tmp_path / "tuned.safetensors"
    argv = [
        "tune",
        "--length",
        "512",
        "--samples",
        "1",
        "--ppl-docs",
        "1",
        "--splits",
        "15",
        "--tails",
        "128",
        "--query-rows",
        "4096",
        "--drops",
        "",
        "--sparse-keeps",
        "1",  # one candidate within the budgets: the choice must not hang on two candidates' timing
        "--budget-ppl",
        "1",
        "--budget-niah",
        "0",
        "--maps",
        str(smollm2_maps),
        "--bundle",
        str(bundle),
        "--out",
        str(out),
        "--plot",
        str(plot),
    ]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    chosen = doc["by_length"]["512"]["chosen"]
    assert doc["command"].startswith("ridgefill tune") and chosen == "ridge@15:tail=128:query_rows=4096"
    assert plot.stat().st_size > 0 and bundle.is_file()
    assert "512 tokens: chosen ridge@15:tail=128:query_rows=4096" in capsys.readouterr().out
    gen = ["generate", "--method", "tuned", "--maps", str(bundle), "--prompt", "Hi", "--max-new-tokens", "2"]
    assert main(gen) == 0
    assert main(["tune", "--seed", "42"]) == 2


@pytest.mark.slow
def test_tune_at_several_lengths_writes_one_bucket_per_length(smollm2, smollm2_maps, tmp_path, capsys):
    from ridgefill.cli import main
    from ridgefill.methods import resolve_prefill

    out, bundle = tmp_path / "tune.json", tmp_path / "tuned.safetensors"
    argv = ["tune", "--dtype", "float32", "--lengths", "768,512", "--samples", "1", "--ppl-docs", "1"]
    argv += ["--splits", "15", "--tails", "128", "--query-rows", "4096", "--drops", "", "--budget-ppl", "1"]
    argv += ["--budget-niah", "0", "--maps", str(smollm2_maps), "--bundle", str(bundle), "--out", str(out)]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["lengths"] == [512, 768] and set(doc["by_length"]) == {"512", "768"}
    assert [doc["by_length"][n]["config"]["samples"] for n in ("512", "768")] == [2, 2]  # at least 2 per task
    pre = resolve_prefill(smollm2, "tuned", maps=bundle)
    assert [u for u, _ in pre.by_length] == [627, None] and all(p.method == "ridge" for p in pre.variants)


@pytest.mark.slow
def test_tuned_falls_back_to_the_shipped_default_with_the_users_maps(smollm2, smollm2_maps, monkeypatch):
    from ridgefill.methods import resolve_prefill, tuned

    monkeypatch.setattr(tuned, "shipped_defaults", lambda: {})
    with pytest.raises(MapError, match="no shipped configuration"):
        resolve_prefill(smollm2, "tuned", maps=smollm2_maps)
    default = {"method": "ridge", "settings": {"split": 15, "tail": 256, "query_rows": 512, "drop": 0.5}}
    monkeypatch.setattr(tuned, "shipped_defaults", lambda: {"smollm2-135m": default})
    pre = resolve_prefill(smollm2, "tuned", maps=smollm2_maps)
    assert pre.method == "ridge" and pre.maps.split == 15
    assert pre.settings == FillSettings(split=15, tail=256, query_rows=512, drop=0.5)
    default["settings"]["query_layer"] = 17  # a setting the name clears with `none`
    pre = resolve_prefill(smollm2, "tuned:query_layer=none:drop=0.25", maps=smollm2_maps)
    assert pre.settings == FillSettings(split=15, tail=256, query_rows=512, drop=0.25)
    default["settings"]["split"] = 12  # no maps for it in that folder: says how to fit them
    with pytest.raises(MapError, match="--splits 12"):
        resolve_prefill(smollm2, "tuned", maps=smollm2_maps, fit_missing=False)


def test_tune_fits_missing_maps_with_facts_and_refuses_others(smollm2, smollm2_maps, tmp_path, monkeypatch):
    import argparse
    import shutil

    from ridgefill.cli.tune import _maps_for
    from ridgefill.fit import ridge

    name = "smollm2-135m.ridge.s15.safetensors"
    args = argparse.Namespace(maps=tmp_path, corpus=None, calib_facts=3)
    fitted = []

    def fake_fit(lm, cfg, corpus, out_dir):  # records the config, writes maps from the fixture
        fitted.append(cfg)
        shutil.copy(smollm2_maps / name, out_dir / name)

    monkeypatch.setattr(ridge, "fit_from_corpus", fake_fit)
    with pytest.raises(MapError, match="fitted with 0 facts per segment, not --calib-facts 3"):
        _maps_for(smollm2, [15], args)  # the fixture's maps have no facts: refused, not used
    assert [(c.splits, c.facts) for c in fitted] == [((15,), 3)]
    args.calib_facts = 0
    assert _maps_for(smollm2, [15], args)[15].split == 15  # already there: not fitted again
    assert len(fitted) == 1
    args.calib_facts = -1
    with pytest.raises(RidgefillError, match="--calib-facts must be >= 0"):
        _maps_for(smollm2, [15], args)


def test_shipped_defaults_are_valid_settings():
    from ridgefill.methods.tuned import buckets, shipped_defaults

    for name, tuned in shipped_defaults().items():
        for b in buckets(tuned, name):
            assert b.method == "ridge", name
            FillSettings(**b.settings).check(64)
