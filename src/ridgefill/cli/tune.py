"""`ridgefill tune`: search fill configurations under a NIAH and a perplexity budget."""

from __future__ import annotations

import argparse

from ridgefill.cli.common import dtype_name, floats, ints, load


def _maps_for(lm, splits: list[int], args: argparse.Namespace) -> dict:
    """Ridge maps of every split, fitting the missing ones in one pass over the calibration text
    (with `--calib-facts` facts per segment); maps already there must have been fitted with as many."""
    from ridgefill.errors import MapError, RidgefillError
    from ridgefill.fit.maps import calib_info, default_maps_dir, find_maps, maps_filename
    from ridgefill.fit.ridge import FitConfig, fit_from_corpus

    if args.calib_facts < 0:
        raise RidgefillError(f"--calib-facts must be >= 0, got {args.calib_facts}")
    folder = args.maps if args.maps is not None else default_maps_dir(lm)
    # Only absent maps are fitted: a corrupt or foreign file is reported by find_maps, not overwritten.
    missing = [s for s in splits if not (folder / maps_filename(lm.name, "ridge", s)).is_file()]
    if missing:
        print(f"fitting ridge maps for split(s) {missing} in one pass (cached for later runs)")
        fit_cfg = FitConfig(splits=tuple(missing), methods=("ridge",), facts=args.calib_facts)
        fit_from_corpus(lm, fit_cfg, args.corpus, out_dir=args.maps)
    maps = {s: find_maps(lm, "ridge", s, args.maps) for s in splits}
    for s, m in maps.items():
        facts = calib_info(m)["facts"]
        if facts != args.calib_facts:
            raise MapError(
                f"the split-{s} maps in {folder} were fitted with {facts} facts per segment, "
                f"not --calib-facts {args.calib_facts}; pass --maps with another folder (missing maps are fitted there)"
            )
    return maps


def cmd_tune(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from tqdm.auto import tqdm

    from ridgefill.fit.maps import calib_info
    from ridgefill.results import command_line, write_json
    from ridgefill.tune import report
    from ridgefill.tune.bundle import tuned_path, write_bundle
    from ridgefill.tune.search import TuneConfig, run_search, tuning_set
    from ridgefill.tune.space import Space, grid

    lm = load(args)
    space = Space(
        ints(args.splits),
        ints(args.tails),
        ints(args.query_rows),
        floats(args.drops),
        floats(args.sparse_keeps),
        query_sentence=args.query_sentence,
    )
    cfg = TuneConfig(
        budget_niah=args.budget_niah,
        budget_ppl=args.budget_ppl,
        length=args.length or min(4096, lm.context_length),
        samples=args.samples,
        ppl_docs=args.ppl_docs,
        seed=args.seed,
        wave=args.wave,
        ppl_tail=min(256, *space.tails) if space.tails else 256,  # scored rows must run fully in every candidate
        ppl_upper=args.ppl_upper,
    )
    cfg.check()
    candidates = grid(space, lm.num_layers)
    maps = _maps_for(lm, sorted({c.settings.split for c in candidates}), args)
    prompts, docs = tuning_set(lm, cfg, args.corpus)
    total = len(docs) * (1 + len(candidates)) + len(prompts) * (1 + min(cfg.wave, len(candidates)))
    print(
        f"{lm.name}: {len(candidates)} configurations; tuning set {len(docs)} perplexity documents and "
        f"{len(prompts)} NIAH prompts of {cfg.length} tokens (held-out split, seed {cfg.seed}); "
        f"NIAH runs {cfg.wave} configurations at a time, fastest first, until one meets both budgets"
    )
    bar = tqdm(total=total, desc=f"tune {lm.name}", unit="run")

    def progress(k: int, stage: str, remaining: int | None = None) -> None:
        if remaining is not None:  # a new NIAH wave: what is left is now known
            bar.total = bar.n + remaining
        bar.set_postfix_str(stage, refresh=False)
        bar.update(k)

    base = {
        "model": lm.name,
        "dtype": dtype_name(lm),
        "config": asdict(cfg),
        "space": asdict(space),
        "maps_calib": {str(s): calib_info(m) for s, m in maps.items()},
    }

    def checkpoint(partial: dict) -> None:  # what is measured so far, in case the search is cut short
        if args.out:
            write_json(args.out, {**base, **partial}, args.argv)

    result = run_search(lm, cfg, candidates, maps, prompts, docs, progress, checkpoint)
    bar.close()
    print(report.table(result, cfg.budget_niah, cfg.budget_ppl, cfg.ppl_upper))
    print(f"search took {result['search_seconds']:.0f} s")
    if args.out:
        write_json(args.out, {**base, **result}, args.argv)
        print(f"results written to {args.out}")
    if args.plot:
        title = f"{lm.name}: tuning frontier at {cfg.length} tokens"
        print(f"plot written to {report.plot(result, args.plot, title, cfg.budget_niah, cfg.budget_ppl)}")
    if result["chosen"] is None:
        print(
            f"no configuration met both budgets (NIAH loss <= {cfg.budget_niah:g} points, tail PPL <= "
            f"+{cfg.budget_ppl:g}%); the table is the measured frontier. No bundle written."
        )
        return 1
    row = next(r for r in result["candidates"] if r["label"] == result["chosen"])
    tuned = {
        "method": row["method"],
        "settings": row["settings"],
        "budgets": {"niah_points": cfg.budget_niah, "ppl_pct": cfg.budget_ppl},
        "measured": {
            k: row[k] for k in ("speedup", "flop_bound", "niah_loss", "niah_samples", "ppl_increase_pct", "ppl_ci95")
        },
        "tuning_set": {"length": cfg.length, "seed": cfg.seed, "prompts": len(prompts), "ppl_docs": len(docs)},
        "command": command_line(args.argv),
    }
    path = write_bundle(maps[row["settings"]["split"]], tuned, args.bundle or tuned_path(lm, args.maps))
    print(
        f"chosen: {row['label']} ({row['speedup']:.2f}x TTFT, NIAH {row['niah_loss']:+.1f} points, tail PPL "
        f"{row['ppl_increase_pct']:+.1f}% on the tuning set) -> {path}\n"
        f"check it on the evaluation split: ridgefill eval --model {lm.name} --methods tuned "
        f"--tasks {','.join(cfg.tasks)} --lengths {cfg.length}"
    )
    return 0


def tune_args(p: argparse.ArgumentParser) -> None:
    from pathlib import Path

    p.add_argument("--budget-niah", type=float, default=2.0, help="most NIAH points lost to exact")
    p.add_argument("--budget-ppl", type=float, default=5.0, help="most tail-perplexity increase, percent")
    p.add_argument("--length", type=int, default=None, help="tuning prompt tokens (default: 4096 or the context)")
    p.add_argument("--samples", type=int, default=6, help="NIAH tuning samples per task (4 tasks)")
    p.add_argument("--ppl-docs", type=int, default=4, help="held-out documents for tail perplexity")
    p.add_argument(
        "--ppl-upper",
        action="store_true",
        help="hold the upper end of the tail-PPL increase's 95%% interval over the documents to the budget",
    )
    p.add_argument("--seed", type=int, default=7, help="tuning sample seed (eval's 42 is refused)")
    p.add_argument("--splits", default="", help="comma-separated (default: 1/3, 2/5 and 1/2 of the layers)")
    p.add_argument("--tails", default="256,512", help="tail rows that run fully (comma-separated)")
    p.add_argument("--query-rows", default="512", help="query-aware full rows (comma-separated)")
    p.add_argument(
        "--query-sentence", type=int, default=0, help="query spans cover their peak's sentence (N tokens each side)"
    )
    p.add_argument("--drops", default="0.5,0.75", help="fractions of bulk rows dropped from the deep layers")
    p.add_argument("--sparse-keeps", default="1,0.5", help="key-block fractions below the split (1: dense)")
    p.add_argument("--wave", type=int, default=12, help="NIAH-stage candidates at a time, fastest first")
    p.add_argument("--maps", type=Path, default=None, help="map folder (default: the model's cache folder)")
    p.add_argument("--corpus", default=None, help="text for fitting and tuning (held-out split is used)")
    p.add_argument(
        "--calib-facts",
        type=int,
        default=0,
        help="key-value facts spliced into each calibration segment of the maps (as `fit --calib-facts`)",
    )
    p.add_argument("--bundle", type=Path, default=None, help="tuned bundle path (default: next to the maps)")
    p.add_argument("--out", type=Path, default=None, help="JSON results (rewritten after each stage and wave)")
    p.add_argument("--plot", type=Path, default=None, help="PNG of the frontier")
