"""heads.magpie_tasks: requests over a document the target wrote, seeded and decontaminated."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from heads import magpie, magpie_tasks
from heads.contamination import evaluation_turns
from specdec.errors import SpecdecError
from specdec.models.loader import LoadedModel


@pytest.fixture
def accept_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    """A random model writes noise: keep every document and question it writes."""
    monkeypatch.setattr(magpie_tasks, "whole_sentences", lambda text: text.strip() or "empty")
    monkeypatch.setattr(magpie_tasks, "first_question", lambda text: (text.strip() or "what") + "?")


def test_seeded_requests_repeat_and_wrap_their_document(tiny_target: LoadedModel, accept_noise: None) -> None:
    kw = dict(batch_size=10, max_doc_tokens=6)
    a = magpie_tasks.generate(tiny_target, 10, seed=3, **kw)
    assert a == magpie_tasks.generate(tiny_target, 10, seed=3, **kw)
    assert a != magpie_tasks.generate(tiny_target, 10, seed=4, **kw)
    assert {r["task"] for r in a} == set(magpie_tasks.DOCUMENTS)  # tasks in turn: all five in one batch
    for r in a:
        assert [m["role"] for m in r["messages"]] == ["user"] and r["domain"] in magpie.DOMAINS
        stems = [p.split("{")[0] for p in magpie_tasks.TRAIN_PHRASINGS[r["task"]]]
        assert any(r["messages"][0]["content"].startswith(s) for s in stems)


def test_heldapart_draws_other_topics_and_phrasings(tiny_target: LoadedModel, accept_noise: None) -> None:
    rows = magpie_tasks.generate(tiny_target, 5, seed=0, batch_size=5, max_doc_tokens=6,
                                 domains=magpie.HELDAPART_DOMAINS, phrasings=magpie_tasks.HELDAPART_PHRASINGS)
    assert rows and all(r["domain"] in magpie.HELDAPART_DOMAINS for r in rows)
    qs = magpie_tasks.as_questions(rows)
    assert [q["category"] for q in qs] == [r["task"] for r in rows] and all(len(q["turns"]) == 1 for q in qs)


def test_phrasings_are_apart_and_each_holds_the_document() -> None:
    train = {p for ps in magpie_tasks.TRAIN_PHRASINGS.values() for p in ps}
    held = {p for ps in magpie_tasks.HELDAPART_PHRASINGS.values() for p in ps}
    assert not train & held
    assert set(magpie_tasks.TRAIN_PHRASINGS) == set(magpie_tasks.HELDAPART_PHRASINGS) == set(magpie_tasks.DOCUMENTS)
    assert all("{doc}" in p for p in train | held)
    qa = (*magpie_tasks.TRAIN_PHRASINGS["qa"], *magpie_tasks.HELDAPART_PHRASINGS["qa"])
    assert all("{question}" in p for p in qa)


def test_contaminated_requests_are_dropped(tiny_target: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    leaked = evaluation_turns()[0].text  # a document that repeats an evaluation question
    monkeypatch.setattr(magpie_tasks, "whole_sentences", lambda text: leaked)
    monkeypatch.setattr(magpie_tasks, "first_question", lambda text: "why?")
    assert magpie_tasks.generate(tiny_target, 3, seed=0, batch_size=5, max_doc_tokens=4, max_minutes=0.05) == []


def test_documents_end_on_a_sentence_and_questions_are_questions() -> None:
    text = "The bridge opened in May. " * 3 + "It carries forty cars an hour and it was built by the town council over"
    assert magpie_tasks.whole_sentences(text, min_words=10) == ("The bridge opened in May. " * 3).strip()
    assert magpie_tasks.whole_sentences("no sentence end here at all") is None
    assert magpie_tasks.first_question(" When did the bridge open?\nIt opened in May.") == "When did the bridge open?"
    assert magpie_tasks.first_question("The bridge opened in May.") is None


def test_bad_settings_are_one_line(tiny_target: LoadedModel) -> None:
    with pytest.raises(SpecdecError) as err:
        magpie_tasks.generate(tiny_target, 0)
    assert "\n" not in str(err.value) and "magpie_tasks" in str(err.value)


def test_both_commands_write_through_the_shared_cli(tiny_target: LoadedModel, accept_noise: None, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    loaded: list[tuple[str, ...]] = []
    monkeypatch.setattr(magpie, "load_target", lambda model, *o: loaded.append((model, *o)) or tiny_target)
    monkeypatch.setattr(magpie, "clean", lambda text, **kw: text.strip() or None)  # a random model writes noise
    # Short outputs keep the tiny model quick; everything else is the commands' own path.
    tasks_generate, magpie_generate = magpie_tasks.generate, magpie.generate
    monkeypatch.setattr(magpie_tasks, "generate", lambda *a, **kw: tasks_generate(*a, max_doc_tokens=6, **kw))
    monkeypatch.setattr(magpie, "generate",
                        lambda *a, **kw: magpie_generate(*a, max_prompt_tokens=8, max_answer_tokens=6, **kw))

    out = tmp_path / "q.jsonl"
    assert magpie_tasks.main(["--n", "3", "--domains", "heldapart", "--questions", "--out", str(out)]) == 0
    qs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(qs) == 3 and {q["category"] for q in qs} <= set(magpie_tasks.DOCUMENTS)
    assert loaded[-1] == ("smollm2-135m", "model.matmul=numba") and "wrote 3 requests" in capsys.readouterr().out

    gz = tmp_path / "m.jsonl.gz"
    assert magpie.main(["--n", "2", "--turns", "2", "--batch-size", "2", "--seed", "1", "--out", str(gz)]) == 0
    rows = [json.loads(line) for line in gzip.decompress(gz.read_bytes()).decode().splitlines()]
    assert rows and all([m["role"] for m in r["messages"]] == ["user", "assistant", "user"] for r in rows)
    assert loaded[-1] == ("smollm2-135m",)
    with pytest.raises(SystemExit):
        magpie_tasks.main(["--n", "3"])  # --out is required
