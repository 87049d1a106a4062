"""answers.jsonl: appended and flushed turn by turn, read back to resume an interrupted run."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

Row = dict[str, Any]


class AnswerLog:
    """One JSON line per finished (strategy, question, turn, repeat); a torn last line is dropped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._rows: dict[tuple[str, str, int, int], Row] = {}
        self.new_rows: list[Row] = []
        if path.is_file():
            self._load()

    @staticmethod
    def key(row: Row) -> tuple[str, str, int, int]:
        return row["strategy"], str(row["question_id"]), int(row["turn"]), int(row.get("repeat", 0))

    def _load(self) -> None:
        good: list[str] = []
        for line in self.path.read_text().splitlines():
            try:
                row = json.loads(line)
                self._rows.setdefault(self.key(row), row)
                good.append(line)
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a line torn by a kill; that turn is simply generated again
        if len(good) != len(self.path.read_text().splitlines()):
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(g + "\n" for g in good))
            os.replace(tmp, self.path)

    def get(self, strategy: str, question_id: str, turn: int, repeat: int = 0) -> Row | None:
        return self._rows.get((strategy, question_id, turn, repeat))

    def append(self, row: Row) -> None:
        # One write() of a whole line, then flush and fsync: a crash never leaves half a row behind
        # that a reader would mistake for an answer.
        line = json.dumps(row) + "\n"
        with open(self.path, "a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self._rows[self.key(row)] = row
        self.new_rows.append(row)

    def rows(self) -> list[Row]:
        return list(self._rows.values())

    def count(self) -> int:
        return len(self._rows)
