"""`ridgefill serve`: a real server on a loopback port, driven by the official `openai` client."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from ridgefill.generation import generate
from ridgefill.methods import FillSettings, Prefill
from ridgefill.serve import ServeConfig
from ridgefill.serve.loadtest import run_load
from ridgefill.serve.local import local_server

pytestmark = pytest.mark.slow

# A prompt long enough (~400 tokens) that a fill method with tail 64 really fills bulk rows.
LONG = " ".join(f"Item {i} of the inventory is a box of {i * 7 % 13} red pens." for i in range(30))
SETTINGS = FillSettings(split=15, sink=4, tail=64)


def _config(lm, max_queue=32) -> ServeConfig:
    methods = {"exact": Prefill("exact", "exact"), "identity": Prefill("identity", "identity", SETTINGS)}
    return ServeConfig(lm, methods, "identity", max_queue)


@pytest.fixture(scope="module")
def server(smollm2):
    with local_server(_config(smollm2)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def _wait_idle(url: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = httpx.get(f"{url}/health").json()
        if h["running"] == 0 and h["queue_depth"] == 0:
            return h
        time.sleep(0.2)
    raise AssertionError(f"the server stayed busy: {h}")


def test_completion_matches_library_generate(client, smollm2):
    prompt = "The three primary colours are"
    r = client.completions.create(
        model="smollm2-135m", prompt=prompt, max_tokens=12, temperature=0, extra_body={"prefill": {"method": "exact"}}
    )
    ref = generate(smollm2, prompt, "exact", max_new_tokens=12, chat=False)
    assert r.choices[0].text == ref.text
    assert r.usage.completion_tokens == len(ref.token_ids) and r.usage.prompt_tokens == ref.prompt_tokens
    assert r.usage.prefill["method"] == "exact" and r.usage.prefill["ttft_s"] > 0


def test_chat_and_streaming_chat_agree(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=16, temperature=0)
    text = whole.choices[0].message.content
    assert "Paris" in text and whole.choices[0].finish_reason in ("stop", "length")
    chunks = list(
        client.chat.completions.create(
            model="smollm2-135m", messages=messages, max_tokens=16, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_method_override_and_default(client):
    messages = [{"role": "user", "content": LONG + "\nHow many red pens are in item 3?"}]
    default = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=4, temperature=0)
    assert default.usage.prefill == {**default.usage.prefill, "method": "identity", "ran_exact": False}
    exact = client.chat.completions.create(
        model="smollm2-135m",
        messages=messages,
        max_tokens=4,
        temperature=0,
        extra_body={"prefill": {"method": "exact"}},
    )
    assert exact.usage.prefill["method"] == "exact" and exact.usage.prefill["ran_exact"]


def test_stop_strings_and_seeded_sampling(client):
    kw = dict(model="smollm2-135m", prompt="Count: one, two, three, four, five,", max_tokens=12)
    greedy = client.completions.create(temperature=0, **kw).choices[0].text
    cut = greedy.strip().split(",")[0]
    stopped = client.completions.create(temperature=0, stop=[","], **kw).choices[0]
    assert "," not in stopped.text and stopped.text.strip() == cut and stopped.finish_reason == "stop"
    a = client.completions.create(temperature=1.0, top_p=0.9, seed=7, **kw).choices[0].text
    b = client.completions.create(temperature=1.0, top_p=0.9, seed=7, **kw).choices[0].text
    assert a == b


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        ({"model": "smollm2-135m"}, 400, "messages"),
        ({"model": "smollm2-135m", "messages": "hi"}, 400, "messages"),
        ({"model": "smollm2-135m", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
        (
            {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "3"},
            400,
            "max_tokens",
        ),
        (
            {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
            400,
            "max_tokens",
        ),
        (
            {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6},
            400,
            "max_tokens",
        ),
        (
            {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "temperature": -1},
            400,
            "temperature",
        ),
        (
            {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "prefill": {"method": "magic"}},
            400,
            "prefill.method",
        ),
        ({"model": "smollm2-135m", "messages": [{"role": "user", "content": "  "}]}, 400, "messages"),
        ({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ],
)
def test_bad_input_gets_openai_error(server, body, status, param):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server}/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error" and err["param"] == param
    assert httpx.get(f"{server}/health").json()["status"] == "ok"


def test_prompt_longer_than_context_and_client_errors(client, smollm2):
    huge = "word " * (smollm2.context_length + 100)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2-135m", prompt=huge, max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-a-model", prompt="hi", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="prefill method"):
        client.completions.create(
            model="smollm2-135m", prompt="hi", max_tokens=4, extra_body={"prefill": {"method": "ridge"}}
        )


def test_disconnect_mid_stream_frees_the_slot(server, client):
    body = {
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": "Tell a long story."}],
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
    assert any(line.startswith("data: ") for line in got)
    _wait_idle(server, timeout=30)  # cancelled at the next token, not after 400
    r = client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "Say hi."}], max_tokens=4, temperature=0
    )
    assert r.choices[0].message.content


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["smollm2-135m"]
    assert httpx.get(f"{server}/health").json()["methods"] == ["exact", "identity"]
    text = httpx.get(f"{server}/metrics").text
    for name in (
        "ridgefill_ttft_seconds_bucket",
        "ridgefill_prompt_tokens_total",
        "ridgefill_generated_tokens_total",
        "ridgefill_queue_depth",
        'method="exact"',
    ):
        assert name in text
    assert httpx.get(f"{server}/nope").json()["error"]["message"]


def test_load_sixteen_streaming_clients(server):
    report = run_load(server, "smollm2-135m", clients=16, requests=1, max_tokens=8, timeout_s=300)
    assert report["ok"] == 16 and report["failed"] == 0 and report["server_errors_5xx"] == 0
    assert report["recovered"]


def test_queue_overflow_gets_429_then_recovers(smollm2):
    with local_server(_config(smollm2, max_queue=1)) as url:
        report = run_load(url, "smollm2-135m", clients=8, requests=1, max_tokens=24, timeout_s=300)
        assert report["rejected_429"] > 0 and report["failed"] == 0
        assert report["ok"] + report["rejected_429"] == 8 and report["recovered"]
        r = httpx.post(f"{url}/v1/completions", json={"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200


def test_cli_refuses_maps_of_another_model(tmp_path, smollm2):
    import torch

    from conftest import make_tiny
    from ridgefill.fit.maps import FillMaps, fingerprint, save_maps

    tiny = make_tiny("llama")
    d = tiny.parts.hidden_size
    header = {"model": fingerprint(tiny)}
    path = save_maps(FillMaps("ridge", 1, {2: torch.zeros(d + 1, d)}, header), tmp_path / "tiny.ridge.safetensors")
    out = subprocess.run(
        [str(Path(sys.executable).parent / "ridgefill"), "serve", "--maps", str(path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    last = out.stderr.strip().splitlines()[-1]  # (progress bars come before it)
    assert out.returncode == 2 and last.startswith("ridgefill: error:") and "ridgefill fit" in last
