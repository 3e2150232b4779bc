"""OpenAI request bodies, response objects and error bodies.

What it is: the one validation layer for request bodies. `decode` turns bytes into JSON (no
NaN/Infinity, no nesting deeper than the parser can take); `parse` validates it against strict
pydantic models of the fields we honour. Unknown fields are ignored, except OpenAI parameters
that would change the answer and that we do not implement (`UNSUPPORTED`): those are refused
unless they carry their neutral value. Every string must be valid Unicode (a lone surrogate such as "\\ud800" is refused
before a tokenizer sees it). Every failure is an `ApiError`; its body never echoes more than a
short, clipped piece of the client's input. Also the builders for the JSON the `openai` client
expects. What it is not: the routes or the checks that need the model (app.py).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

MESSAGE_LIMIT = 1000  # characters of an error message; echoed input is clipped well below it
ECHO_LIMIT = 80  # characters of the client's input quoted back in a message


def quote(value: object, limit: int = ECHO_LIMIT) -> str:
    """`repr` of a piece of client input for an error message: at most `limit` characters of it."""
    text = value if isinstance(value, str) else str(value)
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


def _safe(text: str, limit: int) -> str:
    """Clipped, and encodable as UTF-8 (a lone surrogate becomes its escape)."""
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


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
        param = None if self.param is None else _safe(self.param, ECHO_LIMIT)
        message = _safe(self.message, MESSAGE_LIMIT)
        return {"error": {"message": message, "type": self.kind, "param": param, "code": self.code}}


def decode(raw: bytes) -> object:
    """A request body -> JSON value, or a 400. Refuses NaN/Infinity (not JSON), numbers too long for
    Python to convert, and nesting too deep to parse."""

    def no_constant(name: str) -> None:
        raise ValueError(f"{name} is not a JSON number")

    try:
        return json.loads(raw, parse_constant=no_constant)
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None


def _unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (it holds a lone surrogate)") from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class PrefillOptions(_Strict):
    """Our extension (sent by the `openai` client through `extra_body`)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    method: Text


INT64 = 2**63


class _Request(_Strict):
    model: Text
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: Text | list[Text] | None = None
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stream: bool = False
    n: int = Field(1, ge=1, le=1)
    prefill: PrefillOptions | None = None

    # OpenAI parameters that would change the answer and that we do not implement -> the values
    # that mean "off", which are accepted (some clients send them always).
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        "logprobs": (None, False),
        "top_logprobs": (None, 0),
        "echo": (None, False),
        "best_of": (None, 1),
        "suffix": (None, ""),
        "logit_bias": (None, {}),
        "presence_penalty": (None, 0, 0.0),
        "frequency_penalty": (None, 0, 0.0),
        "response_format": (None, {"type": "text"}),
        "tools": (None, []),
        "tool_choice": (None, "none"),
        "functions": (None, []),
        "function_call": (None, "none"),
    }

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, off in cls.UNSUPPORTED.items():
                value = data.get(name)
                if not any(type(value) is type(v) and value == v for v in off):
                    raise ApiError(
                        400,
                        f"{name} is not supported by this server; leave it out",
                        name,
                        "unsupported_parameter",
                    )
        return data

    def asked_tokens(self) -> tuple[int | None, str]:
        """The token budget the client set (None: not set) and the field that set it."""
        return self.max_tokens, "max_tokens"

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ApiError(400, "stop takes at most 4 non-empty strings", "stop")
        return stops


class CompletionRequest(_Request):
    prompt: Text | list[Text] = Field(min_length=1)

    def text(self) -> str:
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise ApiError(400, "one prompt per request (batch size 1)", "prompt")
            return self.prompt[0]
        return self.prompt


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: Text | list[TextPart]

    def plain(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": text}


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def asked_tokens(self) -> tuple[int | None, str]:
        """`max_completion_tokens` (OpenAI's newer name) wins over `max_tokens`."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


def parse(kind: type[_Request], body: object) -> _Request:
    """Validate a decoded JSON body; every problem becomes a 400 naming the field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return kind.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False, include_input=False)[0]
        param = _param(body, err["loc"], err["type"] == "missing")
        raise ApiError(400, f"{_safe(param, ECHO_LIMIT)}: {err['msg']}" if param else err["msg"], param) from None


def _param(body: object, loc: tuple, missing: bool) -> str | None:
    """The dotted path of the field an error is about. pydantic's `loc` also names the member of a
    union it tried (`str`, `list[TextPart]`): only the parts that index the body are kept (and a
    missing field's name)."""
    parts, node = [], body
    for i, part in enumerate(loc):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif not (missing and i == len(loc) - 1):
            continue
        parts.append(str(part))
    return ".".join(parts) or None


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
