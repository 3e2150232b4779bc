"""RULER retrieval tasks (niah_*, vt), generated as RULER generates them.

What it is: sample generation for the eight NIAH variants and variable tracking, following
../shared/RULER.md and RULER's public templates: needle and question wording (made singular when
one answer is expected), key/value types, essay depths from a 40-point grid, noise-line and
distractor-needle haystacks, vt's chains with a one-shot example, the haystack size found by
binary search with the model's own tokenizer (keeping `tokens_to_generate` for the answer), and
`string_match_all` scoring. What it is not: a runner; `ridgefill.eval.runner` runs methods.
"""

from __future__ import annotations

import random
import re
import string
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib.resources import files

from ridgefill.errors import RidgefillError
from ridgefill.eval.api import Sample

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DEPTHS = [round(i * 100 / 39) for i in range(40)]  # RULER: np.linspace(0, 100, 40) rounded

NIAH_TEMPLATE = (
    "Some special magic {type_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_v} afterwards.\n{context}\n"
    "What are all the special magic {type_v} for {query} mentioned in the provided text?"
)
NIAH_ANSWER_PREFIX = " The special magic {type_v} for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
# "assgined" is RULER's own spelling; kept so scores stay comparable.
VT_ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, "
    "{num_v} variables are assgined the value {query}, they are: "
)


@dataclass(frozen=True)
class NiahSpec:
    haystack: str  # "noise", "essay" or "needle"
    type_k: str  # "words" or "uuids"
    type_v: str  # "numbers" or "uuids"
    num_k: int = 1
    num_v: int = 1
    num_q: int = 1


NIAH_TASKS: dict[str, NiahSpec] = {
    "niah_single_1": NiahSpec("noise", "words", "numbers"),
    "niah_single_2": NiahSpec("essay", "words", "numbers"),
    "niah_single_3": NiahSpec("essay", "words", "uuids"),
    "niah_multikey_1": NiahSpec("essay", "words", "numbers", num_k=4),
    "niah_multikey_2": NiahSpec("needle", "words", "numbers"),
    "niah_multikey_3": NiahSpec("needle", "uuids", "uuids"),
    "niah_multivalue": NiahSpec("essay", "words", "numbers", num_v=4),
    "niah_multiquery": NiahSpec("essay", "words", "numbers", num_k=4, num_q=4),
}
TASKS = (*NIAH_TASKS, "vt")
TOKENS_TO_GENERATE = {"vt": 30, **dict.fromkeys(NIAH_TASKS, 128)}


@cache
def key_words() -> tuple[str, ...]:
    """RULER's keys: every adjective-noun pair from wonderwords' lists, sorted."""
    try:
        assets = files("wonderwords") / "assets"
        adjs = (assets / "adjectivelist.txt").read_text().split()
        nouns = (assets / "nounlist.txt").read_text().split()
    except (ModuleNotFoundError, FileNotFoundError):
        raise RidgefillError("RULER keys need the `wonderwords` package: pip install wonderwords") from None
    return tuple(sorted({f"{a}-{n}" for a in adjs for n in nouns}))


def _random(kind: str, rng: random.Random) -> str:
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    if kind == "words":
        return rng.choice(key_words())
    raise ValueError(kind)


def essay_sentences(texts: list[str]) -> list[str]:
    """Whitespace-collapsed prose split into sentences (the essay haystack)."""
    joined = re.sub(r"\s+", " ", " ".join(texts)).strip()
    return [s for s in re.split(r"(?<=[.!?])\s+", joined) if s]


def _singular(text: str, type_v: str) -> str:
    # RULER rewrites the plural wording when exactly one answer is expected.
    one = type_v[:-1]
    return (
        text.replace(f"Some special magic {type_v} are", f"A special magic {one} is")
        .replace(f"What are all the special magic {type_v}", f"What is the special magic {one}")
        .replace(f"about the {type_v} afterwards", f"about the {one} afterwards")
        .replace(f"special magic {type_v} for", f"special magic {one} for")
        .replace("provided text are", "provided text is")
    )


def niah_sample(task: str, size: int, rng: random.Random, essay: Sequence[str], index: int = 0) -> Sample:
    """A NIAH sample whose haystack has `size` units (noise lines, essay sentences or needles)."""
    spec = NIAH_TASKS[task]
    keys, values, needles = [], [], []
    for _ in range(spec.num_k):
        keys.append(_random(spec.type_k, rng))
        values.append([_random(spec.type_v, rng) for _ in range(spec.num_v)])
        needles += [NEEDLE.format(type_v=spec.type_v, key=keys[-1], value=v) for v in values[-1]]
    rng.shuffle(needles)
    if spec.haystack == "essay":
        sents = list(essay[:size])
        cuts = sorted(int(len(sents) * d / 100) for d in rng.sample(DEPTHS, len(needles)))
        parts, last = [], 0
        for cut, needle in zip(cuts, needles, strict=True):
            parts += sents[last:cut] + [needle]
            last = cut
        context = " ".join(parts + sents[last:])
    else:
        lines = (
            [NOISE] * size
            if spec.haystack == "noise"
            else [
                NEEDLE.format(type_v=spec.type_v, key=_random(spec.type_k, rng), value=_random(spec.type_v, rng))
                for _ in range(size)
            ]
        )
        for i, needle in zip(sorted(rng.sample(range(size + 1), len(needles)), reverse=True), needles, strict=True):
            lines.insert(i, needle)
        context = "\n".join(lines)
    picked = rng.sample(range(spec.num_k), spec.num_q)
    queries = [keys[i] for i in picked]
    answers = [v for i in picked for v in values[i]]
    query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
    # The singular rewrite touches the template only; the needles in the context keep the plural.
    template = NIAH_TEMPLATE.format(type_v=spec.type_v, context="{context}", query=query)
    prefix = NIAH_ANSWER_PREFIX.format(type_v=spec.type_v, query=query)
    if len(answers) == 1:
        template, prefix = _singular(template, spec.type_v), _singular(prefix, spec.type_v)
    return Sample(task, index, template.replace("{context}", context, 1), prefix, answers, needles)


def _vt_chain(rng: random.Random, hops: int, letters: int) -> tuple[list[str], list[str]]:
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if name not in names:
            names.append(name)
    chain = [f"VAR {names[0]} = {rng.randint(10000, 99999)}"]
    chain += [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(hops)]
    return names, chain


def _vt_text(size: int, rng: random.Random, hops: int, letters: int) -> tuple[str, str, list[str], list[str]]:
    names, chain = _vt_chain(rng, hops, letters)
    lines = [NOISE + "\n"] * size
    slots = range(size + 1)  # a tiny haystack (during the length search) lets links share a slot
    picks = rng.sample(slots, len(chain)) if len(slots) >= len(chain) else rng.choices(slots, k=len(chain))
    for j, pos in enumerate(sorted(picks)):
        lines.insert(pos + j, chain[j])
    context = " ".join(lines).replace(". \n", ".\n")
    value = chain[0].split("=")[-1].strip()
    text = VT_TEMPLATE.format(context=context, query=value)
    return text, VT_ANSWER_PREFIX.format(num_v=hops + 1, query=value), names, chain


def vt_sample(size: int, rng: random.Random, example_size: int, index: int = 0, hops: int = 4) -> Sample:
    """Variable tracking with RULER's one-shot example (3-letter names) placed before the task."""
    ex_text, ex_prefix, ex_names, _ = _vt_text(example_size, rng, hops, letters=3)
    text, prefix, names, chain = _vt_text(size, rng, hops, letters=5)
    example = ex_text + ex_prefix + " ".join(ex_names)
    return Sample("vt", index, example + "\n\n" + text, prefix, names, chain)


def string_match_all(prediction: str, answers: list[str]) -> float:
    """RULER's metric: the fraction of references found (case-insensitive) in the cleaned prediction."""
    pred = re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip().lower()
    return sum(a.lower() in pred for a in answers) / len(answers)


def fit_size(count_tokens: Callable[[int], int], budget: int, hi: int, guess: int | None = None) -> int:
    """Largest haystack size in [1, hi] whose prompt has at most `budget` tokens (binary search).

    `guess` (the size a sibling sample needed) first brackets the answer by galloping outwards
    from it, so a good guess costs a few tokenisations of a prompt near the budget instead of
    many of prompts up to the whole haystack; the answer is the same.
    """
    lo = 1
    if guess is not None and 1 < guess <= hi:
        step = 1
        if count_tokens(guess) <= budget:
            lo = guess
            while lo < hi:
                probe = min(hi, guess + step)
                if count_tokens(probe) > budget:
                    hi = probe - 1
                    break
                lo, step = probe, step * 2
        else:
            hi = guess - 1
            while hi > 1:
                probe = max(1, guess - step)
                if count_tokens(probe) <= budget:
                    lo = probe
                    break
                hi, step = probe - 1, step * 2
    if lo == 1 and count_tokens(1) > budget:
        raise RidgefillError(f"even the smallest haystack exceeds {budget} tokens")
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count_tokens(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class RulerTask:
    """One RULER task behind the `api.Task` interface: seeded samples fitted to a token budget by
    binary search over the haystack size, scored with `string_match_all`."""

    name: str
    essay: tuple[str, ...] = field(default=(), repr=False)  # essay sentences (niah tasks with an essay haystack)

    def __post_init__(self) -> None:
        if self.name not in TASKS:
            raise RidgefillError(f"unknown task {self.name!r}; choose from {', '.join(TASKS)}")
        if self.name in NIAH_TASKS and NIAH_TASKS[self.name].haystack == "essay" and not self.essay:
            raise RidgefillError(f"{self.name} needs essay sentences for its haystack")

    @property
    def max_new_tokens(self) -> int:
        return TOKENS_TO_GENERATE[self.name]

    def _make(self, size: int, state: int, index: int) -> Sample:
        rng = random.Random(state)
        if self.name == "vt":
            return vt_sample(size, rng, example_size=20, index=index)
        return niah_sample(self.name, size, rng, self.essay, index=index)

    def samples(self, count_tokens: Callable[[Sample], int], length: int, count: int, seed: int) -> list[Sample]:
        budget = length - self.max_new_tokens
        essay_task = self.name in NIAH_TASKS and NIAH_TASKS[self.name].haystack == "essay"
        # Every unit (sentence, line) is at least one token, so no more than `length` of them fit:
        # the search never tokenises a prompt longer than that (the answer is the same).
        hi = min(len(self.essay), length) if essay_task else length
        out, size = [], None
        for i in range(count):
            state = seed * 1_000_003 + TASKS.index(self.name) * 10_007 + i
            # Each sample's size search starts from its sibling's size (a few tokenisations).
            size = fit_size(lambda n, state=state, i=i: count_tokens(self._make(n, state, i)), budget, hi, guess=size)
            out.append(self._make(size, state, i))
        return out

    def score(self, prediction: str, sample: Sample) -> float:
        return 100 * string_match_all(prediction, sample.answers)
