"""Shared fixtures: tiny random-config models of every supported architecture, and SmolLM2."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from ridgefill.models import hf
from ridgefill.models.loading import LoadedModel

# Hidden 64, 3 layers, GQA 4:2. Windows of 8 make the sliding masks bite on short prompts.
_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)

TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(model_type="llama"),
    "mistral": dict(model_type="mistral", sliding_window=8),
    "qwen2": dict(model_type="qwen2", use_sliding_window=False),
    "qwen3": dict(model_type="qwen3"),
    "gemma3_text": dict(
        model_type="gemma3_text",
        sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=16,
        final_logit_softcapping=0.5,  # small, so a missing cap shows
    ),
}


def make_tiny(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> LoadedModel:
    from transformers import AutoConfig

    spec = dict(TINY_CONFIGS[arch])
    model_type = spec.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **_COMMON, **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa").eval()
    with torch.no_grad():  # random norms, so that a mix-up of norm weights cannot pass unseen
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return LoadedModel(model=model, tokenizer=None, name=f"tiny-{arch}", parts=hf.model_parts(model))


@pytest.fixture(scope="session", autouse=True)
def fp32_by_default():
    """Tests compare against fp32 references on every machine: `--dtype auto` reads this CPU as
    one where bf16 is not faster (an explicit cpuinfo text, as the dtype tests pass, is still read)."""
    from ridgefill.models import device

    real = device.cpu_prefers_bf16

    def prefers(cpuinfo=None, gain=device.bf16_matmul_gain):
        return False if cpuinfo is None else real(cpuinfo, gain)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(device, "cpu_prefers_bf16", prefers)
        yield


@pytest.fixture(params=sorted(TINY_CONFIGS))
def tiny(request) -> LoadedModel:
    return make_tiny(request.param)


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    from ridgefill.models import load_model

    return load_model("smollm2-135m", dtype="float32")


@pytest.fixture(scope="session")
def smollm2_maps(tmp_path_factory):
    """A folder with SmolLM2 ridge + kva maps at split 15, fitted on 6K tokens of the default corpus."""
    from ridgefill.cli import main
    from ridgefill.corpus import DEFAULT_CORPUS_DIR

    if not DEFAULT_CORPUS_DIR.is_dir():
        pytest.skip("needs Debian's python3.11-doc (`make` installs it)")
    out = tmp_path_factory.mktemp("maps")
    argv = ["fit", "--splits", "15", "--calib-tokens", "6144", "--heldout-tokens", "2048", "--segment-tokens", "1024"]
    assert main([*argv, "--out", str(out), "--report", str(out / "fit.json")]) == 0
    return out
