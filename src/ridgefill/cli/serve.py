"""`ridgefill serve`: load the model and maps once, then serve the OpenAI API with uvicorn."""

from __future__ import annotations

import argparse
import os

from ridgefill.errors import RidgefillError


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from ridgefill.serve import Security, ServeConfig, create_app
    except ImportError as e:
        raise RidgefillError(f"serving needs its extra: pip install 'ridgefill[serve]' ({e.name} is missing)") from None
    from ridgefill.cli.common import load, setting_options

    if not 0 <= args.port <= 65535:
        raise RidgefillError(f"port {args.port} is outside 0..65535")
    api_key = args.api_key or os.environ.get("RIDGEFILL_API_KEY") or None
    security = Security.for_host(args.host, api_key, args.max_body_bytes)
    lm = load(args)
    cfg = ServeConfig.for_model(lm, args.method, args.maps, args.max_queue, setting_options(args))
    print(
        f"serving {lm.name} on http://{args.host}:{args.port}/v1 "
        f"(prefill methods: {', '.join(sorted(cfg.methods))}; default {cfg.default_method})",
        flush=True,
    )
    if not security.loopback_only and security.api_key is None:
        print(f"note: {args.host} is not a loopback address and no API key is set: anyone who can reach it may use it")
    uvicorn.run(create_app(cfg, security), host=args.host, port=args.port, log_level="warning")
    return 0


def cmd_loadtest(args: argparse.Namespace) -> int:
    from ridgefill.cli.common import ints, load, setting_options
    from ridgefill.results import write_json
    from ridgefill.serve import ServeConfig
    from ridgefill.serve.loadtest import run_load
    from ridgefill.serve.local import local_server

    lm = load(args)
    prompts = None
    if args.prompt_tokens:
        from ridgefill.cli.common import eval_corpus, eval_tokens

        ids = eval_tokens(lm, eval_corpus(args), args.prompt_tokens, args.clients * args.requests)
        prompts = [lm.tokenizer.decode(p) for p in ids]
    runs = []

    def report(r: dict, label: str) -> None:
        print(
            f"{label}: {r['requests']} requests, {r['ok']} ok, {r['rejected_429']} x 429, "
            f"{r['failed']} failed ({r['server_errors_5xx']} x 5xx); TTFT median {r['ttft_median_s']} s, "
            f"p95 {r['ttft_p95_s']} s, max {r['ttft_max_s']} s (model alone: median {r['model_ttft_median_s']} s); "
            f"{r['tokens_per_s']} tokens/s; recovered: {r['recovered']}"
        )

    if args.url:  # a server already running, ours or another OpenAI-compatible one (vLLM)
        import openai

        model = openai.OpenAI(base_url=f"{args.url}/v1", api_key="unused").models.list().data[0].id
        r = run_load(args.url, model, args.clients, args.requests, args.max_tokens, args.timeout, prompts)
        runs.append({"url": args.url, "server_model": model, **r})
        report(r, args.url)
    for limit in [] if args.url else ints(args.queue_limits):
        cfg = ServeConfig.for_model(lm, args.method, args.maps, limit, setting_options(args))
        with local_server(cfg) as url:
            r = run_load(url, lm.name, args.clients, args.requests, args.max_tokens, args.timeout, prompts)
        runs.append({"max_queue": limit, "method": cfg.default_method, **r})
        report(r, f"queue limit {limit:>3}")
    if args.out:
        doc = {"model": lm.name, "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens, "runs": runs}
        write_json(args.out, doc, args.argv)
    bad = any(r["failed"] for r in runs) or not all(r["recovered"] for r in runs)
    return 1 if bad else 0


def cmd_vllm_serve(args: argparse.Namespace) -> int:
    """Check the model, maps and settings, then become vLLM's own OpenAI server with RidgeFill on."""
    import sys

    from ridgefill.vllm import SETTINGS, prepare, serve_args
    from ridgefill.vllm.config import PREFIX_CACHING

    settings = {k: getattr(args, k) for k in SETTINGS}
    prepared = prepare(args.model, args.maps, args.method, dtype=args.dtype, **settings)
    extra = args.passthrough
    if any(a.startswith("--enable-prefix-caching") for a in extra):
        raise RidgefillError(PREFIX_CACHING)
    argv = [sys.executable, "-W", "ignore::DeprecationWarning", "-m", "vllm.entrypoints.openai.api_server"]
    argv += [*serve_args(prepared), *extra]
    argv += ["--host", args.host, "--port", str(args.port)]
    print(f"starting vLLM with RidgeFill ({prepared.hf_overrides}) on http://{args.host}:{args.port}/v1", flush=True)
    os.execv(sys.executable, argv)
    return 0  # pragma: no cover (execv does not return)
