"""Text domains: each loads real documents with its boilerplate gone, a missing or unknown one says
what to do, evaluation text never meets calibration text, and eval/ppl name the domain they read."""

from __future__ import annotations

import dataclasses
import json
import statistics

import pytest

from ridgefill import domains
from ridgefill.cli import main
from ridgefill.errors import RidgefillError


def installed(name: str) -> bool:
    return domains.DOMAINS[name].root.exists()


def need(*names: str):
    missing = [n for n in names if not installed(n)]
    return pytest.mark.skipif(
        bool(missing), reason=f"needs Debian's {', '.join(domains.DOMAINS[n].package for n in missing)} (`make corpus`)"
    )


@pytest.fixture(scope="module")
def corpora():
    return {n: domains.load_domain(n) for n in domains.DOMAINS if installed(n)}


@pytest.mark.parametrize("name", sorted(domains.DOMAINS))
def test_domain_loads_documents_of_reasonable_length(name, corpora):
    if name not in corpora:
        pytest.skip(f"needs Debian's {domains.DOMAINS[name].package} (`make corpus`)")
    corpus = corpora[name]
    docs = corpus.part("eval")
    assert corpus.domain == name and corpus.id == domains.DOMAINS[name].corpus_id
    assert len(docs) >= 100  # enough for 8 tail-PPL documents and a 32K-token essay haystack
    lengths = [len(d.text) for d in docs]
    assert min(lengths) >= domains.MIN_CHARS and 4_000 < statistics.median(lengths) < 50_000
    assert len({d.id for d in docs}) == len(docs)
    info = domains.corpus_info(corpus)
    assert info["domain"] == name and info["package"] == domains.DOMAINS[name].package and info["version"]
    assert info["eval_documents"] == len(docs)


@need("prose")
def test_prose_is_the_novels_chapter_by_chapter_without_boilerplate(corpora):
    docs = corpora["prose"].documents
    novels = {d.id.split("/")[0] for d in docs}
    assert novels == {
        "emma",
        "mansfield-park",
        "northanger-abbey",
        "persuasion",
        "pride-and-prejudice",
        "sense-and-sensibility",
    }
    first = next(d for d in docs if d.id == "pride-and-prejudice/01")
    assert first.text.startswith("It is a truth universally acknowledged, that a single man in possession of a good")
    for d in docs:
        assert "gutenberg" not in d.text.lower() and "*** " not in d.text
        assert not d.text.lstrip().upper().startswith("CHAPTER")  # headings are not text
        assert "\n" not in d.text.replace("\n\n", "")  # hard-wrapped lines joined into paragraphs


@need("code")
def test_code_is_the_standard_library_without_its_tests(corpora):
    ids = {d.id for d in corpora["code"].documents}
    assert {"json/decoder.py", "http/client.py", "asyncio/tasks.py"} <= ids
    assert not any(i.startswith("test/") or "/test/" in i or "idle_test" in i for i in ids)
    decoder = next(d.text for d in corpora["code"].documents if d.id == "json/decoder.py")
    assert "class JSONDecoder(" in decoder


def test_strip_gutenberg_keeps_only_the_text_between_the_markers():
    text = (
        "The Project Gutenberg eBook of Emma\n\nThis eBook is for the use of anyone anywhere...\n"
        "*** START OF THE PROJECT GUTENBERG EBOOK EMMA ***\n\nCHAPTER I\n\nEmma Woodhouse, handsome.\n\n"
        "*** END OF THE PROJECT GUTENBERG EBOOK EMMA ***\n\nSection 1. General Terms of Use\n"
    )
    assert domains.strip_gutenberg(text) == "CHAPTER I\n\nEmma Woodhouse, handsome."
    old = "*** START OF THIS PROJECT GUTENBERG EBOOK X ***\nBody.\nEnd of the Project Gutenberg EBook of X\nLicence"
    assert domains.strip_gutenberg(old) == "Body."
    assert domains.strip_gutenberg("  No markers.\n") == "No markers."


def test_unknown_domain_lists_the_valid_ones():
    with pytest.raises(RidgefillError, match="unknown text domain 'news'; choose from docs, prose, code"):
        domains.load_domain("news")
    assert main(["ppl", "--domain", "news"]) == 2


@pytest.mark.parametrize("name", sorted(domains.DOMAINS))
def test_missing_package_names_its_install_command(name, monkeypatch, tmp_path):
    gone = dataclasses.replace(domains.DOMAINS[name], root=tmp_path / "absent")
    monkeypatch.setitem(domains.DOMAINS, name, gone)
    with pytest.raises(RidgefillError) as err:
        domains.load_domain(name)
    assert f"`{gone.install}`" in str(err.value) and gone.package in str(err.value)
    assert gone.install.startswith(f"apt-get install --no-install-recommends {gone.package}")


def test_domain_and_corpus_are_exclusive(capsys, tmp_path):
    for command in ("eval", "ppl", "bench"):
        with pytest.raises(SystemExit) as exit_:
            main([command, "--domain", "prose", "--corpus", str(tmp_path)])
        assert exit_.value.code == 2
        assert "not allowed with argument" in capsys.readouterr().err


@need("docs")
def test_calibration_and_evaluation_text_never_overlap(corpora):
    docs = corpora["docs"]
    calib = docs.part("calib") + docs.part("heldout")
    assert not {d.id for d in calib} & {d.id for d in docs.part("eval")}
    calib_text = "\n".join(d.text for d in calib)
    for name, corpus in corpora.items():
        if name == "docs":
            continue
        # Only docs has calibration text: every other domain is evaluation text, whole.
        assert not domains.DOMAINS[name].calibration and corpus.eval_only
        assert corpus.part("eval") == list(corpus.documents)
        for split in ("calib", "heldout"):
            with pytest.raises(RidgefillError, match="evaluation text only"):
                corpus.part(split)
        # And none of it is calibration text: no 200-character passage of it occurs there.
        for d in corpus.documents[::5]:
            mid = len(d.text) // 2
            assert d.text[mid : mid + 200] not in calib_text


@need("docs", "prose")
def test_essay_prompts_differ_by_domain_so_cached_records_cannot_mix(corpora, smollm2):
    """The eval cache keys a record by its prompt's token ids: an essay-haystack task gets
    different prompts (so different keys) from another domain, a noise-haystack one the same."""
    from ridgefill.eval.adapter import EngineAdapter
    from ridgefill.eval.ruler import RulerTask, essay_sentences
    from ridgefill.methods import Prefill

    adapter = EngineAdapter(smollm2, [Prefill("exact", "exact")])
    keys = {}
    for name in ("docs", "prose"):
        essay = tuple(essay_sentences([d.text for d in corpora[name].part("eval")]))
        for task in ("niah_single_2", "niah_single_1"):
            samples = RulerTask(task, essay).samples(adapter.count_tokens, 512, 2, seed=1)
            keys[name, task] = [adapter.prompt(s).key for s in samples]
    assert not set(keys["docs", "niah_single_2"]) & set(keys["prose", "niah_single_2"])
    assert keys["docs", "niah_single_1"] == keys["prose", "niah_single_1"]  # noise haystack: same prompt, same answer


@need("prose")
def test_eval_and_ppl_with_a_domain_name_it_beside_every_score(tmp_path, capsys):
    # One exact sample: the decode is what costs (the cache's keys are tested above).
    out = tmp_path / "eval.json"
    argv = ["eval", "--domain", "prose", "--tasks", "niah_single_2", "--lengths", "512", "--samples", "1"]
    assert main([*argv, "--methods", "exact", "--out", str(out)]) == 0
    assert "text: prose (debian:r-cran-janeaustenr)" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["corpus"]["domain"] == "prose" and data["corpus"]["id"] == "debian:r-cran-janeaustenr"
    assert data["command"].startswith("ridgefill eval --domain prose")
    rows = data["results"] + data["niah_pooled"]
    assert rows and all(r["domain"] == "prose" and r["corpus"] == "debian:r-cran-janeaustenr" for r in rows)

    out = tmp_path / "ppl.json"
    argv = ["ppl", "--domain", "prose", "--length", "512", "--docs", "1", "--splits", "15", "--tail", "64"]
    assert main([*argv, "--methods", "identity", "--out", str(out)]) == 0
    assert "evaluation documents of prose (debian:r-cran-janeaustenr)" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["corpus"]["domain"] == "prose" and data["corpus"]["package"] == "r-cran-janeaustenr"
    assert [(r["method"], r["domain"]) for r in data["ppl"]] == [("exact", "prose"), ("identity@15", "prose")]
