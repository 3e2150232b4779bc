"""Every file ridgefill reads or writes survives hostile input and interruption.

Whole files are replaced atomically (a write that fails half way leaves the previous file), the
append-only eval cache skips a cut line and reruns its sample, a damaged dequantised-model cache
is rebuilt, and a malformed map file is one `MapError` line naming it, never a traceback.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import _COMMON
from ridgefill.errors import MapError
from ridgefill.eval.dummy import DummyAdapter, DummyTask
from ridgefill.eval.runner import run_eval
from ridgefill.files import append_jsonl, atomic_path, read_jsonl, safetensors_problem, write_text
from ridgefill.fit.maps import fingerprint, load_maps
from ridgefill.models import hf
from ridgefill.models.loading import LoadedModel


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    """3 layers, hidden 64, one KV head of 16: ridge maps are (65, 64), kva maps (65, 32)."""
    cfg = AutoConfig.for_model("llama", **{**_COMMON, "num_key_value_heads": 1})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()
    return LoadedModel(model=model, tokenizer=None, name="tiny-mqa", parts=hf.model_parts(model))


def _map_file(path, header: dict | list | str, tensors: dict[str, torch.Tensor]):
    """A safetensors file with `header` as its ridgefill metadata (JSON-encoded unless a str)."""
    raw = header if isinstance(header, str) else json.dumps(header)
    save_file({k: v.clone() for k, v in tensors.items()}, str(path), metadata={"ridgefill": raw})
    return path


def _good(lm, method: str = "ridge") -> tuple[dict, dict[str, torch.Tensor]]:
    out = 64 if method == "ridge" else 32
    header = {"model": fingerprint(lm), "method": method, "split": 1, "format_version": 1}
    return header, {"layer.2": torch.randn(65, out)}


def test_well_formed_map_files_load(lm, tmp_path):
    for method in ("ridge", "kva"):
        maps = load_maps(_map_file(tmp_path / f"{method}.safetensors", *_good(lm, method)), lm)
        assert maps.method == method and maps.layers == [2]


def _without(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


def _z(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


# (header from the good one, tensors from the good ones); each is refused with the model and without.
MALFORMED = {
    "header is a list": (lambda h: [1, 2], None),
    "header is not JSON": (lambda h: "{not json", None),
    "header nested past the recursion limit": (lambda h: "[" * 100_000 + "]" * 100_000, None),
    "method missing": (lambda h: _without(h, "method"), None),
    "method unknown": (lambda h: {**h, "method": "lasso"}, None),
    "method ill-typed": (lambda h: {**h, "method": ["ridge"]}, None),
    "split missing": (lambda h: _without(h, "split"), None),
    "split a string": (lambda h: {**h, "split": "1"}, None),
    "split a bool": (lambda h: {**h, "split": True}, None),
    "split a float": (lambda h: {**h, "split": 1.5}, None),
    "split negative": (lambda h: {**h, "split": -1}, None),
    "split out of range": (lambda h: {**h, "split": 7}, lambda t: {"layer.8": t["layer.2"]}),
    "model not an object": (lambda h: {**h, "model": [1]}, None),
    "fit not an object": (lambda h: {**h, "fit": "x"}, None),
    "newer format": (lambda h: {**h, "format_version": 2}, None),
    "tensor layer.x": (None, lambda t: {"layer.x": t["layer.2"]}),
    "tensor layer.2.weight": (None, lambda t: {"layer.2.weight": t["layer.2"]}),
    "tensor of another name": (None, lambda t: {**t, "bias": _z(64)}),
    "two tensors for one layer": (None, lambda t: {**t, "layer.02": t["layer.2"]}),
    "no tensors": (None, lambda t: {}),
    "float16": (None, lambda t: {"layer.2": _z(65, 64, dtype=torch.float16)}),
    "int64": (None, lambda t: {"layer.2": _z(65, 64, dtype=torch.int64)}),
    "1-D": (None, lambda t: {"layer.2": _z(65)}),
    "3-D": (None, lambda t: {"layer.2": _z(1, 65, 64)}),
    "2x2": (None, lambda t: {"layer.2": _z(2, 2)}),
    "NaN": (None, lambda t: {"layer.2": torch.full((65, 64), float("nan"))}),
    "infinite": (None, lambda t: {"layer.2": torch.full((65, 64), float("inf"))}),
    "hidden size of another model": (None, lambda t: {"layer.2": _z(33, 32)}),
    "kva width for ridge": (None, lambda t: {"layer.2": _z(65, 32)}),
    "ridge width for kva": (lambda h: {**h, "method": "kva"}, lambda t: {"layer.2": _z(65, 64)}),
    "shapes differ": (lambda h: {**h, "split": 0}, lambda t: {"layer.1": _z(65, 64), "layer.2": _z(33, 32)}),
    "layer missing": (lambda h: {**h, "split": 0}, None),
    "layer extra": (None, lambda t: {**t, "layer.3": t["layer.2"]}),
    "layers with a gap": (lambda h: {**h, "split": 0}, lambda t: {**t, "layer.4": t["layer.2"]}),
}


def _malformed(lm, tmp_path, case: str):
    edit_header, edit_tensors = MALFORMED[case]
    header, tensors = _good(lm)
    header = edit_header(header) if edit_header else header
    tensors = edit_tensors(tensors) if edit_tensors else tensors
    return _map_file(tmp_path / "bad.safetensors", header, tensors)


def _assert_refused(path, lm=None) -> str:
    with pytest.raises(MapError) as e:
        load_maps(path, lm)
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_map_file_is_one_map_error_naming_it(lm, tmp_path, case):
    path = _malformed(lm, tmp_path, case)
    _assert_refused(path, lm)
    _assert_refused(path)


def test_maps_made_in_memory_are_checked_against_the_model(lm):
    from ridgefill.fit.maps import FillMaps

    header = {"model": fingerprint(lm)}
    FillMaps("kva", 1, {2: torch.zeros(65, 32)}, header).check_model(lm)
    with pytest.raises(MapError, match=r"layer 2 is \(33, 32\), but this model needs \(65, 64\)"):
        FillMaps("ridge", 1, {2: torch.zeros(33, 32)}, header).check_model(lm)
    with pytest.raises(MapError, match=r"needs \(65, 32\)"):
        FillMaps("kva", 1, {2: torch.zeros(65, 64)}, header).check_model(lm)
    with pytest.raises(MapError, match=r"cover layers \[1\], but split 0 needs \[1, 2\]"):
        FillMaps("ridge", 0, {1: torch.zeros(65, 64)}, header).check_model(lm)


@pytest.mark.parametrize("cut", [0, 7, 8, 100, -1])
def test_corrupt_map_bytes_are_one_map_error(lm, tmp_path, cut):
    good = _map_file(tmp_path / "good.safetensors", *_good(lm)).read_bytes()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(good[:cut])
    assert "not a ridgefill map file" in _assert_refused(bad, lm)
    bad.write_bytes(b"\xff" * 8 + good[8:])  # a header length of 2**64 - 1
    _assert_refused(bad, lm)
    save_file({"layer.2": torch.zeros(65, 64)}, str(bad))  # safetensors, but not ours
    assert "no ridgefill header" in _assert_refused(bad, lm)


@pytest.mark.parametrize(
    "case", ["header is a list", "2x2", "tensor layer.x", "split out of range", "kva width for ridge"]
)
def test_cli_refuses_a_malformed_map_file_in_one_line(lm, tmp_path, monkeypatch, capsys, case):
    from ridgefill.cli import main

    path = _malformed(lm, tmp_path, case)
    monkeypatch.setattr("ridgefill.models.load_model", lambda *a, **k: lm)
    monkeypatch.setenv("RIDGEFILL_CACHE", str(tmp_path / "cache"))
    code = main(["generate", "--prompt", "hi", "--method", "tuned", "--maps", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"ridgefill: error: {path}: "), err


# --- atomic whole-file writes -------------------------------------------------------------------

_FILL_THE_DISK = textwrap.dedent(
    """
    import json, resource, signal, sys
    from pathlib import Path
    import torch
    from ridgefill.fit.maps import FillMaps, save_maps
    from ridgefill.results import write_json

    out = Path(sys.argv[1])
    write_json(out / "tune.json", {"checkpoint": 1}, ["tune"])
    save_maps(FillMaps("ridge", 1, {2: torch.zeros(65, 64)}, {}), out / "m.safetensors")
    # A full disk, or a process stopped mid-write: writes past 64 KB fail with EFBIG.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    failed = []
    big = {"checkpoint": 2, "rows": list(range(100_000))}
    writes = {
        "json": lambda: write_json(out / "tune.json", big, ["tune"]),
        "maps": lambda: save_maps(FillMaps("ridge", 1, {2: torch.ones(513, 512)}, {}), out / "m.safetensors"),
    }
    for name, write in writes.items():
        try:
            write()
        except Exception:
            failed.append(name)
    print(json.dumps(failed))
    """
)


def test_a_write_cut_short_leaves_the_previous_file_whole(tmp_path):
    out = subprocess.run([sys.executable, "-c", _FILL_THE_DISK, str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == ["json", "maps"]  # both writes did fail
    assert json.loads((tmp_path / "tune.json").read_text())["checkpoint"] == 1
    assert torch.equal(load_maps(tmp_path / "m.safetensors").weights[2], torch.zeros(65, 64))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors", "tune.json"]  # no temporaries


def test_atomic_path_keeps_the_old_file_when_the_block_raises(tmp_path):
    path = write_text(tmp_path / "sub" / "f.txt", "old")
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_text("half of the ne")
        raise RuntimeError("killed")
    assert path.read_text() == "old" and [p.name for p in path.parent.iterdir()] == ["f.txt"]
    write_text(path, "new")
    assert path.read_text() == "new" and [p.name for p in path.parent.iterdir()] == ["f.txt"]


def test_png_is_written_atomically(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ridgefill.results import save_png

    path = save_png(plt.subplots()[0], tmp_path / "plot.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and [p.name for p in tmp_path.iterdir()] == ["plot.png"]


# --- the append-only eval cache -----------------------------------------------------------------


def test_read_jsonl_skips_cut_and_corrupt_lines_with_one_warning(tmp_path, caplog):
    path = tmp_path / "c.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": 2, "b"\n[1, 2]\n\xff\xfe\n\n{"a": 3}\n{"a": 4')
    with caplog.at_level(logging.WARNING, logger="ridgefill.files"):
        assert read_jsonl(path) == [{"a": 1}, {"a": 3}]
    (rec,) = caplog.records
    assert str(path) in rec.getMessage() and "skipped 4 " in rec.getMessage()


def test_read_jsonl_checks_fields(tmp_path, caplog):
    path = tmp_path / "c.jsonl"
    rows = [{"k": "a", "x": 1.5}, {"k": "b"}, {"k": 1, "x": 1.0}, {"x": 2.0}, {"k": "c", "x": float("nan")}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    fields = {"k": str, "x": (float, type(None))}
    with caplog.at_level(logging.WARNING, logger="ridgefill.files"):
        assert read_jsonl(path, fields) == rows[:2]
    assert "skipped 3 " in caplog.text


def test_append_after_a_cut_line_starts_a_fresh_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"a": 1}\n{"a": 2, "b')
    with append_jsonl(path) as add:
        add({"a": 3})
        add({"a": 4})
    assert path.read_text() == '{"a": 1}\n{"a": 2, "b\n{"a": 3}\n{"a": 4}\n'
    assert read_jsonl(path) == [{"a": 1}, {"a": 3}, {"a": 4}]
    with append_jsonl(tmp_path / "new" / "d.jsonl") as add:  # a new file needs no fresh line
        add({"a": 5})
    assert (tmp_path / "new" / "d.jsonl").read_text() == '{"a": 5}\n'


def test_eval_cache_with_a_cut_line_reruns_that_sample(tmp_path, caplog):
    cache = tmp_path / "c.jsonl"
    first = run_eval(DummyAdapter(), [DummyTask()], [256], 4, cache, tail=64)
    data = cache.read_bytes()
    cache.write_bytes(data[: data.rindex(b"\n", 0, -1) + 20])  # the last record cut after 19 bytes
    resumed = DummyAdapter()
    with caplog.at_level(logging.WARNING, logger="ridgefill.files"):
        again = run_eval(resumed, [DummyTask()], [256], 4, cache, tail=64)
    assert resumed.generated == [(3, "forgetful")]
    assert [{**r, "run": None} for r in again] == [{**r, "run": None} for r in first]
    assert str(cache) in caplog.text and "skipped 1 " in caplog.text
    lines = cache.read_text().splitlines()
    assert len(lines) == 9 and json.loads(lines[-1])["index"] == 3  # the cut line stays a line of its own
    third = DummyAdapter()
    assert run_eval(third, [DummyTask()], [256], 4, cache, tail=64) == again and third.generated == []


# --- the dequantised-model cache ----------------------------------------------------------------


def test_safetensors_problem_tells_whole_files_from_cut_ones(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(16, 16), "b": torch.ones(3)}, str(path))
    assert safetensors_problem(path) is None
    data = path.read_bytes()
    for cut in (0, 5, 8, 40, len(data) - 1):
        path.write_bytes(data[:cut])
        assert "truncated" in safetensors_problem(path)
    path.write_bytes(data + b"\0")
    assert "truncated or foreign" in safetensors_problem(path)
    n = int.from_bytes(data[:8], "little")
    path.write_bytes(data[:8] + b"[" + b" " * (n - 1) + data[8 + n :])
    assert "no readable safetensors header" in safetensors_problem(path)
    assert "cannot be read" in safetensors_problem(tmp_path / "missing.safetensors")


class _Tokenizer:
    def save_pretrained(self, folder: str) -> None:
        (__import__("pathlib").Path(folder) / "tokenizer.json").write_text("{}")


def test_damaged_dequantised_cache_is_rebuilt(tmp_path, monkeypatch, caplog):
    from ridgefill.models import loading

    monkeypatch.setenv("RIDGEFILL_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    built = []

    def convert(*args, **kwargs):
        built.append(args)
        return AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **_COMMON))

    monkeypatch.setattr(loading.AutoTokenizer, "from_pretrained", lambda *a, **k: _Tokenizer())
    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained", convert)
    target = loading._dequantised_dir(gguf)
    weights = target / "model.safetensors"
    assert len(built) == 1 and safetensors_problem(weights) is None
    assert loading._dequantised_dir(gguf) == target and len(built) == 1  # a whole cache is reused

    weights.write_bytes(weights.read_bytes()[:-1000])
    with caplog.at_level(logging.WARNING, logger="ridgefill.models.loading"):
        assert loading._dequantised_dir(gguf) == target
    assert len(built) == 2 and safetensors_problem(weights) is None
    assert "damaged" in caplog.text and "model.safetensors" in caplog.text and "truncated" in caplog.text

    (target / "ridgefill.json").unlink()  # a conversion killed before its marker
    assert loading._dequantised_dir(gguf) == target and len(built) == 3
    (target / "config.json").write_text('{"model_type": "lla')
    assert loading._dequantised_dir(gguf) == target and len(built) == 4
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # no .partial left


def test_assembled_gguf_is_whole_or_absent(tmp_path, monkeypatch):
    import hashlib

    from ridgefill.errors import RidgefillError
    from ridgefill.models import registry

    chunks = [tmp_path / f"part{i}" for i in range(2)]
    for i, p in enumerate(chunks):
        p.write_bytes(bytes([i]) * 1000)
    monkeypatch.setattr(registry, "part_paths", lambda model: chunks)
    good = registry.EmbeddedModel("m", "", (), (), hashlib.sha256(bytes(1000) + b"\1" * 1000).hexdigest())
    bad = registry.EmbeddedModel("m", "", (), (), "0" * 64)
    with pytest.raises(RidgefillError, match="sha256"):
        registry.assemble(bad, tmp_path / "cache")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []  # neither the file nor a temporary
    target = registry.assemble(good, tmp_path / "cache")
    assert target.read_bytes() == bytes(1000) + b"\1" * 1000 and list(target.parent.iterdir()) == [target]
