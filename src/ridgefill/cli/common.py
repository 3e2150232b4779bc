"""Helpers shared by the command-line subcommands: argument groups and method settings."""

from __future__ import annotations

import argparse
from pathlib import Path

from ridgefill.errors import RidgefillError


def model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="short name, HF model folder or .gguf file")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")


def fill_args(p: argparse.ArgumentParser, split: bool = True) -> None:
    if split:
        p.add_argument("--split", type=int, default=None, help="first layer that fills bulk rows (default: half)")
    p.add_argument("--sink", type=int, default=4, help="first tokens run fully")
    p.add_argument("--tail", type=int, default=256, help="last tokens run fully")
    p.add_argument(
        "--query-rows", type=int, default=0, help="about this many rows the question attends to run fully (0: off)"
    )
    p.add_argument("--maps", type=Path, default=None, help="map folder (default: the model's cache folder)")


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


def method_spec(lm, spec: str, split: int | None, args: argparse.Namespace):
    """A `MethodSpec` from `name[:key=value[:key=value...]]`, e.g. `ridge:query_rows=256:tail=512`.

    Keys are fields of the method's settings (`FillSettings` for identity/ridge/kva/gated-ridge:
    split, sink, tail, query_rows, drop, ...; `GateSettings` for tokengate: gate_layer, keep,
    sparse_keep, ...); they override the command's own options for this method only, so one run
    can compare variants.
    """
    from ridgefill.eval.ppl import MethodSpec
    from ridgefill.methods import parse_method

    name, *opts = spec.split(":")
    if name == "tuned":
        if opts:
            raise RidgefillError("`tuned` takes no options: its settings come from the bundle `ridgefill tune` wrote")
        return MethodSpec("tuned", *resolve_method(lm, name, split, args))
    name, over = parse_method(spec)
    return MethodSpec(spec, name, method_kwargs(lm, name, over.pop("split", split), args, **over))


def resolve_method(lm, name: str, split: int | None, args: argparse.Namespace) -> tuple[str, dict]:
    """(method, prefill kwargs) for a method name; `tuned` reads the bundle `ridgefill tune` wrote
    (in --maps, default the model's cache folder)."""
    if name == "tuned":
        from ridgefill.tune.bundle import load_tuned

        return load_tuned(lm, getattr(args, "maps", None))
    return name, method_kwargs(lm, name, split, args)


def method_kwargs(lm, method: str, split: int | None, args: argparse.Namespace, **settings) -> dict:
    """Keyword arguments a prefill method needs: its settings from the command's options (over the
    method's own defaults), and maps for the methods that read them."""
    from ridgefill.methods import prefill_kwargs, settings_for

    base = {"split": default_split(lm, split), "sink": args.sink, "tail": args.tail}
    if getattr(args, "query_rows", 0):
        base["query_rows"] = args.query_rows
    return prefill_kwargs(lm, method, settings_for(method, **{**base, **settings}), args.maps)


def default_split(lm, split: int | None) -> int:
    return lm.num_layers // 2 if split is None else split


def eval_tokens(lm, corpus: str | None, length: int, count: int) -> list[list[int]]:
    """`count` prompts of `length` tokens from the evaluation split (never calibration text)."""
    from ridgefill.corpus import load_corpus, token_segments

    docs = load_corpus(corpus).part("eval")
    segments, _ = token_segments(lm.tokenizer, docs, length, length * count, per_doc=length)
    if len(segments) < count:
        raise RidgefillError(f"the evaluation split holds only {len(segments)} prompts of {length} tokens")
    return segments
