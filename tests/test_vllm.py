"""The vLLM plugin: equivalence with stock vLLM and with our own engine, its server, its refusals.

Runs where vllm 0.32.0 is installed (`make test` builds such an environment); fp32, eager, on
SmolLM2-135M with maps fitted by the `smollm2_maps` fixture. Each vLLM configuration runs in its
own process (tests/vllm_run.py).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ridgefill.errors import MapError, RidgefillError

vllm = pytest.importorskip("vllm")
from ridgefill.vllm.plugin import PINNED_VLLM  # noqa: E402

if vllm.__version__.split("+")[0] != PINNED_VLLM:
    pytest.skip(f"needs vllm {PINNED_VLLM}", allow_module_level=True)

pytestmark = pytest.mark.slow
RUNNER = Path(__file__).with_name("vllm_run.py")
TAIL, SINK, CHUNK = 200, 4, 256  # the first prompt's tail [500, 700) crosses the chunk boundary at 512
FILL_TOL = 1e-3  # |log-prob| between the plugin and our engine's fill prefill (fp32; measured ~3e-5)
FULL_TOL = 1e-4  # the plugin with every row full against stock vLLM (measured below 1e-5)


def run_vllm(spec: dict, preemptions: bool = False):
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run(
        [sys.executable, str(RUNNER), json.dumps(spec)], capture_output=True, text=True, timeout=900, env=env
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            out = json.loads(line[len("RESULT ") :])
            return (out["outputs"], out["preemptions"]) if preemptions else out["outputs"]
    raise AssertionError(f"vLLM run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    """Two prompts of different lengths (700 and 450 tokens) from the documentation corpus."""
    from ridgefill.corpus import DEFAULT_CORPUS_DIR

    text = (DEFAULT_CORPUS_DIR / "library" / "functions.rst.txt").read_text()
    ids = smollm2.tokenizer(text)["input_ids"]
    return [ids[:700], ids[2000:2450]]


@pytest.fixture(scope="module")
def ridge_maps(smollm2_maps) -> Path:
    return smollm2_maps / "smollm2-135m.ridge.s15.safetensors"


def spec(prompts, settings=None, maps=None, method=None, max_tokens=8) -> dict:
    return dict(
        model="smollm2-135m",
        maps=None if maps is None else str(maps),
        method=method,
        settings=settings,
        prompts=prompts,
        max_tokens=max_tokens,
        logprobs=5,
        chunk=CHUNK,
    )


@pytest.fixture(scope="module")
def stock(prompts) -> list[dict]:
    return run_vllm(spec(prompts))


def max_logprob_gap(a: dict, b: dict) -> float:
    return max(abs(v - b[t]) for t, v in a.items() if t in b)


def test_fill_off_and_every_row_full_equal_stock_vllm(prompts, ridge_maps, stock):
    off = run_vllm(spec(prompts, {}, method="off"))
    assert off == stock  # the stock forward itself
    # Every row full: the fill path runs (lower layers, then the deep layers as runs of full rows
    # with rebuilt attention metadata) but fills nothing.
    full = run_vllm(spec(prompts, {"tail": 4096, "sink": SINK}, ridge_maps, "ridge"))
    for got, want in zip(full, stock, strict=True):
        assert got["tokens"] == want["tokens"]
        for a, b in zip(got["logprobs"], want["logprobs"], strict=True):
            assert max_logprob_gap(a, b) < FULL_TOL


def test_fill_matches_our_engine_across_chunks_and_a_shared_batch(prompts, ridge_maps, smollm2, stock):
    """Two prompts served together under a 256-token step budget: chunked prefill, a batch mixing
    one request's prefill chunk with the other's decode steps, a tail crossing a chunk boundary."""
    from ridgefill.fit.maps import load_maps
    from ridgefill.generation import generate

    got = run_vllm(spec(prompts, {"tail": TAIL, "sink": SINK}, ridge_maps, "ridge"))
    maps = load_maps(ridge_maps, smollm2)
    for ids, out, exact in zip(prompts, got, stock, strict=True):
        ref = generate(smollm2, torch.tensor([ids]), "ridge", maps=maps, max_new_tokens=8, tail=TAIL, sink=SINK)
        assert ref.prefill.plan.filled > 0
        ref_lp = torch.log_softmax(ref.prefill.logits[-1].float(), -1)
        first = {t: float(ref_lp[int(t)]) for t in out["logprobs"][0]}
        assert max_logprob_gap(out["logprobs"][0], first) < FILL_TOL
        assert max_logprob_gap(exact["logprobs"][0], first) > 10 * FILL_TOL  # the fill did change the logits
        assert out["tokens"] == ref.token_ids[:8]


@pytest.mark.parametrize(
    "scoring",
    [{"query_sentence": 16}, {"query_layer": 17, "query_top": 2}, {"query_layer": 7, "query_pool": 5}],
    ids=["split-layer-sentences", "predicted-layer-top-queries", "lower-layer-pooled"],
)
def test_query_rows_match_our_engine_for_prompts_scheduled_whole(prompts, ridge_maps, smollm2, scoring):
    """Both prompts in one scheduler step: each one's query-aware spans are chosen from its own
    scores, as our engine chooses them: at the split layer with sentences, at a deeper layer on
    the maps' prediction from the queries that attend most, or pooled at a layer below the split
    on its exact input."""
    from ridgefill.fit.maps import load_maps
    from ridgefill.generation import generate

    q = {"tail": 64, "sink": SINK, "query_rows": 96, **scoring}
    got = run_vllm({**spec(prompts, q, ridge_maps, "ridge"), "chunk": 2048})
    maps = load_maps(ridge_maps, smollm2)
    for ids, out in zip(prompts, got, strict=True):
        ref = generate(smollm2, torch.tensor([ids]), "ridge", maps=maps, max_new_tokens=8, **q)
        assert len(ref.prefill.plan.full) > 64 + SINK + 64  # spans were chosen
        ref_lp = torch.log_softmax(ref.prefill.logits[-1].float(), -1)
        assert max_logprob_gap(out["logprobs"][0], {t: float(ref_lp[int(t)]) for t in out["logprobs"][0]}) < FILL_TOL
        assert out["tokens"] == ref.token_ids[:8]


def test_length_buckets_give_each_request_its_own_rows_in_one_batch(prompts, ridge_maps, smollm2):
    """One step holds a 450-token prompt (first bucket: query rows) and a 700-token one (second
    bucket: a longer tail, none): each matches our engine run with its own bucket's settings."""
    from ridgefill.fit.maps import load_maps
    from ridgefill.generation import generate

    buckets = [{"up_to": 500, "tail": 64, "query_rows": 96}, {"up_to": None, "tail": TAIL, "query_rows": 0}]
    got = run_vllm({**spec(prompts, {"sink": SINK, "by_length": buckets}, ridge_maps, "ridge"), "chunk": 2048})
    maps = load_maps(ridge_maps, smollm2)
    for ids, out in zip(prompts, got, strict=True):
        mine = next(b for b in buckets if b["up_to"] is None or len(ids) <= b["up_to"])
        settings = {"sink": SINK, "tail": mine["tail"], "query_rows": mine["query_rows"]}
        ref = generate(smollm2, torch.tensor([ids]), "ridge", maps=maps, max_new_tokens=8, **settings)
        ref_lp = torch.log_softmax(ref.prefill.logits[-1].float(), -1)
        assert max_logprob_gap(out["logprobs"][0], {t: float(ref_lp[int(t)]) for t in out["logprobs"][0]}) < FILL_TOL
        assert out["tokens"] == ref.token_ids[:8]


def test_fill_survives_preemption_and_recompute(smollm2, ridge_maps):
    """A KV cache of 11 blocks (128 tokens each) for three 630-token prompts that each need a
    sixth block while decoding: vLLM preempts requests, frees their blocks and later recomputes
    them (prompt and generated tokens) from scratch. The fill must give the same tokens."""
    from ridgefill.corpus import DEFAULT_CORPUS_DIR
    from ridgefill.fit.maps import load_maps
    from ridgefill.generation import generate

    text = (DEFAULT_CORPUS_DIR / "library" / "stdtypes.rst.txt").read_text()
    ids = smollm2.tokenizer(text)["input_ids"]
    prompts = [ids[i * 1000 : i * 1000 + 630] for i in range(3)]
    s = {**spec(prompts, {"tail": 64, "sink": SINK}, ridge_maps, "ridge", max_tokens=16), "chunk": 1024}
    got, preemptions = run_vllm({**s, "max_model_len": 1024, "kv_blocks": 11}, preemptions=True)
    assert preemptions > 0
    maps = load_maps(ridge_maps, smollm2)
    for p, out in zip(prompts, got, strict=True):
        ref = generate(smollm2, torch.tensor([p]), "ridge", maps=maps, max_new_tokens=16, tail=64, sink=SINK)
        assert out["tokens"] == ref.token_ids[:16]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllm_serve_answers_the_openai_client(ridge_maps, tmp_path):
    openai = pytest.importorskip("openai")
    port = _free_port()
    cmd = [sys.executable, "-m", "ridgefill", "vllm-serve", "smollm2-135m", "--maps", str(ridge_maps)]
    cmd += [
        "--dtype",
        "float32",
        "--tail",
        "64",
        "--port",
        str(port),
        "--",
        "--enforce-eager",
        "--max-model-len",
        "2048",
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120)
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                model = client.models.list().data[0].id
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "vllm-serve did not come up"
                time.sleep(2)
        long = "Python's built-in functions are always available. " * 40 + "Name one built-in function:"
        done = client.completions.create(model=model, prompt=long, max_tokens=8, temperature=0)
        assert done.choices[0].text and done.usage.prompt_tokens > 64
        parts = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": long}], max_tokens=8, temperature=0, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
        assert text
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


# Refusals: each one line, before vLLM starts.


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def test_wrong_vllm_version_is_refused_and_not_registered(monkeypatch, caplog):
    from ridgefill.vllm import plugin, prepare

    monkeypatch.setattr(plugin, "vllm_version", lambda: "0.31.1")
    with pytest.raises(RidgefillError) as e:
        prepare("smollm2-135m")
    assert "0.32.0 only, found 0.31.1" in one_line(e)
    plugin.register()  # registers nothing, says why
    assert "not registering" in caplog.text


def test_maps_of_another_model_corrupt_maps_and_bad_settings_are_refused(ridge_maps, tmp_path, smollm2_maps):
    from ridgefill.fit.maps import load_maps, save_maps
    from ridgefill.vllm import LLM, prepare

    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\x00" * 64)
    with pytest.raises(MapError) as e:
        prepare("smollm2-135m", corrupt)
    assert str(corrupt) in one_line(e)

    maps = load_maps(ridge_maps)
    other = tmp_path / "other.safetensors"
    maps.header["model"] = {**maps.header["model"], "weights_sha256": "0" * 24}
    save_maps(maps, other)
    with pytest.raises(MapError) as e:
        prepare("smollm2-135m", other, dtype="float32")
    assert "another model" in one_line(e)
    with pytest.raises(MapError) as e:  # the right model at another dtype
        prepare("smollm2-135m", ridge_maps, dtype="bfloat16")
    assert "fitted on this model at float32" in one_line(e)

    with pytest.raises(MapError) as e:
        prepare("smollm2-135m", ridge_maps, split=12)
    assert "the maps are for split 15, not ridgefill_split 12" in one_line(e)

    small = load_maps(smollm2_maps / "smollm2-135m.kva.s15.safetensors")
    wrong = type(small)("ridge", 15, {i: torch.zeros(65, 64) for i in range(16, 30)}, {})
    save_maps(wrong, tmp_path / "wrong.safetensors")
    with pytest.raises(MapError) as e:
        prepare("smollm2-135m", tmp_path / "wrong.safetensors")
    assert "not maps for this model" in one_line(e)

    for bad, words in [
        (dict(method="identity", split=31), "split 31 is outside"),
        (dict(method="ridge", split=29), "no ridge maps for split 29 of smollm2-135m at float32"),
        (dict(method="identity", tail=0), "tail >= 1"),
        (dict(method="sparse"), "not one of"),
        (
            dict(method="identity", split=10, query_rows=64, query_layer=12),
            "query_layer 12 above the split scores on the ridge maps",
        ),
        (
            dict(method="ridge", maps=ridge_maps, query_rows=64, query_layer=15),
            "query_layer 15 must be another layer than the split 15",
        ),
    ]:
        with pytest.raises(RidgefillError) as e:
            prepare("smollm2-135m", **bad)
        assert words in one_line(e)
    with pytest.raises(RidgefillError) as e:
        LLM("smollm2-135m", ridge_maps, enable_prefix_caching=True)
    assert "prefix caching" in one_line(e)


def test_config_keys_architectures_and_engine_features_are_checked():
    from ridgefill.vllm.config import VllmFill, overrides
    from ridgefill.vllm.models import check_engine

    with pytest.raises(RidgefillError) as e:
        overrides("Gemma3ForCausalLM")
    assert "does not support Gemma3ForCausalLM" in one_line(e)
    base = dict(num_hidden_layers=30, ridgefill_method="identity")
    for extra, words in [
        (dict(ridgefill_tial=64), "unknown RidgeFill setting ridgefill_tial"),
        (dict(ridgefill_tail="64"), "ridgefill_tail must be int"),
        (dict(ridgefill_sink=True), "ridgefill_sink must be int"),
    ]:
        with pytest.raises(RidgefillError) as e:
            VllmFill.from_config(SimpleNamespace(**base, **extra))
        assert words in one_line(e)
    fill = VllmFill.from_config(SimpleNamespace(**base, ridgefill_outlier_factor=0))
    assert fill.settings.split == 15 and fill.settings.outlier_factor is None
    # With maps and no split, a query_layer below half the layers waits for the maps' split.
    ridge = dict(num_hidden_layers=30, ridgefill_method="ridge", ridgefill_maps="m.safetensors")
    fill = VllmFill.from_config(SimpleNamespace(**ridge, ridgefill_query_rows=64, ridgefill_query_layer=11))
    assert fill.settings.query_layer == 11 and fill.with_split(10).settings.split == 10

    def engine(prefix=False, pp=1, spec=None, lora=None):
        return SimpleNamespace(
            cache_config=SimpleNamespace(enable_prefix_caching=prefix),
            parallel_config=SimpleNamespace(pipeline_parallel_size=pp),
            speculative_config=spec,
            lora_config=lora,
        )

    check_engine(engine())
    for kwargs, words in [
        (dict(prefix=True), "prefix caching"),
        (dict(pp=2), "pipeline"),
        (dict(spec=object()), "speculative"),
        (dict(lora=object()), "LoRA"),
    ]:
        with pytest.raises(RidgefillError) as e:
            check_engine(engine(**kwargs))
        assert words in one_line(e)


def test_vllm_serve_refuses_bad_input_in_one_line(tmp_path, capsys, ridge_maps):
    from ridgefill.cli import main

    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"not a map")
    assert main(["vllm-serve", "smollm2-135m", "--maps", str(corrupt)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # earlier lines: progress bars
    assert last.startswith("ridgefill: error:") and str(corrupt) in last
    assert main(["vllm-serve", "smollm2-135m", "--maps", str(ridge_maps), "--", "--enable-prefix-caching"]) == 2
    assert "prefix caching" in capsys.readouterr().err
