"""The pass-key test: one number hidden in the evaluation text at evenly spread depths, asked plainly.

What it is: the check a user tries first on a long-context method, with the needle of the pass-key
retrieval test (Mohtashami and Jaggi, 2023) and a plain question instead of RULER's template, and
the domain's evaluation text as the haystack, so that a score does not hinge on one wording. (The
question asks for "the number": without that, SmolLM2-135M describes a door key.) Sample `i`
hides a 5-digit key at depth (i mod 10) / 9 of the haystack's sentences (10 samples: 0%, 11%, ...,
100%); the haystack size is found by binary search with the model's own tokenizer, as for RULER's
tasks; a reply is right when it holds the key (RULER's `string_match_all`). What it is not: a
RULER task (ruler.py), nor pooled with them in the NIAH score.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from ridgefill.errors import RidgefillError
from ridgefill.eval.api import Sample
from ridgefill.eval.ruler import fit_size, string_match_all

NAME = "passkey"
DEPTHS = 10
INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it afterwards."
)
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? Answer with the number."
ANSWER_PREFIX = " The pass key is"


def depth(index: int) -> float:
    """Where sample `index` hides its key, as a fraction of the haystack."""
    return (index % DEPTHS) / (DEPTHS - 1)


def passkey_sample(size: int, key: str, at: float, essay: Sequence[str], index: int = 0) -> Sample:
    """A prompt whose haystack is the first `size` sentences of `essay`, the key at fraction `at`."""
    sents = list(essay[:size])
    cut = round(len(sents) * at)
    needle = NEEDLE.format(key=key)
    context = " ".join([*sents[:cut], needle, *sents[cut:]])
    return Sample(NAME, index, f"{INTRO}\n{context}\n{QUESTION}", ANSWER_PREFIX, [key], [needle])


class PasskeyTask:
    """`api.Task`: find the pass key in the essay haystack."""

    name = NAME
    max_new_tokens = 16

    def __init__(self, essay: Sequence[str]):
        if not essay:
            raise RidgefillError("the pass-key test needs essay sentences for its haystack")
        self.essay = tuple(essay)

    def samples(self, count_tokens: Callable[[Sample], int], length: int, count: int, seed: int) -> list[Sample]:
        budget = length - self.max_new_tokens
        out, size = [], None
        for i in range(count):
            key = str(random.Random(f"{NAME}-{seed}-{i}").randint(10_000, 99_999))

            def make(n: int, i: int = i, key: str = key) -> Sample:
                return passkey_sample(n, key, depth(i), self.essay, i)

            size = fit_size(lambda n, make=make: count_tokens(make(n)), budget, min(len(self.essay), length), size)
            out.append(make(size))
        return out

    def score(self, prediction: str, sample: Sample) -> float:
        return 100.0 * string_match_all(prediction, sample.answers)
