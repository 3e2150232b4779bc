"""Prompt encoding and generation: our prefill, then the unmodified model decodes.

What it is: `generate(lm, prompt, method=..., **settings)`. The method (by default `tuned` where
the model has a tuned configuration, else exact; see methods/resolve.py) fills a stock cache;
every decode step is the stock transformers forward. What it is not: a server or a batcher (batch 1).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ridgefill.engine import Engine, LowerState, PrefillResult
from ridgefill.errors import PromptError, RidgefillError
from ridgefill.methods import Prefill, resolve_prefill
from ridgefill.models import hf
from ridgefill.models.loading import LoadedModel


@dataclass
class GenerationResult:
    """Generated text with the prefill it came from."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    prefill: PrefillResult
    ttft_s: float  # prefill plus choosing the first token
    decode_s: float
    decode_batch: int = 1  # rows of the stock decode batch this one shared (generate_batch)


def prompt_text(lm: LoadedModel, prompt: str, chat: bool = True, answer_prefix: str = "") -> tuple[str, bool]:
    """The exact string the model reads, and whether the tokenizer should add special tokens.

    With `chat` and a tokenizer that has a chat template, the prompt is the user turn and
    `answer_prefix` opens the assistant turn (RULER's answer prefix).
    """
    if not prompt or not prompt.strip():
        raise PromptError("the prompt is empty")
    tok = lm.tokenizer
    if chat and getattr(tok, "chat_template", None):
        messages = [{"role": "user", "content": prompt}]
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + answer_prefix, False
    return prompt + answer_prefix, True


def encode_prompt(lm: LoadedModel, prompt: str, chat: bool = True, answer_prefix: str = "") -> torch.Tensor:
    """Tokenise a prompt as `prompt_text` lays it out. Returns (1, N) token ids."""
    text, special = prompt_text(lm, prompt, chat, answer_prefix)
    return torch.tensor([lm.tokenizer(text, add_special_tokens=special)["input_ids"]], dtype=torch.long)


def encode_chat(lm: LoadedModel, messages: list[dict[str, str]]) -> torch.Tensor:
    """Tokenise a conversation through the chat template, opening the assistant turn. Returns (1, N).

    A tokenizer without a template gets `role: content` lines and an `assistant:` cue.
    """
    if not messages or not any(m["content"].strip() for m in messages):
        raise PromptError("the conversation is empty")
    tok = lm.tokenizer
    if getattr(tok, "chat_template", None):
        text, special = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), False
    else:
        text, special = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:", True
    return torch.tensor([tok(text, add_special_tokens=special)["input_ids"]], dtype=torch.long)


def eos_ids(lm: LoadedModel) -> set[int]:
    ids: set[int] = set()
    for src in (lm.model.generation_config, lm.model.config):
        e = getattr(src, "eos_token_id", None)
        ids.update(e if isinstance(e, list) else [e] if e is not None else [])
    return ids


class StopText:
    """Generated token ids -> text, cut at the first stop string, with a streamable safe prefix.

    `push` returns the new text that can no longer change: it holds back a possible beginning of
    a stop string and a half-decoded UTF-8 character. `finish` becomes "stop" at an end-of-sequence
    token or a stop string; `text` is then the answer, cut before the stop string.
    """

    def __init__(self, lm: LoadedModel, stop: list[str]):
        self.lm, self.stop = lm, stop
        self.eos = eos_ids(lm)
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.tokens: list[int] = []
        self.text = ""
        self.sent = 0
        self.finish: str | None = None

    def push(self, tok: int) -> str:
        self.tokens.append(tok)
        if tok in self.eos:
            self.finish = "stop"
            return ""
        self.text = self.lm.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cut = min((i for i in (self.text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.finish = self.text[:cut], "stop"
            return ""
        safe = len(self.text) - self.hold - (1 if self.text.endswith("\ufffd") else 0)
        if safe <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent : safe], safe
        return delta

    def rest(self) -> str:
        """The text not yet returned by `push` (call once the stream has ended)."""
        delta, self.sent = self.text[self.sent :], len(self.text)
        return delta


def _sampler(temperature: float, top_p: float, seed: int | None) -> Callable[[torch.Tensor], int]:
    if temperature < 0 or not 0 < top_p <= 1:
        raise RidgefillError("temperature must be >= 0 and top_p in (0, 1]")
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed())

    def pick(logits: torch.Tensor) -> int:  # (V,) float32
        logits = logits.cpu()  # the generator lives on the CPU; V numbers are cheap to move
        if temperature == 0:
            return int(logits.argmax())
        probs = torch.softmax(logits / temperature, dim=-1)
        if top_p < 1:
            sorted_p, idx = probs.sort(descending=True)
            keep = sorted_p.cumsum(-1) - sorted_p < top_p
            probs = torch.zeros_like(probs).scatter(0, idx[keep], sorted_p[keep])
        return int(torch.multinomial(probs, 1, generator=gen))

    return pick


@torch.inference_mode()
def stream_tokens(
    lm: LoadedModel,
    input_ids: torch.Tensor,
    prefill: PrefillResult,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
) -> Iterator[int]:
    """Yield generated token ids: the first from the prefill's logits, the rest from stock decode."""
    pick = _sampler(temperature, top_p, seed)
    stops = eos_ids(lm)
    cache = prefill.cache
    tok = pick(prefill.logits[-1])
    for step in range(max_new_tokens):
        yield tok
        if tok in stops or step == max_new_tokens - 1:
            return
        logits, cache = hf.stock_forward(lm.model, torch.tensor([[tok]], device=lm.device), cache)
        tok = pick(logits[0, -1].float())


def _check_room(lm: LoadedModel, n: int, max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise RidgefillError("max_new_tokens must be at least 1")
    if n + max_new_tokens > lm.context_length:
        raise PromptError(
            f"the prompt has {n} tokens; with max_new_tokens={max_new_tokens} it exceeds "
            f"{lm.name}'s context of {lm.context_length}"
        )


@torch.inference_mode()
def _greedy_batch(
    lm: LoadedModel, prefills: list[PrefillResult], firsts: list[int], max_new_tokens: int
) -> list[list[int]]:
    """Greedy decode of several prefills of one prompt as one batch of the stock forward; each row
    stops at its own end-of-sequence token, as `stream_tokens` would."""
    stops = eos_ids(lm)
    outs = [[t] for t in firsts]
    live = [t not in stops for t in firsts]
    cache = hf.stack_caches([p.cache for p in prefills]) if len(prefills) > 1 else prefills[0].cache
    toks = list(firsts)
    for _ in range(max_new_tokens - 1):
        if not any(live):
            break
        logits, cache = hf.stock_forward(lm.model, torch.tensor([[t] for t in toks], device=lm.device), cache)
        toks = [int(t) for t in logits[:, -1].float().argmax(-1)]
        for b, t in enumerate(toks):
            if live[b]:
                outs[b].append(t)
                live[b] = t not in stops
    return outs


def generate_batch(
    lm: LoadedModel, ids: torch.Tensor, runs: list[Prefill], max_new_tokens: int, lower: LowerState | None = None
) -> list[GenerationResult]:
    """Greedy generation of one (1, N) prompt under several prefills (each continuing from the
    shared lower layers `lower` where it can), as `generate` does
    one by one: each prefill is timed on its own (TTFT); the decodes whose caches hold the same
    keys in every layer run as one batch of the stock forward (per row the same greedy tokens up
    to floating-point rounding), the others alone. A row's `decode_s` is its share of its batch."""
    n = int(ids.shape[1])
    _check_room(lm, n, max_new_tokens)
    engine = Engine(lm)
    pres, firsts, ttfts = [], [], []
    for prefill in runs:
        t0 = engine.clock()
        pre = prefill.run(engine, ids, lower=lower)
        firsts.append(int(pre.logits[-1].float().argmax()))
        ttfts.append(engine.clock() - t0)
        pres.append(pre)
    groups: dict[tuple, list[int]] = {}
    for i, pre in enumerate(pres):
        groups.setdefault(tuple(hf.batch_signature(layer) for layer in pre.cache.layers), []).append(i)
    results: list[GenerationResult | None] = [None] * len(runs)
    for rows in groups.values():
        t0 = time.perf_counter()
        outs = _greedy_batch(lm, [pres[i] for i in rows], [firsts[i] for i in rows], max_new_tokens)
        share = (time.perf_counter() - t0) / len(rows)
        for i, out in zip(rows, outs, strict=True):
            text = lm.tokenizer.decode(out, skip_special_tokens=True)
            results[i] = GenerationResult(text, out, n, pres[i], ttfts[i], share, len(rows))
    return results


def generate(
    lm: LoadedModel,
    prompt: str | torch.Tensor,
    method: str | None = None,
    *,
    prefill: Prefill | None = None,
    maps: Any = None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    chat: bool = True,
    **settings: Any,
) -> GenerationResult:
    """Prefill with `method`, then decode with the unmodified model.

    Args:
        prompt: text (chat-templated when `chat` and the tokenizer has a template) or (1, N) ids.
        method: a method name (`ridgefill.METHODS`, or `tuned`), optionally with settings as in
            `ridge:tail=512`; None: `tuned` where the model has a tuned configuration, else exact.
        prefill: a `resolve_prefill` result to reuse instead of `method`, `maps` and `settings`.
        maps: fitted maps, a map file or folder (default: the model's cache, fitted on first use).
        settings: the method's settings by name (split=12, tail=512, ...); unknown names and wrong
            types are refused with the list of valid ones.
    """
    if prefill is None:
        prefill = resolve_prefill(lm, method, maps=maps, **settings)
    elif method is not None or maps is not None or settings:
        raise RidgefillError("pass either prefill= or a method with its maps and settings, not both")
    ids = prompt if isinstance(prompt, torch.Tensor) else encode_prompt(lm, prompt, chat=chat)
    n = int(ids.shape[1])
    _check_room(lm, n, max_new_tokens)
    engine = Engine(lm)
    t0 = engine.clock()
    pre = prefill.run(engine, ids)
    out: list[int] = []
    ttft = 0.0
    for tok in stream_tokens(lm, ids, pre, max_new_tokens, temperature, top_p, seed):
        if not out:
            ttft = engine.clock() - t0
        out.append(tok)
    total = time.perf_counter() - t0
    text = lm.tokenizer.decode(out, skip_special_tokens=True)
    return GenerationResult(text, out, n, pre, ttft, total - ttft)
