"""Subcommands that use a model: generate, models, demo."""

from __future__ import annotations

import argparse
import sys

from ridgefill.cli.common import default_split, resolve_method
from ridgefill.errors import RidgefillError


def cmd_generate(args: argparse.Namespace) -> int:
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
    method, kwargs = resolve_method(lm, args.method, args.split, args)
    res = generate(
        lm,
        prompt,
        method=method,
        **kwargs,
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
    from ridgefill.fit.maps import find_maps
    from ridgefill.fit.ridge import FitConfig, fit_from_corpus
    from ridgefill.methods import FillSettings, settings_for
    from ridgefill.models import load_model

    lm = load_model(args.model, dtype=args.dtype)
    split = default_split(lm, args.split)
    try:
        maps = find_maps(lm, "ridge", split)
        print(f"using cached ridge maps for split {split}")
    except RidgefillError:
        print(f"fitting ridge maps for split {split} (once; cached for later runs) ...")
        fit_from_corpus(lm, FitConfig(splits=(split,), methods=("ridge",)), corpus=args.corpus)
        maps = find_maps(lm, "ridge", split)
    settings = FillSettings(split=split, tail=args.tail)
    gated = settings_for("gated-ridge", split=split, tail=args.tail)
    methods = {
        "exact": {"method": "exact"},
        "ridge": {"method": "ridge", "maps": maps, "settings": settings},
        "gated-ridge": {"method": "gated-ridge", "maps": maps, "settings": gated},
    }
    prompt, results = run_demo(lm, methods, target_tokens=args.tokens)
    print(
        f"\nmodel {lm.name} ({args.dtype}): the magic number for {prompt.key!r} is {prompt.answer}, "
        f"hidden at {prompt.depth:.0%} depth of a {prompt.input_ids.shape[1]}-token prompt"
    )
    for label, r in results.items():
        found = "found" if prompt.answer in r.text else "missed"
        print(
            f"  {label:<11} TTFT {r.ttft_s:6.2f} s  prefill {r.prefill.tokens_per_s:7,.0f} tok/s  "
            f"answer {r.text.strip()!r} ({found})"
        )
    for label in ("ridge", "gated-ridge"):
        ratio = results["exact"].ttft_s / results[label].ttft_s
        print(f"  {label} TTFT is {ratio:.2f}x faster than exact (split {split} of {lm.num_layers}, tail {args.tail})")
    print("  gated-ridge: the 256 rows the question attends to run fully, half the rest is ridge-filled, half dropped")
    print("  one sample, one run: `ridgefill bench` and `ridgefill ppl` give repeated, paired measurements")
    return 0
