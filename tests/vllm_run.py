"""Run one vLLM configuration on token prompts and print the greedy tokens and logprobs as JSON.

A separate process per configuration: vLLM keeps process-wide state, so the tests start one
engine per run (`python tests/vllm_run.py SPEC_JSON`). SPEC: model, maps, method, settings (fill
settings, or null for stock vLLM), prompts (token id lists), max_tokens, logprobs, chunk (the
scheduler's max_num_batched_tokens), and optionally max_model_len and kv_blocks (a KV cache that
small makes vLLM preempt and recompute requests; the run then also reports how many times).
"""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    spec = json.loads(sys.argv[1])
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.core.sched.scheduler import Scheduler

    preempted = []
    preempt = Scheduler._preempt_request

    def counting(self, request, *args, **kwargs):
        preempted.append(request.request_id)
        return preempt(self, request, *args, **kwargs)

    Scheduler._preempt_request = counting
    common = dict(
        dtype="float32",
        enforce_eager=True,
        max_model_len=spec.get("max_model_len", 2048),
        max_num_batched_tokens=spec["chunk"],
        enable_chunked_prefill=True,
        enable_prefix_caching=False,
        seed=0,
    )
    if spec.get("kv_blocks"):
        common["num_gpu_blocks_override"] = spec["kv_blocks"]
    if spec["settings"] is None:
        import vllm

        from ridgefill.models.loading import resolve

        llm = vllm.LLM(str(resolve(spec["model"])[0]), **common)
    else:
        import ridgefill.vllm as rv

        common.pop("enable_prefix_caching")
        llm = rv.LLM(spec["model"], spec["maps"], spec["method"], **spec["settings"], **common)
    sp = SamplingParams(max_tokens=spec["max_tokens"], temperature=0, logprobs=spec["logprobs"], ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], sp, use_tqdm=False)
    result = [
        {
            "tokens": list(o.outputs[0].token_ids),
            "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs],
        }
        for o in outs
    ]
    print("RESULT " + json.dumps({"outputs": result, "preemptions": len(preempted)}), flush=True)


if __name__ == "__main__":
    main()
