"""The FastAPI app: OpenAI routes over the model worker.

What it is: `create_app(ServeConfig)` -> FastAPI. `POST /v1/completions` and
`POST /v1/chat/completions` (plain or SSE streaming), `GET /v1/models`, `GET /health`,
`GET /metrics`. The prefill method is chosen per request with `"prefill": {"method": ...}`;
every `usage` names the method that ran and its TTFT. Bad input gets a 4xx with OpenAI's error
body; an unexpected failure gets a 500 body and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ridgefill.errors import MapError, RidgefillError
from ridgefill.fit.maps import MAP_METHODS, load_maps
from ridgefill.generation import encode_chat, encode_prompt
from ridgefill.methods import FillSettings, prefill_kwargs, settings_for
from ridgefill.models.loading import LoadedModel
from ridgefill.serve.metrics import Metrics
from ridgefill.serve.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    chunk_object,
    completion_object,
    new_id,
    parse,
)
from ridgefill.serve.worker import Job, QueueFull, Worker

DEFAULT_MAX_TOKENS = {"completions": 16, "chat": 512}


@dataclass
class ServeConfig:
    """What a server serves.

    Attributes:
        lm: the loaded model; requests must name `lm.name`.
        methods: prefill method name -> keyword arguments (maps, settings) it runs with.
        default_method: used when a request does not choose one.
        max_queue: requests allowed to wait behind the running one; beyond it, 429.
    """

    lm: LoadedModel
    methods: dict[str, dict[str, Any]] = field(default_factory=lambda: {"exact": {}})
    default_method: str = "exact"
    max_queue: int = 32

    @classmethod
    def for_model(
        cls,
        lm: LoadedModel,
        method: str | None = None,
        settings: FillSettings | None = None,
        maps: Path | None = None,
        max_queue: int = 32,
    ) -> ServeConfig:
        """Every method this model can serve: exact, identity and tokengate always; ridge/kva where
        their maps load, and gated-ridge with the ridge maps.

        `maps` is one map file (its method and split win) or a folder (default: the model's cache
        folder, searched at `settings.split`). Without `method`, ridge when its maps loaded, else exact.
        """
        s = settings or FillSettings(split=lm.num_layers // 2)
        methods: dict[str, dict[str, Any]] = {
            "exact": {},
            "identity": {"settings": s},
            "tokengate": prefill_kwargs(lm, "tokengate", settings_for("tokengate", sink=s.sink, tail=s.tail)),
        }
        problems = {}
        if maps is not None and Path(maps).is_file():
            m = load_maps(maps, lm)
            methods[m.method] = {"maps": m, "settings": s}
        else:
            for name in MAP_METHODS:
                try:
                    methods[name] = prefill_kwargs(lm, name, s, maps)
                except MapError as e:
                    problems[name] = str(e)
        if "ridge" in methods:
            gated = settings_for("gated-ridge", split=methods["ridge"]["maps"].split, sink=s.sink, tail=s.tail)
            methods["gated-ridge"] = {"maps": methods["ridge"]["maps"], "settings": gated}
        if method is None:
            method = "ridge" if "ridge" in methods else "exact"
        if method not in methods:
            raise RidgefillError(
                problems.get(method) or f"unknown prefill method {method!r}; choose from {sorted(methods)}"
            )
        return cls(lm, methods, method, max_queue)

    def __post_init__(self):
        if self.default_method not in self.methods:
            raise RidgefillError(f"default method {self.default_method!r} is not among {sorted(self.methods)}")
        if self.max_queue < 0:
            raise RidgefillError("max_queue must be >= 0")


def create_app(cfg: ServeConfig) -> FastAPI:
    lm = cfg.lm
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        metrics = state["metrics"] = Metrics(lambda: state["worker"].waiting, lambda: state["worker"].running)
        worker = state["worker"] = Worker(lm, cfg.max_queue, metrics.first_token, metrics.finished)
        yield
        worker.close()

    app = FastAPI(title="ridgefill", lifespan=lifespan)

    @app.middleware("http")
    async def count(request: Request, call_next):
        response = await call_next(request)
        if "metrics" in state:
            state["metrics"].responses.labels(route=request.url.path, status=str(response.status_code)).inc()
        return response

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException):
        return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, e: Exception):
        return JSONResponse(ApiError(500, f"internal error: {type(e).__name__}").body(), status_code=500)

    @app.get("/health")
    async def health():
        w = state["worker"]
        return {
            "status": "ok",
            "model": lm.name,
            "methods": sorted(cfg.methods),
            "default_method": cfg.default_method,
            "queue_depth": w.waiting,
            "running": w.running,
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": lm.name, "object": "model", "created": 0, "owned_by": "ridgefill"}]}

    @app.get("/metrics")
    async def metrics():
        return Response(state["metrics"].render(), media_type=Metrics.content_type)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, chat=True)

    async def _serve(request: Request, chat: bool):
        req = parse(ChatRequest if chat else CompletionRequest, await _json(request))
        if req.model != lm.name:
            raise ApiError(
                404,
                f"model {req.model!r} is not served here; this server serves {lm.name!r}",
                "model",
                "model_not_found",
            )
        method = req.prefill.method if req.prefill else cfg.default_method
        if method not in cfg.methods:
            raise ApiError(
                400,
                f"prefill method {method!r} is not available here; choose from {sorted(cfg.methods)}",
                "prefill.method",
                "unknown_method",
            )
        try:
            if chat:
                ids = encode_chat(lm, [m.plain() for m in req.messages])
            else:
                ids = encode_prompt(lm, req.text(), chat=False)
        except RidgefillError as e:
            raise ApiError(400, str(e), "messages" if chat else "prompt") from None
        n = int(ids.shape[1])
        max_tokens = _max_tokens(req, chat, n)
        loop = asyncio.get_running_loop()
        job = Job(ids, method, cfg.methods[method], max_tokens, req.temperature, req.top_p, req.seed, req.stops(), loop)
        try:
            state["worker"].submit(job)
        except QueueFull as e:
            raise ApiError(429, str(e), None, "queue_full") from None
        rid = new_id("chatcmpl" if chat else "cmpl")
        if req.stream:
            return StreamingResponse(_stream(job, rid, chat, n), media_type="text/event-stream")
        return await _collect(request, job, rid, chat, n)

    def _max_tokens(req, chat: bool, n: int) -> int:
        ctx = lm.context_length
        if n >= ctx:
            raise ApiError(
                400,
                f"the prompt has {n} tokens; {lm.name}'s context is {ctx}",
                "messages" if chat else "prompt",
                "context_length_exceeded",
            )
        asked = (req.max_completion_tokens if chat else None) or req.max_tokens
        if asked is None:
            return min(DEFAULT_MAX_TOKENS["chat" if chat else "completions"], ctx - n)
        if not 1 <= asked <= ctx:
            raise ApiError(400, f"max_tokens must be between 1 and {ctx}, got {asked}", "max_tokens")
        if n + asked > ctx:
            raise ApiError(
                400,
                f"{n} prompt tokens + max_tokens {asked} exceed {lm.name}'s context of {ctx}",
                "max_tokens",
                "context_length_exceeded",
            )
        return asked

    def _usage(n: int, generated: int, first: tuple | None, submitted: float) -> dict:
        usage: dict[str, Any] = {"prompt_tokens": n, "completion_tokens": generated, "total_tokens": n + generated}
        if first is not None:
            _, ttft, meta, arrived = first
            usage["prefill"] = {
                **meta,
                "ttft_s": round(ttft, 4),
                "wait_s": round(max(0.0, arrived - submitted - ttft), 4),
            }
        return usage

    async def _next(job: Job) -> tuple:
        """The job's next event; "first" is stamped with its arrival time."""
        ev = await job.events.get()
        return (*ev, time.perf_counter()) if ev[0] == "first" else ev

    async def _collect(request: Request, job: Job, rid: str, chat: bool, n: int):
        submitted, parts, first = time.perf_counter(), [], None
        while True:
            try:
                ev = await asyncio.wait_for(_next(job), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    state["worker"].cancel(job)
                    return Response(status_code=499)
                continue
            if ev[0] == "first":
                first = ev
            elif ev[0] == "text":
                parts.append(ev[1])
            elif ev[0] == "error":
                raise ApiError(ev[1], ev[2])
            else:
                return completion_object(rid, lm.name, chat, "".join(parts), ev[1], _usage(n, ev[2], first, submitted))

    async def _stream(job: Job, rid: str, chat: bool, n: int) -> AsyncIterator[str]:
        submitted, first = time.perf_counter(), None
        try:
            if chat:
                yield _sse(chunk_object(rid, lm.name, True, None, None, None))
            while True:
                ev = await _next(job)
                if ev[0] == "first":
                    first = ev
                elif ev[0] == "text":
                    yield _sse(chunk_object(rid, lm.name, chat, ev[1], None, None))
                else:
                    if ev[0] == "error":
                        yield _sse(ApiError(ev[1], ev[2]).body())
                    else:
                        yield _sse(chunk_object(rid, lm.name, chat, "", ev[1], _usage(n, ev[2], first, submitted)))
                    yield "data: [DONE]\n\n"
                    return
        finally:  # the client left, or we are done (then this changes nothing)
            state["worker"].cancel(job)

    return app


async def _json(request: Request) -> object:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
