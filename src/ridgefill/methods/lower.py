"""Lower layers shared by the skipping methods: dense or block-sparse, reused across methods.

What it is: the pieces both TokenGate (methods/gate.py) and the fill (methods/fill.py) run before
they part ways: the layers below their split (or gate) layer on every row, optionally with
block-sparse attention, and the rows a sliding-window layer above must keep. What it is not: a
prefill method.
"""

from __future__ import annotations

import torch

from ridgefill.engine import Engine, LowerState
from ridgefill.errors import RidgefillError
from ridgefill.ops.sparse import block_layout, block_sparse_attend


def check_fraction(name: str, value: float) -> None:
    if not 0 < value <= 1:
        raise RidgefillError(f"{name} must be in (0, 1], got {value}")


class SparseAttention:
    """Block-sparse attention for full-attention layers below the gate; records the pairs it computed."""

    def __init__(self, keep: float, block: int):
        self.keep, self.block = keep, block
        self.pairs: list[int] = []  # visible (query, key) pairs per call, for the FLOP model

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        layout = block_layout(q, k, self.block, scaling, self.keep)
        n = q.shape[2]
        rows = torch.full((layout.shape[0],), self.block, device=layout.device)
        rows[-1] = n - self.block * (layout.shape[0] - 1)
        off_diag = torch.tril(layout, diagonal=-1).sum(1)
        self.pairs.append(int((off_diag * self.block * rows + rows * (rows + 1) // 2).sum()))
        return block_sparse_attend(q, k, v, layout, self.block, scaling)


def run_lower(engine: Engine, ids: torch.Tensor, upto: int, sparse_keep: float, block: int, lower: LowerState | None):
    """Layers [0, upto) on every row, dense or block-sparse; returns (state, pairs or None).

    `lower` is reused when it fits: a dense state continues densely; a block-sparse one only when it
    is this prompt's, at `upto`, with the same `sparse_keep` and `block` (a tuner's shared pass).
    """
    if sparse_keep >= 1:
        return engine.run_lower(ids, upto, start=lower), None
    if (
        lower is not None
        and lower.sparse == (sparse_keep, block)
        and lower.upto == upto
        and torch.equal(lower.input_ids, ids)
    ):
        return lower, lower.pairs
    attn = SparseAttention(sparse_keep, block)
    st = engine.run_lower(ids, upto, attention=attn)
    st.sparse, st.pairs = (sparse_keep, block), attn.pairs
    return st, attn.pairs


def sliding_rows(engine: Engine, first_layer: int) -> int:
    """How many of the prompt's last rows layers >= `first_layer` must hold: a sliding-window layer's
    cache keeps its last window - 1 rows and treats them as contiguous, so none of them may be dropped."""
    windows = [lp.sliding_window - 1 for lp in engine.parts.layers[first_layer:] if lp.sliding_window]
    return max(windows, default=0)
