"""Retrieval-like calibration content: short key-value facts spliced into calibration segments.

What it is (experimental): retrieval-like content added to the calibration text. The fill maps are fitted
on prose, so the rows a retrieval prompt depends on (a fact with a rare key and a number, in the
middle of unrelated text) are rows the fit rarely saw. `with_facts` inserts `per_segment` facts at
random positions of each calibration segment, keeping its length, so the fit sees such rows in a
prose context. The templates deliberately differ from RULER's needle sentence ("One of the special
magic numbers for ... is: ...") and its keys, so no evaluation text reaches the calibration.
What it is not: evaluation data; held-out segments (which choose lambda) stay natural text.
"""

from __future__ import annotations

import random

# Our own short word lists; RULER's keys are hyphenated pairs from wonderwords' much longer lists.
_ADJ = (
    "amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen",
    "lively", "mellow", "narrow", "olive", "plain", "quiet", "rapid", "silver", "tidy", "upper",
    "vivid", "warm", "young", "zesty", "bold", "crisp", "dense", "even", "fresh",
)  # fmt: skip
_NOUN = (
    "anchor", "basket", "candle", "desk", "engine", "feather", "garden", "harbor", "island", "jacket",
    "kettle", "ladder", "meadow", "needle", "orchard", "pencil", "quarry", "river", "saddle", "tunnel",
    "umbrella", "valley", "wagon", "yard", "zipper", "bridge", "cabin", "drum", "forest", "glove",
)  # fmt: skip
_TEMPLATES = (
    "The access code for the {key} account is {value}.",
    "Note: {key} = {value}",
    "Record {key}: {value}",
    "The {key} was registered under number {value}.",
    '"{key}": {value},',
    "Remember that the {key} belongs to locker {value}.",
)


def fact(rng: random.Random) -> str:
    """One fact: a two-word key and a 4-8 digit value in one of a few templates."""
    key = f"{rng.choice(_ADJ)} {rng.choice(_NOUN)}"
    digits = rng.randint(4, 8)
    value = str(rng.randrange(10 ** (digits - 1), 10**digits))
    return rng.choice(_TEMPLATES).format(key=key, value=value)


def with_facts(tokenizer, segments: list[list[int]], per_segment: int, seed: int = 0) -> list[list[int]]:
    """Each segment with `per_segment` facts inserted at random token positions, cut back to its length.

    Facts go after the segment's first 16 tokens (the sinks the fit skips) and each is preceded by a
    space and followed by a newline, as a fact in a document would be. Deterministic in `seed`.
    """
    if per_segment <= 0:
        return segments
    rng = random.Random(seed)
    out = []
    for seg in segments:
        n = len(seg)
        spots = sorted(rng.randrange(16, n) for _ in range(per_segment))
        pieces, prev = [], 0
        for at in spots:
            pieces += seg[prev:at] + tokenizer(" " + fact(rng) + "\n", add_special_tokens=False)["input_ids"]
            prev = at
        out.append((pieces + seg[prev:])[:n])
    return out
