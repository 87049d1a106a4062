"""Training prompts from any `datasets` source (`python -m heads.train data.source=...`).

Terms:

- **source**: `data.source`, one of
  - a local data file: `.json` (one JSON array of rows, or one row a line), `.jsonl` or `.parquet`;
  - a glob of such files (`data/*.jsonl`), or a folder holding them;
  - a folder written by `datasets.Dataset.save_to_disk`;
  - anything else is a Hugging Face hub dataset id (`ORG/NAME`), downloaded by `datasets` (so only where
    a network exists; the default `data.source=null` reads the built-in prompts and downloads nothing).
- **conversation**: one row's turns, in either form:
  - ShareGPT: `conversations: [{from: human | gpt | system, value: TEXT}, ...]`;
  - OpenAI messages: `messages: [{role: user | assistant | system, content: TEXT}, ...]` (`content` may
    also be a list of parts; their `text` parts are joined).
  A column holding plain strings (`prompt`, `instruction`, `question`) is a one-turn conversation.
  Turns are normalised to `{role: user | assistant, content}`: system turns are dropped (the target's
  own chat template supplies its default), consecutive turns of one role are joined with a blank
  line, leading assistant turns are dropped, and the conversation ends at the first turn of another
  role (tool, function, ...).
- **user turn**: a `human` / `user` turn.
- **prompt**: what the target is asked to answer; its greedy reply is the training continuation.
  With `data.turns=first` (the default) a prompt is a row's first user turn, a string. With
  `data.turns=all` every user turn of a row is a prompt: the message list of the conversation up to
  and including that turn, the dataset's own assistant replies in between (the target answers only
  the last turn; earlier replies are context, never learnt).
- **contaminated**: sharing a 13-word n-gram with an evaluation question shipped in the repository
  (heads/contamination.py). A prompt any of whose messages is contaminated is dropped, the count
  reported; the kept prompts are checked again before they are returned.
"""

from __future__ import annotations

import glob
import json
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from heads.contamination import EvalIndex, check_clean, evaluation_turns
from specdec.errors import SpecdecError

Message = dict[str, str]
Prompt = str | list[Message]  # a first user turn, or a conversation ending in a user turn

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
CONVERSATION_FIELDS = ("messages", "conversations", "conversation")
STRING_FIELDS = ("prompt", "instruction", "question")
USER = {"user", "human"}
ASSISTANT = {"assistant", "gpt", "bot", "chatgpt", "model", "bard"}
SYSTEM = {"system"}
TURNS = ("first", "all")


def data_suffix(path: str | Path) -> str:
    """A data file's kind by its name, a compression suffix left off: `a.jsonl.gz` -> `.jsonl`
    (`datasets` reads gzip, bz2, xz and zstd files as they are)."""
    suffixes = [x.lower() for x in Path(path).suffixes]
    if suffixes and suffixes[-1] in (".gz", ".bz2", ".xz", ".zst"):
        suffixes = suffixes[:-1]
    return suffixes[-1] if suffixes else ""


@dataclass
class PromptStats:
    """How the rows of a source became prompts (every count is of prompts unless it says rows)."""

    rows: int = 0  # rows read from the source
    no_user_turn: int = 0  # rows without a non-empty user turn
    candidates: int = 0  # prompts built from the rows
    duplicates: int = 0  # prompts equal to an earlier one
    contaminated: int = 0  # prompts dropped for sharing a 13-word n-gram with evaluation questions
    capped: int = 0  # prompts left out by data.max_prompts
    kept: int = 0

    def line(self, source: str) -> str:
        return (f"data: {self.kept} prompts from {source} ({self.rows} rows); dropped {self.contaminated} "
                f"sharing a 13-word n-gram with evaluation questions, {self.duplicates} duplicates, "
                f"{self.no_user_turn} rows without a user turn, {self.capped} over data.max_prompts")


def _is_local(source: str) -> bool:
    """Whether `source` names local files (so a missing one is an error, not a hub id)."""
    path = Path(source).expanduser()
    return (path.exists() or glob.has_magic(source) or source.startswith((".", "/", "~"))
            or data_suffix(path) in FILE_BUILDERS)


def _files(source: str) -> list[str]:
    """The data files a local file, glob or folder names, all of one supported kind."""
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(str(p) for p in path.rglob("*") if data_suffix(p) in FILE_BUILDERS and p.is_file())
    elif glob.has_magic(source):
        files = sorted(f for f in glob.glob(str(path), recursive=True) if Path(f).is_file())
    else:
        files = [str(path)] if path.is_file() else []
    if not files:
        raise SpecdecError(f"data.source={source}: no such file, or no .json/.jsonl/.parquet files there; "
                           "give an existing data file, glob or folder")
    kinds = {FILE_BUILDERS.get(data_suffix(f)) for f in files}
    if None in kinds or len(kinds) > 1:
        raise SpecdecError(f"data.source={source}: the files must all be .json/.jsonl or all .parquet (found "
                           f"{', '.join(sorted({data_suffix(f) or '(none)' for f in files}))}); select one kind")
    return files


def load_rows(source: str, split: str = "train", subset: str | None = None) -> Any:
    """The rows of `source` (see the module docstring) as a `datasets.Dataset`.

    A data file has no split names: its rows are the split `split` whatever it is called. A hub
    dataset is read by `datasets.load_dataset(source, subset, split=split)`.
    """
    import datasets

    path = Path(source).expanduser()
    try:
        if path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "state.json").is_file()
                              or (path / "dataset_dict.json").is_file()):
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise SpecdecError(f"data.source={source} has splits {', '.join(loaded)}, not {split!r}; "
                                       "set data.split")
                loaded = loaded[split]
            return loaded
        if _is_local(source):
            files = _files(source)
            builder = FILE_BUILDERS[data_suffix(files[0])]
            return datasets.load_dataset(builder, data_files={split: files}, split=split)
        return datasets.load_dataset(source, subset, split=split)
    except SpecdecError:
        raise
    # datasets raises many unrelated types (hub, network, builder, Arrow schema errors); the CLI wants
    # one line for all of them, and the message keeps the original type's name
    except Exception as err:  # noqa: BLE001
        text = " ".join(str(err).split())[:300]
        where = "a local file" if _is_local(source) else "a hub dataset (needs a network)"
        raise SpecdecError(f"cannot load data.source={source} as {where}: {type(err).__name__}: {text} (check "
                           "data.source, data.split and data.subset)") from None


def _json_rows(files: list[str]) -> list[dict[str, Any]]:
    """Rows of .json/.jsonl files read with Python's json: for files `datasets` cannot put in one Arrow
    schema (ShareGPT dumps whose fields change type between rows)."""
    rows: list[Any] = []
    for f in files:
        text = Path(f).read_text(encoding="utf-8")
        try:
            whole = json.loads(text)
            rows += whole if isinstance(whole, list) else [whole]
        except json.JSONDecodeError:
            for n, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise SpecdecError(f"{f} line {n}: not JSON ({e.msg}); fix or drop the line") from None
    return [r for r in rows if isinstance(r, dict)]


def load_columns(source: str, split: str = "train", subset: str | None = None
                 ) -> tuple[list[str], Callable[[str], Iterable[Any]]]:
    """The column names of `source` and a reader of one column's values (rows in order).

    Read by `datasets` (load_rows); local JSON that `datasets` refuses is read row by row instead.
    """
    try:
        rows = load_rows(source, split, subset)
    except SpecdecError:
        path = Path(source).expanduser()
        saved = path.is_dir() and any((path / n).is_file() for n in ("dataset_info.json", "state.json"))
        if saved or not _is_local(source):
            raise
        files = _files(source)
        if FILE_BUILDERS[data_suffix(files[0])] != "json":
            raise
        records = _json_rows(files)
        columns = list(dict.fromkeys(k for r in records for k in r))
        return columns, lambda c: (r.get(c) for r in records)
    return list(rows.column_names), lambda c: rows.select_columns([c])[c]


def _text(content: Any) -> str | None:
    """A turn's text: a string, or the `text` parts of an OpenAI content list joined; None otherwise."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type", "text") == "text"]
        texts = [p for p in parts if isinstance(p, str)]
        return "\n".join(texts) if texts else None
    return None


def conversation(raw: Any) -> list[Message]:
    """One row's conversation normalised to [{role: user | assistant, content}] (module docstring)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}] if raw.strip() else []
    if not isinstance(raw, list):
        return []
    out: list[Message] = []
    for turn in raw:
        if not isinstance(turn, dict):
            break
        role = str(turn.get("role", turn.get("from", ""))).lower()
        text = _text(turn.get("content", turn.get("value", turn.get("text"))))
        if role in SYSTEM:
            continue
        if role not in USER | ASSISTANT or text is None:
            break  # a tool call or an unreadable turn: the conversation ends before it
        role = "user" if role in USER else "assistant"
        if not out and role == "assistant":
            continue
        if out and out[-1]["role"] == role:
            out[-1] = {"role": role, "content": f"{out[-1]['content']}\n\n{text}"}
        else:
            out.append({"role": role, "content": text})
    return out


def conversation_prompts(turns: list[Message], which: str = "first") -> list[Prompt]:
    """The prompts of one normalised conversation: its first user turn (which="first"), or the
    conversation up to each non-empty user turn (which="all")."""
    if which == "first":
        return [turns[0]["content"]] if turns and turns[0]["content"].strip() else []
    return [turns[:i + 1] for i, m in enumerate(turns) if m["role"] == "user" and m["content"].strip()]


def prompt_texts(prompt: Prompt) -> list[str]:
    """Every text of a prompt (each message's content), as the contamination check reads them."""
    return [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt]


def _field(columns: Sequence[str], field: str | None, source: str) -> str:
    if field is not None:
        if field not in columns:
            raise SpecdecError(f"data.source={source} has no column {field!r} (columns: {', '.join(columns)}); "
                               "set data.field to one of them")
        return field
    for name in (*CONVERSATION_FIELDS, *STRING_FIELDS):
        if name in columns:
            return name
    raise SpecdecError(f"data.source={source} has no conversation column (columns: {', '.join(columns)}); set "
                       "data.field to the column holding ShareGPT `conversations`, OpenAI `messages` or prompts")


def prompts_from_rows(rows: Iterable[Any], turns: str = "first", index: EvalIndex | None = None,
                      max_prompts: int | None = None, shuffle: bool = True,
                      stats: PromptStats | None = None) -> list[Prompt]:
    """Deduplicated, decontaminated prompts of raw conversations (one per row; module docstring).

    `shuffle` mixes the prompts in a fixed order (seed 0) before `max_prompts` cuts them, so that a cut
    or a generation time budget keeps a sample of the whole source rather than its first rows.
    """
    if turns not in TURNS:
        raise SpecdecError(f"data.turns={turns!r} is not one of {', '.join(TURNS)}")
    stats = stats if stats is not None else PromptStats()
    seen: set[str] = set()
    kept: list[Prompt] = []
    for raw in rows:
        stats.rows += 1
        made = conversation_prompts(conversation(raw), turns)
        stats.no_user_turn += not made
        for p in made:
            stats.candidates += 1
            key = p if isinstance(p, str) else json.dumps(p, sort_keys=True)
            if key in seen:
                stats.duplicates += 1
                continue
            seen.add(key)
            if index is not None and not all(index.clean(t) for t in prompt_texts(p)):
                stats.contaminated += 1
                continue
            kept.append(p)
    if shuffle:
        random.Random(0).shuffle(kept)
    if max_prompts is not None and len(kept) > max_prompts:
        stats.capped = len(kept) - max_prompts
        kept = kept[:max_prompts]
    stats.kept = len(kept)
    return kept


def source_prompts(source: str, split: str = "train", subset: str | None = None, field: str | None = None,
                   turns: str = "first", max_prompts: int | None = None, shuffle: bool = True,
                   exclude_per_category: int = 20, exclude_seed: int = 0, log: Callable[[str], Any] = print
                   ) -> tuple[list[Prompt], PromptStats]:
    """The training prompts of `source` and how they were obtained; logs one line with the counts.

    Held out like the built-in prompts: none shares a 13-word n-gram with a turn of
    default_suite(exclude_per_category, exclude_seed) or of experiments/data/*.jsonl.
    """
    columns, values = load_columns(source, split, subset)
    column = _field(columns, field, source)
    index = EvalIndex(evaluation_turns(exclude_per_category, exclude_seed))
    stats = PromptStats()
    prompts = prompts_from_rows(values(column), turns, index, max_prompts, shuffle, stats)
    log(stats.line(source))
    if not prompts:
        raise SpecdecError(f"data.source={source}: no usable prompts in column {column!r} ({stats.rows} rows, "
                           f"{stats.contaminated} contaminated); check data.field and data.split")
    check_clean([t for p in prompts for t in prompt_texts(p)], index, f"prompts of {source}")
    return prompts, stats
