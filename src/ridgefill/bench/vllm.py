"""`ridgefill vllm-bench`: TTFT of stock vLLM, vLLM with RidgeFill and our own engine, side by side.

What it is: two vLLM engines (stock, and RidgeFill from the same map file and settings) each in
a worker process that waits for prompts, and our own engine (exact, and the same fill) in this
process. At each length every runner times the same prompt, one runner at a time in an order
rotated each repeat, after a warm-up: TTFT is a request with one output token, whole prompt in
one scheduler step. Reported per runner: median/min/max seconds, the speedup over its own
engine's exact (ratio of medians, with min/max of the per-repeat paired ratios), and for the
plugin the share of our engine's speedup it keeps. What it is not: an accuracy measurement.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ridgefill.errors import RidgefillError

_TAG = "RIDGEFILL-BENCH "


@dataclass(frozen=True)
class VllmBenchConfig:
    lengths: tuple[int, ...]
    repeats: int = 3
    warmup: int = 1


class _Worker:
    """A vLLM engine in its own process, timing one prompt per request on stdin."""

    def __init__(self, name: str, spec: dict):
        self.name = name
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB: enough for one 32K prompt, not the default's half of RAM
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ridgefill.bench.vllm", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.log: list[str] = []

    def _reply(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(_TAG):
                return json.loads(line[len(_TAG) :])
            self.log.append(line)
            del self.log[:-40]
        raise RidgefillError(f"the {self.name} vLLM worker stopped:\n{''.join(self.log)}")

    def ready(self) -> dict:
        return self._reply()

    def ttft(self, ids: list[int]) -> float:
        self.proc.stdin.write(json.dumps(ids) + "\n")
        self.proc.stdin.flush()
        return self._reply()["seconds"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def run_vllm_bench(lm, prepared, fill_prefill, exact_prefill, cfg: VllmBenchConfig, prompts: dict[int, list[int]]):
    """Rows of the side-by-side table; `prepared` is `ridgefill.vllm.prepare`'s result for the
    fill, run by the plugin and (as `fill_prefill`) by our engine."""
    from ridgefill.bench.ttft import flop_bound
    from ridgefill.engine import Engine

    longest = max(cfg.lengths)
    # max_len: the longest prompt and its one output token
    base = dict(model=str(prepared.model_dir), dtype=prepared.dtype, max_len=longest + 1)
    workers = {
        "vllm exact": _Worker("stock", {**base, "hf_overrides": None}),
        "vllm fill": _Worker("RidgeFill", {**base, "hf_overrides": prepared.hf_overrides}),
    }
    engine = Engine(lm)

    def ours(prefill):
        def run(ids: list[int]) -> tuple[float, object]:
            t0 = engine.clock()
            res = prefill.run(engine, torch.tensor([ids]))
            int(res.logits[-1].float().argmax())  # the first token, as vLLM samples it
            return engine.clock() - t0, res

        return run

    runners = {"ours exact": ours(exact_prefill), "ours fill": ours(fill_prefill)}
    rows = []
    try:
        for w in workers.values():
            w.ready()
        bar = tqdm(total=len(cfg.lengths) * (cfg.warmup + cfg.repeats) * 4, desc="vllm-bench", unit="run")
        labels = list(workers) + list(runners)
        for n in cfg.lengths:
            ids = prompts[n]
            times: dict[str, list[float]] = {k: [] for k in labels}
            plan = None
            for rep in range(cfg.warmup + cfg.repeats):
                order = labels[rep % 4 :] + labels[: rep % 4]
                for label in order:
                    if label in workers:
                        seconds = workers[label].ttft(ids)
                    else:
                        seconds, res = runners[label](ids)
                        if label == "ours fill" and not res.ran_exact:
                            plan = res.plan
                    if rep >= cfg.warmup:
                        times[label].append(seconds)
                    bar.update()
            bound = flop_bound(engine, n, plan)
            for label in labels:
                exact = times[label.split()[0] + " exact"]
                t = times[label]
                ratios = [e / x for e, x in zip(exact, t, strict=True)]
                rows.append(
                    {
                        "length": n,
                        "engine": "vllm" if label.startswith("vllm") else "ridgefill",
                        "method": label.split()[1],
                        "median_s": round(statistics.median(t), 4),
                        "min_s": round(min(t), 4),
                        "max_s": round(max(t), 4),
                        "speedup": round(statistics.median(exact) / statistics.median(t), 3),
                        "speedup_min": round(min(ratios), 3),
                        "speedup_max": round(max(ratios), 3),
                        "flop_bound": round(bound, 3) if label.endswith("fill") else 1.0,
                        "repeats": cfg.repeats,
                    }
                )
            mine = {r["engine"] + " " + r["method"]: r for r in rows if r["length"] == n}
            mine["vllm fill"]["share_of_our_speedup"] = round(
                (mine["vllm fill"]["speedup"] - 1) / max(mine["ridgefill fill"]["speedup"] - 1, 1e-9), 3
            )
            mine["vllm fill"]["ratio_of_speedups"] = round(
                mine["vllm fill"]["speedup"] / mine["ridgefill fill"]["speedup"], 3
            )
            mine["vllm exact"]["vs_our_exact"] = round(
                mine["ridgefill exact"]["median_s"] / mine["vllm exact"]["median_s"], 3
            )
        bar.close()
    finally:
        for w in workers.values():
            w.close()
    return rows


def _worker(spec: dict) -> None:
    """A vLLM engine that answers each line of token ids on stdin with its TTFT."""
    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(
        dtype=spec["dtype"],
        max_model_len=spec["max_len"],
        max_num_batched_tokens=spec["max_len"],
        enable_prefix_caching=False,
        enforce_eager=True,
        seed=0,
    )
    if spec["hf_overrides"]:
        kwargs["hf_overrides"] = spec["hf_overrides"]
    llm = vllm.LLM(spec["model"], **kwargs)
    sp = SamplingParams(max_tokens=1, temperature=0)
    print(_TAG + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        prompt = TokensPrompt(prompt_token_ids=json.loads(line))
        t0 = time.perf_counter()
        llm.generate([prompt], sp, use_tqdm=False)
        print(_TAG + json.dumps({"seconds": time.perf_counter() - t0}), flush=True)


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]))
