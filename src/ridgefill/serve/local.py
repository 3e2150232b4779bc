"""A real server on a free loopback port, in a background thread (tests and the load test use it)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from ridgefill.errors import RidgefillError
from ridgefill.serve.app import ServeConfig, create_app
from ridgefill.serve.guard import Security


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def local_server(cfg: ServeConfig, security: Security | None = None, start_timeout: float = 30.0) -> Iterator[str]:
    """Serve `cfg` on 127.0.0.1; yield the base URL (`http://127.0.0.1:PORT`); stop on exit."""
    port = free_port()
    app = create_app(cfg, security or Security.for_host("127.0.0.1"))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="ridgefill-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RidgefillError(f"the server did not start on port {port}")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
