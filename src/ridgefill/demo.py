"""The built-in long-prompt demo: one RULER-style needle in a long document.

What it is: a reproducible long prompt (RULER niah_single_1 wording: noise haystack, a word key,
a 7-digit value, the answer prefix inside the assistant turn) answered by the model under each
requested method, with TTFT and prefill tokens/s. What it is not: an evaluation; it is one
sample, for showing the product working.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ridgefill.generation import GenerationResult, encode_prompt, generate
from ridgefill.models.loading import LoadedModel

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
_KEYS = ("quiet-harbor", "amber-falcon", "silver-meadow", "crimson-lantern", "gentle-glacier")


@dataclass(frozen=True)
class DemoPrompt:
    input_ids: torch.Tensor  # (1, N)
    answer: str
    key: str
    depth: float


def needle_prompt(lm: LoadedModel, target_tokens: int = 3000, depth: float = 0.3, seed: int = 7) -> DemoPrompt:
    """A prompt of about `target_tokens` tokens with one magic number at relative `depth`."""
    rng = random.Random(seed)
    key, value = rng.choice(_KEYS), str(rng.randint(1_000_000, 9_999_999))
    per_line = len(lm.tokenizer(NOISE + "\n", add_special_tokens=False)["input_ids"])
    lines = [NOISE] * max(1, (target_tokens - 100) // per_line)
    lines.insert(int(len(lines) * depth), f"One of the special magic numbers for {key} is: {value}.")
    text = (
        "A special magic number is hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the number afterwards.\n"
        + "\n".join(lines)
        + f"\nWhat is the special magic number for {key} mentioned in the provided text?"
    )
    prefix = f" The special magic number for {key} mentioned in the provided text is"
    return DemoPrompt(encode_prompt(lm, text, answer_prefix=prefix), value, key, depth)


def run_demo(
    lm: LoadedModel, methods: dict[str, dict], target_tokens: int = 3000
) -> tuple[DemoPrompt, dict[str, GenerationResult]]:
    """Answer the built-in prompt once per method; `methods` maps a label to generate() kwargs."""
    prompt = needle_prompt(lm, target_tokens)
    results = {label: generate(lm, prompt.input_ids, max_new_tokens=12, **kw) for label, kw in methods.items()}
    return prompt, results
