"""Per-layer fill error: how far each method's predicted deep inputs, K and V are from exact.

What it is: on held-out documents, the exact forward gives every layer's true input and K/V;
each fill method predicts them from the split state. The relative error
sqrt(sum |pred - true|^2 / sum |true|^2) is reported per deep layer and per position bucket,
as JSON and as a plot. What it is not: an end-task score; tail perplexity and RULER are.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ridgefill.engine import Engine
from ridgefill.fit.maps import MAP_METHODS, FillMaps
from ridgefill.fit.ridge import layer_inputs
from ridgefill.ops.norm import rms_normed

WHATS = ("input", "k", "v")  # what is compared: the deep layer's input, its K, its V


def _kv_rows(engine: Engine, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, d) layer inputs -> pre-RoPE K and V, each (n, H_kv * head_dim)."""
    k, v = engine.pre_rope_kv(layer, engine.parts.layers[layer].input_norm(x[None]))
    return k[0].transpose(0, 1).flatten(1), v[0].transpose(0, 1).flatten(1)


@torch.inference_mode()
def fill_errors(
    engine: Engine, docs: list[list[int]], split: int, maps: dict[str, FillMaps], buckets: int = 5, skip_first: int = 4
) -> dict:
    """Relative error per method -> layer -> {"input", "k", "v"} -> list over position buckets.

    `maps` holds "ridge" and/or "kva" maps for `split`; identity needs none. The first
    `skip_first` rows (attention sinks, run fully by every fill) are left out.
    """
    methods = ["identity", *[m for m in MAP_METHODS if m in maps]]
    num_layers = engine.parts.num_layers
    sums: dict = {}
    for ids in docs:
        states = layer_inputs(engine, torch.tensor([ids]))
        n = len(ids)
        x = states[split][0]
        bucket = (torch.arange(n) * buckets // n).clamp(max=buckets - 1)
        keep = torch.arange(n) >= skip_first
        for li in range(split + 1, num_layers):
            true_in = states[li][0]
            true_k, true_v = _kv_rows(engine, li, true_in)
            for m in methods:
                if m == "kva":
                    w = maps["kva"].weights[li].to(x.dtype)
                    kv = x @ w[:-1] + w[-1]
                    pred = {"k": kv[:, : true_k.shape[1]], "v": kv[:, true_k.shape[1] :]}
                else:
                    w = maps["ridge"].weights[li].to(x.dtype) if m == "ridge" else None
                    pin = x if w is None else x @ w[:-1] + w[-1]
                    k, v = _kv_rows(engine, li, pin)
                    # Inputs are compared after RMS normalisation: the layer reads them through
                    # an RMSNorm, so only their direction reaches K and V.
                    pred = {"input": rms_normed(pin), "k": k, "v": v}
                true = {"input": rms_normed(true_in), "k": true_k, "v": true_v}
                for what, p in pred.items():
                    err = ((p - true[what]).float() ** 2).sum(1)
                    ref = (true[what].float() ** 2).sum(1)
                    acc = sums.setdefault((m, li, what), torch.zeros(2, buckets, dtype=torch.float64))
                    acc[0].index_add_(0, bucket[keep], err[keep].double())
                    acc[1].index_add_(0, bucket[keep], ref[keep].double())
    out: dict = {m: {} for m in methods}
    for (m, li, what), acc in sums.items():
        out[m].setdefault(str(li), {})[what] = [round(float(v), 4) for v in (acc[0] / acc[1]).sqrt()]
    return out


def plot_fill_errors(errors: dict, split: int, title: str, path: str | Path) -> Path:
    """Three panels (input, K, V): error per deep layer, one line per method (mean over buckets)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4), sharey=True)
    for ax, what in zip(axes, WHATS, strict=True):
        for m, layers in errors.items():
            xs = [int(li) for li, e in layers.items() if what in e]
            ys = [sum(e[what]) / len(e[what]) for e in layers.values() if what in e]
            if xs:
                ax.plot(xs, ys, marker="o", ms=3, label=m)
        ax.set_title({"input": "deep-layer input", "k": "K (pre-RoPE)", "v": "V"}[what])
        ax.set_xlabel(f"layer (split {split})")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("relative error")
    axes[1].legend()  # the K panel has every method (kva has no input panel line)
    fig.suptitle(title)
    from ridgefill.results import save_png

    return save_png(fig, path)
