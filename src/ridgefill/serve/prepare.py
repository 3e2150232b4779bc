"""A request body -> what the model worker needs: token ids, prefill method, token budget.

What it is: the checks that need the model (its name, its methods, its tokenizer, its context),
after protocol.py's checks that do not. `prepare` is blocking work (JSON decoding and tokenising
a body of up to the size limit take up to seconds), so the app runs it on a thread of its own,
never on the event loop. What it is not: admission to the queue (worker.py) or HTTP (app.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from jinja2 import TemplateError

from ridgefill.errors import RidgefillError
from ridgefill.generation import encode_chat, encode_prompt
from ridgefill.models.loading import LoadedModel
from ridgefill.serve.protocol import ApiError, ChatRequest, CompletionRequest, decode, parse, quote

DEFAULT_MAX_TOKENS = {"completions": 16, "chat": 512}


@dataclass(frozen=True)
class Prepared:
    """A valid request, tokenised. `input_ids` is (1, N)."""

    request: CompletionRequest | ChatRequest
    input_ids: torch.Tensor
    method: str
    max_tokens: int
    stop: list[str]

    @property
    def prompt_tokens(self) -> int:
        return int(self.input_ids.shape[1])


def prepare(lm: LoadedModel, methods: dict[str, Any], default_method: str, raw: bytes, chat: bool) -> Prepared:
    """Validate `raw` for `lm` and tokenise it; every problem is an `ApiError` (4xx)."""
    req = parse(ChatRequest if chat else CompletionRequest, decode(raw))
    if req.model != lm.name:
        raise ApiError(
            404,
            f"model {quote(req.model)} is not served here; this server serves {lm.name!r}",
            "model",
            "model_not_found",
        )
    method = req.prefill.method if req.prefill else default_method
    if method not in methods:
        raise ApiError(
            400,
            f"prefill method {quote(method)} is not available here; choose from {sorted(methods)}",
            "prefill.method",
            "unknown_method",
        )
    stop = req.stops()
    field = "messages" if chat else "prompt"
    try:
        if chat:
            ids = encode_chat(lm, [m.plain() for m in req.messages])
        else:
            ids = encode_prompt(lm, req.text(), chat=False)
    except RidgefillError as e:
        raise ApiError(400, str(e), field) from None
    except TemplateError as e:  # the model's chat template refused the conversation
        raise ApiError(400, f"the chat template refused the conversation: {e}", field) from None
    return Prepared(req, ids, method, max_tokens(lm, req, int(ids.shape[1]), chat), stop)


def max_tokens(lm: LoadedModel, req: CompletionRequest | ChatRequest, n: int, chat: bool) -> int:
    """The tokens to generate after an `n`-token prompt: the client's budget, checked against the
    context, or a default that fits."""
    ctx = lm.context_length
    if n >= ctx:
        raise ApiError(
            400,
            f"the prompt has {n} tokens; {lm.name}'s context is {ctx}",
            "messages" if chat else "prompt",
            "context_length_exceeded",
        )
    asked, field = req.asked_tokens()
    if asked is None:
        return min(DEFAULT_MAX_TOKENS["chat" if chat else "completions"], ctx - n)
    if not 1 <= asked <= ctx:
        raise ApiError(400, f"{field} must be between 1 and {ctx}, got {asked}", field)
    if n + asked > ctx:
        raise ApiError(
            400,
            f"{n} prompt tokens + {field} {asked} exceed {lm.name}'s context of {ctx}",
            field,
            "context_length_exceeded",
        )
    return asked
