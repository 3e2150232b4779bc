"""The built-in long-prompt demo: one RULER-style needle in a long document.

What it is: a reproducible long prompt (RULER niah_single_1 wording: noise haystack, a word key,
a 7-digit value, the answer prefix inside the assistant turn) answered by the model with exact and
with its default method (`tuned`), both prefills then timed side by side. What it is not: an
evaluation; it is one sample, for showing the product working.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ridgefill.generation import GenerationResult, encode_prompt, generate
from ridgefill.methods import Prefill, resolve_prefill
from ridgefill.methods.resolve import TUNED
from ridgefill.models.device import cpu_model
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


@dataclass
class DemoReport:
    """Both answers, each method's TTFTs over the repeats, and the prompt they answered."""

    lm: LoadedModel
    prompt: DemoPrompt
    prefills: dict[str, Prefill]
    answers: dict[str, GenerationResult]
    ttfts: dict[str, list[float]]

    def median(self, label: str) -> float:
        return statistics.median(self.ttfts[label])

    def lines(self) -> list[str]:
        p, lm = self.prompt, self.lm
        out = [
            f"{lm.name} ({lm.dtype_name} on {lm.device}, {cpu_model()}): "
            f"the magic number for {p.key!r} is {p.answer}, hidden at {p.depth:.0%} depth of a "
            f"{p.input_ids.shape[1]}-token prompt"
        ]
        for label, pre in self.prefills.items():
            r, t = self.answers[label], self.ttfts[label]
            found = "found" if p.answer in r.text else "MISSED"
            out.append(
                f"  {label:<6} TTFT {self.median(label):6.2f} s (median of {len(t)}, {min(t):.2f}-{max(t):.2f})  "
                f"answer {r.text.strip()!r} ({found})  [{pre.for_length(p.input_ids.shape[1]).describe()}]"
            )
        if "tuned" in self.prefills:
            ratio = self.median("exact") / self.median("tuned")
            out.append(f"  tuned TTFT is {ratio:.2f}x exact's, same prompt, same dtype, measured side by side")
        else:
            out.append(f"  {lm.name} has no tuned configuration: `ridgefill tune --model {lm.name}` makes one")
        out.append("  one prompt: `ridgefill bench` and `ridgefill eval` give repeated, paired measurements")
        return out


def run_demo(lm: LoadedModel, target_tokens: int = 6000, maps=None, repeats: int = 3) -> DemoReport:
    """Answer the built-in prompt with exact and with the model's default method (`tuned` where it
    has one, its maps fitted on first use), then time both prefills `repeats` times, alternating."""
    prompt = needle_prompt(lm, min(target_tokens, lm.context_length - 64))
    prefills = {"exact": resolve_prefill(lm, "exact")}
    default = resolve_prefill(lm, maps=maps)  # tuned where the model has it, its maps fitted on first use
    if default.label == TUNED:
        prefills[TUNED] = default
    answers = {label: generate(lm, prompt.input_ids, prefill=p, max_new_tokens=12) for label, p in prefills.items()}
    ttfts: dict[str, list[float]] = {label: [] for label in prefills}
    for _ in tqdm(range(repeats), desc="timing both prefills", unit="round"):
        for label, p in prefills.items():
            ttfts[label].append(generate(lm, prompt.input_ids, prefill=p, max_new_tokens=1).ttft_s)
    return DemoReport(lm, prompt, prefills, answers, ttfts)
