"""One way to name a prefill: the resolver, its defaults and refusals, `auto` dtype and device,
`tuned` through the Python API and `patch`, the first-use fit, and a library that behaves."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import ridgefill
from conftest import make_tiny
from ridgefill.errors import MapError, RidgefillError
from ridgefill.methods import FillSettings, GateSettings, resolve_prefill, tuned
from ridgefill.models.device import pick_device, pick_dtype

AMX = "processor\t: 0\nmodel name\t: Xeon\nflags\t\t: fpu sse2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
AVX512BF16 = "processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\n"
EPYC = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n"


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 250, (1, n), generator=torch.Generator().manual_seed(seed))


def test_auto_dtype_follows_the_cpus_bf16_flags():
    cpu = torch.device("cpu")
    assert pick_dtype("auto", cpu, AMX) == torch.bfloat16
    # AVX512-BF16 without AMX: bf16 only where the matmul probe measures it faster.
    assert pick_dtype("auto", cpu, AVX512BF16, gain=lambda: 0.6) == torch.float32
    assert pick_dtype("auto", cpu, AVX512BF16, gain=lambda: 2.1) == torch.bfloat16
    assert pick_dtype("auto", cpu, AMX, gain=lambda: pytest.fail("AMX needs no probe")) == torch.bfloat16
    assert pick_dtype("auto", cpu, EPYC, gain=lambda: pytest.fail("no bf16 flag needs no probe")) == torch.float32
    assert pick_dtype("auto", cpu, EPYC) == torch.float32
    assert pick_dtype("auto", cpu, "model name : x\n") == torch.float32  # no flags line: cannot tell
    assert pick_dtype("float32", cpu, AMX) == torch.float32 and pick_dtype("bfloat16", cpu, EPYC) == torch.bfloat16
    with pytest.raises(RidgefillError, match="unknown dtype 'fp8'"):
        pick_dtype("fp8", cpu)


def test_auto_device_and_refusals():
    assert pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert pick_device("cpu") == torch.device("cpu")
    with pytest.raises(RidgefillError, match="unknown device"):
        pick_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(RidgefillError, match="no CUDA device"):
            pick_device("cuda")


def test_settings_are_checked_by_name_and_type(tmp_path):
    lm = make_tiny("llama")
    with pytest.raises(MapError, match="no ridge maps for split 1"):  # gated-ridge reads ridge maps
        resolve_prefill(lm, "gated-ridge:drop=0.25", maps=tmp_path, fit_missing=False)
    assert resolve_prefill(lm, "identity", split=2).settings.split == 2
    assert resolve_prefill(lm, "identity").settings.split == lm.num_layers // 2  # one default, resolved
    assert resolve_prefill(lm, "identity:tail=16", tail=8).settings.tail == 16  # the spec's own setting wins
    assert resolve_prefill(lm, "identity", settings={"sink": 1}, sink=2).settings.sink == 2
    cases = {
        ("identity", "splt", 1): "unknown setting 'splt' for method 'identity'; valid settings: split, sink, tail",
        ("identity", "split", "1"): "setting 'split' of method 'identity' must be int",
        ("identity", "split", True): "must be int",
        ("identity", "drop", "x"): "must be float",
        ("identity", "split", 9): "split 9 is outside 0..3",
        ("tokengate", "split", 1): "unknown setting 'split' for method 'tokengate'; valid settings: gate_layer",
        ("exact", "tail", 8): "method 'exact' takes no settings",
    }
    for (method, key, value), message in cases.items():
        with pytest.raises(RidgefillError, match=message.replace("(", r"\(")):
            resolve_prefill(lm, method, **{key: value})
    with pytest.raises(RidgefillError, match="unknown prefill method 'magic'; choose one of exact, identity"):
        resolve_prefill(lm, "magic")
    with pytest.raises(RidgefillError, match="use key=value"):
        resolve_prefill(lm, "identity:tail")


def test_generate_takes_settings_as_keywords_and_refuses_unknown_ones():
    lm = make_tiny("llama")

    class Bytes:
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode(errors="replace")

    from dataclasses import replace

    lm = replace(lm, tokenizer=Bytes())
    ids = _ids(64)
    res = ridgefill.generate(lm, ids, method="identity", split=0, sink=2, tail=8, max_new_tokens=2)
    assert not res.prefill.ran_exact and res.prefill.plan.split == 0 and res.prefill.settings["split"] == 0
    with pytest.raises(RidgefillError, match="unknown setting 'splt'"):
        ridgefill.generate(lm, ids, method="identity", splt=2)
    with pytest.raises(RidgefillError, match="must be int"):
        ridgefill.generate(lm, ids, method="identity", split=2.5)
    pre = ridgefill.resolve_prefill(lm, "identity", split=1, sink=2, tail=8)
    again = ridgefill.generate(lm, ids, prefill=pre, max_new_tokens=2)
    assert again.prefill.plan.split == 1
    with pytest.raises(RidgefillError, match="either prefill= or a method"):
        ridgefill.generate(lm, ids, "identity", prefill=pre)
    short = ridgefill.generate(lm, _ids(8), method="identity", split=1, sink=2, tail=8, max_new_tokens=1)
    assert short.prefill.ran_exact and "short prompt" in short.prefill.reason


def test_default_method_is_tuned_only_where_a_tuned_configuration_exists(monkeypatch, caplog, tmp_path):
    lm = make_tiny("llama")
    tuned._say_untuned.cache_clear()  # said once per model and process: earlier tests may have said it
    with caplog.at_level("WARNING"):
        assert resolve_prefill(lm, maps=tmp_path).method == "exact"
        assert resolve_prefill(lm, maps=tmp_path).method == "exact"
    assert caplog.text.count("no tuned configuration for tiny-llama") == 1 and "ridgefill tune" in caplog.text
    monkeypatch.setattr(tuned, "shipped_defaults", lambda: {"tiny-llama": {"method": "identity", "settings": {}}})
    pre = resolve_prefill(lm, maps=tmp_path)
    assert pre.label == "tuned" and pre.method == "identity" and pre.settings.split == 1


def test_tuned_bundle_through_the_python_api_and_patch(tmp_path):
    """A tuned bundle (maps + configuration) resolves the same way in generate and in patch, and the
    patched model's own generate gives our tokens."""
    from ridgefill.fit.maps import FillMaps
    from ridgefill.fit.ridge import FitConfig, fit_maps
    from ridgefill.generation import stream_tokens
    from ridgefill.tune.bundle import write_bundle

    lm = make_tiny("llama")
    segs = [torch.randint(3, 250, (96,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(8)]
    maps = {m.method: m for m in fit_maps(lm, segs[:6], segs[6:], FitConfig(splits=(1,), segment_tokens=96))[0]}
    tuned = {
        "method": "ridge",
        "settings": {"split": 1, "sink": 2, "tail": 8, "query_rows": 8, "drop": 0.5, "block": 8},
    }
    bundle = write_bundle(maps["ridge"], tuned, tmp_path / "tiny.tuned.safetensors")
    pre = resolve_prefill(lm, "tuned", maps=bundle)
    assert pre.method == "ridge" and pre.settings == FillSettings(
        split=1, sink=2, tail=8, query_rows=8, drop=0.5, block=8
    )
    assert isinstance(pre.maps, FillMaps)
    ids = _ids(96)
    ours = list(stream_tokens(lm, ids, pre.run(ridgefill.Engine(lm), ids), 6))
    ridgefill.patch(lm, bundle, method="tuned")
    try:
        out = lm.model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)[0, 96:].tolist()
        assert out == ours and ridgefill.patch_state(lm).prefill.label == "tuned"
    finally:
        ridgefill.unpatch(lm)
    with pytest.raises(MapError, match="without a tuned configuration"):
        resolve_prefill(lm, "tuned", maps=maps["ridge"])
    with pytest.raises(MapError, match="maps given are for split 1, not the split 2"):
        resolve_prefill(lm, "ridge", maps=maps["ridge"], split=2)


def test_a_corrupt_map_file_in_the_folder_is_an_error_not_a_fallback(tmp_path, caplog):
    from ridgefill.fit.maps import maps_filename
    from ridgefill.serve import ServeConfig

    lm = make_tiny("llama")
    (tmp_path / maps_filename(lm.name, "ridge", 1)).write_bytes(b"not a safetensors file")
    with pytest.raises(MapError, match="ridge.s1.safetensors"):
        resolve_prefill(lm, "ridge", split=1, maps=tmp_path)
    with pytest.raises(MapError, match="ridge.s1.safetensors"):
        ServeConfig.for_model(lm, "ridge", tmp_path, settings={"split": 1})  # the default must load
    with caplog.at_level("WARNING"):  # an optional method left out says why
        cfg = ServeConfig.for_model(lm, None, tmp_path, settings={"split": 1})
    assert "ridge" not in cfg.methods and "serving without ridge" in caplog.text and "ridge.s1" in caplog.text


@pytest.mark.slow
def test_missing_maps_are_fitted_on_first_use_and_then_reused(smollm2, tmp_path, monkeypatch):
    from ridgefill.corpus import DEFAULT_CORPUS_DIR
    from ridgefill.fit import ridge

    if not DEFAULT_CORPUS_DIR.is_dir():
        pytest.skip("needs Debian's python3.11-doc (`make` installs it)")
    real = ridge.fit_from_corpus
    calls = []

    def small(lm, cfg, corpus=None, calib_tokens=16384, heldout_tokens=4096, out_dir=None):
        calls.append(cfg.splits)  # a smaller fit than the first-use default, to keep the suite short
        return real(lm, cfg, corpus, 4096, 2048, out_dir)

    monkeypatch.setattr(ridge, "fit_from_corpus", small)
    pre = resolve_prefill(smollm2, "ridge", split=20, maps=tmp_path)
    assert calls == [(20,)] and pre.maps.split == 20 and (tmp_path / "smollm2-135m.ridge.s20.safetensors").is_file()
    assert resolve_prefill(smollm2, "ridge", split=20, maps=tmp_path).maps.header == pre.maps.header
    assert calls == [(20,)]  # cached: not fitted again
    with pytest.raises(MapError, match="run `ridgefill fit --model smollm2-135m --splits 21`"):
        resolve_prefill(smollm2, "ridge", split=21, maps=tmp_path, fit_missing=False)


@pytest.mark.slow
def test_cli_refuses_unknown_settings_in_one_line(capsys):
    from ridgefill.cli import main

    assert main(["generate", "--dtype", "float32", "--prompt", "Hi", "--method", "identity:splt=3"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("ridgefill: error:")]
    assert len(errors) == 1 and "unknown setting 'splt'" in errors[0] and "valid settings: split" in errors[0]
    assert main(["generate", "--dtype", "float32", "--prompt", "Hi", "--method", "tokengate:keep=all"]) == 2
    assert "setting 'keep' of method 'tokengate' must be float" in capsys.readouterr().err


def test_import_sets_no_environment_variable_and_load_model_never_runs_pip(monkeypatch):
    code = (
        "import os, json, torch._dynamo, transformers\n"
        "before = dict(os.environ)\n"
        "import ridgefill, ridgefill.cli, ridgefill.methods, ridgefill.patch\n"
        "print(json.dumps(sorted(k for k in os.environ if os.environ.get(k) != before.get(k))))\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []

    from ridgefill.models import loading

    def no_pip(*args, **kwargs):
        raise AssertionError("load_model ran pip")

    monkeypatch.setattr(subprocess, "run", no_pip)
    monkeypatch.setattr(subprocess, "check_call", no_pip)
    monkeypatch.setattr(loading, "is_installed", lambda em: False)  # the name loading reads
    with pytest.raises(RidgefillError, match="not installed; run `ridgefill models pull qwen2.5-0.5b`"):
        loading.load_model("qwen2.5-0.5b")


def test_gate_settings_resolve_their_layer():
    lm = make_tiny("llama")
    pre = resolve_prefill(lm, "tokengate", settings=GateSettings(keep=0.5))
    assert pre.settings.gate_layer == 1 and pre.split == 1 and pre.describe().startswith("tokengate gate layer 1")


def test_tuned_by_length_picks_each_prompts_bucket(monkeypatch, tmp_path):
    from ridgefill.methods.tuned import buckets, length_bounds

    assert length_bounds([4096, 8192, 16384]) == [5793, 11585, None] and length_bounds([4096]) == [None]
    lm = make_tiny("llama")
    entry = {
        "by_length": [
            {"up_to": 64, "method": "exact", "settings": {}},
            {"up_to": 128, "method": "identity", "settings": {"split": 0, "sink": 2, "tail": 8}},
            {"up_to": None, "method": "tokengate", "settings": {"gate_layer": 1, "keep": 0.5, "min_length": 0}},
        ]
    }
    monkeypatch.setattr(tuned, "shipped_defaults", lambda: {"tiny-llama": entry})
    pre = resolve_prefill(lm, "tuned", maps=tmp_path)
    assert [p.method for p in pre.variants] == ["exact", "identity", "tokengate"]
    assert pre.for_length(64).method == "exact" and pre.for_length(65).method == "identity"
    assert pre.for_length(100_000).method == "tokengate" and "up to 64: exact" in pre.describe()
    engine = ridgefill.Engine(lm)
    assert pre.run(engine, _ids(48)).ran_exact
    mid = pre.run(engine, _ids(96))
    assert mid.method == "identity" and mid.plan.split == 0
    assert pre.run(engine, _ids(200)).method == "tokengate"
    assert resolve_prefill(lm, "tuned", maps=tmp_path, tail=16).for_length(96).settings.tail == 16  # asked wins
    for bad in (
        {"by_length": []},
        {"by_length": [{"up_to": 64, "method": "exact", "settings": {}}]},  # the last must be open
        {
            "by_length": [
                {"up_to": 128, "method": "exact", "settings": {}},
                {"up_to": 64, "method": "exact", "settings": {}},
                {"up_to": None, "method": "exact", "settings": {}},
            ]
        },
        {"method": "ridge"},
        [1, 2],
    ):
        with pytest.raises(MapError, match="here"):
            buckets(bad, "here")


def test_tuned_refuses_settings_no_bucket_has(monkeypatch, tmp_path):
    lm = make_tiny("llama")
    monkeypatch.setattr(tuned, "shipped_defaults", lambda: {"tiny-llama": {"method": "identity", "settings": {}}})
    with pytest.raises(RidgefillError, match="unknown setting 'splt' for method 'tuned'"):
        resolve_prefill(lm, "tuned", maps=tmp_path, splt=1)
    assert resolve_prefill(lm, "tuned", maps=tmp_path, split=0).settings.split == 0


def test_a_shipped_calibration_size_sets_the_fit_default_and_flags_smaller_cached_maps(monkeypatch, tmp_path, caplog):
    from ridgefill.fit.maps import maps_filename, save_maps
    from ridgefill.fit.ridge import CALIB_TOKENS, FitConfig, default_calib_tokens, fit_maps

    lm = make_tiny("llama")
    segs = [torch.randint(3, 250, (96,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(8)]
    (ridge,) = fit_maps(lm, segs[:6], segs[6:], FitConfig(splits=(1,), methods=("ridge",), segment_tokens=96))[0]
    save_maps(ridge, tmp_path / maps_filename(lm.name, "ridge", 1))
    entry = {"method": "ridge", "settings": {"split": 1, "sink": 2, "tail": 8}}
    for named, default in ((None, CALIB_TOKENS), (True, CALIB_TOKENS), (-5, CALIB_TOKENS), (4096, 4096)):
        monkeypatch.setattr(tuned, "shipped_defaults", lambda n=named: {"tiny-llama": {**entry, "calib_tokens": n}})
        assert default_calib_tokens("tiny-llama") == default and default_calib_tokens("other") == CALIB_TOKENS
    with caplog.at_level("WARNING"):  # 6 segments of 96 tokens: fewer than the 4096 named
        resolve_prefill(lm, "tuned", maps=tmp_path)
        resolve_prefill(lm, "ridge", split=1, maps=tmp_path)  # a method named with its settings: no warning
    said = [r.getMessage() for r in caplog.records if "calibration tokens" in r.getMessage()]
    assert len(said) == 1 and "fitted on 576 calibration tokens" in said[0] and "fitted on 4096" in said[0]
    assert "`ridgefill fit --model tiny-llama --dtype float32 --splits 1 --methods ridge`" in said[0]
    caplog.clear()
    monkeypatch.setattr(tuned, "shipped_defaults", lambda: {"tiny-llama": {**entry, "calib_tokens": 576}})
    with caplog.at_level("WARNING"):
        resolve_prefill(lm, "tuned", maps=tmp_path)
    assert "calibration tokens" not in caplog.text


def test_given_maps_decide_the_default_and_a_settings_object_counts_what_differs(tmp_path):
    from ridgefill.fit.maps import save_maps
    from ridgefill.fit.ridge import FitConfig, fit_maps
    from ridgefill.tune.bundle import write_bundle

    lm = make_tiny("llama")
    segs = [torch.randint(3, 250, (96,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(8)]
    maps = {m.method: m for m in fit_maps(lm, segs[:6], segs[6:], FitConfig(splits=(1,), segment_tokens=96))[0]}
    plain = save_maps(maps["kva"], tmp_path / "plain.kva.safetensors")
    assert resolve_prefill(lm, maps=plain).method == "kva"  # a plain map file runs its own method
    assert resolve_prefill(lm, maps=maps["ridge"]).method == "ridge"
    gated = resolve_prefill(lm, "gated-ridge", settings=FillSettings(tail=16), maps=maps["ridge"])
    assert (gated.settings.tail, gated.settings.query_rows, gated.settings.drop) == (16, 256, 0.5)
    with pytest.raises(MapError, match="map file not found: .*typo.safetensors"):
        resolve_prefill(lm, "ridge", maps=tmp_path / "typo.safetensors")
    tuned_entry = {
        "by_length": [
            {"up_to": 64, "method": "exact", "settings": {}},
            {"up_to": None, "method": "ridge", "settings": {"split": 1, "sink": 2, "tail": 8}},
        ]
    }
    bundle = write_bundle(maps["ridge"], tuned_entry, tmp_path / "b.safetensors")
    pre = resolve_prefill(lm, maps=bundle)
    assert pre.label == "tuned" and pre.for_length(100).maps.split == 1 and pre.for_length(10).method == "exact"
    with pytest.raises(MapError, match="do not include the maps' split 1"):
        write_bundle(maps["ridge"], {"method": "ridge", "settings": {"split": 2}}, tmp_path / "c.safetensors")
    # A gate scoring at a predicted deeper layer reads the bundle's own maps, fitted at its gate layer.
    gate = {"method": "tokengate", "settings": {"gate_layer": 1, "score_layer": 2, "keep": 0.5, "min_length": 0}}
    pre = resolve_prefill(lm, maps=write_bundle(maps["ridge"], gate, tmp_path / "g.safetensors"))
    assert pre.method == "tokengate" and pre.maps.split == 1 and pre.maps.header["tuned"] == gate


def test_the_maps_a_method_reads_follow_from_its_table_entry_and_settings():
    from ridgefill.methods.registry import maps_read

    assert maps_read("exact", {}) is None and maps_read("identity", {"split": 3}) is None
    assert maps_read("ridge", {"split": 3}) == ("ridge", 3) and maps_read("kva", {}, 30) == ("kva", 15)
    assert maps_read("gated-ridge", {}, 30) == ("ridge", 15)
    assert maps_read("tokengate", {"gate_layer": 4}) is None
    assert maps_read("tokengate", {"score_layer": 20}, 30) == ("ridge", 7)


def test_patch_names_a_local_model_by_its_folder(tmp_path):
    lm = make_tiny("llama")
    lm.model.config.name_or_path = str(tmp_path / "checkpoints" / "my-llama")
    ridgefill.patch(lm.model, method="identity", split=1, sink=2, tail=8)
    try:
        assert ridgefill.patch_state(lm.model).engine.lm.name == "my-llama"
    finally:
        ridgefill.unpatch(lm.model)
