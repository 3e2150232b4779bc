"""Eval reports: a Markdown table for the terminal and PNG plots (score by depth; length x depth).

What it is: presentation of `runner.summarise` output. What it is not: scoring.
"""

from __future__ import annotations

from pathlib import Path

from ridgefill.eval.runner import DEPTH_BUCKETS, breakdown_case


def speed_cell(r: dict) -> str:
    """The side TTFT figure of a summary row: n/a where no prompt had exact and the method timed in
    one process (exact's records came from a cache made by another run)."""
    if r.get("ttft_speedup") is not None:
        return f"{r['ttft_speedup']:.2f}x"
    return "" if r["method"] == "exact" else "n/a"


SPEED_NOTE = (
    "TTFT x: median paired ratio over prompts where exact and the method were timed in one run (n/a: exact's records "
    "came from another run's cache); `ridgefill bench` gives the clean figure"
)


def markdown(results: list[dict], ppl: list[dict] | None = None) -> str:
    lines = [
        "| task | length | method | n | score | delta vs exact [95% CI] | TTFT x | " + " | ".join(DEPTH_BUCKETS) + " |",
        "|" + "---|" * (7 + len(DEPTH_BUCKETS)),
    ]
    for r in results:
        delta = (
            "" if r["method"] == "exact" else f"{r['delta_vs_exact']:+.1f} [{r['ci95'][0]:+.1f}, {r['ci95'][1]:+.1f}]"
        )
        depth = " | ".join("-" if r["by_depth"][b] is None else f"{r['by_depth'][b]:.0f}" for b in DEPTH_BUCKETS)
        speed = speed_cell(r)
        lines.append(
            f"| {r['task']} | {r['length']} | {r['method']} | {r['samples']} | {r['score']:.1f} | {delta} | {speed} "
            f"| {depth} |"
        )
    if ppl:
        lines += ["", "| method | length | docs | tail NLL | PPL | vs exact |", "|---|---|---|---|---|---|"]
        for p in ppl:
            lines.append(
                f"| {p['method']} | {p['length']} | {p['docs']} | {p['tail_nll']:.4f} | {p['ppl']:.3f} | "
                f"{p.get('ppl_increase_pct', 0):+.1f}% |"
            )
    return "\n".join(lines)


def niah_table(pooled: list[dict], ppl: list[dict] | None = None) -> str:
    """One row per method and length: the needle tasks pooled, paired against exact on the same
    prompts, beside the tail-perplexity increase and the TTFT ratio (the ablation table's columns)."""
    increase = {(p["method"], p["length"]): p.get("ppl_increase_pct") for p in ppl or []}
    lines = [
        "| method | length | NIAH tasks | n | NIAH | exact | delta vs exact [95% CI] | tail PPL vs exact | TTFT x |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in pooled:
        if r["method"] == "exact":
            continue
        inc = increase.get((r["method"], r["length"]))
        ppl_txt = "" if inc is None else f"{inc:+.1f}%"
        speed = speed_cell(r)
        lines.append(
            f"| {r['method']} | {r['length']} | {len(r['tasks'])} | {r['samples']} | {r['score']:.1f} | "
            f"{r['exact_score']:.1f} | {r['delta_vs_exact']:+.1f} [{r['ci95'][0]:+.1f}, {r['ci95'][1]:+.1f}] | "
            f"{ppl_txt} | {speed} |"
        )
    return "\n".join(lines)


def needle_lines(pooled: list[dict]) -> list[str]:
    """One line per fill method: where the needle's rows ran, and what each case scored."""
    out = []
    for r in pooled:
        nr = r.get("needle_rows")
        if not nr:
            continue
        parts = []
        for kind in ("full", "part", "none"):
            if nr[kind]["prompts"]:
                parts.append(f"{kind} in {nr[kind]['prompts']} ({breakdown_case(nr[kind])})")
        rank = "" if nr["rank_median"] is None else f"; median rank of the needle by row score {nr['rank_median']}"
        if nr.get("rank_refine_median") is not None:
            rank += f", by the second gate's score {nr['rank_refine_median']}"
        out.append(f"{r['method']} @ {r['length']}: needle rows ran {', '.join(parts)}{rank}")
    return out


def plot(results: list[dict], out_dir: str | Path, title: str) -> list[Path]:
    """score_by_depth.png (mean over tasks) and heatmap.png (length x depth, one panel per method)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ridgefill.results import save_png

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    methods = list(dict.fromkeys(r["method"] for r in results))
    lengths = sorted({r["length"] for r in results})

    def mean_depth(method: str, length: int | None = None) -> list[float]:
        rows = [r for r in results if r["method"] == method and (length is None or r["length"] == length)]
        vals = []
        for b in DEPTH_BUCKETS:
            xs = [r["by_depth"][b] for r in rows if r["by_depth"][b] is not None]
            vals.append(sum(xs) / len(xs) if xs else float("nan"))
        return vals

    fig, ax = plt.subplots(figsize=(7, 4))
    for m in methods:
        ax.plot(DEPTH_BUCKETS, mean_depth(m), marker="o", label=m)
    ax.set(xlabel="needle depth (%)", ylabel="score (0-100)", title=title, ylim=(-2, 102))
    ax.grid(alpha=0.3)
    ax.legend()
    p1 = save_png(fig, out / "score_by_depth.png")

    fig, axes = plt.subplots(1, len(methods), figsize=(3.2 * len(methods), 0.6 * len(lengths) + 2), squeeze=False)
    for ax, m in zip(axes[0], methods, strict=True):
        grid = [mean_depth(m, n) for n in lengths]
        im = ax.imshow(grid, vmin=0, vmax=100, cmap="viridis", aspect="auto")
        ax.set(title=m, xticks=range(len(DEPTH_BUCKETS)), yticks=range(len(lengths)))
        ax.set_xticklabels(DEPTH_BUCKETS, rotation=45)
        ax.set_yticklabels(lengths)
    fig.colorbar(im, ax=axes[0].tolist(), label="score")
    p2 = save_png(fig, out / "heatmap.png", tight=False)
    return [p1, p2]
