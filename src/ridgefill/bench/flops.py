"""A FLOP model of each prefill path: what it computes, counted in multiply-accumulates.

What it is: per-layer counts of projections, MLP, attention (keys actually visible under the
causal and sliding-window masks) and fill maps, for exact and for a fill configuration. The
ratio exact / method is the speedup bound a perfect implementation would reach. What it is
not: a timer; norms, RoPE and softmax are left out as lower-order terms.
"""

from __future__ import annotations

from ridgefill.models.hf import ModelParts


def _visible(pos: int, window: int | None) -> int:
    return pos + 1 if window is None else min(pos + 1, window)


def _attn_macs(rows: list[int] | range, window: int | None, heads: int, head_dim: int) -> int:
    # QK^T and PV: 2 * head_dim MACs per (query, visible key, head).
    return sum(_visible(p, window) for p in rows) * heads * head_dim * 2


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


def fill_macs(parts: ModelParts, n: int, method: str, split: int, full: list[int]) -> int:
    """MACs of a fill prefill whose full rows are the positions `full`."""
    d = parts.hidden_size
    n_bulk = n - len(full)
    total = 0
    for i, lp in enumerate(parts.layers):
        c = layer_costs(parts, i)
        if i < split:
            total += n * (c["q"] + c["kv"] + c["o"] + c["mlp"])
            total += _attn_macs(range(n), lp.sliding_window, lp.num_heads, lp.head_dim)
            continue
        total += len(full) * (c["q"] + c["kv"] + c["o"] + c["mlp"])
        total += _attn_macs(full, lp.sliding_window, lp.num_heads, lp.head_dim)
        if i == split or method == "identity":
            total += n_bulk * c["kv"]
        elif method == "ridge":
            total += n_bulk * ((d + 1) * d + c["kv"])
        elif method == "kva":
            total += n_bulk * (d + 1) * c["kv_out"]
    return total
