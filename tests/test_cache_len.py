"""generation.max_len=auto: the KV cache sized to the suite's longest conversation (specdec/cache_len.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from run_helpers import make_cfg, read_answers, write_questions

from specdec.cache_len import AUTO_FLOOR, ROUND, SLACK, fit_cache
from specdec.data import Question
from specdec.errors import SpecdecError
from specdec.models.loader import LoadedModel
from specdec.run import generation_params, run


def test_auto_fits_every_turn_with_its_earlier_answers(tiny_target: LoadedModel) -> None:
    short = Question("a", "c", ("Hi.",))
    assert fit_cache(tiny_target, [short], 128) == AUTO_FLOOR  # short suites keep the fixed size they had
    two = Question("b", "c", (" ".join(["word"] * 300), "And then?"))
    both = tiny_target.chat_ids([{"role": "user", "content": two.turns[0]}, {"role": "assistant", "content": ""},
                                 {"role": "user", "content": two.turns[1]}])
    max_new = 1000
    need = len(both) + (max_new + SLACK) + max_new + 1  # the second turn carries the first answer
    assert need > AUTO_FLOOR
    assert fit_cache(tiny_target, [short, two], max_new) == -(-need // ROUND) * ROUND
    assert fit_cache(tiny_target, [two], 3000) == tiny_target.context_len  # never past the model's context


def test_a_conversation_longer_than_the_default_cache_is_answered(tmp_path: Path) -> None:
    data = write_questions(tmp_path / "q.jsonl", 2, long=750)  # q1: about 2,250 tokens, more than 2048 slots hold
    out = tmp_path / "auto"
    run(make_cfg(out, "data=jsonl", f"data.path={data}"))
    assert sorted(r["question_id"] for r in read_answers(out)) == ["q0", "q1"]
    summary = json.loads((out / "summary.json").read_text())
    assert not summary["failures"] and summary["config"]["generation"]["max_len"] > AUTO_FLOOR
    with pytest.raises(SpecdecError, match="greedy/q1"):  # a number is kept as given
        run(make_cfg(tmp_path / "fixed", "data=jsonl", f"data.path={data}", f"generation.max_len={AUTO_FLOOR}"))


def test_max_len_is_a_number_or_auto(tmp_path: Path) -> None:
    assert generation_params(make_cfg(tmp_path, "generation.max_len=auto")).max_new_tokens == 3
    with pytest.raises(SpecdecError, match="generation.max_len='big' is not an integer.* or auto$"):
        generation_params(make_cfg(tmp_path, "generation.max_len=big"))
