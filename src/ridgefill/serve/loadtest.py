"""A bounded loopback load test: concurrent streaming chat clients against an OpenAI server.

What it is: `run_load(url, model, clients, ...)` drives a server (ours, or any OpenAI-compatible
one such as vLLM's) with the official `openai` async client (retries off, so every 429 is seen),
measures client-side TTFT (request sent to first content chunk, queueing included), the model's
own TTFT from `usage` where the server reports it (ours does), generated tokens per second over
the whole load, counts outcomes by status, then sends one more request to check that the server
recovered. Prompts are short by default, or `prompts` given by the caller (e.g. 2K tokens each).
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time


async def _one(client, model: str, prompt: str, max_tokens: int) -> dict:
    import openai

    t0 = time.perf_counter()
    first = model_ttft = None
    chunks = 0
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                chunks += 1  # one token per chunk in both servers
                first = first or time.perf_counter() - t0
            if chunk.usage is not None:
                model_ttft = (chunk.usage.prefill or {}).get("ttft_s")
        total = time.perf_counter() - t0
        return {"status": 200, "ttft_s": first, "model_ttft_s": model_ttft, "total_s": total, "tokens": chunks}
    except openai.APIStatusError as e:
        return {"status": e.status_code}
    except Exception as e:  # connection reset, timeout: a failure of the server
        return {"status": "error", "error": f"{type(e).__name__}: {e}"}


async def _load(
    url: str, model: str, clients: int, requests: int, max_tokens: int, timeout_s: float, prompts: list[str] | None
) -> list[dict]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout_s)

    def prompt(i: int, r: int) -> str:
        head = f"Client {i}, request {r}: name one colour."
        return head if not prompts else prompts[(i * requests + r) % len(prompts)] + "\n\n" + head

    async def worker(i: int) -> list[dict]:
        return [await _one(client, model, prompt(i, r), max_tokens) for r in range(requests)]

    try:
        per_client = await asyncio.wait_for(asyncio.gather(*(worker(i) for i in range(clients))), timeout_s)
    finally:
        await client.close()
    return [r for rs in per_client for r in rs]


def run_load(
    url: str,
    model: str,
    clients: int = 16,
    requests: int = 1,
    max_tokens: int = 16,
    timeout_s: float = 600,
    prompts: list[str] | None = None,
) -> dict:
    """Run the load, then one request alone; return counts and client-side TTFT statistics.
    `prompts`: texts the clients' requests start with, one per request in turn (None: short)."""
    t0 = time.perf_counter()
    rows = asyncio.run(_load(url, model, clients, requests, max_tokens, timeout_s, prompts))
    wall = time.perf_counter() - t0
    after = asyncio.run(_load(url, model, 1, 1, max_tokens, timeout_s, None))[0]
    ttfts = sorted(r["ttft_s"] for r in rows if r["status"] == 200 and r["ttft_s"] is not None)
    model = sorted(r["model_ttft_s"] for r in rows if r["status"] == 200 and r.get("model_ttft_s") is not None)
    statuses: dict[str, int] = {}
    for r in rows:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    return {
        "clients": clients,
        "requests": len(rows),
        "ok": statuses.get("200", 0),
        "rejected_429": statuses.get("429", 0),
        "failed": sum(n for s, n in statuses.items() if s not in ("200", "429")),
        "server_errors_5xx": sum(n for s, n in statuses.items() if s.isdigit() and int(s) >= 500),
        "statuses": statuses,
        "ttft_median_s": round(statistics.median(ttfts), 3) if ttfts else None,
        "ttft_p95_s": round(ttfts[math.ceil(0.95 * len(ttfts)) - 1], 3) if ttfts else None,  # nearest rank
        "ttft_max_s": round(max(ttfts), 3) if ttfts else None,
        "tokens_per_s": round(sum(r.get("tokens", 0) for r in rows) / wall, 2),
        # the model's own TTFT (prefill + first token) from `usage`, without the time spent queued
        "model_ttft_median_s": round(statistics.median(model), 3) if model else None,
        "model_ttft_max_s": round(max(model), 3) if model else None,
        "wall_s": round(wall, 2),
        "recovered": after["status"] == 200,
        "errors": sorted({r["error"] for r in rows if "error" in r})[:5],
    }
