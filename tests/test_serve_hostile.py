"""`ridgefill serve` under hostile input: a real server on a loopback port, a tiny random model.

The model is a 2-layer random Llama with SmolLM2's tokenizer (its vocabulary), so tokenising,
chat templates and error paths are real while a generated token costs about a millisecond. It has
no end-of-sequence token, so it always generates exactly its budget. A forward hook on its
embedding counts forward passes (prefill and each decode step) and can slow each one down.
"""

from __future__ import annotations

import json
import random
import re
import socket
import threading
import time

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from ridgefill.models import hf
from ridgefill.models.loading import LoadedModel
from ridgefill.serve import Security, ServeConfig
from ridgefill.serve.local import local_server
from ridgefill.serve.worker import Job, QueueFull, Worker

pytestmark = pytest.mark.slow  # (SmolLM2's tokenizer)

NAME = "tiny-serve"
CONTEXT = 2048
MIB = 2**20
ERROR_KEYS = {"message", "type", "param", "code"}


class Passes:
    """Forward hook: counts the model's forward passes and sleeps `delay` seconds in each."""

    def __init__(self):
        self.count, self.delay = 0, 0.0

    def __call__(self, module, args, output):
        if self.delay:
            time.sleep(self.delay)
        self.count += 1


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A model this small gains nothing from intra-op threads; on a busy 2-core machine their
    spinning across the worker and preparation threads made each token ~15x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_lm(smollm2) -> LoadedModel:
    cfg = LlamaConfig(
        vocab_size=len(smollm2.tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=CONTEXT,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None
    return LoadedModel(model=model, tokenizer=smollm2.tokenizer, name=NAME, parts=hf.model_parts(model))


@pytest.fixture(scope="module")
def passes(tiny_lm) -> Passes:
    hook = Passes()
    handle = tiny_lm.parts.embed.register_forward_hook(hook)
    yield hook
    handle.remove()


@pytest.fixture
def slow_model(passes):
    passes.delay = 0.05
    yield passes
    passes.delay = 0.0


def _config(lm: LoadedModel, max_queue: int = 8) -> ServeConfig:
    return ServeConfig(lm, max_queue=max_queue)  # exact prefill only


@pytest.fixture(scope="module")
def server(tiny_lm, passes):
    with local_server(_config(tiny_lm)) as url:
        yield url


def _post(url: str, path: str, body: object, **kw) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **kw.pop("headers", {})}
    return httpx.post(f"{url}{path}", content=raw, headers=headers, timeout=kw.pop("timeout", 60), **kw)


def _assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text[:500]
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None and param.endswith("*"):  # a field name that holds client input, clipped
        assert err["param"].startswith(param[:-1]) and len(err["param"]) <= 80, err
    else:
        assert err["param"] == param, err
    assert code is None or err["code"] == code, err
    assert len(r.content) < 2000  # no long echo of the input
    return err


def _assert_healthy(url: str) -> None:
    r = httpx.get(f"{url}/health", timeout=5)
    assert r.status_code == 200 and r.json()["status"] == "ok"


def _wait_idle(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = httpx.get(f"{url}/health", timeout=5).json()
        if h["running"] == 0 and h["queue_depth"] == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"the server stayed busy: {h}")


def _chat(**extra) -> dict:
    return {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


def _completion(**extra) -> dict:
    return {"model": NAME, "prompt": "hi", "max_tokens": 2, **extra}


def _nested_objects(depth: int) -> bytes:
    return b'{"a":' * depth + b"1" + b"}" * depth


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"

# (path, body, status, param, code): every case is answered before the model runs.
BAD = {
    "malformed json": (CHAT, b"{not json", 400, None, None),
    "not an object": (CHAT, b"[1, 2]", 400, None, None),
    "deep arrays": (CHAT, b"[" * 100_000, 400, None, None),
    "deep objects": (COMPLETIONS, _nested_objects(5000), 400, None, None),
    "NaN literal": (CHAT, json.dumps(_chat()).encode()[:-1] + b', "temperature": NaN}', 400, None, None),
    "huge integer literal": (
        CHAT,
        json.dumps(_chat()).encode()[:-1] + b', "seed": ' + b"9" * 5000 + b"}",
        400,
        None,
        None,
    ),
    "invalid utf-8": (COMPLETIONS, b'{"model": "tiny-serve", "prompt": "\xff\xfe"}', 400, None, None),
    "missing messages": (CHAT, {"model": NAME}, 400, "messages", None),
    "messages not a list": (CHAT, {"model": NAME, "messages": "hi"}, 400, "messages", None),
    "bad role": (
        CHAT,
        {"model": NAME, "messages": [{"role": "wizard", "content": "hi"}]},
        400,
        "messages.0.role",
        None,
    ),
    "max_tokens a string": (CHAT, _chat(max_tokens="3"), 400, "max_tokens", None),
    "max_tokens 0": (CHAT, _chat(max_tokens=0), 400, "max_tokens", None),
    "max_tokens over context": (CHAT, _chat(max_tokens=10**6), 400, "max_tokens", None),
    "max_completion_tokens 0": (CHAT, _chat(max_completion_tokens=0), 400, "max_completion_tokens", None),
    "max_completion_tokens over context": (
        CHAT,
        _chat(max_completion_tokens=CONTEXT),
        400,
        "max_completion_tokens",
        "context_length_exceeded",
    ),
    "temperature below 0": (CHAT, _chat(temperature=-1), 400, "temperature", None),
    "temperature above 2": (CHAT, _chat(temperature=2.5), 400, "temperature", None),
    "top_p 0": (COMPLETIONS, _completion(top_p=0), 400, "top_p", None),
    "top_p a bool": (COMPLETIONS, _completion(top_p=True), 400, "top_p", None),
    "n 2": (CHAT, _chat(n=2), 400, "n", None),
    "seed 2**64": (COMPLETIONS, _completion(seed=2**64, temperature=1.0), 400, "seed", None),
    "seed below int64": (COMPLETIONS, _completion(seed=-(2**63) - 1, temperature=1.0), 400, "seed", None),
    "five stop strings": (COMPLETIONS, _completion(stop=["a", "b", "c", "d", "e"]), 400, "stop", None),
    "two prompts": (COMPLETIONS, _completion(prompt=["a", "b"]), 400, "prompt", None),
    "token-id prompt": (COMPLETIONS, _completion(prompt=[1, 2, 3]), 400, "prompt", None),
    "blank chat": (CHAT, {"model": NAME, "messages": [{"role": "user", "content": "  "}]}, 400, "messages", None),
    "surrogate in prompt": (COMPLETIONS, _completion(prompt="a\ud800b"), 400, "prompt", None),
    "surrogate in a message": (
        CHAT,
        {"model": NAME, "messages": [{"role": "user", "content": "\udfff"}]},
        400,
        "messages.0.content",
        None,
    ),
    "surrogate in a text part": (
        CHAT,
        {"model": NAME, "messages": [{"role": "user", "content": [{"type": "text", "text": "x\ud800"}]}]},
        400,
        "messages.0.content",
        None,
    ),
    "surrogate in stop": (COMPLETIONS, _completion(stop="\ud800"), 400, "stop", None),
    "surrogate in model": (COMPLETIONS, _completion(model="\ud800"), 400, "model", None),
    "unknown prefill method": (CHAT, _chat(prefill={"method": "magic"}), 400, "prefill.method", "unknown_method"),
    "prefill method not a string": (CHAT, _chat(prefill={"method": 3}), 400, "prefill.method", None),
    "unknown prefill setting": (CHAT, _chat(prefill={"method": "exact", "k" * 3000: 1}), 400, "prefill.k*", None),
    "surrogate prefill setting": (CHAT, _chat(prefill={"method": "exact", "\ud800" * 9: 1}), 400, "prefill", None),
    "prompt over the context": (
        COMPLETIONS,
        _completion(prompt="word " * (CONTEXT + 100)),
        400,
        "prompt",
        "context_length_exceeded",
    ),
    "unknown model": (CHAT, _chat(model="gpt-4"), 404, "model", "model_not_found"),
    "unknown 1 MB model name": (CHAT, _chat(model="m" * MIB), 404, "model", "model_not_found"),
    "logprobs": (CHAT, _chat(logprobs=True), 400, "logprobs", "unsupported_parameter"),
    "completion logprobs": (COMPLETIONS, _completion(logprobs=2), 400, "logprobs", "unsupported_parameter"),
    "top_logprobs": (CHAT, _chat(top_logprobs=3), 400, "top_logprobs", "unsupported_parameter"),
    "echo": (COMPLETIONS, _completion(echo=True), 400, "echo", "unsupported_parameter"),
    "best_of": (COMPLETIONS, _completion(best_of=3), 400, "best_of", "unsupported_parameter"),
    "logit_bias": (CHAT, _chat(logit_bias={"42": 5}), 400, "logit_bias", "unsupported_parameter"),
    "presence_penalty": (CHAT, _chat(presence_penalty=0.5), 400, "presence_penalty", "unsupported_parameter"),
    "frequency_penalty": (COMPLETIONS, _completion(frequency_penalty=1), 400, "frequency_penalty", None),
    "suffix": (COMPLETIONS, _completion(suffix="end"), 400, "suffix", "unsupported_parameter"),
    "tools": (CHAT, _chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools", None),
    "json mode": (CHAT, _chat(response_format={"type": "json_object"}), 400, "response_format", None),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_request_gets_openai_error_before_model_work(server, passes, case):
    path, body, status, param, code = BAD[case]
    before = passes.count
    _assert_error(_post(server, path, body), status, param, code)
    assert passes.count == before  # refused before any model work
    _assert_healthy(server)


@pytest.mark.parametrize(
    "path, body",
    [
        (CHAT, _chat(logprobs=False, top_logprobs=0, presence_penalty=0, frequency_penalty=0.0, logit_bias={})),
        (COMPLETIONS, _completion(echo=False, best_of=1, logprobs=None, suffix=None, user="u", stream_options=None)),
        (COMPLETIONS, _completion(seed=2**63 - 1, temperature=1.0)),
        (COMPLETIONS, _completion(seed=-(2**63), temperature=1.0)),
    ],
)
def test_neutral_values_of_unsupported_parameters_are_accepted(server, path, body):
    r = _post(server, path, body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def test_max_completion_tokens_is_honoured(server):
    r = _post(server, CHAT, _chat(max_tokens=9, max_completion_tokens=3))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_size_media_type_and_host(server):
    big = b'{"model": "tiny-serve", "prompt": "' + b"a" * (8 * MIB) + b'"}'
    _assert_error(_post(server, COMPLETIONS, big), 413, None, "request_too_large")

    def chunks():  # no Content-Length: the limit applies while the body streams in
        for _ in range(9):
            yield b" " * MIB

    r = httpx.post(f"{server}{CHAT}", content=chunks(), headers={"Content-Type": "application/json"}, timeout=60)
    assert "8 MiB" in _assert_error(r, 413, None, "request_too_large")["message"]
    raw = json.dumps(_chat()).encode()
    for headers in ({"Content-Type": "text/plain"}, {}, {"Content-Type": "application/x-www-form-urlencoded"}):
        r = httpx.post(f"{server}{CHAT}", content=raw, headers=headers, timeout=30)
        _assert_error(r, 415, None, "unsupported_media_type")
    assert _post(server, CHAT, _chat(), headers={"Content-Type": "application/json; charset=utf-8"}).status_code == 200
    port = server.rsplit(":", 1)[1]
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "localhost.evil.example:80"):
        _assert_error(httpx.get(f"{server}/health", headers={"Host": host}, timeout=5), 421, None, "host_not_allowed")
        _assert_error(_post(server, CHAT, _chat(), headers={"Host": host}), 421, None, "host_not_allowed")
    for host in ("localhost", f"localhost:{port}", "127.0.0.1", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST"):
        assert httpx.get(f"{server}/health", headers={"Host": host}, timeout=5).status_code == 200
    _assert_healthy(server)


def test_big_prompt_does_not_stall_health(server):
    """Tokenising ~4 MB takes seconds; it runs off the event loop, so /health keeps answering."""
    body = {"model": NAME, "prompt": "word " * (4 * MIB // 5), "max_tokens": 1}
    result = {}
    sender = threading.Thread(target=lambda: result.update(r=_post(server, COMPLETIONS, body)))
    sender.start()
    slowest = 0.0
    while sender.is_alive():
        t0 = time.perf_counter()
        _assert_healthy(server)
        slowest = max(slowest, time.perf_counter() - t0)
        time.sleep(0.05)
    sender.join()
    _assert_error(result["r"], 400, "prompt", "context_length_exceeded")
    assert slowest < 1.0, f"/health took {slowest:.2f} s while a big prompt was tokenised"


def test_api_key(tiny_lm):
    with local_server(_config(tiny_lm), Security.for_host("127.0.0.1", api_key="s3cret")) as url:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "s3cret"},
            {"Authorization": "Basic s3cret"},
        ):
            r = _post(url, CHAT, _chat(), headers=headers)
            _assert_error(r, 401, None, "invalid_api_key")
            assert r.headers["www-authenticate"] == "Bearer"
        _assert_error(httpx.get(f"{url}/v1/models", timeout=5), 401, None, "invalid_api_key")
        _assert_error(httpx.get(f"{url}/nope", timeout=5), 401, None, "invalid_api_key")
        assert _post(url, CHAT, _chat(), headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": "bearer s3cret"}, timeout=5).status_code == 200
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200  # open for probes
        assert httpx.get(f"{url}/metrics", timeout=5).status_code == 200  # and scrapers


def test_non_streaming_disconnect_stops_within_a_token(server, slow_model):
    """The client leaves mid-generation; the worker stops at its next token and frees the model."""
    port = int(server.rsplit(":", 1)[1])
    body = json.dumps(_completion(max_tokens=400)).encode()
    head = f"POST {COMPLETIONS} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    start = slow_model.count
    sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
    deadline = time.monotonic() + 30
    while slow_model.count < start + 5:
        assert time.monotonic() < deadline, "generation did not start"
        time.sleep(0.005)
    at_close = slow_model.count
    sock.close()
    _wait_idle(server, timeout=10)
    after = slow_model.count - at_close
    assert after <= 2, f"{after} forward passes after the client left (one may be under way)"
    assert httpx.post(f"{server}{COMPLETIONS}", json=_completion(), timeout=30).status_code == 200


def test_admission_is_exact_whatever_the_worker_does():
    """1 running + max_queue waiting, counted together: the worker taking a job off the queue (or
    not yet) cannot change how many are admitted."""
    worker = Worker(None, max_queue=2)
    worker.close()  # (its thread ends: nothing is taken off the queue)
    worker._thread.join(timeout=5)
    admitted = 0
    for _ in range(5):
        try:
            worker.submit(Job(torch.zeros(1, 1, dtype=torch.long), "exact", {}, 1, 0.0, 1.0, None, [], None))
            admitted += 1
        except QueueFull:
            pass
    assert admitted == 3


def _arrive_together(url: str, clients: int) -> list[int]:
    """`clients` requests released at once by a barrier; their status codes."""
    barrier = threading.Barrier(clients)
    codes: list[int] = []

    def one():
        barrier.wait()
        codes.append(_post(url, COMPLETIONS, _completion(max_tokens=30)).status_code)

    threads = [threading.Thread(target=one) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return codes


def test_simultaneous_arrivals_at_the_queue_limit(tiny_lm, passes):
    passes.delay = 0.01
    try:
        with local_server(_config(tiny_lm, max_queue=1)) as url:
            for _ in range(3):
                assert sorted(_arrive_together(url, 4)) == [200, 200, 429, 429]
                _wait_idle(url)
    finally:
        passes.delay = 0.0


def _responses(url: str) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    pattern = r'^ridgefill_responses_total\{route="([^"]*)",status="(\d+)"\} (\S+)$'
    return {(m[1], m[2]): float(m[3]) for m in re.finditer(pattern, text, re.M)}


def test_metrics_labels_are_bounded_and_every_5xx_counted(tiny_lm, monkeypatch):
    from ridgefill.serve import app as app_module
    from ridgefill.serve import worker as worker_module

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")

    with local_server(_config(tiny_lm)) as url:
        rng = random.Random(0)
        for _ in range(25):
            path = "/" + "".join(rng.choice("abcdefghij/") for _ in range(rng.randint(1, 30)))
            assert httpx.get(f"{url}{path}", timeout=5).status_code in (404, 405)
        _post(url, "/v1/" + "x" * 50, _chat())
        routes = {route for route, _ in _responses(url)}
        assert routes <= {"other", "/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"}
        assert _responses(url)[("other", "404")] >= 25

        monkeypatch.setattr(worker_module, "stream_tokens", broken)  # fails inside the worker thread
        for _ in range(3):
            _assert_error(_post(url, CHAT, _chat()), 500)
        monkeypatch.setattr(app_module, "prepare", broken)  # raises in the route itself
        for _ in range(3):
            _assert_error(_post(url, COMPLETIONS, _completion()), 500)
        monkeypatch.undo()
        counts = _responses(url)
        assert counts[("/v1/chat/completions", "500")] == 3 and counts[("/v1/completions", "500")] == 3
        assert sum(v for (_, status), v in counts.items() if status.startswith("5")) == 6
        assert _post(url, CHAT, _chat()).status_code == 200
        _assert_healthy(url)


def _fuzz_value(rng: random.Random, depth: int = 0) -> object:
    kinds = ["none", "bool", "int", "float", "str", "list", "dict"] if depth < 4 else ["int", "str", "none"]
    kind = rng.choice(kinds)
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.choice([0, 1, -1, 2, 7, 2**31, 2**64, -(2**70), rng.randint(-100, 5000)])
    if kind == "float":
        return rng.choice([0.0, 0.5, 1.0, -0.1, 1e308, 3.5, rng.random()])
    if kind == "str":
        return rng.choice(["", "hi", " ", "\ud800", "\x00", "exact", NAME, "user", "text", "é" * 50, "a" * 3000])
    if kind == "list":
        return [_fuzz_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(FIELDS): _fuzz_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}


FIELDS = [
    "model",
    "prompt",
    "messages",
    "role",
    "content",
    "type",
    "text",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "stream",
    "n",
    "prefill",
    "method",
    "logprobs",
    "echo",
    "x",
]


def _fuzz_body(rng: random.Random, chat: bool) -> bytes:
    """A valid request, then 0-2 mutations of it; or random JSON; or random bytes; some cut short."""
    r = rng.random()
    if r < 0.15:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 200)))
    if r < 0.25:
        return json.dumps(_fuzz_value(rng)).encode()
    body: dict = _chat(max_tokens=rng.randint(1, 4)) if chat else _completion(max_tokens=rng.randint(1, 4))
    if rng.random() < 0.2:
        body["stream"] = True
    for _ in range(rng.choice([0, 1, 1, 2])):
        name = rng.choice(FIELDS)
        if name in body and rng.random() < 0.3:
            del body[name]
        elif name == "messages" and rng.random() < 0.5:
            body[name] = [{"role": rng.choice(["user", "system", "assistant", "bot"]), "content": _fuzz_value(rng)}]
        else:
            body[name] = _fuzz_value(rng)
    raw = json.dumps(body).encode()
    if rng.random() < 0.1:
        cut = rng.randrange(len(raw) + 1)
        raw = raw[:cut] + bytes(rng.randrange(256) for _ in range(rng.randint(0, 3)))
    return raw


def test_fuzz_no_5xx_no_hang(server):
    rng = random.Random(1234)
    deadline = time.monotonic() + 30
    statuses: dict[int, int] = {}
    with httpx.Client(timeout=10) as client:
        for i in range(200):
            assert time.monotonic() < deadline, f"the fuzz run took too long ({i} requests sent)"
            path = rng.choice([CHAT, COMPLETIONS])
            raw = _fuzz_body(rng, path == CHAT)
            r = client.post(f"{server}{path}", content=raw, headers={"Content-Type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (raw[:300], r.text[:300])
            if r.status_code != 200:
                assert set(r.json()["error"]) == ERROR_KEYS
    assert statuses.get(200, 0) > 20 and statuses.get(400, 0) > 20, statuses
    _assert_healthy(server)
