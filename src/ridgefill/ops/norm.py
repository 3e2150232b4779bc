"""Scale-free normalisation used by fitting and diagnostics."""

from __future__ import annotations

import torch


def rms_normed(x: torch.Tensor) -> torch.Tensor:
    """(..., d) -> x / RMS(x) over the last dim: an RMSNorm without weight or epsilon."""
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True)).to(x.dtype)
