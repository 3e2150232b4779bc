"""What every request passes before it reaches a route, and the one place responses are counted.

What it is: `Security`, the server's exposure settings (a frozen dataclass beside `ServeConfig`),
and `Guard`, a plain ASGI middleware that applies them in this order:

1. Host: a server bound to a loopback address answers only requests whose `Host` header names
   loopback (`localhost`, `127.0.0.1`, `[::1]`, with or without a port); others get 421. A web
   page cannot then reach it by DNS rebinding (a hostile name resolving to 127.0.0.1).
2. API key: with `api_key` set, every path except `GET /health` and `GET /metrics` needs
   `Authorization: Bearer <key>` (compared in constant time), else 401, as vLLM's `--api-key`.
   /health and /metrics stay open so that probes and scrapers need no secret; they reveal
   the model name, the method names and counts, not prompts.
3. Media type: a POST must say `Content-Type: application/json`, else 415.
4. Body size: a body over `max_body_bytes` gets 413, from its Content-Length before it is read,
   or while a chunked body streams in.

Every response, the refusals above and unexpected exceptions (counted as 500) included, is
counted by route and status; the route label is one of the app's own paths or "other", so random
paths cannot grow the label set. What it is not: request validation (protocol.py).
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Callable
from dataclasses import dataclass

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ridgefill.errors import RidgefillError
from ridgefill.serve.protocol import ApiError, quote

DEFAULT_MAX_BODY_BYTES = 8 * 2**20
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
OPEN_PATHS = frozenset({"/health", "/metrics"})


def is_loopback(host: str) -> bool:
    """Whether a bind address (`127.0.0.1`, `::1`, `localhost`, ...) reaches this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Security:
    """How exposed a server is.

    Attributes:
        api_key: when set, requests need `Authorization: Bearer <api_key>` (see the module doc).
        max_body_bytes: the largest request body accepted; beyond it, 413.
        loopback_only: answer only requests whose Host header names loopback. Right for a server
            bound to a loopback address, wrong for one bound to a public one: `for_host` decides.
    """

    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    loopback_only: bool = True

    @classmethod
    def for_host(cls, host: str, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Security:
        """The settings for a server bound to `host`: the Host check only where it is loopback."""
        return cls(api_key or None, max_body_bytes, is_loopback(host))

    def __post_init__(self):
        if self.max_body_bytes < 1:
            raise RidgefillError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.api_key is not None and not self.api_key:
            raise RidgefillError("an empty API key would let anyone in; leave it unset instead")


def host_name(header: str) -> str:
    """`Host` header -> its host name, lower case, without port or IPv6 brackets."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class Guard:
    """ASGI middleware: refuse what `Security` forbids, cap the body, count every response.

    `count(route, status)` is called once per response; `routes` are the paths that are their own
    label.
    """

    def __init__(self, app: ASGIApp, security: Security, count: Callable[[str, int], None], routes: frozenset[str]):
        self.app, self.security, self.count, self.routes = app, security, count, routes
        key = security.api_key
        self._key = key.encode("utf-8") if key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        status: int | None = None

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                headers = {"WWW-Authenticate": "Bearer"} if refusal.status == 401 else None
                response = JSONResponse(refusal.body(), status_code=refusal.status, headers=headers)
                await response(scope, receive, send_counted)
            else:
                await self.app(scope, self._capped(receive), send_counted)
        except Exception:
            status = status or 500  # the outer error middleware answers 500
            raise
        finally:
            if status is not None:
                self.count(path if path in self.routes else "other", status)

    def _refusal(self, scope: Scope) -> ApiError | None:
        headers = {k.decode("latin-1"): v for k, v in scope["headers"]}
        sec = self.security
        host = headers.get("host")
        if sec.loopback_only and host is not None and host_name(host.decode("latin-1")) not in LOOPBACK_NAMES:
            return ApiError(
                421,
                f"Host {quote(host.decode('latin-1'))} is not served here: this server is bound to "
                "loopback and answers only to localhost, 127.0.0.1 or [::1]",
                None,
                "host_not_allowed",
            )
        if self._key is not None and not (scope["method"] == "GET" and scope["path"] in OPEN_PATHS):
            scheme, _, token = headers.get("authorization", b"").partition(b" ")
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)):
                return ApiError(
                    401,
                    "missing or wrong API key; send the header 'Authorization: Bearer <key>'",
                    None,
                    "invalid_api_key",
                )
        if scope["method"] == "POST":
            media = headers.get("content-type", b"").split(b";")[0].strip().lower()
            if media != b"application/json":
                return ApiError(
                    415,
                    "the request body must be JSON, sent with 'Content-Type: application/json'",
                    None,
                    "unsupported_media_type",
                )
        length = headers.get("content-length", b"")
        if length.isdigit() and int(length) > sec.max_body_bytes:
            return self._too_large()
        return None

    def _too_large(self) -> ApiError:
        limit = self.security.max_body_bytes
        return ApiError(
            413,
            f"the request body is over this server's limit of {limit} bytes ({limit / 2**20:g} MiB)",
            None,
            "request_too_large",
        )

    def _capped(self, receive: Receive) -> Receive:
        """`receive` that raises a 413 `ApiError` once the body passes the limit."""
        seen = 0

        async def capped() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.security.max_body_bytes:
                    raise self._too_large()
            return message

        return capped
