"""Rotary embedding and position-masked attention over arbitrary row subsets.

What it is: pure torch kernels. Queries and keys carry explicit positions, so a caller can run
any subset of rows (the fill methods run different rows through different layers) against keys
gathered from elsewhere. Queries are processed in chunks, so no (N, N) score matrix is built
for a long prompt. What it is not: aware of any model; norms and projections live in the engine.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(..., D) -> (..., D): [-x2, x1], the half-split RoPE convention transformers uses."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate heads by their positions.

    Args:
        x: (B, H, T, D).
        cos, sin: (B, T, D) for the same T rows.
    """
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scaling: float,
    window: int | None = None,
    chunk: int = 1024,
) -> torch.Tensor:
    """Causal (optionally sliding-window) attention by position, chunked over queries.

    A query at position p sees keys at positions p' with p' <= p and, with a window W,
    p - p' < W (transformers' sliding-window rule).

    Args:
        q: (B, Hq, Tq, D) queries.
        k, v: (B, Hkv, Tk, D) keys and values; Hq must be a multiple of Hkv (GQA).
        q_pos: (Tq,) positions of the queries.
        k_pos: (Tk,) positions of the keys, sorted ascending.
        scaling: softmax scale applied to q.k.
        window: sliding window size, or None for full causal attention.
        chunk: queries per block; bounds the mask and scores at (chunk, Tk).
    Returns:
        (B, Hq, Tq, D).
    """
    if window is None and q_pos.shape == k_pos.shape and bool((q_pos == k_pos).all()):
        # Square causal case (the exact path): the fused kernel needs no mask and never builds
        # the (N, N) scores; on CPU it runs about 2x faster than a masked call.
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
    out = torch.empty_like(q)
    for s in range(0, q.shape[2], chunk):
        qp = q_pos[s : s + chunk]
        # Keys past the chunk's last query, or before its first query's window, are never seen.
        hi = int(torch.searchsorted(k_pos, qp.max(), right=True))
        lo = 0 if window is None else int(torch.searchsorted(k_pos, qp.min() - window + 1))
        kp = k_pos[lo:hi]
        mask = kp[None, :] <= qp[:, None]  # (tq, tk)
        if window is not None:
            mask &= (qp[:, None] - kp[None, :]) < window
        out[:, :, s : s + chunk] = F.scaled_dot_product_attention(
            q[:, :, s : s + chunk],
            k[:, :, lo:hi],
            v[:, :, lo:hi],
            attn_mask=mask,
            scale=scaling,
            enable_gqa=True,
        )
    return out
