"""`ridgefill experimental margins`: how close exact came to the answer a method gave instead.

What it is: for the prompts where a method and exact score differently in an eval cache (same
prompts, same configuration keys), the stock model's teacher-forced log-probabilities of both
answers after the prompt: the first token where the two answers part, and exact's margin there
(the log-probability of its own token less that of the method's). A margin of a tenth of a nat
says exact's answer was itself a near tie, one any change to the cache can tip; a margin of
several nats says the method lost something exact read clearly. With a second copy of the model at
another dtype (`rescore`), each record also holds that copy's log-probabilities of both answers:
whether exact's own precision tips the same tie. What it is not: an evaluation (it decodes
nothing; answers come from the cache).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ridgefill.eval.adapter import Prepared, config_key, prepare, prompt_key
from ridgefill.eval.runner import read_records
from ridgefill.methods import Prefill
from ridgefill.models import hf
from ridgefill.models.loading import LoadedModel


def answer_logprobs(lm: LoadedModel, input_ids: torch.Tensor, texts: list[str]) -> list[tuple[list[int], list[float]]]:
    """Each text's tokens and the stock model's log-probability of each, teacher-forced after the
    prompt. The prompt runs once; each answer continues from a copy of its cache."""
    with torch.no_grad():
        head, cache = hf.stock_forward(lm.model, input_ids, keep=1)
        first = torch.log_softmax(head[0, -1].float(), -1)
        out = []
        for text in texts:
            tokens = lm.tokenizer.encode(text, add_special_tokens=False)
            if not tokens:
                out.append(([], []))
                continue
            logp = first[None]
            if len(tokens) > 1:
                rest = torch.tensor([tokens[:-1]], device=input_ids.device)
                tail, _ = hf.stock_forward(lm.model, rest, copy.deepcopy(cache))
                logp = torch.cat([logp, torch.log_softmax(tail[0].float(), -1)])
            out.append((tokens, [round(logp[j, t].item(), 4) for j, t in enumerate(tokens)]))
    return out


def parting(lm: LoadedModel, input_ids: torch.Tensor, exact_text: str, method_text: str) -> dict:
    """Where two answers to one prompt part, and exact's log-probabilities of each token there."""
    (a, a_lp), (b, b_lp) = answer_logprobs(lm, input_ids, [exact_text, method_text])
    j = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    out = {"exact_logprobs": a_lp, "method_logprobs": b_lp, "parting_token": j}
    if j is None:  # one answer is the other's prefix: they part at an end, not at a token
        return {**out, "exact_token": None, "method_token": None, "margin_nats": None}
    decode = lm.tokenizer.decode
    return {
        **out,
        "exact_token": decode([a[j]]),
        "method_token": decode([b[j]]),
        "margin_nats": round(a_lp[j] - b_lp[j], 4),
    }


def margin_records(
    lm: LoadedModel,
    spec: Prefill,
    tasks: list[str],
    length: int,
    samples: int,
    essay: list[str],
    cache: Path,
    seed: int = 42,
    rescore: LoadedModel | None = None,
) -> list[dict]:
    """One record per prompt where `spec`'s cached score differs from exact's (both cached under
    their current configuration keys), with `parting` of their two answers; and under `rescored`
    the same from `rescore`, the model at another dtype, when given."""
    keys = {p.label: config_key(lm, p) for p in (Prefill("exact", "exact"), spec)}
    cached = {(r["prompt"], r["method"], r.get("config")): r for r in read_records(cache)}
    out = []
    bar = tqdm(total=len(tasks) * samples, desc=f"margins {lm.name}", unit="prompt")
    for task in tasks:
        for p in prepare(lm, task, length, samples, seed, essay):
            key = prompt_key(p.input_ids)
            ex, m = (cached.get((key, label, c)) for label, c in keys.items())
            if ex is not None and m is not None and ex["score"] != m["score"]:
                out.append(_record(lm, task, length, p, key, ex, m, rescore))
            bar.update()
    bar.close()
    return out


def _record(
    lm: LoadedModel, task: str, length: int, p: Prepared, key: str, ex: dict, m: dict, rescore: LoadedModel | None
) -> dict:
    out = {
        "task": task,
        "length": length,
        "index": p.sample.index,
        "prompt": key,
        "depth": round(p.depth, 4),
        "answers": p.sample.answers,
        "exact": {"prediction": ex["prediction"], "score": ex["score"]},
        "method": {"prediction": m["prediction"], "score": m["score"], "needle_full": m.get("needle_full")},
        **parting(lm, p.input_ids, ex["prediction"], m["prediction"]),
    }
    if rescore is not None:
        ids = p.input_ids.to(rescore.device)
        out["rescored"] = {"dtype": rescore.dtype_name, **parting(rescore, ids, ex["prediction"], m["prediction"])}
    return out


def markdown(records: list[dict], method: str) -> str:
    """A row per differing prompt: both answers, where they part and exact's margin there."""
    if not records:
        return f"{method} and exact score the same on every cached prompt."
    other = next((r["rescored"]["dtype"] for r in records if "rescored" in r), None)
    extra = "" if other is None else f" exact's margin in {other} (nats) |"
    lines = [
        f"Prompts where {method} and exact differ (exact's teacher-forced log-probabilities):",
        "",
        "| task | # | answer | exact | method | needle ran fully | parting tokens (exact / method) "
        f"| exact's margin (nats) |{extra}",
        "| --- " * (8 if other is None else 9) + "|",
    ]
    for r in records:
        e, m = r["exact"], r["method"]
        part = "-" if r["parting_token"] is None else f"{r['exact_token']!r} / {r['method_token']!r}"
        full = "-" if m["needle_full"] is None else f"{m['needle_full']:.2f}"
        lines.append(
            f"| {r['task']} | {r['index']} | {r['answers'][0]} | {e['prediction'].strip()} ({e['score']:.0f}) "
            f"| {m['prediction'].strip()} ({m['score']:.0f}) | {full} | {part} | {_margin(r)} |"
            + ("" if other is None else f" {_margin(r.get('rescored', {}))} |")
        )
    return "\n".join(lines)


def _margin(r: dict) -> str:
    return "-" if r.get("margin_nats") is None else f"{r['margin_nats']:+.3f}"
