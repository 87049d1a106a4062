"""Tests for specdec.data: the offline default suite, jsonl and HF loaders, selection and configs."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from specdec.data import (
    CATEGORIES,
    MAX_PROMPT_CHARS,
    Question,
    default_suite,
    load_hf_dataset,
    load_jsonl,
    select,
)
from specdec.errors import SpecdecError

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "data"


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def error_of(excinfo: pytest.ExceptionInfo[SpecdecError]) -> str:
    message = str(excinfo.value)
    # The CLI prints errors as one line; a newline would break that contract.
    assert "\n" not in message
    return message


# --- default suite ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def suite() -> list[Question]:
    return default_suite()


def test_default_suite_has_every_category_with_ten(suite: list[Question]) -> None:
    counts = Counter(q.category for q in suite)
    assert set(counts) == set(CATEGORIES)
    assert len(CATEGORIES) >= 5
    assert all(n == 10 for n in counts.values())


def test_default_suite_shapes(suite: list[Question]) -> None:
    for q in suite:
        assert isinstance(q.question_id, str)
        assert q.question_id.startswith(q.category + "-")
        assert q.turns and all(isinstance(t, str) and t.strip() for t in q.turns)
        assert all(len(t) <= MAX_PROMPT_CHARS for t in q.turns)
        assert len(q.turns) == (2 if q.category == "multi_turn" else 1)
    assert [q.question_id for q in suite if q.category == "code"][:2] == ["code-0000", "code-0001"]


def test_default_suite_ids_and_first_turns_unique(suite: list[Question]) -> None:
    assert len({q.question_id for q in suite}) == len(suite)
    first_turns = [q.turns[0] for q in suite]
    assert len(set(first_turns)) == len(first_turns)


def test_default_suite_deterministic_per_seed(suite: list[Question]) -> None:
    assert default_suite() == suite
    other = default_suite(seed=1)
    assert other != suite
    assert default_suite(seed=1) == other


def test_default_suite_per_category() -> None:
    small = default_suite(per_category=3)
    assert Counter(q.category for q in small) == {c: 3 for c in CATEGORIES}
    # All five sources appear as first turns once there are enough multi-turn questions.
    assert len(default_suite(per_category=12)) == 12 * len(CATEGORIES)


def test_default_suite_rejects_bad_per_category() -> None:
    with pytest.raises(SpecdecError) as excinfo:
        default_suite(per_category=0)
    assert "per_category" in error_of(excinfo)
    with pytest.raises(SpecdecError) as excinfo:
        default_suite(per_category=100_000)
    assert "lower data.per_category" in error_of(excinfo)


def test_default_suite_prompt_templates(suite: list[Question]) -> None:
    by_cat = {c: [q for q in suite if q.category == c] for c in CATEGORIES}
    assert all("```python" in q.turns[0] and "def " in q.turns[0] for q in by_cat["code"])
    assert all(q.turns[0].startswith("Summarize") for q in by_cat["summarization"])
    assert all(q.turns[0].startswith("Rewrite") for q in by_cat["rewriting"])
    assert all(any(ch.isdigit() for ch in q.turns[0]) for q in by_cat["math"])


# --- jsonl ------------------------------------------------------------------------------------


def test_jsonl_round_trip_keeps_id_text(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "q.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["Hi", "And then?"]},
        {"question_id": "abc", "category": "math", "turns": ["1+1?"]},
    ])
    assert load_jsonl(str(path)) == [
        Question("81", "writing", ("Hi", "And then?")),
        Question("abc", "math", ("1+1?",)),
    ]


def test_jsonl_defaults_and_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "q.jsonl"
    path.write_text('{"turns": ["a"]}\n\n{"question_id": 7, "turns": ["b"]}\n', encoding="utf-8")
    assert load_jsonl(str(path)) == [Question("1", "general", ("a",)), Question("7", "general", ("b",))]


def test_jsonl_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(SpecdecError) as excinfo:
        load_jsonl(str(missing))
    message = error_of(excinfo)
    assert f"data file not found: {missing}" in message
    assert "data.path" in message


def test_jsonl_bad_json_names_line(tmp_path: Path) -> None:
    path = tmp_path / "q.jsonl"
    path.write_text('{"turns": ["a"]}\n{"turns": ["b"]}\n{not json\n', encoding="utf-8")
    with pytest.raises(SpecdecError) as excinfo:
        load_jsonl(str(path))
    message = error_of(excinfo)
    assert "q.jsonl line 3: not valid JSON (" in message
    assert "fix or remove that line" in message


@pytest.mark.parametrize("row", [
    {"question_id": 1},
    {"question_id": 1, "turns": "just a string"},
    {"question_id": 1, "turns": []},
    {"question_id": 1, "turns": ["ok", 3]},
])
def test_jsonl_bad_turns(tmp_path: Path, row: dict[str, Any]) -> None:
    path = write_jsonl(tmp_path / "q.jsonl", [{"turns": ["x"]}] * 4 + [row])
    with pytest.raises(SpecdecError) as excinfo:
        load_jsonl(str(path))
    message = error_of(excinfo)
    assert 'q.jsonl line 5: no "turns" list of strings' in message
    assert '"question_id", "category", "turns"' in message


def test_jsonl_not_an_object(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "q.jsonl", [["a", "b"]])
    with pytest.raises(SpecdecError) as excinfo:
        load_jsonl(str(path))
    assert "line 1: expected a JSON object" in error_of(excinfo)


def test_jsonl_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "q.jsonl"
    path.write_text("\n  \n", encoding="utf-8")
    with pytest.raises(SpecdecError) as excinfo:
        load_jsonl(str(path))
    assert "has no questions" in error_of(excinfo)


def test_jsonl_duplicate_ids(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "q.jsonl", [
        {"question_id": 3, "turns": ["a"]},
        {"question_id": "4", "turns": ["b"]},
        {"question_id": "3", "turns": ["c"]},
    ])
    with pytest.raises(SpecdecError) as excinfo:
        load_jsonl(str(path))
    message = error_of(excinfo)
    assert 'line 3: duplicate question_id "3" (first on line 1)' in message


def test_jsonl_validates_whole_file(tmp_path: Path) -> None:
    rows: list[Any] = [{"turns": [f"q{i}"]} for i in range(50)] + [{"turns": 5}]
    path = write_jsonl(tmp_path / "q.jsonl", rows)
    with pytest.raises(SpecdecError) as excinfo:
        load_jsonl(str(path))
    assert "line 51" in error_of(excinfo)


def test_jsonl_bad_category_type(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "q.jsonl", [{"category": 5, "turns": ["a"]}])
    with pytest.raises(SpecdecError) as excinfo:
        load_jsonl(str(path))
    assert "line 1: category must be" in error_of(excinfo)


# --- select -----------------------------------------------------------------------------------

QUESTIONS = [
    Question("1", "a", ("x",)),
    Question("2", "b", ("y",)),
    Question("3", "a", ("z",)),
    Question("4", "c", ("w",)),
]


def test_select_passthrough_and_limit() -> None:
    assert select(QUESTIONS) == QUESTIONS
    assert select(QUESTIONS, limit=2) == QUESTIONS[:2]
    assert select(QUESTIONS, limit=99) == QUESTIONS


def test_select_categories_keeps_order_then_limits() -> None:
    assert [q.question_id for q in select(QUESTIONS, categories=["c", "a"])] == ["1", "3", "4"]
    assert [q.question_id for q in select(QUESTIONS, limit=1, categories=["c", "a"])] == ["1"]
    assert [q.question_id for q in select(QUESTIONS, categories="b")] == ["2"]  # type: ignore[arg-type]


def test_select_skip_then_limit() -> None:
    # skip passes over the first questions (after categories), so skip=N limit=N is the draw after the first N.
    assert [q.question_id for q in select(QUESTIONS, skip=1, limit=2)] == ["2", "3"]
    assert [q.question_id for q in select(QUESTIONS, skip=1, categories=["c", "a"])] == ["3", "4"]
    assert select(QUESTIONS, skip=0) == QUESTIONS


@pytest.mark.parametrize("skip", [-1, True, "1", 4])
def test_select_bad_skip(skip: Any) -> None:
    with pytest.raises(SpecdecError) as excinfo:
        select(QUESTIONS, skip=skip)
    assert "data.skip" in error_of(excinfo)


def test_select_unknown_category_lists_available() -> None:
    with pytest.raises(SpecdecError) as excinfo:
        select(QUESTIONS, categories=["a", "nope"])
    message = error_of(excinfo)
    assert "nope" in message
    assert "available: a, b, c" in message


@pytest.mark.parametrize("limit", [0, -1, True, "3"])
def test_select_bad_limit(limit: Any) -> None:
    with pytest.raises(SpecdecError) as excinfo:
        select(QUESTIONS, limit=limit)
    assert "data.limit" in error_of(excinfo)


def test_select_empty_categories() -> None:
    with pytest.raises(SpecdecError) as excinfo:
        select(QUESTIONS, categories=[])
    assert "data.categories" in error_of(excinfo)


def test_select_on_default_suite(suite: list[Question]) -> None:
    picked = select(suite, limit=3, categories=["math", "multi_turn"])
    assert [q.category for q in picked] == ["math"] * 3
    assert len(select(suite, categories=["multi_turn"])) == 10


# --- Hugging Face datasets --------------------------------------------------------------------


def test_hf_local_jsonl_file(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"question_id": 10, "category": "x", "turns": ["a", "b"]},
        {"question_id": 11, "category": "y", "turns": ["c"]},
    ])
    assert load_hf_dataset(str(path)) == [Question("10", "x", ("a", "b")), Question("11", "y", ("c",))]


def test_hf_local_json_string_field_and_defaults(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"prompt": "first"}, {"prompt": "second"}]), encoding="utf-8")
    got = load_hf_dataset(str(path), split="validation", question_field="prompt")
    assert got == [Question("1", "general", ("first",)), Question("2", "general", ("second",))]


def test_hf_missing_question_column(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}])
    with pytest.raises(SpecdecError) as excinfo:
        load_hf_dataset(str(path))
    message = error_of(excinfo)
    assert "no column 'turns'" in message
    assert "columns: text" in message
    assert "data.question_field" in message


def test_hf_duplicate_ids(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"question_id": 1, "turns": ["a"]},
                                              {"question_id": 1, "turns": ["b"]}])
    with pytest.raises(SpecdecError) as excinfo:
        load_hf_dataset(str(path))
    assert 'row 2: duplicate question id "1"' in error_of(excinfo)


def test_hf_missing_path_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(SpecdecError) as excinfo:
        load_hf_dataset(str(tmp_path / "no_such_dir"))
    message = error_of(excinfo)
    assert "cannot load dataset" in message
    assert "data.path" in message


def test_hf_unsupported_extension(tmp_path: Path) -> None:
    path = tmp_path / "d.txt"
    path.write_text("hello\n", encoding="utf-8")
    with pytest.raises(SpecdecError) as excinfo:
        load_hf_dataset(str(path))
    assert "unsupported extension '.txt'" in error_of(excinfo)


# --- Hydra configs ----------------------------------------------------------------------------


def load_config(name: str, **overrides: Any) -> tuple[dict[str, Any], list[Question]]:
    omegaconf = pytest.importorskip("omegaconf")
    hydra_utils = pytest.importorskip("hydra.utils")
    cfg = omegaconf.OmegaConf.load(CONFIG_DIR / f"{name}.yaml")
    for key, value in overrides.items():
        cfg[key] = value
    # Mirror the runner: these keys belong to it, not to the loader.
    popped = {key: cfg.pop(key) for key in ("name", "skip", "limit", "categories")}
    return popped, hydra_utils.instantiate(cfg)


def test_config_default() -> None:
    popped, questions = load_config("default")
    assert popped == {"name": "default", "skip": 0, "limit": None, "categories": None}
    assert len(questions) == 10 * len(CATEGORIES)


def test_config_jsonl(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "q.jsonl", [{"question_id": 81, "turns": ["a"]}])
    popped, questions = load_config("jsonl", path=str(path))
    assert popped["name"] == "jsonl"
    assert questions == [Question("81", "general", ("a",))]


def test_config_hf(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"question_id": "q", "category": "c", "turns": ["a"]}])
    popped, questions = load_config("hf", path=str(path))
    assert popped["name"] == "hf"
    assert questions == [Question("q", "c", ("a",))]
