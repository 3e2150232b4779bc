"""The evaluation's two narrow interfaces: a task and a model/method adapter.

What it is: the contract `runner.run_eval` is written against, in the spirit of
lm-evaluation-harness (`lm_eval/api/model.py`): a `Task` makes seeded samples that fit a token
budget and scores a prediction; an `Adapter` measures and runs prompts under its methods. RULER's
tasks (`ruler.RulerTask`) and our engine (`adapter.EngineAdapter`) implement them; `dummy.py` is
the smallest implementation of both and doubles as the living spec. What it is not: an
implementation; nothing here imports torch or transformers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class Sample:
    """One task sample: the user turn, the answer prefix for the assistant turn, the references."""

    task: str
    index: int
    text: str
    answer_prefix: str
    answers: list[str]
    needles: list[str] = field(default_factory=list)  # inserted needle strings (where the answer sits)


@dataclass(frozen=True)
class Prompt:
    """A sample as one adapter tokenises it."""

    key: str  # stable id of the exact token sequence (the resume cache pairs records by it)
    tokens: int  # prompt length in tokens
    needle_pos: int | None  # token where the needle holding answers[0] starts (None: no needle)


@dataclass(frozen=True)
class Generation:
    """One method's greedy answer to one prompt, with its timings."""

    text: str
    ttft_s: float  # prefill and first token, including any work shared with other methods
    run_s: float  # this method's share of the whole run (prefill, shared work, decode)
    decode_batch: int | None = None  # rows of the decode batch it shared (None: decoded alone)
    info: dict = field(default_factory=dict)  # method diagnostics copied into the record (JSON values)


@runtime_checkable
class Task(Protocol):
    """Makes samples and scores predictions; knows nothing of models."""

    name: str
    max_new_tokens: int  # the answer budget: prompts fill `length - max_new_tokens` tokens

    def samples(self, count_tokens: Callable[[Sample], int], length: int, count: int, seed: int) -> list[Sample]:
        """`count` samples, reproducible from `seed`, each as long as fits `length - max_new_tokens`
        tokens as `count_tokens` (the adapter's tokeniser, template included) measures them."""
        ...

    def score(self, prediction: str, sample: Sample) -> float:
        """The prediction's score, 0-100."""
        ...


@runtime_checkable
class Adapter(Protocol):
    """A model and the methods it is evaluated under; knows nothing of tasks' scoring."""

    name: str  # the model's name in reports
    context_length: int
    methods: list[str]  # method labels, "exact" first: every score is paired against it

    def count_tokens(self, sample: Sample) -> int:
        """Prompt tokens of `sample` as the model reads it (chat template, answer prefix)."""
        ...

    def prompt(self, sample: Sample) -> Prompt:
        """The sample's cache key, length and needle position."""
        ...

    def config(self, method: str) -> str:
        """What `method`'s records are computed with (model weights, settings, maps), as a short key:
        a cached record is reused only under the same key."""
        ...

    def generate(self, sample: Sample, methods: Sequence[str], max_new_tokens: int) -> dict[str, Generation]:
        """Greedy answers of `sample` under each of `methods` (labels), keyed by label."""
        ...
