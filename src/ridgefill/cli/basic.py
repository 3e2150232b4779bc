"""Subcommands that use a model: generate, models, demo."""

from __future__ import annotations

import argparse
import sys

from ridgefill.cli.common import load, setting_options
from ridgefill.errors import RidgefillError


def cmd_generate(args: argparse.Namespace) -> int:
    from ridgefill.generation import generate
    from ridgefill.methods import resolve_prefill

    prompt = args.prompt
    if args.prompt_file is not None:
        if not args.prompt_file.is_file():
            raise RidgefillError(f"prompt file not found: {args.prompt_file}")
        prompt = args.prompt_file.read_text(encoding="utf-8") + "\n\n" + prompt
    if not prompt.strip():
        raise RidgefillError("the prompt is empty: give --prompt and/or --prompt-file")
    lm = load(args)
    pre = resolve_prefill(lm, args.method, maps=args.maps, shared=setting_options(args))
    res = generate(
        lm,
        prompt,
        prefill=pre,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        chat=not args.no_chat,
    )
    print(res.text)
    fell_back = f", ran exact: {res.prefill.reason}" if res.prefill.ran_exact and pre.settings else ""
    print(
        f"\n[{pre.label}: {pre.for_length(res.prompt_tokens).describe()}{fell_back}; "
        f"{lm.name} {lm.dtype_name} on {lm.device}] prompt {res.prompt_tokens} tokens, TTFT {res.ttft_s:.3f} s, "
        f"prefill {res.prefill.tokens_per_s:,.0f} tok/s, {len(res.token_ids)} tokens generated",
        file=sys.stderr,
    )
    return 0


def cmd_models(args: argparse.Namespace) -> int:
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


def cmd_demo(args: argparse.Namespace) -> int:
    from ridgefill.demo import run_demo

    lm = load(args)
    report = run_demo(lm, target_tokens=args.tokens, maps=args.maps)
    print()
    for line in report.lines():
        print(line)
    return 0
