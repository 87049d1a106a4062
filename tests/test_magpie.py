"""heads.magpie: prompts the target writes itself, seeded, cleaned and decontaminated."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from heads import magpie
from heads.contamination import EvalIndex, evaluation_turns
from specdec.errors import SpecdecError
from specdec.models.loader import LoadedModel


def test_the_prefix_is_the_template_up_to_the_users_text(tiny_target: LoadedModel) -> None:
    msgs = [{"role": "system", "content": "You are terse."}]
    prefix = magpie.turn_prefix(tiny_target, msgs)
    full = tiny_target.chat_ids([*msgs, {"role": "user", "content": "hello there"}])
    assert full[:len(prefix)] == prefix and len(full) > len(prefix)


def test_seeded_generation_repeats_and_conversations_are_well_formed(tiny_target: LoadedModel,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(magpie, "clean", lambda text, **kw: text.strip() or None)  # a random model writes noise
    a = magpie.generate(tiny_target, 6, seed=3, turns=2, batch_size=4, max_prompt_tokens=8, max_answer_tokens=6)
    b = magpie.generate(tiny_target, 6, seed=3, turns=2, batch_size=4, max_prompt_tokens=8, max_answer_tokens=6)
    assert a == b and 0 < len(a) <= 6
    c = magpie.generate(tiny_target, 6, seed=4, turns=2, batch_size=4, max_prompt_tokens=8, max_answer_tokens=6)
    assert c != a
    for row in a:
        assert [m["role"] for m in row["messages"]] == ["user", "assistant", "user"]
        assert row["domain"] in magpie.DOMAINS
    firsts = [" ".join(r["messages"][0]["content"].lower().split()) for r in a]
    assert len(set(firsts)) == len(firsts)  # no duplicate first requests


def test_contaminated_requests_are_dropped(tiny_target: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    leaked = evaluation_turns()[0].text  # what a model that memorised the suite would write
    monkeypatch.setattr(magpie, "clean", lambda text, **kw: leaked)
    assert magpie.generate(tiny_target, 4, seed=0, batch_size=4, max_prompt_tokens=4, max_minutes=0.05) == []
    assert not EvalIndex(evaluation_turns()).clean(leaked)


def test_clean_rejects_short_and_looping_text() -> None:
    assert magpie.clean("hi") is None and magpie.clean("go " * 30) is None
    assert magpie.clean("  How do I reverse a list in Python?  ") == "How do I reverse a list in Python?"


def test_written_files_are_byte_identical_and_readable(tmp_path: Path) -> None:
    rows = [{"messages": [{"role": "user", "content": "Why is the sky blue?"}], "domain": "physics"}]
    a, b = tmp_path / "a.jsonl.gz", tmp_path / "b.jsonl.gz"
    magpie.write(rows, a)
    magpie.write(rows, b)
    assert a.read_bytes() == b.read_bytes()
    assert [json.loads(line) for line in gzip.decompress(a.read_bytes()).decode().splitlines()] == rows


def test_bad_settings_are_one_line(tiny_target: LoadedModel) -> None:
    with pytest.raises(SpecdecError) as err:
        magpie.generate(tiny_target, 0)
    assert "\n" not in str(err.value) and "magpie" in str(err.value)
