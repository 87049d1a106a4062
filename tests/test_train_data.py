"""`python -m heads.train data.source=...`: prompts from local ShareGPT / OpenAI-messages files (and the hub,
mocked: no network here), decontaminated, self-distilled through the target's chat template."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import tiny_train_overrides
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from heads.card import gpu_lines
from heads.contamination import evaluation_turns
from heads.data_mix import build_mix, source_list
from heads.prompt_sources import (
    PromptStats,
    conversation,
    conversation_prompts,
    data_suffix,
    load_rows,
    prompts_from_rows,
    source_prompts,
)
from heads.train import data_alias, train
from specdec.cli_checks import CONFIG_DIR
from specdec.errors import SpecdecError
from specdec.models.loader import LoadedModel


def sharegpt(*turns: str, system: str | None = None) -> dict[str, Any]:
    """A ShareGPT row: turns alternate human, gpt, human, ..."""
    conv = [{"from": "system", "value": system}] if system else []
    conv += [{"from": "human" if i % 2 == 0 else "gpt", "value": t} for i, t in enumerate(turns)]
    return {"id": str(len(turns)), "conversations": conv}


def openai(*turns: str) -> dict[str, Any]:
    return {"messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]}


def eval_question() -> str:
    """An evaluation question of the default suite (long enough for a 13-word n-gram)."""
    return next(t.text for t in evaluation_turns(20, 0) if len(t.text.split()) >= 20)


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("distill-sources")


def config(out: Path, data_dir: Path, *overrides: str) -> DictConfig:
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        return compose("train", overrides=[
            *tiny_train_overrides("draft", out, data_dir),
            "head.layers=1", "head.init_layers=[0]", "head.kept_vocab=128", "head.kl_weight=0", *overrides])


# --------------------------------------------------------------------------------------------------
# Rows to prompts
# --------------------------------------------------------------------------------------------------


def test_both_forms_normalise_to_user_and_assistant_turns() -> None:
    share = sharegpt("Hi there.", "Hello!", "Tell me a joke.", system="Be brief.")["conversations"]
    assert conversation(share) == [{"role": "user", "content": "Hi there."}, {"role": "assistant", "content": "Hello!"},
                                   {"role": "user", "content": "Tell me a joke."}]
    parts = [{"role": "system", "content": "x"}, {"role": "assistant", "content": "leading reply, dropped"},
             {"role": "user", "content": [{"type": "text", "text": "Part one."}, {"type": "image_url"}]},
             {"role": "user", "content": "Part two."}, {"role": "assistant", "content": "Sure."},
             {"role": "tool", "content": "42"}, {"role": "user", "content": "after a tool turn: cut"}]
    assert conversation(parts) == [{"role": "user", "content": "Part one.\n\nPart two."},
                                   {"role": "assistant", "content": "Sure."}]
    assert conversation("A plain prompt.") == [{"role": "user", "content": "A plain prompt."}]
    assert conversation(None) == [] and conversation([{"from": "gpt", "value": "only a reply"}]) == []


def test_first_takes_the_first_user_turn_and_all_takes_each_in_its_conversation() -> None:
    turns = conversation(sharegpt("Q1?", "A1.", "Q2?", "A2.", "Q3?")["conversations"])
    assert conversation_prompts(turns, "first") == ["Q1?"]
    every = conversation_prompts(turns, "all")
    assert [p[-1]["content"] for p in every] == ["Q1?", "Q2?", "Q3?"]
    assert every[1] == turns[:3] and every[2] == turns  # the dataset's own replies as context
    with pytest.raises(SpecdecError, match="data.turns='some'"):
        prompts_from_rows([], turns="some")


def test_contaminated_and_duplicate_prompts_are_dropped_and_counted(tmp_path: Path) -> None:
    bench = eval_question()
    rows = [sharegpt(f"Write a limerick about the number {i}.", "...") for i in range(5)]
    rows += [sharegpt(f"Please help with this: {bench}", "..."), sharegpt("Write a limerick about the number 0.", "x"),
             {"conversations": []}, sharegpt("Fine first turn.", "ok", f"{bench} Thanks.")]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    lines: list[str] = []
    prompts, stats = source_prompts(str(path), log=lines.append)
    assert sorted(prompts) == sorted([f"Write a limerick about the number {i}." for i in range(5)]
                                     + ["Fine first turn."])
    assert (stats.rows, stats.contaminated, stats.duplicates, stats.no_user_turn, stats.kept) == (9, 1, 1, 1, 6)
    assert "dropped 1 sharing a 13-word n-gram with evaluation questions" in lines[0]
    # turns=all also reads the later turns, and drops a prompt whose context holds an evaluation question
    every, stats = source_prompts(str(path), turns="all", shuffle=False, log=lambda s: None)
    assert stats.contaminated == 2 and len(every) == 6
    assert not any(bench in m["content"] for p in every for m in p)
    capped, stats = source_prompts(str(path), max_prompts=2, log=lambda s: None)
    assert len(capped) == 2 and stats.capped == 4


def test_local_json_array_parquet_and_folders_load(tmp_path: Path) -> None:
    import datasets

    rows = [openai(f"Explain idea number {i}.", "Done.") for i in range(4)]
    (tmp_path / "array.json").write_text(json.dumps(rows))  # one JSON array, as ShareGPT dumps often are
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "rows.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    shard = tmp_path / "shards"
    shard.mkdir()
    for k in range(2):
        write_jsonl(shard / f"part-{k}.jsonl", [sharegpt(f"Shard {k} question {i}.") for i in range(3)])
    want = {f"Explain idea number {i}." for i in range(4)}
    for source in ("array.json", "rows.parquet", "saved"):
        prompts, _ = source_prompts(str(tmp_path / source), log=lambda s: None)
        assert set(prompts) == want, source
    for source in (shard, f"{shard}/*.jsonl"):
        prompts, stats = source_prompts(str(source), log=lambda s: None)
        assert stats.rows == 6 and len(prompts) == 6
    gz = tmp_path / "magpie.jsonl.gz"  # compressed jsonl, as heads.magpie writes it
    gz.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    prompts, _ = source_prompts(str(gz), log=lambda s: None)
    assert set(prompts) == want
    assert data_suffix("a/b.jsonl.gz") == ".jsonl" and data_suffix("x.parquet") == ".parquet"
    named, _ = source_prompts(str(tmp_path / "array.json"), field="messages", shuffle=False, log=lambda s: None)
    assert named == [f"Explain idea number {i}." for i in range(4)]
    # a field that changes type between rows (as in some ShareGPT dumps) still reads: row by row
    mixed = [sharegpt("A good question?", "Yes."), {"conversations": [{"from": "human", "value": 17}]},
             {"conversations": [{"from": "human", "value": ["not", "text"]}], "extra": {"a": 1}}]
    prompts, stats = source_prompts(str(write_jsonl(tmp_path / "mixed.jsonl", mixed)), log=lambda s: None)
    assert prompts == ["A good question?"] and stats.rows == 3 and stats.no_user_turn == 2


def test_source_errors_are_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    with pytest.raises(SpecdecError, match="no such file") as e:
        load_rows(str(tmp_path / "missing.jsonl"))
    assert "\n" not in str(e.value)
    write_jsonl(tmp_path / "odd.jsonl", [{"text": "x", "label": 1}])
    with pytest.raises(SpecdecError, match="no conversation column .*set data.field"):
        source_prompts(str(tmp_path / "odd.jsonl"), log=lambda s: None)
    with pytest.raises(SpecdecError, match="no column 'chat'"):
        source_prompts(str(tmp_path / "odd.jsonl"), field="chat", log=lambda s: None)
    (tmp_path / "mixed").mkdir()
    write_jsonl(tmp_path / "mixed" / "a.jsonl", [sharegpt("One.")])
    datasets.Dataset.from_list([sharegpt("Two.")]).to_parquet(str(tmp_path / "mixed" / "b.parquet"))
    with pytest.raises(SpecdecError, match="must all be .json/.jsonl or all .parquet"):
        load_rows(str(tmp_path / "mixed"))

    def offline(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("Couldn't reach 'someone/chats' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(SpecdecError, match=r"as a hub dataset \(needs a network\): ConnectionError") as e:
        load_rows("someone/chats")
    assert "\n" not in str(e.value)


def test_stats_line_names_every_count() -> None:
    line = PromptStats(rows=10, no_user_turn=1, duplicates=2, contaminated=3, capped=0, kept=4).line("f.jsonl")
    assert line.startswith("data: 4 prompts from f.jsonl (10 rows); dropped 3 sharing a 13-word n-gram")


# --------------------------------------------------------------------------------------------------
# Through the trainer
# --------------------------------------------------------------------------------------------------


def test_training_on_a_sharegpt_file_uses_its_prompts_through_the_chat_template(
        tmp_path: Path, tiny_target: LoadedModel) -> None:
    import datasets

    bench = eval_question()
    rows = [sharegpt(f"Describe animal number {i} in one line.", "A cat.", f"And animal {i + 1}?") for i in range(6)]
    rows.append(sharegpt(f"Answer this: {bench}", "..."))
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    out, data_dir = tmp_path / "draft", tmp_path / "cache"
    meta = train(config(out, data_dir, f"data.source={path}", "data.turns=all", "train.max_steps=2"))
    assert meta["steps"] == 2 and meta["sequences"] == 12  # 6 rows x 2 user turns, the contaminated row dropped
    [account] = meta["prompt_sources"]
    assert account["contaminated"] == 1 and account["kept"] == 12
    card = (out / "README.md").read_text()
    assert f"(prompts: data.source={path} (split train, turns all), 12 prompts" in card
    assert "1 dropped for sharing" in card and "offline suite" not in card
    # the generated sequences start with the conversations through the target's chat template
    chunks = sorted(p for p in data_dir.rglob("chunk-*") if p.is_dir())
    data = datasets.concatenate_datasets([datasets.load_from_disk(str(p)) for p in chunks])
    starts = {tuple(ids[:n]) for ids, n in zip(data["input_ids"], data["prompt_len"])}
    second = conversation(rows[2]["conversations"])
    assert tuple(tiny_target.chat_ids(second)) in starts
    assert tuple(tiny_target.chat_ids(second[:1])) in starts


def test_the_default_prompts_never_touch_datasets_loaders(tmp_path: Path, data_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    import heads.prompt_sources

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the default path must not load (or download) a dataset")

    monkeypatch.setattr(datasets, "load_dataset", refuse)
    monkeypatch.setattr(heads.prompt_sources, "load_rows", refuse)
    meta = train(config(tmp_path / "builtin", data_dir, "train.max_steps=1"))
    assert meta["steps"] == 1 and "prompt_sources" not in meta


def test_a_mix_joins_each_sources_own_cached_set(tmp_path: Path, tiny_target: LoadedModel) -> None:
    cache = tmp_path / "cache"
    path = write_jsonl(tmp_path / "chat.jsonl", [sharegpt(f"Name a colour, number {i}.", "Red.") for i in range(3)])
    data_cfg = {"per_category": 1, "seeds": (1,), "exclude_per_category": 20, "exclude_seed": 0, "max_prompts": None,
                "instructions": 0, "max_new_tokens": 6, "batch_size": 4, "chunk_batches": 1, "max_minutes": None,
                "torch_threads": 1, "cache_dir": str(cache)}
    src = {"split": "train", "turns": "first", "shuffle": False}
    alone = [build_mix(tiny_target, [s], src, data_cfg, log=lambda _: None)[0] for s in ("builtin", str(path))]
    chunks = sorted(cache.rglob("chunk-*"))
    mix, accounts = build_mix(tiny_target, ["builtin", str(path)], src, data_cfg, log=lambda _: None)
    assert sorted(cache.rglob("chunk-*")) == chunks  # nothing generated again: each source's cache is reused
    assert [a["source"] for a in accounts] == ["builtin", str(path)] and accounts[1]["kept"] == 3
    assert [a["sequences"] for a in accounts] == [len(a.data) for a in alone]
    assert list(mix.data["input_ids"]) == list(alone[0].data["input_ids"]) + list(alone[1].data["input_ids"])
    assert mix.hidden is not None
    n0 = len(alone[0].data)
    for j, (ids, start) in enumerate(zip(mix.data["input_ids"], mix.data["hidden_start"])):
        own, k = (alone[0], j) if j < n0 else (alone[1], j - n0)
        assert own.hidden is not None
        s0 = own.data["hidden_start"][k]
        assert np.array_equal(mix.hidden[start:start + len(ids)], own.hidden[s0:s0 + len(ids)])
    with pytest.raises(SpecdecError, match="lists no source or one twice"):
        source_list(["builtin", "builtin"])
    assert source_list(None) == ["builtin"] and source_list("a.jsonl") == ["a.jsonl"]
    with pytest.raises(SpecdecError, match="needs `path`"):
        source_list([{"turns": "all"}])
    with pytest.raises(SpecdecError, match="not \\['lr'\\]"):
        source_list([{"path": "a.jsonl", "lr": 1}])


def test_a_mix_entry_sets_its_own_turns_and_budget(tmp_path: Path, tiny_target: LoadedModel) -> None:
    """{path, turns, max_prompts} apply to that source alone; the other entries keep the run's settings."""
    rows = [{"messages": [{"role": "user", "content": f"Name a colour, number {i}."},
                          {"role": "assistant", "content": "Red."},
                          {"role": "user", "content": f"And another one, please, {i}."}]} for i in range(3)]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    data_cfg = {"per_category": 1, "seeds": (1,), "exclude_per_category": 20, "exclude_seed": 0, "max_prompts": None,
                "instructions": 0, "max_new_tokens": 4, "batch_size": 4, "chunk_batches": 1, "max_minutes": None,
                "torch_threads": 1, "cache_dir": str(tmp_path / "cache")}
    src = {"split": "train", "turns": "first", "shuffle": False}
    first = build_mix(tiny_target, [str(path)], src, data_cfg, log=lambda _: None)[1]
    entry = {"path": str(path), "turns": "all", "max_prompts": 2}
    _, accounts = build_mix(tiny_target, source_list([entry, "builtin"]), src, data_cfg, log=lambda _: None)
    assert first[0]["kept"] == 3 and first[0]["turns"] == "first"
    assert accounts[0]["source"] == str(path) and accounts[0]["turns"] == "all" and accounts[0]["kept"] == 2
    assert accounts[0]["max_prompts"] == 2 and set(accounts[1]) == {"source", "sequences"}  # builtin: the run's


def test_training_on_a_mix_names_every_source_on_the_card(tmp_path: Path, data_dir: Path) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", [openai(f"Count to {i}.") for i in range(2, 5)])
    out = tmp_path / "draft"
    meta = train(config(out, data_dir, f"data.source=[builtin,{path}]", "train.max_steps=1"))
    assert [a["source"] for a in meta["prompt_sources"]] == ["builtin", str(path)]
    assert meta["sequences"] == sum(a["sequences"] for a in meta["prompt_sources"])
    card = (out / "README.md").read_text()
    assert "built-in (offline suite" in card and f"; data.source={path} (split train, turns first), 3 prompts" in card
    assert "## On a GPU" in card and "runs the same 1 optimizer step within" in card  # max_steps ended it


def test_the_cards_command_survives_the_shell(tmp_path: Path) -> None:
    """Brackets and braces (data.source lists and mapping entries) are quoted, so the line pastes into a shell."""
    import shlex

    from heads.card import write_card

    argv = ["head=eagle", "data.source=[{path:a.jsonl,max_minutes:12},{path:b.jsonl,turns:all}]", "train.lr=3e-4"]
    card = write_card(tmp_path, "eagle", "tiny", {"config": {}}, argv).read_text()
    line = next(x for x in card.splitlines() if x.startswith("- Command: "))
    assert shlex.split(line.removeprefix("- Command: `").removesuffix("`")) == ["python", "-m", "heads.train", *argv]


def test_the_card_says_what_the_command_does_on_a_gpu() -> None:
    cfg = {"model": {"matmul": "numba", "dtype": "auto"}, "data": {"batch_size": "auto", "max_minutes": 30},
           "train": {"epochs": 1, "max_steps": None, "max_minutes": 6.2}}
    sources = [{"source": "a.jsonl", "kept": 1500, "sequences": 1200}, {"source": "builtin", "sequences": 9}]
    text = "\n".join(gpu_lines(cfg, {"steps": 342, "epochs": 0.64, "prompt_sources": sources}))
    assert "`model.matmul=numba` runs fp32 on the CPU only" in text and "`model.dtype=fp32`" in text
    assert "up to 256 prompts" in text and "a.jsonl at 1200 of 1500" in text
    assert "budget stopped it at 342 steps" in text and "`train.max_steps=342`" in text
    cfg = {"model": {"matmul": "torch", "dtype": "fp32"}, "data": {"batch_size": 32, "max_minutes": None},
           "train": {"epochs": 2, "max_steps": None, "max_minutes": 12}}
    text = "\n".join(gpu_lines(cfg, {"steps": 1070, "epochs": 2, "prompt_sources": sources}))
    assert "matmul" not in text and "bf16" not in text and "256" not in text and "1200 of 1500" not in text
    assert "runs the same 1070 optimizer steps" in text


def test_presets_set_the_source() -> None:
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        default = compose("train")
        hub = compose("train", overrides=["train_data=ultrachat"])
        local = compose("train", overrides=["data.source=chats.jsonl", "data.turns=all"])
    assert default.data.source is None and default.train.mixed_precision is None
    assert (hub.data.source, hub.data.split, hub.data.field) == (
        "HuggingFaceH4/ultrachat_200k", "train_sft", "messages")
    assert (local.data.source, local.data.turns) == ("chats.jsonl", "all")


def test_data_equals_is_a_source_or_a_preset() -> None:
    assert data_alias(["head=medusa", "data=/d/chats.jsonl", "data=ultrachat", "data.turns=all"]) == [
        "head=medusa", "data.source=/d/chats.jsonl", "train_data=ultrachat", "data.turns=all"]
    assert data_alias(["data=ORG/NAME", "data=builtin"]) == ["data.source=ORG/NAME", "train_data=builtin"]


def test_the_cli_takes_data_equals_and_names_a_missing_file_in_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "missing.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "heads.train", *tiny_train_overrides("draft", tmp_path / "out", tmp_path / "cache"),
         f"data={missing}", f"hydra.run.dir={tmp_path / 'hydra'}"],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: data.source={missing}: no such file, or no .json/.jsonl/.parquet files there; give an existing "
        "data file, glob or folder")
