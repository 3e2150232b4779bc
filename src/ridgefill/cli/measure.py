"""Subcommands that measure and write results: fit, bench, ppl, fill-error, eval, needles (and the
ablation table that gathers eval results)."""

from __future__ import annotations

import argparse

from ridgefill.cli.common import eval_corpus, eval_tokens, ints, load, method_prefill, names
from ridgefill.errors import RidgefillError, check_lengths


def scored_tail(args: argparse.Namespace) -> int:
    """Tail perplexity scores the last rows every method runs in full: --tail, else the default tail."""
    from ridgefill.methods import FillSettings

    return args.tail if args.tail is not None else FillSettings.tail


def _named_text(rows: list[dict], corpus) -> list[dict]:
    """Score rows, each naming the text it was measured on (its domain and corpus id)."""
    return [{**r, "domain": corpus.domain, "corpus": corpus.id} for r in rows]


def cmd_fit(args: argparse.Namespace) -> int:
    from ridgefill.fit.ridge import FitConfig, fit_from_corpus
    from ridgefill.results import write_json

    lm = load(args)
    splits = ints(args.splits) or (lm.num_layers // 3, lm.num_layers // 2, 2 * lm.num_layers // 3)
    cfg = FitConfig(
        splits=splits, methods=names(args.methods), segment_tokens=args.segment_tokens, facts=args.calib_facts
    )
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
        write_json(args.report, {"model": lm.name, "maps": [str(p) for p in paths], **report}, args.argv)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from ridgefill.bench.ttft import BenchConfig, run_bench
    from ridgefill.domains import corpus_info
    from ridgefill.eval.adapter import spec_settings
    from ridgefill.models.device import cpu_prefers_bf16
    from ridgefill.results import write_json

    lm = load(args)
    cfg = BenchConfig(ints(args.lengths), args.repeats, args.warmup, args.warmup_length)
    check_lengths(cfg.lengths, lm.name, lm.context_length)  # before maps load and prompts are cut
    specs = [method_prefill(lm, m, args) for m in names(args.methods)]
    corpus = eval_corpus(args)
    prompts = {n: eval_tokens(lm, corpus, n, 1)[0] for n in cfg.lengths}
    rows = run_bench(lm, cfg, prompts, specs)
    print(
        f"{lm.name} ({lm.dtype_name} on {lm.device}), "
        f"{cfg.warmup} warm-up{f' ({cfg.warmup_length} tokens)' if cfg.warmup_length else ''}, {cfg.repeats} repeats, "
        f"prompts from {corpus.describe()}"
    )
    for s in specs:
        print(f"  {s.label}: {s.describe()}")
    w = max(9, *(len(s.label) for s in specs))
    print(
        f"{'length':>6} {'method':<{w}} {'median s':>9} {'speedup':>8} {'[min-max]':>13} {'FLOP bound':>10} "
        f"{'of bound':>8} {'attn s':>8} {'attn x':>7} {'tok/s':>8} {'peak MiB':>9}"
    )
    for r in rows:
        print(
            f"{r['length']:>6} {r['method']:<{w}} {r['median_s']:9.3f} {r['speedup']:7.2f}x "
            f"{r['speedup_min']:5.2f}-{r['speedup_max']:<5.2f}  {r['flop_bound']:9.2f}x {r['fraction_of_bound']:7.0%} "
            f"{r['attn_median_s']:8.3f} {r['attn_speedup'] or 0:6.2f}x {r['tokens_per_s']:8.0f} {r['peak_mem_mb']:9.0f}"
        )
    if lm.dtype_name == "float32" and lm.device.type == "cpu" and cpu_prefers_bf16():
        print("note: this CPU runs bf16 matmuls faster; `--dtype bfloat16` is likely the faster exact baseline")
    if args.out:
        config = {
            **asdict(cfg),
            "device": str(lm.device),
            "methods": [s.label for s in specs],
            # What each label ran (`tuned` resolves to the bundle's method and settings).
            "method_settings": {s.label: spec_settings(s) for s in specs},
            "corpus": corpus_info(corpus),
        }
        write_json(args.out, {"model": lm.name, "dtype": lm.dtype_name, "config": config, "results": rows}, args.argv)
    return 0


def cmd_ppl(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from ridgefill.domains import corpus_info
    from ridgefill.engine import Engine
    from ridgefill.eval.ppl import tail_ppl
    from ridgefill.methods import Prefill, default_split
    from ridgefill.results import write_json

    lm = load(args)
    check_lengths((args.length,), lm.name, lm.context_length)
    corpus = eval_corpus(args)
    docs = eval_tokens(lm, corpus, args.length, args.docs)
    tail = scored_tail(args)
    specs = [Prefill("exact", "exact")]
    for split in ints(args.splits) or (default_split(lm.num_layers),):
        for m in names(args.methods):
            spec = method_prefill(lm, m, args, split=split)
            # A method without a split (tokengate, tuned) runs once, whatever --splits says.
            fixed = m.startswith("tuned") or not hasattr(spec.settings, "split")
            label = m if fixed else f"{m}@{spec.split}"
            if label not in {s.label for s in specs}:
                specs.append(replace(spec, label=label))
    rows = _named_text(tail_ppl(Engine(lm), docs, specs, tail), corpus)
    print(
        f"{lm.name} ({lm.dtype_name}): tail perplexity of the last {tail} tokens, {len(docs)} evaluation documents "
        f"of {corpus.describe()}"
    )
    print(f"{'method':<14} {'text':<8} {'tail NLL':>9} {'PPL':>8} {'vs exact':>9}  [95% CI]  per document")
    for r in rows:
        text = r["domain"] or "user"
        each, (lo, hi) = r["doc_ppl_increase_pct"], r["ppl_increase_ci95"]
        print(
            f"{r['method']:<14} {text:<8} {r['tail_nll']:9.4f} {r['ppl']:8.3f} {r['ppl_increase_pct']:+8.1f}%  "
            f"[{lo:+.1f}, {hi:+.1f}]  {min(each):+.1f}% to {max(each):+.1f}%"
        )
    if args.out:
        info = corpus_info(corpus)
        write_json(args.out, {"model": lm.name, "dtype": lm.dtype_name, "corpus": info, "ppl": rows}, args.argv)
    return 0


def cmd_fill_error(args: argparse.Namespace) -> int:
    from ridgefill.engine import Engine
    from ridgefill.eval.fill_error import WHATS, fill_errors, plot_fill_errors
    from ridgefill.fit.maps import MAP_METHODS, find_maps
    from ridgefill.methods import default_split
    from ridgefill.results import write_json

    lm = load(args)
    split = default_split(lm.num_layers) if args.split is None else args.split
    maps = {m: find_maps(lm, m, split, args.maps) for m in MAP_METHODS}
    docs = eval_tokens(lm, args.corpus, args.length, args.docs)
    errors = fill_errors(Engine(lm), docs, split, maps)
    print(f"{lm.name}, split {split}: relative error, mean over position buckets")
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
                "split": split,
                "length": args.length,
                "docs": len(docs),
                "buckets": "5 equal position buckets, 0-20% ... 80-100%",
                "rel_err": errors,
            },
            args.argv,
        )
    if args.plot:
        plot_fill_errors(errors, split, f"{lm.name}: fill error at split {split}, {args.length} tokens", args.plot)
        print(f"plot written to {args.plot}")
    return 0


def _ruler_setup(args: argparse.Namespace, lengths, allowed, unknown: str, text):
    """What `eval` and `needles` share: the tasks (checked against `allowed`), the model (lengths
    checked against its context before any maps load), the non-exact methods, the evaluation text
    (`text(args)`, a `Corpus`) and the essay haystack from its evaluation split."""
    from ridgefill.eval.ruler import essay_sentences

    tasks = names(args.tasks)
    bad = [t for t in tasks if t not in allowed]
    if bad:
        raise RidgefillError(f"{unknown} {', '.join(bad)}; choose from {', '.join(allowed)}")
    lm = load(args)
    check_lengths(lengths, lm.name, lm.context_length)
    specs = [method_prefill(lm, m, args) for m in names(args.methods) if m != "exact"]
    corpus = text(args)
    essay = essay_sentences([d.text for d in corpus.part("eval")])
    return tasks, lm, specs, corpus, essay


def cmd_eval(args: argparse.Namespace) -> int:
    import time

    from ridgefill.domains import corpus_info
    from ridgefill.engine import Engine
    from ridgefill.eval import report
    from ridgefill.eval.adapter import DECODE, EngineAdapter, spec_settings
    from ridgefill.eval.ppl import tail_ppl
    from ridgefill.eval.runner import recovered_over_identity, run_eval, summarise
    from ridgefill.eval.tasks import TASKS, make_task
    from ridgefill.methods import Prefill
    from ridgefill.models import cache_dir
    from ridgefill.results import write_json

    lengths = ints(args.lengths)
    tasks, lm, methods, corpus, essay = _ruler_setup(args, lengths, TASKS, "unknown task(s)", eval_corpus)
    specs = [Prefill("exact", "exact"), *methods]
    tail = scored_tail(args)
    t0 = time.perf_counter()
    cache = args.cache or (
        args.out.with_suffix(".samples.jsonl") if args.out else cache_dir() / "eval" / "samples.jsonl"
    )
    eval_tasks = [make_task(t, essay) for t in tasks]
    records = run_eval(EngineAdapter(lm, specs), eval_tasks, list(lengths), args.samples, cache, args.seed, tail)
    summary = summarise(records)
    # Every score names its text (the noise-haystack tasks niah_single_1 and vt read none of it).
    for key in ("results", "niah_pooled"):
        summary[key] = _named_text(summary[key], corpus)
    ppl = []
    if args.ppl_docs:
        for n in lengths:
            ppl += tail_ppl(Engine(lm), eval_tokens(lm, corpus, n, args.ppl_docs), specs, tail)
        ppl = _named_text(ppl, corpus)
    recovered = recovered_over_identity(summary["results"])
    print(f"text: {corpus.describe()} (essay haystacks{' and tail-PPL documents' if ppl else ''})")
    print(report.markdown(summary["results"], ppl))
    if any(r["method"] != "exact" for r in summary["niah_pooled"]):
        print("\nNeedle tasks pooled (each method paired against exact on the same prompts):")
        print(report.niah_table(summary["niah_pooled"], ppl))
        for line in report.needle_lines(summary["niah_pooled"]):
            print(line)
    print(report.SPEED_NOTE)
    for r in recovered:
        where = f"{r['task']} @ {r['length']}"
        print(f"ridge - identity in the filled region, {where}: {r['points']:+.1f} points (n={r['samples']})")
    seconds = round(time.perf_counter() - t0, 1)
    compute = round(sum(r.get("run_s", r["ttft_s"]) for r in records), 1)
    print(f"took {seconds} s (samples: {compute} s of compute over all runs); per-sample results cached in {cache}")
    if args.out:
        settings = {"seed": args.seed, "dtype": lm.dtype_name, "device": str(lm.device), "scored_tail": tail}
        write_json(
            args.out,
            {
                "model": lm.name,
                "corpus": corpus_info(corpus),
                "decode": DECODE,
                "methods": [s.label for s in specs],
                "settings": settings,
                "method_settings": {s.label: spec_settings(s) for s in specs},
                "seconds": seconds,
                "sample_compute_seconds": compute,
                **summary,
                "ppl": ppl,
                "recovered_over_identity": recovered,
            },
            args.argv,
        )
    if args.plots:
        for p in report.plot(summary["results"], args.plots, f"{lm.name}: RULER score by needle depth"):
            print(f"plot written to {p}")
    return 0


def cmd_ablation(args: argparse.Namespace) -> int:
    from ridgefill.eval import ablation
    from ridgefill.files import write_text
    from ridgefill.results import command_line, write_json

    table = ablation.attach_bench([row for f in args.files for row in ablation.rows(f)], args.bench)
    text = ablation.markdown(table)
    print(text)
    if args.out:
        write_json(args.out, {"rows": table}, args.argv)
        md = args.out.with_suffix(".md")
        write_text(md, f"`{command_line(args.argv)}`\n\n{text}\n")
        print(f"written to {args.out} and {md}")
    return 0


def cmd_needles(args: argparse.Namespace) -> int:
    from ridgefill.eval import needles
    from ridgefill.eval.ruler import NIAH_TASKS
    from ridgefill.results import write_json

    if args.scores is not None and not args.scores.is_file():
        raise RidgefillError(f"eval cache not found: {args.scores}")
    if args.layers is not None:
        if args.methods is not None or args.scores is not None:
            raise RidgefillError("--layers ranks the needle at layers, not methods: drop --methods and --scores")
        args.methods = ""
    elif args.methods is None:
        args.methods = "ridge:query_rows=512"
    tasks, lm, specs, _, essay = _ruler_setup(args, [args.length], NIAH_TASKS, "not needle task(s):", eval_corpus)
    if args.layers is not None:
        layers = layer_range(args.layers, lm.num_layers)
        records = needles.layer_rank_records(lm, list(tasks), args.length, args.samples, essay, layers, args.seed)
        summary = needles.summarise_layer_ranks(records)
        print(needles.layers_markdown(summary))
    else:
        if not specs:
            raise RidgefillError("name at least one method that skips rows (exact runs the needle in full)")
        records = needles.needle_records(
            lm, specs, list(tasks), args.length, args.samples, essay, args.seed, args.scores
        )
        summary = needles.summarise_needles(records)
        print(needles.markdown(summary))
    if args.out:
        write_json(
            args.out, {"model": lm.name, "length": args.length, "summary": summary, "records": records}, args.argv
        )
        print(f"written to {args.out}")
    return 0


def cmd_margins(args: argparse.Namespace) -> int:
    from ridgefill.eval import margins
    from ridgefill.eval.ruler import NIAH_TASKS
    from ridgefill.results import write_json

    if not args.cache.is_file():
        raise RidgefillError(f"eval cache not found: {args.cache}")
    tasks, lm, specs, corpus, essay = _ruler_setup(args, [args.length], NIAH_TASKS, "not needle task(s):", eval_corpus)
    if len(specs) != 1:
        raise RidgefillError("name one method besides exact: the one whose cached answers are set against exact's")
    spec = specs[0]
    rescore = None
    if args.rescore_dtype is not None:
        if args.rescore_dtype == lm.dtype_name:
            raise RidgefillError(f"--rescore-dtype {args.rescore_dtype} is the dtype the cache was computed in")
        rescore = load(argparse.Namespace(**{**vars(args), "dtype": args.rescore_dtype}))
    records = margins.margin_records(
        lm, spec, list(tasks), args.length, args.samples, essay, args.cache, args.seed, rescore
    )
    print(f"text: {corpus.describe()}")
    print(margins.markdown(records, spec.label))
    if args.out:
        body = {
            "model": lm.name,
            "dtype": lm.dtype_name,
            "length": args.length,
            "method": spec.label,
            "rescore_dtype": args.rescore_dtype,
            "records": records,
        }
        write_json(args.out, body, args.argv)
        print(f"written to {args.out}")
    return 0


def layer_range(text: str, num_layers: int) -> list[int]:
    """Layers named as "4-11" (inclusive) and/or "5,7,11", each within 1..num_layers - 1."""
    out: set[int] = set()
    for part in names(text):
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi if sep else lo)
        except ValueError:
            raise RidgefillError(f"expected layers such as 4-11 or 5,7,11, got {text!r}") from None
        out.update(range(first, last + 1))
    bad = sorted(x for x in out if not 1 <= x < num_layers)
    if not out or bad:
        raise RidgefillError(f"layers must lie within 1..{num_layers - 1}; got {text!r}")
    return sorted(out)


def cmd_vllm_bench(args: argparse.Namespace) -> int:
    from ridgefill.bench.vllm import VllmBenchConfig, run_vllm_bench
    from ridgefill.domains import corpus_info
    from ridgefill.methods import resolve_prefill
    from ridgefill.models.device import cpu_model
    from ridgefill.results import write_json
    from ridgefill.vllm import SETTINGS, prepare

    settings = {k: getattr(args, k) for k in SETTINGS}
    prepared = prepare(args.model, args.maps, args.method, dtype=args.dtype, **settings)
    args.dtype = prepared.dtype  # our engine at the dtype vLLM runs
    lm = load(args)
    cfg = VllmBenchConfig(ints(args.lengths), args.repeats, args.warmup)
    check_lengths(cfg.lengths, lm.name, lm.context_length)
    fill = prepared.fill  # the plugin's checked settings: our engine runs the same ones
    fill_prefill = resolve_prefill(lm, fill.method, settings=fill.settings, maps=fill.maps_path, fit_missing=False)
    exact_prefill = resolve_prefill(lm, "exact")
    corpus = eval_corpus(args)
    prompts = {n: eval_tokens(lm, corpus, n, 1)[0] for n in cfg.lengths}
    rows = run_vllm_bench(lm, prepared, fill_prefill, exact_prefill, cfg, prompts)
    print(f"{lm.name} ({prepared.dtype}, CPU: {cpu_model()}), {cfg.repeats} repeats; fill: {fill_prefill.describe()}")
    print(
        f"{'length':>6} {'engine':<9} {'method':<6} {'median s':>9} {'[min-max]':>15} {'speedup':>8} {'[min-max]':>11} "
        f"{'FLOP bound':>10}  note"
    )
    for r in rows:
        note = ""
        if "ratio_of_speedups" in r:
            note = f"{r['ratio_of_speedups']:.0%} of our engine's speedup"
        if "vs_our_exact" in r:
            note = f"{r['vs_our_exact']:.2f}x our exact"
        print(
            f"{r['length']:>6} {r['engine']:<9} {r['method']:<6} {r['median_s']:9.3f} "
            f"{r['min_s']:7.3f}-{r['max_s']:<7.3f} {r['speedup']:7.2f}x "
            f"{r['speedup_min']:5.2f}-{r['speedup_max']:<5.2f} {r['flop_bound']:9.2f}x  {note}"
        )
    if args.out:
        config = {
            "lengths": list(cfg.lengths),
            "repeats": cfg.repeats,
            "warmup": cfg.warmup,
            "hf_overrides": prepared.hf_overrides,
            "ours": fill_prefill.describe(),
            "cpu": cpu_model(),
            "corpus": corpus_info(corpus),
            "vllm": "whole prompt in one scheduler step, eager, prefix caching off, max_tokens=1",
        }
        write_json(args.out, {"model": lm.name, "dtype": prepared.dtype, "config": config, "results": rows}, args.argv)
    return 0
