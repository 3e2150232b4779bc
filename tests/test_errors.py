"""Bad input gets one clear line and a non-zero exit, never a traceback."""

from __future__ import annotations

import pytest
import torch

from ridgefill.cli import main
from ridgefill.engine import Engine
from ridgefill.errors import PromptError


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RIDGEFILL_CACHE", str(tmp_path / "cache"))


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_unknown_model_lists_known(capsys):
    code, _, err = _run(capsys, "generate", "--model", "no-such-model", "--prompt", "hi")
    assert code == 2
    assert "unknown model 'no-such-model'" in err and "smollm2-135m" in err and "qwen2.5-0.5b" in err
    assert "Traceback" not in err


def test_missing_gguf(capsys, tmp_path):
    code, _, err = _run(capsys, "generate", "--model", str(tmp_path / "gone.gguf"), "--prompt", "hi")
    assert code == 2 and "GGUF file not found" in err


@pytest.mark.parametrize("payload", [b"NOPE" + b"\0" * 64, b"GGUF" + b"\x03\0\0\0" + b"\xff" * 64])
def test_corrupt_gguf(capsys, tmp_path, payload):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(payload)
    code, _, err = _run(capsys, "generate", "--model", str(bad), "--prompt", "hi")
    assert code == 2 and str(bad) in err and "Traceback" not in err


def test_unsupported_architecture(capsys, tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path / "gpt2")
    code, _, err = _run(capsys, "generate", "--model", str(tmp_path / "gpt2"), "--prompt", "hi")
    assert code == 2 and "unsupported architecture 'gpt2'" in err and "llama" in err


def test_empty_prompt(capsys):
    code, _, err = _run(capsys, "generate", "--prompt", "   ")
    assert code == 2 and "prompt is empty" in err


def test_missing_prompt_file(capsys, tmp_path):
    code, _, err = _run(capsys, "generate", "--prompt-file", str(tmp_path / "none.txt"))
    assert code == 2 and "prompt file not found" in err


def test_prompt_longer_than_context_engine(tiny):
    ids = torch.zeros(1, tiny.context_length + 1, dtype=torch.long)
    with pytest.raises(PromptError, match="context of 512"):
        Engine(tiny).prefill_exact(ids)
    with pytest.raises(PromptError, match="empty"):
        Engine(tiny).prefill_exact(torch.zeros(1, 0, dtype=torch.long))


@pytest.mark.slow
def test_prompt_longer_than_context_cli(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("RIDGEFILL_CACHE")  # reuse the dequantised SmolLM2
    long = tmp_path / "long.txt"
    long.write_text("word " * 9000)
    code, _, err = _run(capsys, "generate", "--prompt-file", str(long), "--prompt", "Summarise.")
    assert code == 2 and "context of 8192" in err


@pytest.mark.parametrize("sub", [[], ["generate"], ["models"], ["demo"]])
def test_help_ends_with_examples(capsys, sub):
    with pytest.raises(SystemExit) as exc:
        main([*sub, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out.rstrip()
    assert "examples:" in out and out.splitlines()[-1].strip().startswith("ridgefill ")
