"""The lm-evaluation-harness adapter, run through the harness's own Python entry point on a local task."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
lm_eval = pytest.importorskip("lm_eval")

ROOT = Path(__file__).resolve().parents[1]
INCLUDE = ROOT / "examples" / "lmeval"  # the README's runnable example task (local data, no hub)


def _run(model, model_args, include):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import ridgefill.integrations.lmeval  # noqa: F401  (registers --model ridgefill)

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    out = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["ridgefill_mini", "ridgefill_mini_ppl", "ridgefill_mini_gen"],
        task_manager=TaskManager(include_path=str(include)),
        log_samples=True,
        batch_size=1,
        device="cpu",
    )

    def value(r):  # (loglikelihood, is_greedy) -> loglikelihood; [text] -> text
        while isinstance(r, (list, tuple)):
            r = r[0]
        return r if isinstance(r, str) else float(r)

    return out["results"], {
        task: [[value(r) for r in s["filtered_resps"]] for s in sorted(out["samples"][task], key=lambda s: s["doc_id"])]
        for task in out["samples"]
    }


def test_exact_matches_the_harness_hf_model_and_ridge_runs(monkeypatch, smollm2, smollm2_maps):
    from ridgefill.models.loading import resolve

    monkeypatch.chdir(ROOT)  # the task's data_files path is relative to the repository root
    include = INCLUDE
    hf_dir, _ = resolve("smollm2-135m")
    ref_results, ref = _run("hf", f"pretrained={hf_dir},dtype=float32", include)
    ours_results, ours = _run("ridgefill", "pretrained=smollm2-135m,method=exact", include)
    assert set(ref) == {"ridgefill_mini", "ridgefill_mini_ppl", "ridgefill_mini_gen"}
    assert all(len(v) == 4 for v in ref.values())
    for task in ("ridgefill_mini", "ridgefill_mini_ppl"):
        for a, b in zip(ref[task], ours[task], strict=True):
            assert a == pytest.approx(b, abs=2e-3), task
    assert ours["ridgefill_mini_gen"] == ref["ridgefill_mini_gen"]  # greedy generations agree
    assert ours_results["ridgefill_mini"]["acc,none"] == ref_results["ridgefill_mini"]["acc,none"]
    # ridge with a short tail really fills the passages (~90 tokens); the harness runs it end to end
    args = f"pretrained=smollm2-135m,method=ridge,maps={smollm2_maps},split=15,sink=4,tail=16"
    ridge_results, ridge = _run("ridgefill", args, include)
    assert ridge_results["ridgefill_mini"]["acc,none"] is not None
    assert ridge["ridgefill_mini"] != ours["ridgefill_mini"]  # the fill changed the scores
    for a, b in zip(ridge["ridgefill_mini_ppl"], ours["ridgefill_mini_ppl"], strict=True):
        assert abs(sum(a) - sum(b)) < 0.5 * abs(sum(b))  # filled contexts cost some, not everything
