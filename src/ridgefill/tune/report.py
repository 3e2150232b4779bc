"""Tuner reports: the candidate table for the terminal and the speed/accuracy frontier as a PNG.

What it is: presentation of `tune.search.run_search` output. What it is not: the search.
"""

from __future__ import annotations

from pathlib import Path


def _ci(row: dict) -> str:
    ci = row.get("ppl_ci95")  # absent in results written before the interval was recorded
    return f" [{ci[0]:+.1f}, {ci[1]:+.1f}]" if ci else ""


def table(result: dict, budget_niah: float, budget_ppl: float, ppl_upper: bool = False) -> str:
    """Markdown table, fastest first; `*` marks the frontier, `>` the choice."""
    ex = result["exact"]
    lines = [
        f"exact: NIAH {ex['niah_score']} over {ex['niah_samples']} tuning samples, tail NLL {ex['tail_nll']}",
        f"budgets: NIAH loss <= {budget_niah:g} points, tail PPL <= +{budget_ppl:g}%"
        + (" (the upper end of its 95% interval over the documents)" if ppl_upper else ""),
        "",
        "| | configuration | TTFT x [min-max] | FLOP bound | NIAH loss (n) | tail PPL [95% CI] | status |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(result["candidates"], key=lambda r: -r["speedup"]):
        mark = ">" if r["label"] == result["chosen"] else "*" if r["frontier"] else ""
        loss = "-" if r["niah_loss"] is None else f"{r['niah_loss']:+.1f} ({r['niah_samples']})"
        bound = "-" if r["flop_bound"] is None else f"{r['flop_bound']:.2f}x"
        status = r["stopped"] or ("within budget" if r["within_budget"] else "over budget")
        lines.append(
            f"| {mark} | {r['label']} | {r['speedup']:.2f}x [{r['speedup_min']:.2f}-{r['speedup_max']:.2f}] | "
            f"{bound} | {loss} | {r['ppl_increase_pct']:+.1f}%{_ci(r)} | {status} |"
        )
    return "\n".join(lines)


def plot(result: dict, path: str | Path, title: str, budget_niah: float, budget_ppl: float) -> Path:
    """Speedup (x) against NIAH loss (y), coloured by tail PPL increase; frontier joined, choice ringed.

    Candidates without a NIAH loss are drawn below the others in the same colours, so the picture
    shows every configuration measured: crosses over the perplexity budget, pluses not reached
    because a faster one met both budgets.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["candidates"]
    fig, ax = plt.subplots(figsize=(7.5, 5.4))
    measured = [r for r in rows if r["niah_loss"] is not None]
    ppl_only = [r for r in rows if r["niah_loss"] is None]
    vmax = max(10.0, *(r["ppl_increase_pct"] for r in rows))
    sc = ax.scatter(
        [r["speedup"] for r in measured],
        [r["niah_loss"] for r in measured],
        c=[r["ppl_increase_pct"] for r in measured],
        cmap="viridis_r",
        vmin=0,
        vmax=vmax,
        s=40,
        zorder=3,
    )
    if ppl_only:
        low = min([0.0] + [r["niah_loss"] for r in measured]) - 5
        over = [r for r in ppl_only if r["ppl_increase_pct"] > budget_ppl]
        skipped = [r for r in ppl_only if r["ppl_increase_pct"] <= budget_ppl]
        for group, marker, label in (
            (over, "x", "over the PPL budget (NIAH not run)"),
            (skipped, "+", "NIAH not run: " + ("a faster one met both budgets" if result["chosen"] else "not reached")),
        ):
            if group:
                ax.scatter(
                    [r["speedup"] for r in group],
                    [low] * len(group),
                    marker=marker,
                    s=50,
                    c=[r["ppl_increase_pct"] for r in group],
                    cmap="viridis_r",
                    vmin=0,
                    vmax=vmax,
                    label=label,
                )
    front = sorted((r for r in measured if r["frontier"]), key=lambda r: r["speedup"])
    if front:
        ax.plot([r["speedup"] for r in front], [r["niah_loss"] for r in front], "k--", lw=1, label="frontier")
    for r in rows:
        if r["label"] == result["chosen"]:
            ax.scatter([r["speedup"]], [r["niah_loss"]], s=160, facecolors="none", edgecolors="red", label="chosen")
    ax.axhline(budget_niah, color="red", lw=0.8, ls=":", label=f"NIAH budget ({budget_niah:g} pts)")
    ax.set(xlabel="TTFT speedup over exact (x)", ylabel="NIAH loss vs exact (points)", title=title)
    ax.grid(alpha=0.3)
    fig.colorbar(sc, ax=ax, label=f"tail PPL increase (%), budget {budget_ppl:g}%")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    from ridgefill.results import save_png

    return save_png(fig, path)
