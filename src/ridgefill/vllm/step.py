"""One scheduler step of RidgeFill inside vLLM's paged KV cache.

What it is: given the batch vLLM scheduled (prefill chunks of several requests, decode steps of
others), the rows of every request are sorted into full rows (the first `sink` tokens of the
prompt, its last `tail` tokens counted from the prompt's end, outliers, every generated token)
and bulk rows (the rest of the prompt). Layers below the split run on every row with vLLM's own
attention metadata. For the bulk rows, each deep layer's K/V are computed from the ridge
prediction of that layer's input (through the layer's own norm, K/V projection and RoPE) and
written into the paged cache at the rows' slots. The deep layers then run on the full rows only:
each run of consecutive full rows [a, b) of a request is attended as a request of its own whose
sequence ends at b and which shares the real request's block table (attention kernels align a
request's queries to the end of its sequence, so this is plain causal attention over the cache).

What it is not: the decode path (steps without prompt rows run the stock model), nor the fill
arithmetic's reference (methods/fill.py, which this matches within float tolerance).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ridgefill.errors import RidgefillError
from ridgefill.fit.maps import FillMaps
from ridgefill.fit.ridge import fit_rows
from ridgefill.methods.fill import FillSettings
from ridgefill.methods.select import pick_spans, pool_scores, reduce_queries


@dataclass
class Rows:
    """The rows of one step. Tensors index the step's tokens, sorted.

    full: (F,) rows that run every layer; bulk: (B,) prompt rows whose deep K/V are filled;
    run_req, run_len: per run of consecutive full rows, its request and length.
    """

    full: torch.Tensor
    bulk: torch.Tensor
    run_req: torch.Tensor
    run_len: torch.Tensor


@dataclass
class Step:
    """Which request each scheduled row belongs to. req: (T,) request index; plen: (T,) its
    prompt length; pos: (T,) the row's position; qsl: (R+1,) where each request starts (T excludes
    padding)."""

    req: torch.Tensor
    plen: torch.Tensor
    pos: torch.Tensor
    qsl: torch.Tensor


def prompt_step(positions: torch.Tensor, query_start_loc: torch.Tensor, prompt_lens: torch.Tensor) -> Step | None:
    """The step's rows by request; None when no scheduled row is a prompt row (decode only).

    Args:
        positions: (T,) each scheduled token's position in its sequence (T may include padding).
        query_start_loc: (R+1,) where each request's tokens start in the step.
        prompt_lens: (R,) each request's prompt length.
    """
    device = positions.device
    qsl = query_start_loc.to(device=device, dtype=torch.long)
    if len(prompt_lens) != len(qsl) - 1:
        raise RidgefillError(f"vLLM scheduled {len(qsl) - 1} requests but reported {len(prompt_lens)} prompts")
    n_real = int(qsl[-1])
    pos = positions[:n_real].long()
    req = torch.searchsorted(qsl[1:], torch.arange(n_real, device=device), right=True)  # (T,)
    plen = prompt_lens.to(device=device, dtype=torch.long)[req]
    if not bool((pos < plen).any()):
        return None
    return Step(req, plen, pos, qsl)


def whole_prompt(step: Step, r: int) -> tuple[int, int] | None:
    """[a, b): the step's rows holding request r's whole prompt, when this step schedules all of it."""
    a, b = int(step.qsl[r]), int(step.qsl[r + 1])
    if b > a and int(step.pos[a]) == 0 and b - a >= int(step.plen[a]):
        return a, a + int(step.plen[a])
    return None


def split_rows(
    step: Step,
    settings_for: Callable[[int], FillSettings],
    stream: torch.Tensor,
    scores=None,
    ends: torch.Tensor | None = None,
) -> Rows:
    """Sort a step's rows into full and bulk. settings_for(prompt length) gives each request's
    settings (one configuration, or its length bucket's). stream: (T, d) split-layer states, for
    outlier rows (each request's median over its rows in this step; the whole prompt's when it is
    scheduled in one step, as in methods/fill.py).

    With `query_rows`, `scores(a, b)` gives the (b - a,) split-layer attention score of a whole
    prompt scheduled at rows [a, b), pooled over `query_pool` tokens, and the best-scoring spans
    run fully (methods/select.py; `ends`: (T,) sentence ends for `query_sentence`). A prompt split
    across steps gets none: its question arrives after its bulk was filled."""
    pos, req, qsl = step.pos, step.req, step.qsl
    reqs = [(r, int(qsl[r]), int(qsl[r + 1])) for r in range(len(qsl) - 1) if qsl[r + 1] > qsl[r]]
    per = {r: settings_for(int(step.plen[a])) for r, a, _ in reqs}  # each scheduled request's settings
    full = torch.zeros_like(pos, dtype=torch.bool)
    for r, a, b in reqs:
        s = per[r]
        full[a:b] = (pos[a:b] < s.sink) | (pos[a:b] >= step.plen[a:b] - s.tail)
        if s.outlier_factor is not None:
            full[a:b] |= ~fit_rows(stream[a:b], 0, s.outlier_factor)
    for r, _, _ in reqs:
        s = per[r]
        span = whole_prompt(step, r) if s.query_rows else None
        if span is None:
            continue
        a, b = span
        reach = s.query_sentence if ends is not None else 0
        picked = pick_spans(
            pool_scores(scores(a, b), s.query_pool),
            ~full[a:b],
            s.query_rows,
            s.query_window,
            ends[a:b] if reach else None,
            reach,
        )
        full[a:b] |= picked
    full_idx = full.nonzero().squeeze(1)
    bulk_idx = (~full).nonzero().squeeze(1)
    # Runs: consecutive full rows of one request.
    if full_idx.numel():
        breaks = torch.ones_like(full_idx, dtype=torch.bool)
        breaks[1:] = (full_idx[1:] != full_idx[:-1] + 1) | (req[full_idx[1:]] != req[full_idx[:-1]])
        starts = breaks.nonzero().squeeze(1)
        stops = torch.cat([starts[1:], starts.new_tensor([full_idx.numel()])])
        run_req, run_len = req[full_idx[starts]], stops - starts
    else:
        run_req = run_len = full_idx.new_zeros(0)
    return Rows(full_idx, bulk_idx, run_req, run_len)


def run_metadata(builder, rows: Rows, positions: torch.Tensor, block_table: torch.Tensor, slots: torch.Tensor):
    """Attention metadata for the full rows: one request per run, ending at its last row's
    position + 1 and sharing its request's block table row. Built by vLLM's own builder."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    device = positions.device
    lens = rows.run_len.to(torch.int32)
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(lens.cpu(), 0)
    last = rows.full[qsl[1:].long() - 1]
    seq_lens = (positions[last].long() + 1).to(torch.int32)
    cm = CommonAttentionMetadata(
        query_start_loc=qsl.to(device),
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens.to(device),
        num_reqs=len(lens),
        num_actual_tokens=int(rows.full.numel()),
        max_query_len=int(lens.max()) if len(lens) else 0,
        max_seq_len=int(seq_lens.max()) if len(lens) else 0,
        block_table_tensor=block_table[rows.run_req.to(block_table.device)],
        slot_mapping=slots[rows.full],
        causal=True,
        seq_lens_cpu_upper_bound=seq_lens.cpu(),
    )
    return builder.build(common_prefix_len=0, common_attn_metadata=cm)


def projection_rows(layer: torch.nn.Module, part: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A copy of the query (`part="q"`: (q_size, d)) or K/V (`"kv"`: (2 * kv_size, d)) rows of a
    layer's fused QKV projection, weight and bias, taken after loading and before vLLM's CPU path
    packs the weights away."""
    attn = layer.self_attn
    rows = slice(None, attn.q_size) if part == "q" else slice(attn.q_size, None)
    w, b = attn.qkv_proj.weight, getattr(attn.qkv_proj, "bias", None)
    b = None if b is None or b.numel() == 0 else b[rows].detach().clone()  # vLLM keeps empty biases
    return w[rows].detach().clone(), b


@torch.inference_mode()
def token_scores(
    layer: torch.nn.Module,
    q_w: tuple[torch.Tensor, torch.Tensor | None],
    kv_w: tuple[torch.Tensor, torch.Tensor | None],
    h: torch.Tensor,
    positions: torch.Tensor,
    last: int,
    top: int = 0,
) -> torch.Tensor:
    """(N,) attention the last `last` rows of one prompt pay each of its rows at `layer`, as
    methods/select.py's token_scores (per-head softmax, `reduce_queries` with `top`).
    h: (N, d) the layer's input (the split state, or its prediction); positions: (N,)."""
    attn = layer.self_attn
    n = h.shape[0]
    x = layer.input_layernorm(h)
    k, _ = layer_kv(layer, kv_w, x, positions)  # (N, Hkv, hd)
    qs = slice(max(0, n - last), n)
    q = F.linear(x[qs], *q_w)
    q, _ = attn.rotary_emb(positions[qs], q.contiguous())
    q = q.view(-1, attn.num_heads, attn.head_dim).transpose(0, 1)  # (H, Q, hd)
    k = k.transpose(0, 1).repeat_interleave(attn.num_heads // attn.num_kv_heads, dim=0)  # (H, N, hd)
    att = (q @ k.transpose(-1, -2)) * attn.scaling  # (H, Q, N), in the model dtype as our engine
    idx = torch.arange(n, device=h.device)
    att = att.masked_fill(idx[None, :] > idx[qs][:, None], float("-inf")).softmax(-1)
    return reduce_queries(att, top)


def layer_kv(
    layer: torch.nn.Module, kv: tuple[torch.Tensor, torch.Tensor | None], normed: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """K (after RoPE) and V of rows whose normed layer input is `normed` (N, d), through the
    layer's own K/V weights `kv` (`projection_rows`). Returns two (N, kv_heads, head_dim)."""
    attn = layer.self_attn
    kvs = F.linear(normed, *kv)  # (N, 2 * kv_size)
    k, v = kvs.split([attn.kv_size, attn.kv_size], dim=-1)
    return _rope_kv(attn, k, v, positions)


def _rope_kv(attn, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k, _ = attn.rotary_emb(positions, k.contiguous())  # the query slot rotates K; no key passed
    shape = (-1, attn.num_kv_heads, attn.head_dim)
    return k.reshape(shape), v.reshape(shape)


def write_kv(layer: torch.nn.Module, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Write K/V rows into this layer's paged cache at `slots`."""
    a = layer.self_attn.attn
    a.impl.do_kv_cache_update(a, k, v, a.kv_cache, slots)


def check_layers(layers, settings: FillSettings) -> None:
    """Refuse a model whose deep layers (and score layer) this step cannot fill or score (quantized
    or QK-normed)."""
    at = settings.query_layer
    below = [layers[at]] if at is not None and at < settings.split else []
    for layer in [*below, *layers[settings.split :]]:
        attn = layer.self_attn
        if getattr(attn, "qk_norm", False):
            raise RidgefillError("RidgeFill in vLLM does not support per-head QK norms yet")
        w = getattr(attn.qkv_proj, "weight", None)
        if w is None or w.dim() != 2 or not w.is_floating_point() or w.element_size() < 2:
            raise RidgefillError("RidgeFill in vLLM needs unquantized K/V projections")
        if not hasattr(attn.attn.impl, "do_kv_cache_update"):
            raise RidgefillError(f"vLLM's {type(attn.attn.impl).__name__} cannot write K/V rows; use CPU_ATTN")


@torch.inference_mode()
def fill_bulk(
    layers,
    kv: dict[int, tuple[torch.Tensor, torch.Tensor | None]],
    method: str,
    maps: FillMaps | None,
    split: int,
    x: torch.Tensor,
    positions: torch.Tensor,
    slots: dict[str, torch.Tensor],
) -> None:
    """Write every deep layer's K/V for bulk rows: split states `x` (B, d) at `positions` (B,).
    Layer `split` reads the split state itself (exact K/V); deeper ones read the fill's prediction.
    kv: each deep layer's K/V weights (`projection_rows`)."""

    def put(i: int, h: torch.Tensor) -> None:
        layer = layers[i]
        k, v = layer_kv(layer, kv[i], layer.input_layernorm(h), positions)
        write_kv(layer, k, v, slots[layer.self_attn.attn.layer_name])

    put(split, x)
    deep = range(split + 1, len(layers))
    if method == "identity":
        for i in deep:
            put(i, x)
        return
    w, b = maps.stacked(x.dtype, x.device)
    y = torch.addmm(b, x, w)  # (B, deep layers * out): every deep layer in one GEMM
    width = y.shape[1] // len(deep)
    for j, i in enumerate(deep):
        yi = y[:, j * width : (j + 1) * width]
        if method == "ridge":
            put(i, yi)
        else:  # kva: pre-RoPE K, then V
            attn = layers[i].self_attn
            k, v = _rope_kv(attn, *yi.split([attn.kv_size, attn.kv_size], dim=-1), positions)
            write_kv(layers[i], k, v, slots[attn.attn.layer_name])
