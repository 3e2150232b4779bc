"""The exact prefill engine: embed -> per layer (norm, q/k/v, RoPE, attention, o, MLP) -> norm.

What it is: our own loop over the model's own modules, with rotary tables computed once,
row subsets (queries carry positions), and logits only for the rows that need them. It fills a
stock `DynamicCache`, so the unmodified model decodes from it. With nothing skipped it equals
the stock forward (tests/test_engine_equivalence.py). What it is not: a fill method; those live
in `ridgefill.methods` and reuse the pieces here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from ridgefill.errors import PromptError, RidgefillError
from ridgefill.models import hf
from ridgefill.models.device import synchronize
from ridgefill.models.loading import LoadedModel
from ridgefill.ops.attention import apply_rope, attend

RopeTables = dict[str, tuple[torch.Tensor, torch.Tensor]]
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


@dataclass(frozen=True)
class Plan:
    """Which rows ran which layers in a prefill that skipped work (the FLOP model reads it).

    Attributes:
        split: layers below it ran every row (the split layer of a fill, the gate layer of a gate).
        full: (F,) sorted positions that ran every layer.
        filled: bulk rows whose deep K/V were filled (0 for a gate).
        fill: identity, ridge, kva, or none (a gate).
        deep_keys: sorted key positions the deep layers hold; None when they hold every row.
        lower_pairs: visible query-key pairs per lower full-attention layer under a block-sparse
            kernel; None when the lower layers ran densely.
        resume: layers from it up ran every kept row again; None when none did.
        score_layer: the deeper layer a gate scored with, on every row's predicted input (a map
            GEMM and that layer's K projection per row); None when it scored at its own layer.
        refine: the layer where a two-stage gate narrowed its rows to `full`; None when it did not.
        middle: with `refine`, the sorted positions that ran layers [split, refine) and were the
            keys there.
    """

    split: int
    full: torch.Tensor
    filled: int
    fill: str
    deep_keys: torch.Tensor | None = None
    lower_pairs: list[int] | None = None
    resume: int | None = None
    score_layer: int | None = None
    refine: int | None = None
    middle: torch.Tensor | None = None


@dataclass
class PrefillResult:
    """What a prefill returns: a stock cache, logits for chosen rows, and its timing.

    `ran_exact` says every layer ran on every row (the method was exact, or it fell back to exact
    for a prompt too short to skip, with `reason`); otherwise `plan` says what was skipped.
    `diagnostics` holds optional per-row tensors for analysis (`row_scores`, `score_candidates`).
    """

    cache: DynamicCache
    logits: torch.Tensor  # (R, V) float32, one row per entry of logit_rows
    logit_rows: torch.Tensor  # (R,) prompt positions the logits belong to
    num_tokens: int
    seconds: float
    method: str
    ran_exact: bool = True
    plan: Plan | None = None
    reason: str = ""
    attn_seconds: float = 0.0  # the part of `seconds` spent in attention
    settings: dict | None = None  # the method's settings as it ran (resolved defaults included)
    diagnostics: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else float("inf")

    def as_exact(self, method: str, settings: dict | None, reason: str) -> PrefillResult:
        """This exact result, labelled as a method that fell back to exact."""
        self.method, self.settings, self.reason = method, settings, reason
        return self


@dataclass
class LowerState:
    """Layers [0, upto) run on every row of one prompt.

    Any method that runs those layers in full (exact, or a fill splitting at or above `upto`) can
    continue from it, so a paired evaluation computes them once per prompt. `seconds` is what they
    cost, so a method continuing from it can still report its whole prefill time.
    """

    input_ids: torch.Tensor  # (1, N)
    upto: int
    h: torch.Tensor  # (1, N, d): the input of layer `upto`
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer below `upto`: k, v (1, H_kv, N, hd)
    tables: RopeTables
    seconds: float
    attn_seconds: float = 0.0  # the part of `seconds` spent in attention
    sparse: tuple[float, int] | None = None  # (sparse_keep, block) when the layers ran block-sparse
    pairs: list[int] | None = None  # then: visible query-key pairs per full-attention layer


class Engine:
    """Runs a `LoadedModel`'s layers on chosen rows, borrowing its modules."""

    def __init__(self, lm: LoadedModel):
        self.lm = lm
        self.parts = lm.parts
        # Seconds spent inside attention calls since this engine was made; methods report the
        # difference across one prefill, so the bench can show attention-only time.
        self.attn_seconds = 0.0

    @property
    def dtype(self) -> torch.dtype:
        return self.lm.dtype  # read each time: a patched model may be moved or cast after patching

    @property
    def device(self) -> torch.device:
        return self.lm.device

    def clock(self) -> float:
        """`time.perf_counter()` once the device has finished its queued work (CUDA is async)."""
        synchronize(self.device)
        return time.perf_counter()

    # ----- pieces the fill methods reuse -----

    def check_prompt(self, input_ids: torch.Tensor) -> int:
        """Validate a (1, N) prompt; return N."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise PromptError(f"expected input_ids of shape (1, N), got {tuple(input_ids.shape)}")
        n = int(input_ids.shape[1])
        if n == 0:
            raise PromptError("the prompt is empty")
        if n > self.parts.context_length:
            raise PromptError(
                f"the prompt has {n} tokens but {self.lm.name} has a context of {self.parts.context_length}"
            )
        return n

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(1, N) -> (1, N, d); Gemma's embedding module applies its own scale."""
        return self.parts.embed(input_ids.to(self.device)).to(self.dtype)

    def rope(self, n: int, like: torch.Tensor) -> RopeTables:
        """cos/sin for positions 0..n-1, per layer type, each (1, n, head_dim)."""
        position_ids = torch.arange(n, device=like.device)[None]
        return hf.rotary_tables(self.parts, like, position_ids)

    def pre_rope_kv(self, layer_idx: int, x_normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(1, T, d) normed input -> k, v (1, H_kv, T, head_dim); k after k_norm, before RoPE."""
        lp = self.parts.layers[layer_idx]
        t = x_normed.shape[1]
        k = lp.k_proj(x_normed).view(1, t, lp.num_kv_heads, lp.head_dim).transpose(1, 2)
        v = lp.v_proj(x_normed).view(1, t, lp.num_kv_heads, lp.head_dim).transpose(1, 2)
        if lp.k_norm is not None:
            k = lp.k_norm(k)
        return k, v

    def project_kv(
        self, layer_idx: int, x_normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values from a layer's normed input.

        Args:
            x_normed: (1, T, d), already through the layer's input norm.
            cos, sin: (1, T, head_dim) for those rows.
        Returns:
            k, v: (1, H_kv, T, head_dim), k after k_norm and RoPE.
        """
        k, v = self.pre_rope_kv(layer_idx, x_normed)
        return apply_rope(k, cos, sin), v

    def project_q(self, layer_idx: int, x_normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """(1, T, d) normed input -> (1, H, T, head_dim) queries after q_norm and RoPE."""
        lp = self.parts.layers[layer_idx]
        t = x_normed.shape[1]
        q = lp.q_proj(x_normed).view(1, t, lp.num_heads, lp.head_dim).transpose(1, 2)
        if lp.q_norm is not None:
            q = lp.q_norm(q)
        return apply_rope(q, cos, sin)

    def finish_layer(self, layer_idx: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection, residuals and MLP.

        Args:
            h: (1, T, d) the layer's input rows.
            attn: (1, H, T, head_dim) their attention output.
        Returns:
            (1, T, d) the next layer's input.
        """
        lp = self.parts.layers[layer_idx]
        a = lp.o_proj(attn.transpose(1, 2).reshape(h.shape[0], h.shape[1], -1))
        if lp.attn_out_norm is not None:
            a = lp.attn_out_norm(a)
        h = h + a
        m = lp.mlp(lp.ffn_in_norm(h))
        if lp.ffn_out_norm is not None:
            m = lp.ffn_out_norm(m)
        return h + m

    def layer(
        self,
        layer_idx: int,
        h: torch.Tensor,
        pos: torch.Tensor,
        tables: RopeTables,
        extra_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        attention: AttentionFn | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run one layer fully on rows `pos`, attending to their own K/V plus `extra_kv`.

        Args:
            h: (1, T, d) inputs of the rows at positions `pos` (T,), ascending.
            tables: rotary tables for every prompt position.
            extra_kv: (k, v, positions) of rows filled by other means, or None.
            attention: replaces dense attention in full-attention layers when every row 0..T-1 runs
                (a sparse kernel, `ridgefill.methods.gate`); called as attention(q, k, v, scaling).
        Returns:
            (h_next (1, T, d), k_all, v_all (1, H_kv, T_all, hd), k_pos (T_all,)) with keys
            of the union of rows in position order.
        """
        lp = self.parts.layers[layer_idx]
        cos, sin = tables[lp.layer_type]
        cos, sin = cos[:, pos], sin[:, pos]
        x = lp.input_norm(h)
        q = self.project_q(layer_idx, x, cos, sin)
        k, v = self.project_kv(layer_idx, x, cos, sin)
        k_pos = pos
        if extra_kv is not None:
            k, v, k_pos = merge_by_position((k, v, pos), extra_kv)
        t0 = self.clock()
        if attention is not None and extra_kv is None and lp.sliding_window is None and len(pos) == int(pos[-1]) + 1:
            attn = attention(q, k, v, lp.scaling)
        else:
            attn = attend(q, k, v, pos, k_pos, lp.scaling, lp.sliding_window)
        self.attn_seconds += self.clock() - t0
        return self.finish_layer(layer_idx, h, attn), k, v, k_pos

    def logits(self, h_rows: torch.Tensor) -> torch.Tensor:
        """(R, d) final-layer states -> (R, V) float32 logits (final norm, head, soft-cap)."""
        out = self.parts.lm_head(self.parts.norm(h_rows)).float()
        cap = self.parts.final_logit_softcap
        if cap:
            out = torch.tanh(out / cap) * cap
        return out

    def logits_at(
        self, h: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor | None, what: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits for prompt positions `rows` (default the last) from the final states `h` (1, T, d)
        of the rows at sorted positions `pos` (T,); `what` names the rows that did not run, for the error.

        Returns (logits (R, V), rows (R,)).
        """
        rows = pos[-1:].clone() if rows is None else rows.to(pos.device)
        idx = torch.searchsorted(pos, rows)
        if (idx >= len(pos)).any() or not torch.equal(pos[idx.clamp(max=len(pos) - 1)], rows):
            raise RidgefillError(f"logits were asked for rows that {what}")
        return self.logits(h[0, idx]), rows

    def new_cache(self) -> DynamicCache:
        return hf.new_cache(self.lm.model)

    @torch.inference_mode()
    def run_lower(
        self,
        input_ids: torch.Tensor,
        upto: int,
        start: LowerState | None = None,
        attention: AttentionFn | None = None,
    ) -> LowerState:
        """Run layers [0, upto) on every row, continuing from `start` when it is for this prompt and below `upto`.

        `attention`: a sparse replacement for dense attention (see `layer`); `start` is then ignored,
        since the layers it ran were dense (and a block-sparse `start` is never continued densely).
        """
        n = self.check_prompt(input_ids)
        t0, a0 = self.clock(), self.attn_seconds
        dense_start = start is not None and start.sparse is None
        if attention is None and dense_start and start.upto <= upto and torch.equal(start.input_ids, input_ids):
            h, kv, tables, begin = start.h, list(start.kv), start.tables, start.upto
            before, attn_before = start.seconds, start.attn_seconds
        else:
            h = self.embed(input_ids)  # (1, N, d)
            kv, tables, begin, before, attn_before = [], self.rope(n, h), 0, 0.0, 0.0
        pos = torch.arange(n, device=self.device)
        for i in range(begin, upto):
            h, k, v, _ = self.layer(i, h, pos, tables, attention=attention)
            kv.append((k, v))
        seconds = before + self.clock() - t0
        return LowerState(input_ids, upto, h, kv, tables, seconds, attn_before + self.attn_seconds - a0)

    def cache_from(self, kv: list[tuple[torch.Tensor, torch.Tensor]], into: DynamicCache | None = None) -> DynamicCache:
        """A stock cache holding layers 0..len(kv)-1 (the tensors are shared, never written).

        `into`: an empty cache someone else made (transformers' `generate`) to fill instead of a new one.
        """
        cache = self.new_cache() if into is None else into
        for i, (k, v) in enumerate(kv):
            hf.cache_update(cache, k, v, i)
        return cache

    # ----- the exact path -----

    @torch.inference_mode()
    def prefill_exact(
        self,
        input_ids: torch.Tensor,
        logit_rows: torch.Tensor | None = None,
        lower: LowerState | None = None,
        cache: DynamicCache | None = None,
    ) -> PrefillResult:
        """Every layer on every row: must equal the stock forward.

        Args:
            input_ids: (1, N).
            logit_rows: positions whose logits to return; default the last one.
            lower: layers already run for this prompt (see `LowerState`); their time is counted.
            cache: an empty stock cache to fill (default: a new one).
        """
        n = self.check_prompt(input_ids)
        rows = torch.tensor([n - 1], device=self.device) if logit_rows is None else logit_rows.to(self.device)
        st = self.run_lower(input_ids, self.parts.num_layers, start=lower)
        t0 = self.clock()
        cache = self.cache_from(st.kv, into=cache)
        logits = self.logits(st.h[0, rows])
        seconds = st.seconds + self.clock() - t0
        return PrefillResult(cache, logits, rows, n, seconds, "exact", attn_seconds=st.attn_seconds)


def merge_by_position(
    a: tuple[torch.Tensor, torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Interleave two (k, v, pos) row sets into one, sorted by position.

    k and v are (1, H, T, D); pos is (T,). The two position sets must be disjoint.
    """
    ka, va, pa = a
    kb, vb, pb = b
    pos, order = torch.sort(torch.cat([pa, pb]))
    k = torch.cat([ka, kb], dim=2).index_select(2, order)
    v = torch.cat([va, vb], dim=2).index_select(2, order)
    return k, v, pos
