"""answers.jsonl: appended and flushed turn by turn, read back to resume an interrupted run."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from specdec.errors import SpecdecError

Row = dict[str, Any]
Key = tuple[str, str, int, int]

# Written beside answers.jsonl: what answers in this folder depend on, checked when a run resumes.
RESUME_FILE = "resume_key.json"
# And the code state (commit, dirty) of every run that added answers, so that a resumed folder's summary names
# the code its answers came from rather than only the last run's.
CODE_FILE = "code_states.json"


class AnswerLog:
    """One JSON line per finished (strategy, question, turn, repeat).

    Loading drops what a killed process can leave behind (a torn last line) and repeated keys
    (the first answer wins), and rewrites the file if it had to, so that every line on disk is one
    whole answer and new lines never glue onto a torn one.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SpecdecError(f"cannot create output_dir {path.parent}: {e.strerror}; pick a writable "
                               "output_dir") from None
        self._rows: dict[Key, Row] = {}
        self.new_rows: list[Row] = []
        if path.is_file():
            self._load()

    @staticmethod
    def key(row: Row) -> Key:
        return row["strategy"], str(row["question_id"]), int(row["turn"]), int(row.get("repeat", 0))

    def _load(self) -> None:
        text = self.path.read_text(encoding="utf-8", errors="replace")
        lines = text.splitlines()
        good: list[str] = []
        for line in lines:
            try:
                row = json.loads(line)
                key = self.key(row)
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
                continue  # a line torn by a kill: that turn is simply generated again
            if key in self._rows:
                continue
            self._rows[key] = row
            good.append(line)
        if len(good) != len(lines) or (text and not text.endswith("\n")):
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(g + "\n" for g in good), encoding="utf-8")
            os.replace(tmp, self.path)

    def get(self, strategy: str, question_id: str, turn: int, repeat: int = 0) -> Row | None:
        return self._rows.get((strategy, str(question_id), turn, repeat))

    def has(self, strategy: str, question_id: str, turn: int, repeat: int = 0) -> bool:
        return (strategy, str(question_id), turn, repeat) in self._rows

    def append(self, row: Row) -> None:
        """Write one whole line with a single write() to an O_APPEND file, then fsync.

        Ctrl-C arrives between Python bytecodes, so the line is either on disk whole or not at all;
        a hard kill mid-write can at worst tear the last line, which loading drops.
        """
        key = self.key(row)
        if key in self._rows:
            raise ValueError(f"answer {key} is already in {self.path}")
        data = (json.dumps(row) + "\n").encode("utf-8")
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            written = os.write(fd, data)
            while written < len(data):  # short writes only happen on full disks or pipes
                written += os.write(fd, data[written:])
            os.fsync(fd)
        finally:
            os.close(fd)
        self._rows[key] = row
        self.new_rows.append(row)

    def refresh(self) -> None:
        """Pick up whole lines on disk that are not in memory: Ctrl-C can land between a line's
        write and its bookkeeping, and the summary must count every answer on disk."""
        if not self.path.is_file():
            return
        for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                row = json.loads(line)
                key = self.key(row)
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
                continue
            if key not in self._rows:
                self._rows[key] = row
                self.new_rows.append(row)

    def rows(self) -> list[Row]:
        return list(self._rows.values())

    def count(self) -> int:
        return len(self._rows)


def check_resume_key(out_dir: Path, key: dict[str, Any], has_answers: bool) -> None:
    """Refuse to add answers to a folder whose answers came from a different model or generation setup.

    The first run writes `key` (flat, dotted names); a later run with the same output_dir must match
    it while answers are there, so a resumed run never mixes, say, 64-token and 128-token answers
    in one summary.
    """
    path = out_dir / RESUME_FILE
    old = _read_json(path)
    old = old if isinstance(old, dict) and has_answers else {}
    # Only settings both runs name are compared: adding a strategy to a finished run is fine.
    diff = sorted(k for k in set(old) & set(key) if old[k] != key[k])
    if diff:
        shown = ", ".join(f"{k}: {old[k]!r} then, {key[k]!r} now" for k in diff[:3])
        raise SpecdecError(f"output_dir {out_dir} holds answers made with other settings ({shown}); use a new "
                           "output_dir, or that run's settings to resume it")
    _write_json(path, old | key)


def _read_json(path: Path) -> Any:
    """A folder's small JSON record, or None where it is missing or torn."""
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except json.JSONDecodeError:
        return None


def _write_json(path: Path, obj: Any) -> None:
    """Replace a folder's small JSON record whole (a kill mid-write leaves the old one)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str))
    os.replace(tmp, path)


def code_states(out_dir: Path, commit: str | None, dirty: bool | None, adds: bool,
                has_answers: bool) -> list[dict[str, Any]]:
    """Every code state that wrote answers in out_dir, this run's appended when it `adds` answers. Answers
    already there with no record (a folder from before the record) count as an unknown state."""
    path = out_dir / CODE_FILE
    states = _read_json(path)
    if not isinstance(states, list):
        states = [{"commit": None, "dirty": None}] if has_answers else []
    state = {"commit": commit, "dirty": dirty}
    if adds and state not in states:
        states.append(state)
        _write_json(path, states)
    return states


def answers_code(states: list[dict[str, Any]], commit: str | None, dirty: bool | None) -> dict[str, Any]:
    """The summary's `commit` and `dirty` for answers written under `states`: that state where there is one; where
    several runs at different states wrote them, the last one's commit, `dirty` true (no one clean commit made
    them all) and every state under `code_states`. No states (nothing written yet): this run's."""
    if not states:
        return {"commit": commit, "dirty": dirty}
    if len(states) == 1:
        return dict(states[0])
    return {"commit": states[-1]["commit"], "dirty": True, "code_states": states}


def earlier_strategy_configs(out_dir: Path, names: set[str]) -> dict[str, dict[str, Any]]:
    """Configs of strategies answered in out_dir by an earlier run (a resumed folder can hold strategies
    this run did not name), rebuilt from the dotted `strategy.NAME.*` keys of its resume key."""
    key = _read_json(out_dir / RESUME_FILE) if names else None
    out: dict[str, dict[str, Any]] = {}
    for dotted, value in key.items() if isinstance(key, dict) else ():
        root, _, rest = dotted.partition(".")
        name, _, leaf = rest.partition(".")
        if root != "strategy" or name not in names or not leaf:
            continue
        node = out.setdefault(name, {})
        *parents, last = leaf.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out
