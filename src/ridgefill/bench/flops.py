"""A FLOP model of each prefill path: what it computes, counted in multiply-accumulates.

What it is: per-layer counts of projections, MLP, attention (keys actually visible under the
causal and sliding-window masks, or kept by a sparse kernel) and fill maps, for exact and for
the plan of what a skipping method ran (fill, gate). The ratio exact / method is the speedup
bound a perfect implementation would reach. What it is not: a timer; norms, RoPE, softmax and
the gate's scoring are left out as lower-order terms (except a gate's scoring at a predicted
deeper layer, which maps and projects every row).
"""

from __future__ import annotations

import torch

from ridgefill.engine import Plan
from ridgefill.models.hf import ModelParts


def _attn_macs(rows, window: int | None, heads: int, head_dim: int, keys: torch.Tensor | None = None) -> int:
    """QK^T and PV: 2 * head_dim MACs per (query, visible key, head).

    rows: query positions; keys: sorted key positions (default every position up to the last row).
    A key is visible when it is at or before the query and, with a window W, less than W behind it.
    """
    q = torch.as_tensor(list(rows) if isinstance(rows, range) else rows, dtype=torch.long)
    if q.numel() == 0:
        return 0
    k = torch.arange(int(q.max()) + 1) if keys is None else keys
    seen = torch.searchsorted(k, q, right=True)
    if window is not None:
        seen = seen - torch.searchsorted(k, q - window, right=True)
    return int(seen.sum()) * heads * head_dim * 2


def layer_costs(parts: ModelParts, i: int) -> dict[str, int]:
    """Per-row MACs of one layer's pieces."""
    lp = parts.layers[i]
    d = parts.hidden_size
    q = lp.num_heads * lp.head_dim
    kv = lp.num_kv_heads * lp.head_dim
    mlp = sum(m.weight.numel() for m in lp.mlp.modules() if hasattr(m, "weight") and m.weight.dim() == 2)
    return {"q": d * q, "kv": 2 * d * kv, "o": q * d, "mlp": mlp, "kv_out": 2 * kv}


def exact_macs(parts: ModelParts, n: int) -> int:
    total = 0
    for i, lp in enumerate(parts.layers):
        c = layer_costs(parts, i)
        total += n * (c["q"] + c["kv"] + c["o"] + c["mlp"])
        total += _attn_macs(range(n), lp.sliding_window, lp.num_heads, lp.head_dim)
    return total


def plan_macs(parts: ModelParts, n: int, plan: Plan) -> int:
    """MACs of a skipping prefill described by its `plan` (`PrefillResult.plan`; see `Plan`).

    Deep keys default to every row; lower layers to dense attention; no layer resumes by default;
    a two-stage gate runs `middle` from the split to `refine` and `full` from there.
    """
    d = parts.hidden_size
    split, n_fill, fill = plan.split, plan.filled, plan.fill
    full = torch.as_tensor(plan.full, dtype=torch.long).cpu()
    keys = None if plan.deep_keys is None else torch.as_tensor(plan.deep_keys).cpu()
    middle = None if plan.refine is None else torch.as_tensor(plan.middle, dtype=torch.long).cpu()
    lower_pairs = list(plan.lower_pairs or [])
    resume = plan.resume or len(parts.layers)
    total = n_fill * (d + 1) * d if fill == "ridge" and resume < len(parts.layers) else 0  # resume's input
    if plan.score_layer is not None:  # every row's predicted input of the score layer, and its keys
        total += n * ((d + 1) * d + layer_costs(parts, plan.score_layer)["kv"] // 2)
    for i, lp in enumerate(parts.layers):
        c = layer_costs(parts, i)
        per_attn_pair = lp.num_heads * lp.head_dim * 2
        if i >= resume:
            rows = torch.arange(n) if keys is None else torch.as_tensor(keys, dtype=torch.long)
            total += len(rows) * (c["q"] + c["kv"] + c["o"] + c["mlp"])
            total += _attn_macs(rows, lp.sliding_window, lp.num_heads, lp.head_dim, keys)
            continue
        if i < split:
            total += n * (c["q"] + c["kv"] + c["o"] + c["mlp"])
            if lower_pairs and lp.sliding_window is None:
                total += lower_pairs.pop(0) * per_attn_pair
            else:
                total += _attn_macs(range(n), lp.sliding_window, lp.num_heads, lp.head_dim)
            continue
        rows, seen = (middle, middle) if middle is not None and i < plan.refine else (full, keys)
        total += len(rows) * (c["q"] + c["kv"] + c["o"] + c["mlp"])
        total += _attn_macs(rows, lp.sliding_window, lp.num_heads, lp.head_dim, seen)
        if fill == "none":
            continue
        if i == split or fill == "identity":
            total += n_fill * c["kv"]
        elif fill == "ridge":
            total += n_fill * ((d + 1) * d + c["kv"])
        elif fill == "kva":
            total += n_fill * (d + 1) * c["kv_out"]
    return total


def fill_macs(parts: ModelParts, n: int, method: str, split: int, full: list[int]) -> int:
    """MACs of a fill prefill whose full rows are the positions `full` (every other row filled)."""
    return plan_macs(parts, n, Plan(split=split, full=torch.as_tensor(full), filled=n - len(full), fill=method))
