"""`ridgefill.patch(model, maps=..., method="ridge")`: the user's own transformers model, faster.

What it is: the returned object is the same model. A forward call that is a prefill (no cache yet,
`input_ids` given, batch 1, prompt longer than `sink + tail`) runs our prefill with the chosen
method and fills the cache that `generate` passed in; every other call (decode steps, short
prompts, `labels`, `inputs_embeds`, custom positions) runs the stock forward untouched, so
`generate`'s own arguments (sampling, `max_new_tokens`, `streamer`) all work. `unpatch` restores
the model exactly.

Logits: rows that ran every layer (sinks, tail) carry real logits. Rows whose deep layers were
filled never reach the head; with a fill method and `logits_to_keep=0` (all rows) they are NaN,
so nothing downstream can mistake them for predictions. `logits_to_keep=k` with k <= tail gives
exactly the last k rows. What it is not: batching (batch size > 1 is refused on the prefill path).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ridgefill.engine import Engine
from ridgefill.errors import RidgefillError
from ridgefill.fit.maps import MAP_METHODS, FillMaps, load_maps
from ridgefill.methods import FILL_METHODS, FillSettings, get_method, run_prefill
from ridgefill.models import hf
from ridgefill.models.loading import LoadedModel

# The gated methods (tokengate, gated-ridge) drop rows and would need their own settings here.
PATCH_METHODS = ("exact", *FILL_METHODS)


@dataclass
class PatchState:
    """How a patched model prefills, and how often each path ran."""

    method: str
    settings: FillSettings
    maps: FillMaps | None = field(default=None, repr=False)
    ours: int = 0  # prefills our engine answered
    stock: int = 0  # calls passed to the stock forward
    engine: Engine | None = field(default=None, repr=False)

    @property
    def threshold(self) -> int:
        """Prompts up to this many tokens take the stock path."""
        return self.settings.sink + self.settings.tail


def patch(
    model: torch.nn.Module,
    maps: FillMaps | str | Path | None = None,
    method: str = "ridge",
    *,
    split: int | None = None,
    sink: int = 4,
    tail: int = 256,
    outlier_factor: float | None = 8.0,
) -> torch.nn.Module:
    """Make `model`'s prefill run `method`; return the same model.

    Args:
        maps: fitted maps (a `FillMaps` or a map file) for `ridge`/`kva`; their split wins.
        method: exact, identity, ridge or kva.
        split, sink, tail, outlier_factor: as in `FillSettings` (split defaults to half the layers).
    """
    get_method(method)
    if method not in PATCH_METHODS:
        raise RidgefillError(f"ridgefill.patch runs {', '.join(PATCH_METHODS)}; {method!r} is not supported here yet")
    lm = LoadedModel(model, None, getattr(model.config, "name_or_path", "") or "model", hf.model_parts(model))
    if isinstance(maps, (str, Path)):
        maps = load_maps(maps, lm)
    if method in MAP_METHODS:
        if maps is None:
            raise RidgefillError(f"method {method!r} needs fitted maps: patch(model, maps='...safetensors')")
        if maps.method != method:
            raise RidgefillError(f"these maps are for {maps.method!r}, not {method!r}")
        maps.check_model(lm)
        split = maps.split
    settings = FillSettings(lm.num_layers // 2 if split is None else split, sink, tail, outlier_factor)
    settings.check(lm.num_layers)
    state = PatchState(method, settings, maps, engine=Engine(lm))
    hf.wrap_forward(model, lambda call: _answer(state, call), state)
    return model


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo `patch`: the model's forward is its class's own again."""
    hf.unwrap_forward(model)
    return model


def patch_state(model: torch.nn.Module) -> PatchState | None:
    """The patch of `model` (method, settings, call counts), or None."""
    return hf.patch_state(model)


def _answer(state: PatchState, call: hf.ForwardCall):
    """Our prefill's (logits, cache) for this call, or None to let the stock forward run."""
    if not call.is_prefill or call.other_inputs:
        state.stock += 1
        return None
    ids = call.input_ids
    n = int(ids.shape[-1])
    if ids.shape[0] != 1:
        raise RidgefillError(f"ridgefill.patch runs batch size 1; this prefill has batch {ids.shape[0]}")
    if n <= state.threshold or not _plain_positions(call, n):
        state.stock += 1
        return None
    keep = call.logits_to_keep
    if not isinstance(keep, int) or keep > state.settings.tail and state.method in FILL_METHODS:
        state.stock += 1  # logits asked for rows that would be filled
        return None
    if keep > 0:
        rows = torch.arange(n - keep, n)
    elif state.method in FILL_METHODS:
        s = state.settings
        rows = torch.cat([torch.arange(min(s.sink, n - s.tail)), torch.arange(n - s.tail, n)])
    else:
        rows = torch.arange(n)
    kwargs = {"settings": state.settings, "maps": state.maps} if state.method in FILL_METHODS else {}
    # Fill the cache the caller (generate) made, so that it keeps its own object.
    res = run_prefill(state.engine, ids, state.method, logit_rows=rows, cache=call.cache, **kwargs)
    state.ours += 1
    logits = res.logits[None]
    if keep == 0 and len(rows) < n:
        full = torch.full((1, n, logits.shape[-1]), float("nan"), dtype=logits.dtype)
        full[0, rows] = logits[0]
        logits = full
    return logits, (None if call.use_cache is False and call.cache is None else res.cache)


def _plain_positions(call: hf.ForwardCall, n: int) -> bool:
    """No padding and positions 0..n-1: anything else is left to the stock forward."""
    if call.attention_mask is not None and not bool(call.attention_mask.all()):
        raise RidgefillError("ridgefill.patch runs unpadded batch-size-1 prompts; this one has padding")
    return call.position_ids is None or torch.equal(call.position_ids.reshape(-1), torch.arange(n))
