"""Prometheus metrics of one server: TTFT by method, token counters, queue depth, responses.

What it is: a private registry per app (so tests can run several servers in one process) and
its text exposition for `GET /metrics`. Response labels stay bounded: the caller passes a route
from a fixed set (guard.py), never the raw request path.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, queue_depth: Callable[[], float], running: Callable[[], float]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "ridgefill_ttft_seconds",
            "Time to first token, by prefill method",
            ["method"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("ridgefill_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generated_tokens = Counter("ridgefill_generated_tokens", "Tokens generated", registry=r)
        self.responses = Counter(
            "ridgefill_responses", "Responses by route and status", ["route", "status"], registry=r
        )
        Gauge("ridgefill_queue_depth", "Requests waiting for the model", registry=r).set_function(queue_depth)
        Gauge("ridgefill_running", "Requests on the model now (0 or 1)", registry=r).set_function(running)

    def first_token(self, method: str, seconds: float) -> None:
        self.ttft.labels(method=method).observe(seconds)

    def finished(self, prompt_tokens: int, generated: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generated_tokens.inc(generated)

    def response(self, route: str, status: int) -> None:
        self.responses.labels(route=route, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
