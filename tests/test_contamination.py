"""Training prompts share no 13-word n-gram with an evaluation question shipped in the repository."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from heads.contamination import EvalIndex, EvalTurn, builder_prompts, check_clean, evaluation_turns, main, ngrams
from heads.instruction_prompts import instruction_prompts
from specdec.errors import SpecdecError

SPECBENCH = Path(__file__).resolve().parents[1] / "experiments" / "data" / "specbench_style.jsonl"


@pytest.fixture(scope="module")
def turns() -> list[EvalTurn]:
    return evaluation_turns()


def test_evaluation_covers_the_default_suite_and_the_shipped_files(turns: list[EvalTurn]) -> None:
    sources = {t.source for t in turns}
    assert "default suite" in sources and "experiments/data/specbench_style.jsonl" in sources
    assert sum(t.source == "default suite" for t in turns) >= 60


def test_ngrams_are_lowercased_and_whitespace_normalized() -> None:
    text = " ".join(f"w{i}" for i in range(14))
    assert ngrams(text.upper().replace(" ", " \n\t ")) == ngrams(text)
    assert len(ngrams(text)) == 2
    assert ngrams("a b c") == {("a", "b", "c")}  # shorter than 13 words: the whole text


def test_the_builders_default_output_is_clean(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("clean: ") and f"{len(builder_prompts())} prompts" in out


def test_a_planted_overlap_is_listed_and_exits_nonzero(tmp_path: Path, turns: list[EvalTurn],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    question = json.loads(SPECBENCH.read_text().splitlines()[0])["turns"][0]
    words = question.split()
    planted = "Please help with this:  " + " ".join(words[2:15]).upper() + " and more of my own words."
    near = "Please help with this: " + " ".join(words[2:14]) + " then something else entirely here."  # 12 words
    suite = next(t.text for t in turns if t.source == "default suite" and len(t.text.split()) > 40)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in [
        "Write a short poem about the sea.", {"prompt": planted}, near, {"turns": ["Hello.", suite]}]) + "\n")
    assert main(["--prompts", str(prompts)]) == 1
    out = capsys.readouterr().out.splitlines()
    listed = [line for line in out if line.startswith("prompt ")]
    assert [line.split(":")[0] for line in listed] == ["prompt 1", "prompt 4"]
    assert "specbench_style.jsonl question 1 turn 0" in listed[0]
    assert out[-1].startswith("contaminated: 2 of 5 prompts")
    text = tmp_path / "prompts.txt"  # a text file: one prompt a line
    text.write_text(f"nothing to see\n{planted}\n")
    assert main(["--prompts", str(text)]) == 1


def test_a_gzipped_chat_file_is_read_by_its_user_turns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import gzip

    question = json.loads(SPECBENCH.read_text().splitlines()[0])["turns"][0]
    chats = [{"messages": [{"role": "user", "content": "Name three rivers."},
                           {"role": "assistant", "content": question}]},   # the target's words are not prompts
             {"messages": [{"role": "user", "content": question}]}]
    path = tmp_path / "chats.jsonl.gz"
    path.write_bytes(gzip.compress("\n".join(json.dumps(c) for c in chats).encode()))
    assert main(["--prompts", str(path)]) == 1
    assert capsys.readouterr().out.splitlines()[-1].startswith("contaminated: 1 of 2 prompts")
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(b"not gzip at all")
    assert main(["--prompts", str(broken)]) == 2
    assert "cannot read it as gzip" in capsys.readouterr().err


def test_the_builder_refuses_contaminated_prompts(turns: list[EvalTurn]) -> None:
    index = EvalIndex(turns)
    bad = next(t.text for t in turns if len(t.text.split()) > 20)
    check_clean(["a clean prompt about gardening"], index)
    with pytest.raises(SpecdecError, match="1 of 2 training prompts share a 13-word n-gram"):
        check_clean(["a clean prompt about gardening", "Summarize: " + bad], index)


def test_instructions_never_quote_what_they_exclude(turns: list[EvalTurn]) -> None:
    excluded = [t.text for t in turns]
    made = instruction_prompts(300, seed=1, exclude=excluded)
    assert len(made) == 300
    index = EvalIndex(turns)
    assert not index.hits(made)
    assert instruction_prompts(50, seed=1) == instruction_prompts(50, seed=1, exclude=())
