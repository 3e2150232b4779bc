"""The FastAPI app: OpenAI routes over the model worker.

What it is: `create_app(ServeConfig, Security)` -> FastAPI. `POST /v1/completions` and
`POST /v1/chat/completions` (plain or SSE streaming), `GET /v1/models`, `GET /health`,
`GET /metrics`. The prefill method is chosen per request with `"prefill": {"method": ...}`;
every `usage` names the method that ran and its TTFT.

A request passes, in order: the Guard (guard.py: Host check on a loopback server -> 421, API key
-> 401, `Content-Type: application/json` -> 415, body size -> 413); then, on a thread of its own
so that the event loop and `/health` never wait on it, JSON decoding, validation and tokenising
(protocol.py, prepare.py: any problem -> 400, an unknown model -> 404); then admission to the
worker's queue (full -> 429). Every error has OpenAI's body `{"error": {"message", "type",
"param", "code"}}` and quotes at most a short clipped piece of the input; an unexpected failure
gets a 500 body, is counted in /metrics, and the server keeps serving. A non-streaming request
whose client disconnects is cancelled at once: generation stops at the next token and its slot
is freed. OpenAI parameters we do not implement (`logprobs`, `echo`, `best_of`, `logit_bias`,
penalties, tools, ...) are refused with a 400 naming them unless they carry their "off" value.

Settings (`Security`, CLI option in brackets): `api_key` [`--api-key`, or the environment
variable `RIDGEFILL_API_KEY`]: requests need `Authorization: Bearer <key>`, except `GET /health`
and `GET /metrics`, which stay open for probes and scrapers. `max_body_bytes` [`--max-body-bytes`,
default 8 MiB]. `loopback_only`: set when the bind address is loopback (the default 127.0.0.1);
then only Host headers naming localhost, 127.0.0.1 or [::1] are answered (a DNS-rebinding
defence). The interactive docs (/docs, /openapi.json) are off.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ridgefill.errors import RidgefillError
from ridgefill.fit.maps import load_maps
from ridgefill.methods import METHODS, Prefill, resolve_prefill
from ridgefill.methods.resolve import TUNED
from ridgefill.models.loading import LoadedModel
from ridgefill.serve.guard import Guard, Security
from ridgefill.serve.metrics import Metrics
from ridgefill.serve.prepare import prepare
from ridgefill.serve.protocol import ApiError, chunk_object, completion_object, new_id
from ridgefill.serve.worker import Job, QueueFull, Worker

log = logging.getLogger(__name__)


@dataclass
class ServeConfig:
    """What a server serves.

    Attributes:
        lm: the loaded model; requests must name `lm.name`.
        methods: prefill method name -> the resolved `Prefill` it runs.
        default_method: used when a request does not choose one.
        max_queue: requests allowed to wait behind the running one; beyond it, 429.
    """

    lm: LoadedModel
    methods: dict[str, Prefill] = field(default_factory=lambda: {"exact": Prefill("exact", "exact")})
    default_method: str = "exact"
    max_queue: int = 32

    @classmethod
    def for_model(
        cls,
        lm: LoadedModel,
        method: str | None = None,
        maps: Path | None = None,
        max_queue: int = 32,
        settings: dict[str, Any] | None = None,
    ) -> ServeConfig:
        """Every method this model can serve, each resolved once (methods/resolve.py).

        The default (`method`, else `tuned` where the model has a tuned configuration, else exact)
        must resolve, its maps fitted on first use: any problem with it, such as a corrupt map file,
        stops the server with its message. The others (exact, identity, tokengate; ridge, kva and
        gated-ridge where their maps load; tuned) are offered where they resolve without fitting;
        each one left out is logged with its reason. `settings` (split, sink, tail, query_rows)
        apply to every method that has them, except `tuned`; `maps` is a map file, a tuned bundle
        or a folder (default: the model's cache folder).
        """
        if maps is not None and Path(maps).is_file():
            maps = load_maps(maps, lm)  # read and checked once, not once per method
        first = resolve_prefill(lm, method, maps=maps, shared=settings)
        default = method or first.label
        methods = {default: first}
        for name in (*METHODS, TUNED):
            if name in methods:
                continue
            try:
                methods[name] = resolve_prefill(lm, name, maps=maps, fit_missing=False, shared=settings)
            except RidgefillError as e:
                log.warning("serving without %s: %s", name, e)
        return cls(lm, methods, default, max_queue)

    def __post_init__(self):
        if self.default_method not in self.methods:
            raise RidgefillError(f"default method {self.default_method!r} is not among {sorted(self.methods)}")
        if self.max_queue < 0:
            raise RidgefillError("max_queue must be >= 0")


def create_app(cfg: ServeConfig, security: Security | None = None) -> FastAPI:
    """The app serving `cfg`, exposed as `security` says (default: `Security()`, loopback only)."""
    lm = cfg.lm
    security = security or Security()
    state: dict[str, Any] = {}
    metrics = Metrics(lambda: state["worker"].waiting, lambda: state["worker"].running)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker = state["worker"] = Worker(lm, cfg.max_queue, metrics.first_token, metrics.finished)
        pool = state["prepare"] = ThreadPoolExecutor(1, thread_name_prefix="ridgefill-prepare")
        yield
        worker.close()
        pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="ridgefill", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException):
        return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, e: Exception):
        log.error("request failed", exc_info=e)
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
    async def metrics_text():
        return Response(metrics.render(), media_type=Metrics.content_type)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, chat=True)

    async def _serve(request: Request, chat: bool):
        raw = await request.body()  # capped by the Guard
        loop = asyncio.get_running_loop()
        p = await loop.run_in_executor(state["prepare"], prepare, lm, cfg.methods, cfg.default_method, raw, chat)
        req = p.request
        job = Job(
            p.input_ids,
            p.method,
            cfg.methods[p.method],
            p.max_tokens,
            req.temperature,
            req.top_p,
            req.seed,
            p.stop,
            loop,
        )
        try:
            state["worker"].submit(job)
        except QueueFull as e:
            raise ApiError(429, str(e), None, "queue_full") from None
        rid = new_id("chatcmpl" if chat else "cmpl")
        if req.stream:
            return StreamingResponse(_stream(job, rid, chat, p.prompt_tokens), media_type="text/event-stream")
        return await _collect(request, job, rid, chat, p.prompt_tokens)

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

    async def _watch(request: Request, job: Job) -> None:
        """Cancel `job` the moment its client disconnects (the body is read, so the next ASGI
        message is the disconnect) and wake the collector with a "gone" event."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        state["worker"].cancel(job)
        job.events.put_nowait(("gone",))

    async def _collect(request: Request, job: Job, rid: str, chat: bool, n: int):
        submitted, parts, first = time.perf_counter(), [], None
        watch = asyncio.create_task(_watch(request, job))
        try:
            while True:
                ev = await _next(job)
                if ev[0] == "first":
                    first = ev
                elif ev[0] == "text":
                    parts.append(ev[1])
                elif ev[0] == "gone":
                    return Response(status_code=499)  # nobody reads it; it closes the cycle
                elif ev[0] == "error":
                    raise ApiError(ev[1], ev[2])
                else:
                    usage = _usage(n, ev[2], first, submitted)
                    return completion_object(rid, lm.name, chat, "".join(parts), ev[1], usage)
        finally:
            watch.cancel()
            state["worker"].cancel(job)  # no-op once done

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

    routes = frozenset(route.path for route in app.routes)
    app.add_middleware(Guard, security=security, count=metrics.response, routes=routes)
    return app


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
