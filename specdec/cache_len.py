"""`generation.max_len`: the KV cache slots per sequence, fixed, or `auto`, sized to the suite.

A static cache cannot grow in the middle of a turn, so a conversation longer than its slots fails (one line,
the other questions go on). `auto` sizes it before any strategy is built: enough for the suite's longest
conversation, at least `AUTO_FLOOR` (the fixed default before `auto`, so short suites time as before), at most
the model's context.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specdec.data import Question

AUTO_FLOOR = 2048
ROUND = 256  # sizes are multiples of this: a few cache shapes whatever the suite (compiled steps key on them)
SLACK = 8  # tokens an answer may gain when its decoded text is encoded again into the next turn's prompt


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def cache_len(value: Any) -> int:
    """The slots a strategy is built with: the number given, or AUTO_FLOOR for `auto` before a suite sizes it."""
    return AUTO_FLOOR if is_auto(value) else int(value)


def fit_cache(target: Any, questions: Sequence[Question], max_new_tokens: int) -> int:
    """Slots for every turn of every question: its prompt, with each earlier answer at `max_new_tokens`
    (+ SLACK), plus this turn's answer; rounded up to ROUND, within [AUTO_FLOOR, the model's context]."""
    need = 0
    for q in questions:
        messages: list[dict[str, str]] = []
        for turn, text in enumerate(q.turns):
            messages.append({"role": "user", "content": text})
            prompt = len(target.chat_ids(messages)) + turn * (max_new_tokens + SLACK)  # earlier answers, empty here
            need = max(need, prompt + max_new_tokens + 1)
            messages.append({"role": "assistant", "content": ""})
    size = max(AUTO_FLOOR, -(-need // ROUND) * ROUND)
    return min(size, int(target.context_len))
