"""OpenAI request bodies, response objects and error bodies.

What it is: strict pydantic models of the fields we honour (unknown OpenAI fields are ignored,
ill-typed known ones are refused) and builders for the JSON the `openai` client expects.
What it is not: the routes (app.py).
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class ApiError(Exception):
    """An error the client caused (4xx) or we did (5xx), rendered as OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def kind(self) -> str:
        if self.status == 429:
            return "rate_limit_error" if self.code != "queue_full" else "server_busy"
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class PrefillOptions(_Strict):
    """Our extension (sent by the `openai` client through `extra_body`)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    method: str


class _Request(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    n: int = Field(1, ge=1, le=1)
    prefill: PrefillOptions | None = None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ApiError(400, "stop takes at most 4 non-empty strings", "stop")
        return stops


class CompletionRequest(_Request):
    prompt: str | list[str] = Field(min_length=1)

    def text(self) -> str:
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise ApiError(400, "one prompt per request (batch size 1)", "prompt")
            return self.prompt[0]
        return self.prompt


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]

    def plain(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": text}


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


def parse(kind: type[_Request], body: object) -> _Request:
    """Validate a decoded JSON body; every problem becomes a 400 naming the field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return kind.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise ApiError(400, f"{param}: {err['msg']}" if param else err["msg"], param) from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def completion_object(rid: str, model: str, chat: bool, text: str, finish: str | None, usage: dict | None) -> dict:
    """A whole (non-streamed) response."""
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    obj = "chat.completion" if chat else "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice], "usage": usage}


def chunk_object(rid: str, model: str, chat: bool, delta: str | None, finish: str | None, usage: dict | None) -> dict:
    """One streamed chunk; the first chat chunk carries the role (delta None means role only)."""
    if chat:
        d = {"role": "assistant", "content": ""} if delta is None else ({"content": delta} if delta else {})
        choice = {"index": 0, "delta": d, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
    out = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time())}
    out.update(model=model, choices=[choice])
    if usage is not None:
        out["usage"] = usage
    return out
