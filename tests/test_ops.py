"""Position-masked attention == a naive softmax over an explicit mask."""

from __future__ import annotations

import pytest
import torch

from ridgefill.ops.attention import attend


def _naive(q, k, v, q_pos, k_pos, scaling, window):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * scaling
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= (q_pos[:, None] - k_pos[None, :]) < window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), v)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("subset", ["all", "tail", "scattered"])
def test_attend_matches_naive(window, subset):
    g = torch.Generator().manual_seed(0)
    n = 40
    k_pos = torch.arange(n)
    q_pos = {"all": k_pos, "tail": torch.arange(30, n), "scattered": torch.tensor([0, 3, 17, 18, 39])}[subset]
    q = torch.randn(1, 4, len(q_pos), 8, generator=g)
    k = torch.randn(1, 2, n, 8, generator=g)
    v = torch.randn(1, 2, n, 8, generator=g)
    got = attend(q, k, v, q_pos, k_pos, 0.3, window, chunk=3)
    torch.testing.assert_close(got, _naive(q, k, v, q_pos, k_pos, 0.3, window), atol=1e-5, rtol=0)
