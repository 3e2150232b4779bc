"""The ablation table: rows read back from eval results files, settings from labels, pooled rows
from an old file's cache (checked), and clear errors."""

from __future__ import annotations

import json

import pytest

from ridgefill.cli import main
from ridgefill.errors import RidgefillError
from ridgefill.eval import ablation
from ridgefill.eval.runner import summarise

METHODS = ["exact", "ridge", "ridge:query_rows=512:tail=512", "identity:split=13:drop=0.5"]


def _records():
    recs = []
    outcomes = {"exact": [100, 100, 0, 100], "ridge": [0, 0, 0, 100]}
    for i in range(4):
        task = "niah_single_1" if i < 2 else "niah_multikey_1"
        base = {"task": task, "length": 64, "index": i % 2, "prompt": f"p{i}", "depth": 0.5, "config": "c", "run": "r"}
        for m in METHODS:
            score = outcomes.get(m, outcomes["exact"])[i]
            recs.append({**base, "method": m, "score": float(score), "ttft_s": 1.0 if m == "exact" else 0.5})
    return recs


def _write(tmp_path, pooled=True, name="eval.json"):
    summary = summarise(_records())
    doc = {
        "command": "ridgefill eval --lengths 64",
        "model": "tiny",
        "methods": METHODS,
        "settings": {"split": 15, "sink": 4, "tail": 256, "seed": 42},
        "results": summary["results"],
        "ppl": [{"method": "ridge", "length": 64, "docs": 2, "ppl_increase_pct": 4.5}],
    }
    if pooled:
        doc["niah_pooled"] = summary["niah_pooled"]
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def test_rows_carry_settings_paired_figures_and_command(tmp_path):
    rows = ablation.rows(_write(tmp_path))
    assert [r["method"] for r in rows] == METHODS[1:]  # exact is the reference, not a row
    ridge, wide, drop = rows
    assert (ridge["split"], ridge["tail"], ridge["query_rows"], ridge["direction"]) == (15, 256, 0, "plain fill")
    assert (wide["tail"], wide["query_rows"], wide["direction"]) == (512, 512, "query-aware rows + tail/sinks")
    assert (drop["fill"], drop["split"], drop["drop"]) == ("identity", 13, 0.5)
    assert (ridge["samples"], ridge["niah"], ridge["exact_niah"], ridge["delta_vs_exact"]) == (4, 25.0, 75.0, -50.0)
    assert ridge["ppl_increase_pct"] == 4.5 and wide["ppl_increase_pct"] is None
    assert ridge["ttft_speedup"] == 2.0 and ridge["command"] == "ridgefill eval --lengths 64"
    assert ablation.label_settings("ridge:outlier_factor=none", {})["outlier_factor"] is None
    with pytest.raises(RidgefillError, match="'drop' of method 'ridge' must be float, got 'x'"):
        ablation.label_settings("ridge:drop=x", {})
    table = ablation.markdown(rows)
    assert (
        "| tiny | plain fill | ridge | 15 | 256 | 4 | 0 | 32 | 0 | 1 | - | 0 | - | 0 | 1 | - | - | 4 | 25.0 | 75.0 | "
        "-50.0 [" in table
    )
    # Settings recorded before a field existed read as its old meaning (query_sentence: 0, off).
    path = _write(tmp_path, name="recorded.json")
    doc = json.loads(path.read_text())
    old = {m: ablation.label_settings(m, doc["settings"]) for m in METHODS}
    doc["method_settings"] = {m: {k: v for k, v in s.items() if k != "query_sentence"} for m, s in old.items()}
    path.write_text(json.dumps(doc))
    assert [r["query_sentence"] for r in ablation.rows(path)] == [0, 0, 0]
    # The maps' calibration, as eval records it, names the fit directions (facts, K/V space).
    doc["method_settings"]["ridge"]["maps_calib"] = {"tokens": 16384, "facts": 16, "corpus": "c"}
    doc["method_settings"]["ridge:query_rows=512:tail=512"]["resume"] = 25
    doc["method_settings"]["identity:split=13:drop=0.5"].update(method="kva", maps_calib={"tokens": 65536, "facts": 0})
    path.write_text(json.dumps(doc))
    ridge, wide, kva = ablation.rows(path)
    assert (ridge["direction"], ridge["calibration"]) == ("facts in calibration", "16K + 16 facts/seg")
    assert wide["direction"] == "query-aware rows + tail/sinks + resumed top layers" and wide["resume"] == 25
    assert (kva["direction"], kva["calibration"], wide["calibration"]) == (
        "dropped bulk rows + fit in K/V space",
        "64K",
        None,
    )
    assert (
        "| facts in calibration | ridge | 15 | 256 | 4 | 0 | 32 | 0 | 1 | - | 0 | - | 0 | 1 | - | "
        "16K + 16 facts/seg | 4 |" in ablation.markdown([ridge])
    )


def test_old_files_pool_from_their_cache_only_when_it_reproduces_them(tmp_path):
    path = _write(tmp_path, pooled=False)
    cache = path.with_suffix(".samples.jsonl")
    with pytest.raises(RidgefillError, match="cache .* is missing"):
        ablation.rows(path)
    cache.write_text("".join(json.dumps(r) + "\n" for r in _records()))
    assert [r["niah"] for r in ablation.rows(path)] == [
        r["niah"] for r in ablation.rows(_write(tmp_path, True, "b.json"))
    ]
    flipped = _records()
    flipped[1]["score"] = 100.0  # ridge's first sample no longer matches the file
    cache.write_text("".join(json.dumps(r) + "\n" for r in flipped))
    with pytest.raises(RidgefillError, match="does not reproduce"):
        ablation.rows(path)
    # A later run of the same label under another configuration (e.g. refitted maps) is passed over:
    # the first configuration that reproduces the file is used, whichever comes first in the cache.
    later = [{**r, "config": "other", "score": 100.0 - r["score"]} for r in _records() if r["method"] == "ridge"]
    for records in (_records() + later, later + _records()):
        cache.write_text("".join(json.dumps(r) + "\n" for r in records))
        assert [r["niah"] for r in ablation.rows(path)] == [25.0, 75.0, 75.0]
    cache.write_text("".join(json.dumps(r) + "\n" for r in [*flipped, *later]))
    with pytest.raises(RidgefillError, match="does not reproduce .*ridge"):
        ablation.rows(path)


def test_cli_writes_json_and_markdown_and_refuses_other_files(tmp_path, capsys):
    out = tmp_path / "ablation.json"
    assert main(["experimental", "ablation", str(_write(tmp_path)), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("ridgefill experimental ablation") and len(doc["rows"]) == 3
    assert out.with_suffix(".md").read_text().startswith("`ridgefill experimental ablation")
    bad = tmp_path / "bench.json"
    bad.write_text(json.dumps({"command": "ridgefill bench"}))
    assert main(["experimental", "ablation", str(bad)]) == 2
    assert "not a `ridgefill eval` results file" in capsys.readouterr().err
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({**json.loads(_write(tmp_path).read_text()), "methods": ["exact", "nosuch"]}))
    assert main(["experimental", "ablation", str(wrong)]) == 2
    assert "cannot read method label 'nosuch'" in capsys.readouterr().err


def test_an_eval_run_reads_back_with_each_methods_own_settings(tmp_path):
    from ridgefill.corpus import DEFAULT_CORPUS_DIR

    if not DEFAULT_CORPUS_DIR.is_dir():
        pytest.skip("needs Debian's python3.11-doc (`make` installs it)")
    out = tmp_path / "eval.json"
    argv = ["eval", "--tasks", "niah_single_1", "--lengths", "512", "--samples", "1", "--split", "15"]
    assert main([*argv, "--methods", "identity:tail=64,identity:split=20", "--out", str(out)]) == 0
    settings = json.loads(out.read_text())["method_settings"]
    assert settings["identity:tail=64"]["tail"] == 64 and settings["identity:split=20"]["split"] == 20
    (short, deep) = ablation.rows(out)
    assert (short["split"], short["tail"], deep["split"], deep["tail"]) == (15, 64, 20, 256)
    assert short["samples"] == deep["samples"] == 1


def test_bench_files_give_each_row_its_clean_ttft(tmp_path):
    """A row takes the TTFT of the bench row that computed the same configuration (model, length,
    settings; the maps' calibration aside), from the first bench file listed that has it."""
    rows = ablation.rows(_write(tmp_path))
    rows[0]["settings"]["maps_calib"] = {"tokens": 16384, "facts": 16}  # calibration changes no cost

    def bench(name, methods, speedups, settings=True):
        config = {"split": 15, "sink": 4, "tail": 256, "methods": ["exact", *methods]}
        if settings:
            config["method_settings"] = {m: ablation.label_settings(m, config) for m in methods}
        results = [
            {"length": 64, "method": m, "speedup": x, "speedup_min": x - 0.1, "speedup_max": x + 0.1, "flop_bound": 2.0}
            for m, x in zip(methods, speedups, strict=True)
        ]
        path = tmp_path / name
        path.write_text(json.dumps({"model": "tiny", "config": config, "results": results}))
        return path

    new = bench("new.json", ["ridge"], [1.5])
    old = bench("old.json", ["ridge", "ridge:query_rows=512:tail=512", "ridge:tail=512"], [1.2, 1.3, 1.4], False)
    ablation.attach_bench(rows, [new, old])
    assert [r.get("bench_speedup") for r in rows] == [1.5, 1.3, None]
    assert rows[0]["bench_source"].endswith("new.json") and rows[1]["bench_range"] == pytest.approx([1.2, 1.4])
    assert "| 1.50x [1.40-1.60] (bound 2.00x) |" in ablation.markdown(rows[:1])
    assert ablation.markdown(rows[2:]).count("| - |") >= 1
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(RidgefillError, match="not a `ridgefill bench` results file"):
        ablation.attach_bench(rows, [tmp_path / "bad.json"])
