"""The smallest task and adapter behind `api.py`: the living spec of both interfaces.

What it is: `DummyTask` hides one pass key in filler text at a seeded depth and asks for it;
`DummyAdapter` "tokenises" by whitespace and answers without a model: `exact` always finds the key,
`forgetful` only when it sits in the last `tail` words, as if the rest had been filled. Every figure
is known in advance, so the run loop, the resume cache and the summary are tested without torch
work; a new task or adapter should pass the same tests (tests/test_eval_api.py). What it is not: a
benchmark.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence

from ridgefill.eval.api import Generation, Prompt, Sample
from ridgefill.eval.ruler import fit_size

FILLER = "The grass is green."


class DummyTask:
    """`api.Task`: find the pass key."""

    name = "dummy_passkey"
    max_new_tokens = 8

    def _make(self, size: int, index: int, rng: random.Random) -> Sample:
        key = str(rng.randint(10_000, 99_999))
        needle = f"The pass key is {key}."
        lines = [FILLER] * size
        lines.insert(rng.randint(0, size), needle)
        text = "Find the pass key.\n" + " ".join(lines) + "\nWhat is the pass key?"
        return Sample(self.name, index, text, " The pass key is", [key], [needle])

    def samples(self, count_tokens: Callable[[Sample], int], length: int, count: int, seed: int) -> list[Sample]:
        budget = length - self.max_new_tokens

        def make(size: int, i: int) -> Sample:
            return self._make(size, i, random.Random(seed * 1_000 + i))

        return [make(fit_size(lambda n, i=i: count_tokens(make(n, i)), budget, length), i) for i in range(count)]

    def score(self, prediction: str, sample: Sample) -> float:
        return 100.0 * all(a in prediction for a in sample.answers)


class DummyAdapter:
    """`api.Adapter` without a model: words are tokens; TTFT is 1 ms per prefilled word."""

    name = "dummy"
    context_length = 4096

    def __init__(self, tail: int = 64):
        self.tail = tail
        self.methods = ["exact", "forgetful"]
        self.generated: list[tuple[int, str]] = []  # (sample index, method) per answer, for tests

    def _words(self, sample: Sample) -> list[str]:
        return (sample.text + sample.answer_prefix).split()

    def count_tokens(self, sample: Sample) -> int:
        return len(self._words(sample))

    def prompt(self, sample: Sample) -> Prompt:
        words = self._words(sample)
        holding = [n for n in sample.needles if sample.answers and sample.answers[0] in n]
        needle = holding[0].split() if holding else []
        at = (i for i in range(len(words)) if needle and words[i : i + len(needle)] == needle)
        pos = next(at, None)
        key = hashlib.sha1(" ".join(words).encode()).hexdigest()[:16]
        return Prompt(key, len(words), pos)

    def config(self, method: str) -> str:
        return f"{method}-tail{self.tail}" if method != "exact" else method

    def generate(self, sample: Sample, methods: Sequence[str], max_new_tokens: int) -> dict[str, Generation]:
        p = self.prompt(sample)
        out = {}
        for m in methods:
            self.generated.append((sample.index, m))
            sees = m == "exact" or (p.needle_pos is not None and p.needle_pos >= p.tokens - self.tail)
            words = p.tokens if m == "exact" else self.tail
            text = " " + " ".join(sample.answers) + "." if sees else " not in the text."
            info = {} if m == "exact" else {"needle_full": float(sees)}  # method diagnostics, as the engine's
            out[m] = Generation(text, ttft_s=words / 1000, run_s=words / 1000, info=info)
        return out
