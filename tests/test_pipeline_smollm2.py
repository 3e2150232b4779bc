"""End to end on the real embedded model: fit -> ppl -> bench -> fill-error, through the CLI."""

from __future__ import annotations

import json

import pytest

from ridgefill.cli import main
from ridgefill.corpus import DEFAULT_CORPUS_DIR

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not DEFAULT_CORPUS_DIR.is_dir(), reason="needs Debian's python3.11-doc (`make` installs it)"),
]


@pytest.fixture(scope="module")
def maps_dir(smollm2_maps):
    return smollm2_maps


def test_fit_report_and_maps(maps_dir):
    report = json.loads((maps_dir / "fit.json").read_text())
    assert report["command"].startswith("ridgefill fit")
    ridge = report["splits"]["15"]["ridge"]
    assert set(ridge) == {str(i) for i in range(16, 30)}
    assert all(e["heldout_rel_err"] < e["identity_rel_err"] for e in ridge.values())
    assert not set(report["corpus"]["calib_documents"]) & set(report["corpus"]["heldout_documents"])


def test_ridge_beats_identity_on_tail_perplexity(maps_dir, tmp_path):
    out = tmp_path / "ppl.json"
    argv = ["ppl", "--length", "1024", "--docs", "2", "--splits", "15", "--tail", "128", "--maps", str(maps_dir)]
    assert main([*argv, "--out", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["ppl"]}
    assert rows["exact"]["ppl_increase_pct"] == 0 and rows["exact"]["doc_ppl_increase_pct"] == [0, 0]
    ridge = rows["ridge@15"]
    assert len(ridge["doc_nll"]) == 2 and abs(sum(ridge["doc_nll"]) / 2 - ridge["tail_nll"]) < 1e-4
    lo, hi = ridge["ppl_increase_ci95"]
    assert min(ridge["doc_ppl_increase_pct"]) - 0.01 <= lo <= ridge["ppl_increase_pct"] <= hi
    assert hi <= max(ridge["doc_ppl_increase_pct"]) + 0.01
    assert rows["ridge@15"]["ppl"] < rows["identity@15"]["ppl"]


def test_ppl_runs_a_method_without_a_split_once(tmp_path):
    out = tmp_path / "ppl.json"
    argv = ["ppl", "--length", "1024", "--docs", "1", "--splits", "10,15", "--tail", "128"]
    assert main([*argv, "--methods", "identity,tokengate:min_length=0", "--out", str(out)]) == 0
    labels = [r["method"] for r in json.loads(out.read_text())["ppl"]]
    assert labels == ["exact", "identity@10", "tokengate:min_length=0", "identity@15"]


def test_bench_writes_paired_results(maps_dir, tmp_path):
    out = tmp_path / "bench.json"
    argv = ["bench", "--lengths", "1024", "--repeats", "1", "--methods", "exact,ridge,kva", "--maps", str(maps_dir)]
    assert main([*argv, "--split", "15", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = {r["method"]: r for r in data["results"]}
    assert rows["exact"]["speedup"] == 1.0 and rows["exact"]["flop_bound"] == 1.0
    ran = data["config"]["method_settings"]
    assert ran["ridge"]["split"] == ran["ridge"]["maps_split"] == 15 and ran["kva"]["method"] == "kva"
    assert ran["ridge"]["maps_calib"]["facts"] == 0 and ran["ridge"]["maps_calib"]["tokens"] > 0
    assert rows["ridge"]["flop_bound"] > 1.0 and rows["ridge"]["full_rows"] == 4 + 256


def test_fill_error_report(maps_dir, tmp_path):
    out, png = tmp_path / "fe.json", tmp_path / "fe.png"
    argv = ["experimental", "fill-error", "--length", "1024", "--docs", "1", "--maps", str(maps_dir), "--out", str(out)]
    assert main([*argv, "--plot", str(png)]) == 0
    err = json.loads(out.read_text())["rel_err"]
    assert set(err) == {"identity", "ridge", "kva"} and len(err["ridge"]["20"]["k"]) == 5
    assert png.stat().st_size > 10_000
