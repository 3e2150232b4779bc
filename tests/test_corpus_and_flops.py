"""Corpus splitting and reading; the FLOP model's consistency."""

from __future__ import annotations

import json

import pytest

from ridgefill.bench.flops import exact_macs, fill_macs
from ridgefill.corpus import Document, clean_rst, load_corpus
from ridgefill.errors import RidgefillError


def test_document_split_is_fixed_by_id_and_disjoint(tmp_path):
    for i in range(60):
        (tmp_path / f"doc{i:02d}.txt").write_text(f"Document number {i}. " * 200)
    corpus = load_corpus(tmp_path)
    parts = {s: {d.id for d in corpus.part(s)} for s in ("calib", "heldout", "eval")}
    assert all(parts.values()), parts
    assert not (parts["calib"] & parts["eval"]) and not (parts["calib"] & parts["heldout"])
    assert sum(map(len, parts.values())) == 60
    assert Document("doc07.txt", "x").split == Document("doc07.txt", "other text").split


def test_clean_rst_keeps_prose():
    raw = "Title\n=====\n\n.. index:: thing\n\nUse the :keyword:`for` statement and ``len()``.\n"
    assert clean_rst(raw) == "Title\n\nUse the for statement and len()."


def test_jsonl_and_errors(tmp_path):
    good = tmp_path / "c.jsonl"
    good.write_text("\n".join(json.dumps({"text": f"Line {i}. " * 300}) for i in range(3)))
    assert len(load_corpus(good).documents) == 3
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "no text field"}\n')
    with pytest.raises(RidgefillError, match="'text' field"):
        load_corpus(bad)
    with pytest.raises(RidgefillError, match="corpus not found"):
        load_corpus(tmp_path / "missing")


def test_flop_model(tiny):
    parts = tiny.parts
    n = 200
    assert fill_macs(parts, n, "ridge", parts.num_layers, list(range(n))) == exact_macs(parts, n)
    full = list(range(4)) + list(range(n - 16, n))
    for method in ("identity", "ridge", "kva"):
        assert fill_macs(parts, n, method, 1, full) < exact_macs(parts, n)
    assert fill_macs(parts, n, "kva", 1, full) < fill_macs(parts, n, "ridge", 1, full)


def test_bench_warms_up_on_a_shorter_prompt_and_times_the_full_one(monkeypatch):
    import torch

    from conftest import make_tiny
    from ridgefill.bench import ttft
    from ridgefill.methods import FillSettings, Prefill

    seen = []
    real = Prefill.run

    def spy(self, engine, ids, **kw):
        seen.append((self.method, ids.shape[1]))
        return real(self, engine, ids, **kw)

    monkeypatch.setattr(Prefill, "run", spy)
    lm = make_tiny("llama")
    fill = FillSettings(split=1, sink=2, tail=4)
    specs = [Prefill("exact", "exact"), Prefill("identity", "identity", fill)]
    prompts = {48: torch.randint(0, 100, (48,)).tolist()}
    rows = ttft.run_bench(lm, ttft.BenchConfig((48,), repeats=2, warmup=1, warmup_length=16), prompts, specs)
    assert seen == [("exact", 16), ("identity", 16), ("identity", 48), ("exact", 48), ("exact", 48), ("identity", 48)]
    assert [r["repeats"] for r in rows] == [2, 2] and rows[0]["speedup"] == 1.0


def test_bench_checks_every_length_before_timing_any(monkeypatch):
    import torch

    from conftest import make_tiny
    from ridgefill.bench import ttft
    from ridgefill.errors import PromptError
    from ridgefill.methods import Prefill

    ran = []
    monkeypatch.setattr(Prefill, "run", lambda *a, **k: ran.append(a))
    lm = make_tiny("llama")
    too_long = lm.context_length + 1
    prompts = {48: torch.randint(0, 100, (48,)).tolist(), too_long: []}
    with pytest.raises(PromptError, match=f"length {too_long} exceeds"):
        ttft.run_bench(lm, ttft.BenchConfig((48, too_long)), prompts, [Prefill("exact", "exact")])
    assert ran == []


def test_results_record_whether_the_cpu_computes_bf16_natively():
    from ridgefill.results import cpu_bf16, environment

    amx = "processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
    epyc = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n"
    assert cpu_bf16(amx) is True and cpu_bf16(epyc) is False and cpu_bf16("model name : x\n") is None
    assert environment()["cpu_bf16"] in (True, False, None)
