"""`ridgefill.patch(model, method=...)`: the user's own transformers model, faster.

What it is: the returned object is the same model. A forward call that is a prefill (no cache yet,
`input_ids` given, batch 1, prompt longer than `sink + tail`) runs our prefill with the chosen
method and fills the cache that `generate` passed in; every other call (decode steps, short
prompts, `labels`, `inputs_embeds`, custom positions) runs the stock forward untouched, so
`generate`'s own arguments (sampling, `max_new_tokens`, `streamer`) all work. `unpatch` restores
the model exactly. The method is resolved once, as everywhere (methods/resolve.py): by default
`tuned` where the model has a tuned configuration, else exact.

Logits: rows that ran every layer (sinks, tail) carry real logits. Rows that skipped deep layers
never reach the head; with a skipping method and `logits_to_keep=0` (all rows) they are NaN,
so nothing downstream can mistake them for predictions. `logits_to_keep=k` with k <= tail gives
exactly the last k rows. What it is not: batching (batch size > 1 is refused on the prefill path).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ridgefill.engine import Engine
from ridgefill.errors import RidgefillError
from ridgefill.fit.maps import FillMaps
from ridgefill.methods import Prefill, resolve_prefill
from ridgefill.models import hf
from ridgefill.models.loading import LoadedModel


@dataclass
class PatchState:
    """How a patched model prefills, and how often each path ran."""

    prefill: Prefill
    ours: int = 0  # prefills our engine answered
    stock: int = 0  # calls passed to the stock forward
    engine: Engine | None = field(default=None, repr=False)

    @property
    def method(self) -> str:
        return self.prefill.method

    @property
    def settings(self):
        return self.prefill.settings

    def threshold(self, n: int) -> int:
        """Prompts of `n` tokens take the stock path when `n` is at most this."""
        s = self.prefill.for_length(n).settings
        return 0 if s is None else s.sink + s.tail


def patch(
    model: torch.nn.Module | LoadedModel,
    maps: FillMaps | str | Path | None = None,
    method: str | None = None,
    *,
    tokenizer: Any = None,
    name: str | None = None,
    fit_missing: bool = True,
    **settings: Any,
) -> torch.nn.Module:
    """Make `model`'s prefill run `method`; return the same (transformers) model.

    Args:
        model: a transformers causal LM, or a `LoadedModel` (`ridgefill.load_model`), which brings
            its short name and tokenizer.
        maps: fitted maps, a map file or folder, or a tuned bundle (default: the model's cache folder).
        method: any method name (`tuned`, `ridge`, `gated-ridge`, ...); None: `tuned` where the model
            has a tuned configuration, else exact.
        tokenizer: the model's tokenizer; needed to fit maps on first use and for sentence spans
            (`query_sentence`). Default: the LoadedModel's.
        name: the model's short name (e.g. `smollm2-135m`), under which tuned configurations and
            cached maps are found; default the LoadedModel's, else the config's `name_or_path`.
        fit_missing: fit missing maps on first use (else refuse).
        settings: the method's settings by name (split, sink, tail, ...), checked.
    """
    if isinstance(model, LoadedModel):
        lm = LoadedModel(model.model, tokenizer or model.tokenizer, name or model.name, model.parts)
    else:
        # A folder or hub id names the model by its last part (as load_model does), never a path.
        label = name or Path(getattr(model.config, "name_or_path", "") or "model").name or "model"
        lm = LoadedModel(model, tokenizer, label, hf.model_parts(model))
    # Fitting reads text, which needs the tokenizer: without one, missing maps are refused instead.
    prefill = resolve_prefill(lm, method, maps=maps, fit_missing=fit_missing and lm.tokenizer is not None, **settings)
    if lm.tokenizer is None and any(p.settings is not None and p.settings.reads_sentences for p in prefill.variants):
        raise RidgefillError(f"{prefill.label} finds sentence ends with the tokenizer: patch(model, tokenizer=...)")
    state = PatchState(prefill, engine=Engine(lm))
    hf.wrap_forward(lm.model, lambda call: _answer(state, call), state)
    return lm.model


def unpatch(model: torch.nn.Module | LoadedModel) -> torch.nn.Module:
    """Undo `patch`: the model's forward is its class's own again."""
    model = model.model if isinstance(model, LoadedModel) else model
    hf.unwrap_forward(model)
    return model


def patch_state(model: torch.nn.Module | LoadedModel) -> PatchState | None:
    """The patch of `model` (method, settings, call counts), or None."""
    return hf.patch_state(model.model if isinstance(model, LoadedModel) else model)


def _answer(state: PatchState, call: hf.ForwardCall):
    """Our prefill's (logits, cache) for this call, or None to let the stock forward run."""
    if not call.is_prefill or call.other_inputs:
        state.stock += 1
        return None
    ids = call.input_ids
    n = int(ids.shape[-1])
    if ids.shape[0] != 1:
        raise RidgefillError(f"ridgefill.patch runs batch size 1; this prefill has batch {ids.shape[0]}")
    if n <= state.threshold(n) or not _plain_positions(call, n):
        state.stock += 1
        return None
    keep = call.logits_to_keep
    s = state.prefill.for_length(n).settings
    if not isinstance(keep, int) or s is not None and keep > s.tail:
        state.stock += 1  # logits asked for rows that would skip deep layers
        return None
    if keep > 0:
        rows = torch.arange(n - keep, n)
    elif s is not None:
        rows = torch.cat([torch.arange(min(s.sink, n - s.tail)), torch.arange(n - s.tail, n)])
    else:
        rows = torch.arange(n)
    # Fill the cache the caller (generate) made, so that it keeps its own object.
    res = state.prefill.run(state.engine, ids, logit_rows=rows.to(ids.device), cache=call.cache)
    state.ours += 1
    logits = res.logits[None]
    if keep == 0 and len(rows) < n:
        full = torch.full((1, n, logits.shape[-1]), float("nan"), dtype=logits.dtype, device=logits.device)
        full[0, rows.to(logits.device)] = logits[0]
        logits = full
    return logits, (None if call.use_cache is False and call.cache is None else res.cache)


def _plain_positions(call: hf.ForwardCall, n: int) -> bool:
    """No padding and positions 0..n-1: anything else is left to the stock forward."""
    if call.attention_mask is not None and not bool(call.attention_mask.all()):
        raise RidgefillError("ridgefill.patch runs unpadded batch-size-1 prompts; this one has padding")
    return call.position_ids is None or torch.equal(call.position_ids.reshape(-1).cpu(), torch.arange(n))
