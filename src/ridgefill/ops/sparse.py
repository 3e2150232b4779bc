"""Block-sparse causal attention for a square prompt, and a cheap estimate of which blocks matter.

What it is: pure torch. The prompt's N rows are cut into blocks of `block` rows; query block i
attends only to the key blocks a boolean layout (nb, nb) keeps (the diagonal block with its
causal triangle). Each query block gathers its kept key blocks and runs one fused attention
call, so no (N, N) score matrix is ever built. `block_layout` chooses the blocks from pooled
query/key block means (the estimate MInference's block-sparse pattern and FlexPrefill use).
What it is not: a fast kernel. It is the reference the gated methods run on CPU, tested against
dense attention (with every block kept, it equals dense).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def block_sparse_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: torch.Tensor, block: int, scaling: float
) -> torch.Tensor:
    """Causal attention where query block i sees key block j only if layout[i, j].

    Args:
        q: (B, Hq, N, D); k, v: (B, Hkv, N, D), rows at positions 0..N-1; Hq a multiple of Hkv.
        layout: (nb, nb) bool with nb = ceil(N / block); entries above the diagonal are ignored and
            the diagonal is always kept (a row must see itself).
        block: rows per block.
        scaling: softmax scale.
    Returns:
        (B, Hq, N, D).
    """
    n = q.shape[2]
    nb = -(-n // block)
    if layout.shape != (nb, nb):
        raise ValueError(f"layout must be ({nb}, {nb}) for {n} rows in blocks of {block}, got {tuple(layout.shape)}")
    keep = torch.tril(layout, diagonal=-1)  # strictly below the diagonal; the diagonal is added last
    dev = q.device
    tri = torch.ones(block, block, dtype=torch.bool, device=dev).tril()  # (block, block) causal within a block
    out = torch.empty_like(q)
    for i in range(nb):
        lo, hi = i * block, min(n, (i + 1) * block)
        cols = keep[i].nonzero().squeeze(1)  # kept earlier blocks, ascending
        idx = (cols[:, None] * block + torch.arange(block, device=dev)).reshape(-1)
        idx = torch.cat([idx, torch.arange(lo, hi, device=dev)])  # (Tk,) earlier blocks then the diagonal block
        mask = torch.ones(hi - lo, idx.shape[0], dtype=torch.bool, device=dev)
        mask[:, -(hi - lo) :] = tri[: hi - lo, : hi - lo]
        out[:, :, lo:hi] = F.scaled_dot_product_attention(
            q[:, :, lo:hi],
            k.index_select(2, idx),
            v.index_select(2, idx),
            attn_mask=mask,
            scale=scaling,
            enable_gqa=True,
        )
    return out


def block_means(x: torch.Tensor, block: int) -> torch.Tensor:
    """(B, H, N, D) -> (B, H, nb, D): the mean of each block of rows (the last may be short)."""
    b, h, n, d = x.shape
    nb = -(-n // block)
    pad = nb * block - n
    sums = F.pad(x, (0, 0, 0, pad)).view(b, h, nb, block, d).sum(3)
    counts = torch.full((nb,), float(block), dtype=x.dtype, device=x.device)
    counts[-1] = block - pad
    return sums / counts[:, None]


def block_layout(
    q: torch.Tensor,
    k: torch.Tensor,
    block: int,
    scaling: float,
    keep: float,
    sink_blocks: int = 1,
    local_blocks: int = 1,
) -> torch.Tensor:
    """Choose key blocks per query block from pooled estimates.

    Scores are softmax(mean_q . mean_k * scaling) over the causal blocks, averaged over heads; each
    query block keeps its `sink_blocks` first blocks, its diagonal and `local_blocks` blocks before
    it, then its highest-scoring other blocks until `keep` of its causal blocks are kept.

    Args:
        q: (B, Hq, N, D); k: (B, Hkv, N, D). B must be 1.
        keep: fraction in (0, 1] of each query block's causal key blocks to keep.
    Returns:
        (nb, nb) bool layout for `block_sparse_attend`.
    """
    if not 0 < keep <= 1:
        raise ValueError(f"keep must be in (0, 1], got {keep}")
    qm, km = block_means(q, block)[0], block_means(k, block)[0]  # (Hq, nb, D), (Hkv, nb, D)
    km = km.repeat_interleave(qm.shape[0] // km.shape[0], dim=0)
    nb = qm.shape[1]
    causal = torch.ones(nb, nb, dtype=torch.bool, device=q.device).tril()
    est = ((qm @ km.transpose(-1, -2)) * scaling).masked_fill(~causal, float("-inf")).softmax(-1).mean(0)  # (nb, nb)
    i = torch.arange(nb, device=q.device)
    fixed = (i[None, :] < sink_blocks) | ((i[:, None] - i[None, :]).clamp(min=0) <= local_blocks)
    fixed &= causal
    budget = torch.ceil(keep * (i + 1)).long()  # blocks to keep per query block
    rank = est.masked_fill(fixed, float("inf")).masked_fill(~causal, float("-inf")).argsort(-1, descending=True)
    order = torch.empty_like(rank)
    order.scatter_(1, rank, i.expand(nb, nb).contiguous())  # position of each block in its row's ranking
    return ((order < budget[:, None]) | fixed) & causal
