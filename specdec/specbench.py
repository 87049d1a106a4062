"""Spec-Bench's view of a specdec run: which answers make a Spec-Bench question, and its speedup.

Terms (Spec-Bench's `evaluation/speed.py`, see docs/specbench.md):

- a *question* is one line of a Spec-Bench model-answer file: every turn of one question_id. Here only
  questions that every strategy answered whole (turns 0..T-1, in every repeat) count, so every
  strategy's file holds the same questions in the same order.
- a question's *speed* is its new tokens summed over turns over its wall time summed over turns.
- a strategy's *Spec-Bench speed* is the plain mean of its questions' speeds (not total tokens over total
  time, which is specdec's `tokens_per_s`).
- the *baseline's* speed counts tokens differently: each turn's answer text is tokenized again and one
  token is taken off (`len(tokenizer(text).input_ids) - 1`, the BOS a Llama tokenizer adds); the
  baseline's recorded token counts are not used.
- `speedup_specbench` = a strategy's Spec-Bench speed / the baseline's, per repeat, then the mean over
  repeats (Spec-Bench's mean over runs). With one repeat it is what `speed.py` prints for the export.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

Row = dict[str, Any]
# (strategy, str(question_id), repeat) -> that answer's rows in turn order
Key = tuple[str, str, int]
Tokenizer = Callable[[str], Any]  # a Hugging Face tokenizer: tokenizer(text)["input_ids"]
_FIELDS = {"strategy", "question_id", "turn", "new_tokens", "wall_time_s"}


@dataclass
class Questions:
    """specdec answer rows grouped into Spec-Bench questions (only those answered whole everywhere)."""

    strategies: list[str]  # in the order they first appear in the rows
    question_ids: list[str]  # str(question_id) of the kept questions, in first-appearance order
    repeats: list[int]
    answers: dict[Key, list[Row]]  # kept questions only
    left_out: list[str] = field(default_factory=list)  # str ids of questions some answer lacks a turn of

    def rows(self, strategy: str, question_id: str, repeat: int) -> list[Row]:
        return self.answers[(strategy, question_id, repeat)]


def group_questions(rows: Iterable[Row]) -> Questions:
    """Group rows by (strategy, question, repeat); keep a question when every strategy has each of its
    T turns in every repeat, T being the most turns any answer to it has."""
    grouped: dict[Key, dict[int, Row]] = {}
    strategies: dict[str, None] = {}
    turns_of: dict[str, int] = {}  # str(question_id) -> T, in first-appearance order
    repeats: set[int] = set()
    for r in rows:
        if not isinstance(r, dict) or not _FIELDS <= r.keys():
            continue  # not an answer row (nothing the runner writes)
        key = (str(r["strategy"]), str(r["question_id"]), int(r.get("repeat", 0)))
        strategies.setdefault(key[0])
        turns_of[key[1]] = max(turns_of.get(key[1], 0), int(r["turn"]) + 1)
        repeats.add(key[2])
        grouped.setdefault(key, {}).setdefault(int(r["turn"]), r)  # the first answer of a turn wins
    kept: list[str] = []
    left_out: list[str] = []
    answers: dict[Key, list[Row]] = {}
    for q, turns in turns_of.items():
        keys = [(s, q, rep) for s in strategies for rep in sorted(repeats)]
        if all(set(grouped.get(k, {})) == set(range(turns)) for k in keys):
            kept.append(q)
            answers |= {k: [grouped[k][t] for t in range(turns)] for k in keys}
        else:
            left_out.append(q)
    return Questions(list(strategies), kept, sorted(repeats), answers, left_out)


def turn_text(row: Row) -> str:
    """A turn's answer as Spec-Bench stores it: the decoded text, stripped of surrounding whitespace."""
    return str(row.get("output_text") or "").strip()


def recounted_tokens(text: str, tokenizer: Tokenizer) -> int:
    """Spec-Bench's token count of a baseline turn: its text tokenized again, minus one (the BOS)."""
    return len(tokenizer(text)["input_ids"]) - 1


def mean_question_speed(answers: list[list[Row]], tokenizer: Tokenizer | None = None) -> float | None:
    """Mean over questions of (tokens over turns) / (wall time over turns); each item is one question's
    turn rows. With a tokenizer, tokens are recounted from the text (Spec-Bench's baseline rule),
    without one the recorded new_tokens are used. None when there is no question or a time is zero."""
    speeds = []
    for turns in answers:
        wall = sum(float(r["wall_time_s"]) for r in turns)
        if wall <= 0:
            return None
        if tokenizer is None:
            tokens = sum(int(r["new_tokens"]) for r in turns)
        else:
            tokens = sum(recounted_tokens(turn_text(r), tokenizer) for r in turns)
        speeds.append(tokens / wall)
    return statistics.fmean(speeds) if speeds else None


def specbench_speedups(rows: Iterable[Row], baseline: str, tokenizer: Tokenizer | None = None
                       ) -> tuple[dict[str, float | None], Questions]:
    """Per strategy, Spec-Bench's speedup over `baseline` (the module docstring defines it), and the
    questions it was computed on.

    `tokenizer` must be the target's: it recounts the baseline's tokens as `speed.py` does. Without it
    (a report regenerated where the model is not loaded) the baseline's recorded new_tokens are used
    instead, so the baseline's own value is exactly 1 and the others differ from `speed.py`'s by the
    recount alone.
    """
    qs = group_questions(rows)
    out: dict[str, float | None] = {s: None for s in qs.strategies}
    if baseline not in qs.strategies or not qs.question_ids:
        return out, qs
    per_repeat: dict[str, list[float]] = {s: [] for s in qs.strategies}
    for rep in qs.repeats:
        base = mean_question_speed([qs.rows(baseline, q, rep) for q in qs.question_ids], tokenizer)
        for s in qs.strategies:
            speed = mean_question_speed([qs.rows(s, q, rep) for q in qs.question_ids])
            if base and speed is not None:
                per_repeat[s].append(speed / base)
    for s, ratios in per_repeat.items():
        out[s] = statistics.fmean(ratios) if len(ratios) == len(qs.repeats) else None
    return out, qs


def add_specbench_speedup(summary: dict[str, Any], rows: Iterable[Row], tokenizer: Tokenizer | None = None) -> None:
    """Set `speedup_specbench` on each strategy of a summary, and `specbench` (how it was computed) on
    the summary. Without a tokenizer the baseline's recorded token counts stand in for the recount."""
    values, qs = specbench_speedups(rows, summary.get("baseline") or "", tokenizer)
    for name, s in summary["strategies"].items():
        s["speedup_specbench"] = values.get(name)
    summary["specbench"] = {"baseline_tokens": "retokenized" if tokenizer is not None else "recorded",
                            "questions": len(qs.question_ids), "questions_left_out": len(qs.left_out),
                            "repeats": len(qs.repeats)}
