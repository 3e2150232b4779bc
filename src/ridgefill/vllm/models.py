"""RidgeFill variants of vLLM's own model classes (Llama family, Qwen2).

What it is: a mixin over vLLM's `LlamaForCausalLM` / `Qwen2ForCausalLM` that reads its settings
from the model config (vllm/config.py), checks them and the map file at start-up, and runs a
prefill step as vllm/step.py describes. Steps without prompt rows (decode), and every step with
`ridgefill_method=off`, run the stock forward unchanged. What it is not: a fork of vLLM's
layers: the layers, weights, attention backend and paged cache are vLLM's own.
"""

from __future__ import annotations

import logging

import torch
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

from ridgefill.errors import MapError, RidgefillError
from ridgefill.fit.maps import weights_digest
from ridgefill.vllm import step
from ridgefill.vllm.config import PREFIX_CACHING, VllmFill
from ridgefill.vllm.plugin import STEP

log = logging.getLogger(__name__)


def check_engine(vllm_config: VllmConfig) -> None:
    """Refuse the vLLM features a fill step cannot serve correctly, each in one line."""
    if vllm_config.cache_config.enable_prefix_caching:
        raise RidgefillError(PREFIX_CACHING)
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise RidgefillError("RidgeFill in vLLM does not support pipeline parallelism yet")
    if vllm_config.speculative_config is not None:
        raise RidgefillError("RidgeFill in vLLM does not support speculative decoding yet")
    if vllm_config.lora_config is not None:
        raise RidgefillError("RidgeFill in vLLM does not support LoRA yet")


class RidgeFillMixin:
    """RidgeFill prefill over a vLLM causal LM whose `model` has `layers`, `norm` and embeddings."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        config = vllm_config.model_config.hf_config
        fill = VllmFill.from_config(config)
        self.ridgefill_maps = None
        if fill.enabled:
            check_engine(vllm_config)
            self.ridgefill_maps = fill.load_maps(config)
            if self.ridgefill_maps is not None:
                fill = fill.with_split(self.ridgefill_maps.split)
        self.ridgefill = fill
        self.ridgefill_tokenizer = vllm_config.model_config.tokenizer
        self._ridgefill_ends: torch.Tensor | None = None  # sentence-end vocabulary ids, when read
        self._ridgefill_builder_cache = None  # vLLM's metadata builder of the deep layers
        self._ridgefill_warned = False  # the one warning about prompts split across steps
        log.info("ridgefill: %s, %s", fill.method, fill.settings if fill.enabled else "stock forward")

    def load_weights(self, weights) -> set[str]:
        loaded = super().load_weights(weights)
        if self.ridgefill.enabled:
            layers = self.model.layers
            step.check_layers(layers, self.ridgefill.settings)
            self._check_fingerprint()
            split = self.ridgefill.settings.split
            self._ridgefill_kv = {i: step.projection_rows(layers[i], "kv") for i in range(split, len(layers))}
            if self.ridgefill.query_rows:
                at = self._ridgefill_score_layer
                self._ridgefill_q = step.projection_rows(layers[at], "q")
                self._ridgefill_score_kv = self._ridgefill_kv.get(at) or step.projection_rows(layers[at], "kv")
            if self.ridgefill.reads_sentences:
                self._sentence_table()  # decoding the vocabulary once takes seconds: not in a request
        return loaded

    def _check_fingerprint(self) -> None:
        """Refuse maps fitted on other weights (the map header's hash of a few weight tensors)."""
        maps = self.ridgefill_maps
        want = (maps.header.get("model") or {}).get("weights_sha256") if maps else None
        if want is None:
            return
        layers = self.model.layers
        first, last = layers[0].self_attn, layers[-1].self_attn
        w0, w1 = first.qkv_proj.weight, last.qkv_proj.weight
        have = weights_digest(
            self.model.embed_tokens.weight,
            w0[first.q_size : first.q_size + first.kv_size],
            w1[last.q_size + last.kv_size :],
        )
        if have != want:
            raise MapError(
                f"{self.ridgefill.maps_path}: these maps were fitted on other weights "
                f"(another model, or this one at another dtype than {w0.dtype}); fit maps for this "
                "checkpoint and dtype with `ridgefill fit`"
            )

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ):
        plan = self._prompt_step(positions) if self.ridgefill.enabled else None
        if plan is None:
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        return self._fill_forward(input_ids, positions, inputs_embeds, plan)

    def _prompt_step(self, positions: torch.Tensor) -> step.Step | None:
        fc = get_forward_context()
        meta = fc.attn_metadata
        lens = STEP.lens
        if not isinstance(meta, dict) or not meta or lens is None:
            return None  # profiling and warm-up runs
        name = self.model.layers[self.ridgefill.settings.split].self_attn.attn.layer_name
        return step.prompt_step(positions, meta[name].query_start_loc, lens)

    @torch.inference_mode()
    def _fill_forward(self, input_ids, positions, inputs_embeds, plan: step.Step) -> torch.Tensor:
        s = self.ridgefill.settings
        model = self.model
        layers = model.layers
        hidden = inputs_embeds if inputs_embeds is not None else model.embed_input_ids(input_ids)
        residual = None
        at = self._ridgefill_score_layer if self.ridgefill.query_rows else None
        below = None  # the score layer's input, when it lies below the split
        for i, layer in enumerate(layers[: s.split]):
            if i == at:
                below = hidden if residual is None else hidden + residual
            hidden, residual = layer(positions, hidden, residual)
        stream = hidden if residual is None else hidden + residual  # (T, d): the split state
        rows = self._split_rows(plan, input_ids, positions, stream, below)
        fc = get_forward_context()
        deep = [layer.self_attn.attn.layer_name for layer in layers[s.split :]]
        if rows.bulk.numel():
            step.fill_bulk(
                layers,
                self._ridgefill_kv,
                self.ridgefill.method,
                self.ridgefill_maps,
                s.split,
                stream[rows.bulk],
                positions[rows.bulk],
                {n: fc.slot_mapping[n][rows.bulk] for n in deep},
            )
        out = stream.clone()
        if rows.full.numel():
            meta, slots = fc.attn_metadata, fc.slot_mapping
            saved = {n: (meta[n], slots[n]) for n in deep}
            full_meta = step.run_metadata(
                self._ridgefill_builder(deep[0]), rows, positions, meta[deep[0]].block_table, slots[deep[0]]
            )
            try:
                for n in deep:
                    meta[n], slots[n] = full_meta, slots[n][rows.full]
                pos = positions[rows.full]
                h = hidden[rows.full]
                r = None if residual is None else residual[rows.full]
                for layer in layers[s.split :]:
                    h, r = layer(pos, h, r)
            finally:
                for n, (m, sl) in saved.items():
                    meta[n], slots[n] = m, sl
            h, _ = model.norm(h, r) if r is not None else (model.norm(h), None)
            out[rows.full] = h
        return out

    def _split_rows(self, plan: step.Step, input_ids, positions, stream, below=None) -> step.Rows:
        """The step's full and bulk rows; `below`: the score layer's input when it is below the split."""
        fill = self.ridgefill
        s = fill.settings  # split, query layer and top: one for every length bucket
        if not fill.query_rows:
            return step.split_rows(plan, fill.settings_for, stream)
        at = self._ridgefill_score_layer
        layer, kv = self.model.layers[at], self._ridgefill_score_kv

        def scores(a: int, b: int) -> torch.Tensor:  # a whole prompt: b - a is its length
            if at < s.split:
                h = below[a:b]
            else:
                h = stream[a:b] if at == s.split else self.ridgefill_maps.predict(stream[a:b], at)
            last = fill.settings_for(b - a).query_last
            return step.token_scores(layer, self._ridgefill_q, kv, h, positions[a:b], last, s.query_top)

        ends = None
        if fill.reads_sentences and input_ids is not None:
            table = self._sentence_table()
            ends = table[input_ids[: len(plan.pos)].cpu().clamp(0, len(table) - 1)].to(stream.device)
        for r in range(len(plan.qsl) - 1):
            a, b = int(plan.qsl[r]), int(plan.qsl[r + 1])
            split_prompt = b > a and int(plan.pos[a]) < int(plan.plen[a]) and step.whole_prompt(plan, r) is None
            if split_prompt and not self._ridgefill_warned:
                self._ridgefill_warned = True
                log.warning(
                    "ridgefill: a prompt of %d tokens is split across scheduler steps: it is filled without "
                    "query rows (they need the question before the bulk is filled); raise "
                    "max_num_batched_tokens above your longest prompt to keep them",
                    int(plan.plen[a]),
                )
        return step.split_rows(plan, fill.settings_for, stream, scores, ends)

    @property
    def _ridgefill_score_layer(self) -> int:
        """The layer whose attention scores the query rows: the split's, or `query_layer` (below
        the split on its exact input, above it on the maps' prediction of its input)."""
        s = self.ridgefill.settings
        return s.split if s.query_layer is None else s.query_layer

    def _sentence_table(self) -> torch.Tensor:
        """(V,) bool: vocabulary ids whose text holds a sentence end, from the model's tokenizer."""
        if self._ridgefill_ends is None:
            from transformers import AutoTokenizer

            from ridgefill.methods.select import sentence_end_table

            self._ridgefill_ends = sentence_end_table(AutoTokenizer.from_pretrained(self.ridgefill_tokenizer))
        return self._ridgefill_ends

    def _ridgefill_builder(self, layer_name: str):
        """vLLM's attention metadata builder for the KV cache group holding `layer_name`."""
        if self._ridgefill_builder_cache is None:
            self._ridgefill_builder_cache = _find_builder(layer_name)
        return self._ridgefill_builder_cache


def _find_builder(layer_name: str):
    """The metadata builder vLLM made for the layer's attention group, found through the runner
    the plugin hook saw (the builder holds the backend's head counts, dtype and kernel choice)."""
    runner = STEP.runner
    if runner is None:
        raise RidgefillError("vLLM's model runner was not seen by the ridgefill plugin")
    for groups in runner.attn_groups:
        for group in groups:
            if layer_name in group.layer_names:
                return group.get_metadata_builder()
    raise RidgefillError(f"no attention group holds {layer_name}")


class RidgeFillLlamaForCausalLM(RidgeFillMixin, LlamaForCausalLM):
    """vLLM's Llama (also SmolLM2 and Mistral checkpoints) with RidgeFill prefill."""


class RidgeFillQwen2ForCausalLM(RidgeFillMixin, Qwen2ForCausalLM):
    """vLLM's Qwen2 (Qwen2.5) with RidgeFill prefill."""
