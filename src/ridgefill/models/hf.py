"""The one module that knows transformers' internals.

What it is: a flat view of a causal LM's modules (embedding, per-layer norms and projections,
rotary embedding), cache construction, and the stock forward call with whichever cache keyword
this transformers version uses (`past_key_value` -> `past_key_values` -> `cache`). What it is
not: a forward pass; the engine owns the loop and only borrows these modules, so weights stay
exactly the model's own.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from functools import cache

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from ridgefill.errors import RidgefillError, UnsupportedArchitectureError

# model_type -> residual layout. "prenorm": x + attn(norm(x)); x + mlp(norm(x)) (Llama family).
# "sandwich": Gemma3 normalises each sub-block's input and output (four norms per layer).
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "prenorm",
    "mistral": "prenorm",
    "qwen2": "prenorm",
    "qwen3": "prenorm",
    "gemma3_text": "sandwich",
}


@dataclass(frozen=True)
class LayerParts:
    """Modules and constants of one decoder layer, borrowed from the model."""

    input_norm: nn.Module
    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    o_proj: nn.Linear
    q_norm: nn.Module | None  # per-head norm before RoPE (Qwen3, Gemma3)
    k_norm: nn.Module | None
    attn_out_norm: nn.Module | None  # Gemma3 post_attention_layernorm
    ffn_in_norm: nn.Module
    ffn_out_norm: nn.Module | None  # Gemma3 post_feedforward_layernorm
    mlp: nn.Module
    scaling: float
    sliding_window: int | None  # a key at distance >= window is masked (HF semantics)
    layer_type: str  # key into the rotary table
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class ModelParts:
    """A flat, read-only view of a supported causal LM."""

    arch: str
    embed: nn.Module
    layers: tuple[LayerParts, ...]
    norm: nn.Module
    lm_head: nn.Module
    rotary: nn.Module
    final_logit_softcap: float | None
    context_length: int
    hidden_size: int

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def architecture(model: PreTrainedModel) -> str:
    return getattr(model.config, "model_type", type(model).__name__)


def check_supported(model: PreTrainedModel) -> None:
    arch = architecture(model)
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise UnsupportedArchitectureError(f"unsupported architecture {arch!r}; supported: {supported}")
    if getattr(model.config, "attn_logit_softcapping", None) is not None:
        raise UnsupportedArchitectureError(f"{arch} with attention logit soft-capping is not supported")


def model_parts(model: PreTrainedModel) -> ModelParts:
    """Collect the modules our engine runs, for a supported architecture."""
    check_supported(model)
    cfg = model.config
    arch = architecture(model)
    sandwich = SUPPORTED_ARCHITECTURES[arch] == "sandwich"
    layer_types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers)
    layers = []
    for idx, layer in enumerate(model.model.layers[: cfg.num_hidden_layers]):
        attn = layer.self_attn
        # Mistral keeps the window on the config; the others set it per layer type.
        window = getattr(attn, "sliding_window", getattr(cfg, "sliding_window", None))
        head_dim = attn.head_dim
        layers.append(
            LayerParts(
                input_norm=layer.input_layernorm,
                q_proj=attn.q_proj,
                k_proj=attn.k_proj,
                v_proj=attn.v_proj,
                o_proj=attn.o_proj,
                q_norm=getattr(attn, "q_norm", None),
                k_norm=getattr(attn, "k_norm", None),
                attn_out_norm=layer.post_attention_layernorm if sandwich else None,
                ffn_in_norm=layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm,
                ffn_out_norm=layer.post_feedforward_layernorm if sandwich else None,
                mlp=layer.mlp,
                scaling=float(attn.scaling),
                sliding_window=int(window) if window else None,
                layer_type=layer_types[idx],
                num_heads=cfg.num_attention_heads,
                num_kv_heads=cfg.num_key_value_heads,
                head_dim=head_dim,
            )
        )
    return ModelParts(
        arch=arch,
        embed=model.model.embed_tokens,
        layers=tuple(layers),
        norm=model.model.norm,
        lm_head=model.lm_head,
        rotary=model.model.rotary_emb,
        final_logit_softcap=getattr(cfg, "final_logit_softcapping", None),
        context_length=int(cfg.max_position_embeddings),
        hidden_size=int(cfg.hidden_size),
    )


@cache
def _takes(fn_owner: type, name: str, method: str = "forward") -> bool:
    return name in inspect.signature(getattr(fn_owner, method)).parameters


def rotary_tables(
    parts: ModelParts, x: torch.Tensor, position_ids: torch.Tensor
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """cos/sin per layer type, computed once per forward (Gemma3 has a local and a global base).

    Args:
        x: any tensor of the compute dtype.
        position_ids: (1, T).
    Returns:
        layer_type -> (cos, sin), each (1, T, head_dim).
    """
    types = sorted({lp.layer_type for lp in parts.layers})
    if _takes(type(parts.rotary), "layer_type"):
        return {t: parts.rotary(x, position_ids, t) for t in types}
    table = parts.rotary(x, position_ids)
    return dict.fromkeys(types, table)


class GrowingLayer(DynamicLayer):
    """A full-attention cache layer that appends into spare capacity.

    The stock `DynamicLayer` concatenates a new tensor at every decode step, copying the whole
    layer (at 4K tokens on SmolLM2, 180 MB per generated token over 30 layers). This one keeps a
    buffer with headroom and exposes `keys`/`values` as views of its filled part, so a step writes
    one row; the attention reads exactly the same numbers. Anything that replaces `keys` (crop,
    reorder) is honoured: the next update copies into a fresh buffer (as it does when the buffer
    is an inference tensor and the update is not in inference mode).
    """

    headroom = 0.25  # spare capacity, as a fraction of the filled length (at least 64 rows)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        kbuf, vbuf = getattr(self, "_kbuf", None), getattr(self, "_vbuf", None)
        n = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        t = key_states.shape[-2]
        fresh = kbuf is None or self.keys.dim() != 4 or self.keys.data_ptr() != kbuf.data_ptr()
        # A buffer made under inference_mode (our prefill) cannot be written outside it (a decode
        # under no_grad): copy it once into a normal tensor.
        fresh = fresh or (kbuf.is_inference() and not torch.is_inference_mode_enabled())
        if fresh or kbuf.shape[-2] < n + t:
            cap = max(n + t + 64, int((n + t) * (1 + self.headroom)))
            kbuf = key_states.new_empty((*key_states.shape[:-2], cap, key_states.shape[-1]))  # (B, H, cap, D)
            vbuf = value_states.new_empty((*value_states.shape[:-2], cap, value_states.shape[-1]))
            if n:
                kbuf[..., :n, :] = self.keys
                vbuf[..., :n, :] = self.values
            self._kbuf, self._vbuf = kbuf, vbuf
        kbuf[..., n : n + t, :] = key_states
        vbuf[..., n : n + t, :] = value_states
        self.keys, self.values = kbuf[..., : n + t, :], vbuf[..., : n + t, :]
        return self.keys, self.values


def new_cache(model: PreTrainedModel) -> DynamicCache:
    """An empty stock cache laid out for this model (sliding layers keep only their window; full
    layers grow in place, see `GrowingLayer`)."""
    cache_obj = DynamicCache(config=model.config)
    cache_obj.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache_obj.layers]
    return cache_obj


def batch_signature(layer) -> tuple:
    """What must agree for cache layers to decode as one batch: keys held, and tokens seen."""
    return tuple(layer.keys.shape[-2:]), getattr(layer, "cumulative_length", None)


def stack_caches(caches: list[DynamicCache]) -> DynamicCache:
    """Caches of the same prompt length, layer by layer, stacked along the batch dimension (for one
    batched stock decode). Each layer keeps its kind and bookkeeping (a sliding layer's count of
    tokens seen); every cache must hold the same number of keys in each layer."""
    layers = []
    for group in zip(*(c.layers for c in caches), strict=True):
        if len({batch_signature(layer) for layer in group}) != 1:
            raise RidgefillError("only caches with the same keys per layer can decode as one batch")
        layer = copy.copy(group[0])  # a GrowingLayer copy no longer owns the buffer: it reallocates
        layer.keys = torch.cat([g.keys for g in group])
        layer.values = torch.cat([g.values for g in group])
        layers.append(layer)
    out = copy.copy(caches[0])  # the cache's own bookkeeping, with new layers
    out.layers = layers
    return out


def cache_update(
    cache_obj: DynamicCache, k: torch.Tensor, v: torch.Tensor, layer_idx: int, true_length: int | None = None
) -> None:
    """Append post-RoPE keys and values, each (B, H_kv, T, D), to one layer.

    `true_length`: the prompt's length when this layer gets only some of its rows (a token gate
    dropped the others). A sliding-window layer derives its decode mask offsets from the number of
    tokens it has seen, so it is told the true one; a full-attention layer simply holds fewer keys
    (transformers skips the decode mask for one unpadded query, so each layer reads what it holds).
    """
    cache_obj.update(k, v, layer_idx)
    layer = cache_obj.layers[layer_idx]
    if true_length is not None and hasattr(layer, "cumulative_length"):
        layer.cumulative_length = true_length


def cache_kv(cache_obj: DynamicCache, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored (keys, values) of one layer, each (B, H_kv, T_kept, D)."""
    layer = cache_obj.layers[layer_idx]
    return layer.keys, layer.values


def _cache_kwarg(model: PreTrainedModel) -> str:
    for name in ("cache", "past_key_values", "past_key_value"):
        if _takes(type(model), name):
            return name
    raise UnsupportedArchitectureError(f"{type(model).__name__}.forward takes no cache argument")


def stock_forward(
    model: PreTrainedModel, input_ids: torch.Tensor, cache_obj: DynamicCache | None = None, keep: int = 0
) -> tuple[torch.Tensor, DynamicCache]:
    """The unmodified model's forward: logits (B, T, V), or of the last `keep` positions when
    `keep` > 0, and the cache it extended or made."""
    kwargs = {_cache_kwarg(model): cache_obj} if cache_obj is not None else {}
    out = model(input_ids=input_ids, use_cache=True, logits_to_keep=keep, **kwargs)
    new = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    return out.logits, new


# ----- routing a model's own forward (ridgefill.patch) -----

_PATCH_ATTR = "_ridgefill_patch"


@dataclass
class ForwardCall:
    """The arguments of one call to a causal LM's forward that decide whether we can answer it."""

    input_ids: torch.Tensor | None
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    cache: DynamicCache | None
    other_inputs: bool  # inputs_embeds or labels were given: only the stock forward can answer
    use_cache: bool | None
    logits_to_keep: int | torch.Tensor
    return_dict: bool | None

    @property
    def is_prefill(self) -> bool:
        return self.input_ids is not None and (self.cache is None or self.cache.get_seq_length() == 0)


def wrap_forward(model: PreTrainedModel, answer, state: object) -> None:
    """Route `model.forward` through `answer(ForwardCall) -> (logits, cache) | None`.

    None sends the call to the stock forward unchanged. The model's class is untouched: the wrap
    is an attribute of this one instance, so `unwrap_forward` restores the model exactly.
    `state` is kept on the model for `patch_state`.
    """
    if hasattr(model, _PATCH_ATTR):
        raise RidgefillError("this model is already patched; call ridgefill.unpatch(model) first")
    from transformers.modeling_outputs import CausalLMOutputWithPast

    prior = model.__dict__.get("forward")  # an instance-level wrap someone else made (kept)
    stock = model.forward
    sig = inspect.signature(type(model).forward)
    cache_name = _cache_kwarg(model)
    out_field = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"

    def forward(self, *args, **kwargs):
        a = sig.bind_partial(self, *args, **kwargs).arguments
        extra = a.get("kwargs", {})
        call = ForwardCall(
            input_ids=a.get("input_ids"),
            attention_mask=a.get("attention_mask"),
            position_ids=a.get("position_ids"),
            cache=a.get(cache_name),
            other_inputs=a.get("inputs_embeds") is not None or a.get("labels") is not None,
            use_cache=a.get("use_cache"),
            logits_to_keep=a.get("logits_to_keep", 0),
            return_dict=extra.get("return_dict", a.get("return_dict")),
        )
        answered = answer(call)
        if answered is None:
            return stock(*args, **kwargs)
        logits, cache_obj = answered
        out = CausalLMOutputWithPast(logits=logits, **{out_field: cache_obj})
        return out.to_tuple() if call.return_dict is False else out

    model.forward = forward.__get__(model)
    setattr(model, _PATCH_ATTR, (state, prior))


def unwrap_forward(model: PreTrainedModel) -> None:
    if not hasattr(model, _PATCH_ATTR):
        raise RidgefillError("this model is not patched by ridgefill")
    _, prior = getattr(model, _PATCH_ATTR)
    del model.forward
    if prior is not None:
        model.forward = prior
    delattr(model, _PATCH_ATTR)


def patch_state(model: PreTrainedModel) -> object | None:
    """What `wrap_forward` was given as `state`, or None for an unpatched model."""
    return getattr(model, _PATCH_ATTR, (None, None))[0]
