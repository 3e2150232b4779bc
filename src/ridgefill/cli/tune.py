"""`ridgefill tune`: search fill configurations under a NIAH and a perplexity budget."""

from __future__ import annotations

import argparse

from ridgefill.cli.common import floats, ints, load


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


def gate_candidates(text: str, measured: dict | None = None) -> tuple:
    """`--gates`: comma-separated tokengate configurations (`tokengate:keep=0.3:sentence=64`); plain
    `tokengate` is the model's `measured` gate, as everywhere. A value written `a|b` crosses:
    `tokengate:keep=0.375|0.5:refine_layer=11` is two candidates."""
    from itertools import product

    from ridgefill.errors import RidgefillError
    from ridgefill.methods.gate import GateSettings
    from ridgefill.methods.resolve import check_values, parse_method

    out = []
    for spec in filter(None, (t.strip() for t in text.split(","))):
        name, *opts = spec.split(":")
        if name != "tokengate":
            raise RidgefillError(f"--gates takes tokengate configurations (tokengate:key=value...), not {spec!r}")
        choices = [
            [f"{o.partition('=')[0]}={v}" for v in o.partition("=")[2].split("|")] if "=" in o else [o] for o in opts
        ]
        for picked in product(*choices):
            _, values = parse_method(":".join([name, *picked]))
            check_values(name, GateSettings, values)
            gate = GateSettings(**(values or measured or {}))
            if gate not in out:
                out.append(gate)
    return tuple(out)


def per_length(samples: int, lengths: tuple[int, ...], length: int) -> int:
    """Samples at `length`: fewer where a sample costs more (in proportion to the shortest length,
    at least 2), so each length's search costs about the same."""
    return max(2, round(samples * lengths[0] / length))


def cmd_tune(args: argparse.Namespace) -> int:
    from dataclasses import asdict, replace

    from tqdm.auto import tqdm

    from ridgefill.errors import RidgefillError
    from ridgefill.fit.maps import calib_info
    from ridgefill.methods.resolve import measured_settings
    from ridgefill.methods.tuned import length_bounds
    from ridgefill.results import write_json
    from ridgefill.tune import report
    from ridgefill.tune.search import TuneConfig, run_search, tuning_set
    from ridgefill.tune.space import Space, grid

    lm = load(args)
    lengths = tuple(sorted(set(ints(args.lengths)))) if args.lengths else (args.length or min(4096, lm.context_length),)
    if any(n > lm.context_length for n in lengths):
        raise RidgefillError(f"--lengths {args.lengths} go beyond {lm.name}'s context of {lm.context_length}")
    space = Space(
        ints(args.splits),
        ints(args.tails),
        ints(args.query_rows),
        floats(args.drops),
        floats(args.sparse_keeps),
        query_sentence=args.query_sentence,
        query_pool=args.query_pool,
        query_above=args.query_above,
        query_top=args.query_top,
        drop_top=args.drop_top,
        gates=gate_candidates(args.gates, measured_settings(lm, "tokengate")),
    )
    base_cfg = TuneConfig(
        budget_niah=args.budget_niah,
        budget_ppl=args.budget_ppl,
        length=lengths[0],
        samples=args.samples,
        ppl_docs=args.ppl_docs,
        seed=args.seed,
        wave=args.wave,
        ppl_tail=min(256, *space.tails) if space.tails else 256,  # scored rows must run fully in every candidate
        ppl_upper=args.ppl_upper,
    )
    base_cfg.check()
    candidates = grid(space, lm.num_layers)
    maps = _maps_for(lm, sorted({c.maps_split for c in candidates if c.maps_split is not None}), args)
    cfgs = {
        n: replace(
            base_cfg,
            length=n,
            samples=per_length(args.samples, lengths, n),
            ppl_docs=per_length(args.ppl_docs, lengths, n),
        )
        for n in lengths
    }
    sets = {n: tuning_set(lm, c, args.corpus) for n, c in cfgs.items()}
    # Runs planned per length (NIAH waves may end a length sooner); the bar's time left is read off it.
    planned = {
        n: len(d) * (1 + len(candidates)) + len(p) * (1 + min(base_cfg.wave, len(candidates)))
        for n, (p, d) in sets.items()
    }
    for n, (prompts, docs) in sets.items():
        print(
            f"{lm.name} at {n} tokens: {len(candidates)} configurations; tuning set {len(docs)} perplexity documents "
            f"and {len(prompts)} NIAH prompts (held-out split, seed {base_cfg.seed})"
        )
    print(f"NIAH runs {base_cfg.wave} configurations at a time, fastest first, until one meets both budgets")
    bar = tqdm(total=sum(planned.values()), desc=f"tune {lm.name}", unit="run")
    base = {
        "model": lm.name,
        "dtype": lm.dtype_name,
        "lengths": list(lengths),
        "space": asdict(space),
        "maps_calib": {str(s): calib_info(m) for s, m in maps.items()},
    }
    done: dict[str, dict] = {}

    def checkpoint(partial: dict, n: int) -> None:  # what is measured so far, in case the search is cut short
        if args.out:
            write_json(
                args.out, {**base, "by_length": {**done, str(n): {"config": asdict(cfgs[n]), **partial}}}, args.argv
            )

    for n, (prompts, docs) in sets.items():

        def progress(k: int, stage: str, remaining: int | None = None, n: int = n) -> None:
            if remaining is not None:  # a new NIAH wave: what is left of this length is now known
                bar.total = bar.n + remaining + sum(v for m, v in planned.items() if m > n)
            bar.set_postfix_str(f"{n} tokens: {stage}", refresh=False)
            bar.update(k)

        result = run_search(lm, cfgs[n], candidates, maps, prompts, docs, progress, lambda r, n=n: checkpoint(r, n))
        done[str(n)] = {"config": asdict(cfgs[n]), **result}
        print(f"\n{n} tokens:")
        print(report.table(result, base_cfg.budget_niah, base_cfg.budget_ppl, base_cfg.ppl_upper))
        print(f"search took {result['search_seconds']:.0f} s")
        if args.plot:
            title = f"{lm.name}: tuning frontier at {n} tokens"
            path = args.plot if len(lengths) == 1 else args.plot.with_name(f"{args.plot.stem}_{n}{args.plot.suffix}")
            print(f"plot written to {report.plot(result, path, title, base_cfg.budget_niah, base_cfg.budget_ppl)}")
    bar.close()
    if args.out:
        write_json(args.out, {**base, "by_length": done}, args.argv)
        print(f"results written to {args.out}")
    return _write_tuned(lm, args, lengths, done, maps, base_cfg, length_bounds(list(lengths)))


def _write_tuned(lm, args, lengths, done: dict, maps: dict, cfg, bounds) -> int:
    """The tuned bundle: one bucket per tuned length (exact where nothing met both budgets)."""
    from ridgefill.fit.maps import default_maps_dir
    from ridgefill.results import command_line
    from ridgefill.tune.bundle import tuned_path, write_bundle
    from ridgefill.tune.space import maps_split

    entries = []
    for n, up_to in zip(lengths, bounds, strict=True):
        result = done[str(n)]
        if result["chosen"] is None:
            print(
                f"{n} tokens: no configuration met both budgets (NIAH loss <= {cfg.budget_niah:g} points, tail PPL "
                f"<= +{cfg.budget_ppl:g}%); the table is the measured frontier, and this length runs exact"
            )
            entries.append({"up_to": up_to, "method": "exact", "settings": {}, "tuned_at": n})
            continue
        row = next(r for r in result["candidates"] if r["label"] == result["chosen"])
        measured = ("speedup", "flop_bound", "niah_loss", "niah_samples", "ppl_increase_pct", "ppl_ci95")
        entries.append(
            {
                "up_to": up_to,
                "method": row["method"],
                "settings": row["settings"],
                "tuned_at": n,
                "measured": {k: row[k] for k in measured},
                "tuning_set": {"length": n, "seed": cfg.seed, "prompts": row["niah_samples"]},
            }
        )
        print(
            f"{n} tokens: chosen {row['label']} ({row['speedup']:.2f}x TTFT, NIAH {row['niah_loss']:+.1f} points, "
            f"tail PPL {row['ppl_increase_pct']:+.1f}% on the tuning set)"
        )
    fills = [e for e in entries if e["method"] != "exact"]
    if not fills:
        print("No bundle written.")
        return 1
    tuned = {
        "by_length": entries,
        "budgets": {"niah_points": cfg.budget_niah, "ppl_pct": cfg.budget_ppl},
        "maps_folder": str((args.maps or default_maps_dir(lm)).resolve()),
        "command": command_line(args.argv),
    }
    if len(entries) == 1:  # one length: the configuration holds for every length
        tuned = {**{k: v for k, v in entries[0].items() if k != "up_to"}, **tuned}
        del tuned["by_length"]
    # The bundle is a map file: it carries the first chosen configuration's maps (any split's when
    # every chosen configuration is a gate that reads none).
    split = next((s for e in fills if (s := maps_split(e["method"], e["settings"])) is not None), min(maps))
    path = write_bundle(maps[split], tuned, args.bundle or tuned_path(lm, args.maps))
    print(
        f"tuned bundle -> {path}\n"
        f"check it on the evaluation split: ridgefill eval --model {lm.name} --methods tuned "
        f"--tasks {','.join(cfg.tasks)} --lengths {','.join(map(str, lengths))}"
    )
    return 0 if len(fills) == len(entries) else 1


def tune_args(p: argparse.ArgumentParser) -> None:
    from pathlib import Path

    p.add_argument("--budget-niah", type=float, default=2.0, help="most NIAH points lost to exact")
    p.add_argument("--budget-ppl", type=float, default=5.0, help="most tail-perplexity increase, percent")
    p.add_argument("--length", type=int, default=None, help="tuning prompt tokens (default: 4096 or the context)")
    p.add_argument(
        "--lengths",
        default="",
        help="tuning lengths, comma-separated: one configuration per length bucket (fewer samples at longer ones)",
    )
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
    p.add_argument(
        "--query-pool", type=int, default=1, help="query scores averaged over N neighbouring tokens (odd; 1: none)"
    )
    p.add_argument(
        "--query-above",
        type=int,
        default=0,
        help="query scores at the layer N above the split, on the ridge maps' prediction (0: the split's own)",
    )
    p.add_argument(
        "--query-top", type=int, default=0, help="per head, a row's score from the N queries attending most (0: all)"
    )
    p.add_argument("--drops", default="0.5,0.75", help="fractions of bulk rows dropped from the deep layers")
    p.add_argument(
        "--drop-top", type=int, default=None, help="as --query-top, for the dropped blocks alone (default: --query-top)"
    )
    p.add_argument("--sparse-keeps", default="1,0.5", help="key-block fractions below the split (1: dense)")
    p.add_argument(
        "--gates",
        default="",
        help="tokengate configurations measured beside the fills, comma-separated "
        "(tokengate:sentence=64:score_layer=14); a|b crosses values (tokengate:keep=0.375|0.5:refine_layer=11); "
        "plain tokengate is the gate measured for the model; "
        "one that scores at a deeper layer reads ridge maps at its gate layer",
    )
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
