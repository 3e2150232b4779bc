"""Tail perplexity: NLL of a prompt's last tokens under each method, paired against exact.

What it is: for held-out documents cut to a given length, each method prefills the whole
document and returns logits for the tail rows; the NLL of the tokens they predict is compared
with exact's on the same documents. What it is not: RULER retrieval (eval/ruler.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ridgefill.engine import Engine, LowerState, PrefillResult
from ridgefill.eval.runner import bootstrap_ci
from ridgefill.methods import Prefill


def shared_lower(engine: Engine, ids: torch.Tensor, specs: list[Prefill]) -> LowerState | None:
    """The layers every spec runs in full on this prompt, run once (None when only exact is there)."""
    n = int(ids.shape[-1])
    splits = [s.for_length(n).runs_fully_below for s in specs if s.for_length(n).runs_fully_below]
    return engine.run_lower(ids, min(splits)) if splits else None


def tail_rows(n: int, tail: int) -> torch.Tensor:
    """The rows whose logits predict the last `tail - 1` tokens of an `n`-token document."""
    return torch.arange(n - tail, n - 1)


def scored_nll(res: PrefillResult, ids: torch.Tensor) -> float:
    """Mean NLL (nats) of the tokens that `res`'s logit rows predict in the (1, N) prompt `ids`."""
    return float(F.cross_entropy(res.logits, ids[0].to(res.logits.device)[res.logit_rows + 1]))


def increase_pct(nll: float, exact_nll: float) -> float:
    """Perplexity increase (%) of a mean NLL over exact's."""
    return 100 * (math.exp(nll - exact_nll) - 1)


@torch.inference_mode()
def tail_nll(engine: Engine, ids: list[int], spec: Prefill, tail: int, lower: LowerState | None = None) -> float:
    """Mean NLL (nats) of the last `tail - 1` tokens of `ids`, predicted from the tail rows."""
    x = torch.tensor([ids])
    res = spec.run(engine, x, logit_rows=tail_rows(x.shape[1], tail), lower=lower)
    return scored_nll(res, x)


def tail_ppl(engine: Engine, docs: list[list[int]], specs: list[Prefill], tail: int) -> list[dict]:
    """Every method on every document; returns one row per method with NLL, PPL and delta vs exact.

    Each row also lists its per-document mean NLL (`doc_nll`, in document order) and, where exact
    ran, each document's perplexity increase (`doc_ppl_increase_pct`) and a 95% bootstrap interval of
    the increase over documents (`ppl_increase_ci95`): the spread across documents says how far a few
    documents' mean can be trusted.
    """
    nll = {s.label: [] for s in specs}
    for ids in tqdm(docs, desc="tail perplexity: documents", unit="doc"):
        lower = shared_lower(engine, torch.tensor([ids]), specs)
        for s in specs:
            nll[s.label].append(tail_nll(engine, ids, s, tail, lower))
    exact = sum(nll["exact"]) / len(docs) if "exact" in nll else None
    rows = []
    for s in specs:
        mean = sum(nll[s.label]) / len(docs)
        row = {"method": s.label, "length": len(docs[0]), "docs": len(docs), "tail": tail}
        row.update(tail_nll=round(mean, 5), ppl=round(math.exp(mean), 4), doc_nll=[round(x, 5) for x in nll[s.label]])
        if exact is not None:
            row["ppl_increase_pct"] = round(increase_pct(mean, exact), 2)
            diffs = [m - e for m, e in zip(nll[s.label], nll["exact"], strict=True)]
            row["doc_ppl_increase_pct"] = [round(increase_pct(d, 0.0), 2) for d in diffs]
            row["ppl_increase_ci95"] = [round(increase_pct(d, 0.0), 2) for d in bootstrap_ci(diffs, digits=None)]
        rows.append(row)
    return rows
