"""The vLLM plugin's settings: tuned configurations, length buckets, and the rows each request
runs (pure: runs without vLLM)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from ridgefill.errors import RidgefillError
from ridgefill.vllm.config import VllmFill, overrides
from ridgefill.vllm.step import prompt_step, split_rows


def one_line(e) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def config(**over) -> SimpleNamespace:
    return SimpleNamespace(num_hidden_layers=24, **overrides("Qwen2ForCausalLM", "identity", **over))


def test_tuned_takes_the_shipped_settings_the_plugin_runs(monkeypatch):
    from ridgefill.methods import tuned
    from ridgefill.vllm import _tuned

    one = {"method": "ridge", "settings": {"split": 10, "tail": 512, "query_rows": 512, "query_layer": 11, "drop": 0.5}}
    monkeypatch.setattr(tuned, "shipped_defaults", lambda: {"qwen2.5-0.5b": one})
    method, settings, by_length = _tuned("qwen2.5-0.5b", {"tail": 64, "sink": None})
    assert method == "ridge" and by_length is None
    assert settings == {"split": 10, "tail": 64, "query_rows": 512, "query_layer": 11}  # no drop in vLLM
    with pytest.raises(RidgefillError) as e:
        _tuned("my-model", {})
    assert "no tuned fill configuration ships for my-model" in one_line(e)


def test_tuned_with_a_gated_bucket_is_refused_naming_it(monkeypatch):
    from ridgefill.methods import tuned
    from ridgefill.vllm import _tuned

    short = {"up_to": 12000, "method": "ridge", "settings": {"split": 10, "tail": 512}}
    longer = {"up_to": None, "method": "tokengate", "settings": {"gate_layer": 5, "keep": 0.5}}
    monkeypatch.setattr(tuned, "shipped_defaults", lambda: {"qwen2.5-0.5b": {"by_length": [short, longer]}})
    with pytest.raises(RidgefillError) as e:
        _tuned("qwen2.5-0.5b", {})
    msg = one_line(e)
    assert "uses tokengate for longer prompts" in msg and "runs the fills only" in msg


def test_every_shipped_configuration_runs_in_vllm_or_is_refused_in_one_line():
    from ridgefill.methods.tuned import shipped_defaults
    from ridgefill.vllm import _tuned

    for name in shipped_defaults():
        try:
            method, settings, by_length = _tuned(name, {})
        except RidgefillError as e:
            assert "\n" not in str(e) and "pass the one for your prompts" in str(e)
            continue
        settings.pop("query_layer", None)  # scored on ridge maps' prediction, which identity (no maps) lacks
        fill = VllmFill.from_config(
            SimpleNamespace(
                num_hidden_layers=32, **overrides("LlamaForCausalLM", "identity", by_length=by_length, **settings)
            )
        )
        assert fill.settings.split == settings["split"] and len(fill.by_length) == len(by_length or ())


def test_tuned_by_length_runs_per_request_where_its_buckets_share_the_split(monkeypatch):
    from ridgefill.methods import tuned
    from ridgefill.vllm import _tuned

    short = {"up_to": 5793, "method": "ridge", "settings": {"split": 18, "tail": 512, "drop": 0.75}}
    longer = {"up_to": None, "method": "ridge", "settings": {"split": 18, "tail": 512, "drop": 0.5}}
    monkeypatch.setattr(tuned, "shipped_defaults", lambda: {"smollm2-135m": {"by_length": [short, longer]}})
    assert _tuned("smollm2-135m", {}) == ("ridge", {"split": 18, "tail": 512}, None)  # they differ in the drop alone
    longer["settings"] = {"split": 18, "tail": 1024, "query_rows": 512}
    method, settings, by_length = _tuned("smollm2-135m", {})
    assert settings == {"split": 18, "tail": 512} and [e["up_to"] for e in by_length] == [5793, None]
    assert (by_length[0]["tail"], by_length[0]["query_rows"]) == (512, 0)
    assert (by_length[1]["tail"], by_length[1]["query_rows"]) == (1024, 512)
    # A setting given explicitly holds in every bucket.
    _, settings, by_length = _tuned("smollm2-135m", {"tail": 64})
    assert settings["tail"] == 64 and all("tail" not in e for e in by_length)
    longer["settings"] = {"split": 15, "tail": 1024, "query_rows": 512}
    with pytest.raises(RidgefillError) as e:
        _tuned("smollm2-135m", {})
    msg = one_line(e)
    assert "changes its split or scoring with the prompt length" in msg
    assert "up to 5793 tokens: --method ridge --split 18" in msg
    assert "longer: --method ridge --split 15 --tail 1024 --query-rows 512" in msg


def test_by_length_picks_each_requests_settings_by_its_prompt_length():
    fill = VllmFill.from_config(
        config(split=8, tail=4, by_length=[{"up_to": 100, "tail": 8}, {"up_to": None, "tail": 32, "query_rows": 16}])
    )
    assert fill.settings_for(100).tail == 8 and fill.settings_for(101).tail == 32
    assert fill.settings_for(101).split == 8 and fill.query_rows and not fill.settings.query_rows
    # Two whole prompts in one step: 60 tokens (tail 8) and 300 tokens (tail 32).
    positions = torch.cat([torch.arange(60), torch.arange(300)])
    plan = prompt_step(positions, torch.tensor([0, 60, 360]), torch.tensor([60, 300]))
    bucket = fill.settings_for
    asked = []

    def scores(a: int, b: int) -> torch.Tensor:
        asked.append((a, b))
        sc = torch.zeros(b - a)
        sc[100] = 1.0
        return sc

    rows = split_rows(plan, lambda n: replace(bucket(n), sink=0, outlier_factor=None), torch.ones(360, 8), scores)
    full = set(rows.full.tolist())
    assert asked == [(60, 360)]  # query rows in the long prompt's bucket alone
    assert set(range(0, 60)) & full == set(range(52, 60))
    assert set(range(328, 360)) <= full and 160 in full and len(full) < 8 + 32 + 64


@pytest.mark.parametrize(
    ("by_length", "says"),
    [
        ([], "non-empty list"),
        ([{"up_to": 100, "tail": 8}], "the last one null"),
        ([{"up_to": 200, "tail": 8}, {"up_to": 100}, {"up_to": None}], "ascending"),
        ([{"up_to": 100, "split": 6}, {"up_to": None}], "'split' cannot change with the prompt length"),
        ([{"up_to": 100, "tail": "8"}, {"up_to": None}], "tail must be int"),
        ([{"up_to": 100, "tail": -1}, {"up_to": None}], "tail"),
    ],
)
def test_bad_length_buckets_are_refused_in_one_line(by_length, says):
    with pytest.raises(RidgefillError) as e:
        VllmFill.from_config(config(split=8, by_length=by_length))
    assert says in one_line(e)
