"""The answer loop of `specdec.run` at generation.batch_size > 1 (strategies/batched.py does the decoding).

Questions go through in groups of up to 2B conversations; within a group each strategy answers them
all through its batched decoder, and the strategies' order alternates between groups, so neither
always runs on a warmer machine (the batch-1 loop alternates per question for the same reason).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from specdec.data import Question
from specdec.errors import SpecdecError
from specdec.models.loader import LoadedModel
from specdec.results import AnswerLog
from specdec.strategies.base import GenerationParams, Strategy, TurnResult
from specdec.strategies.batched import Job


def answer_batched(strategies: dict[str, Strategy], target: LoadedModel, questions: list[Question],
                   params: GenerationParams, seed: int, log: AnswerLog, repeats: int, batch: int,
                   on_row: Callable[[dict[str, Any]], None], failures: dict[str, str],
                   tick: Callable[[], None], warmup: bool = True) -> None:
    from specdec.run import _turn_seed, turn_row

    decoders = {}
    for name, strategy in strategies.items():
        if not hasattr(strategy, "batch_decoder"):
            raise SpecdecError(f"strategy {name} cannot decode in batches; run it with generation.batch_size=1")
        decoders[name] = strategy.batch_decoder(batch, params)
    names = list(strategies)
    if warmup:  # a full batch of short first turns: kernels loaded and buffers touched before any timing
        for d in decoders.values():
            d.params, kept = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, 16)), d.params
            prompts = [target.chat_ids([{"role": "user", "content": q.turns[0]}]) for q in questions[:batch]]
            d.run([Job(1, lambda t, p=p: p, lambda t: 0, lambda *a: None) for p in prompts])
            d.params = kept
    work = [(q, r) for r in range(repeats) for q in questions]
    # up to two batches' worth per group, yet at least two groups where there is a batch's worth or more
    group = max(batch, min(2 * batch, -(-len(work) // 2)))
    for g, first in enumerate(range(0, len(work), group)):
        order = names if g % 2 == 0 else names[::-1]
        for name in order:
            jobs = [_job(name, q, r, target, params, seed, log, on_row, failures, tick, _turn_seed, turn_row)
                    for q, r in work[first:first + group]]
            decoders[name].run([j for j in jobs if j is not None])


def _job(name: str, q: Question, repeat: int, target: LoadedModel, params: GenerationParams, seed: int,
         log: AnswerLog, on_row: Callable[[dict[str, Any]], None], failures: dict[str, str],
         tick: Callable[[], None], turn_seed: Callable[..., int],
         turn_row: Callable[..., dict[str, Any]]) -> Job | None:
    """Question q as a batched job: the turns already on disk are skipped, each answered turn is
    written as it finishes, and a turn that cannot run is recorded as a failure of the question."""
    messages: list[dict[str, str]] = []
    first = 0
    for turn, text in enumerate(q.turns):
        done = log.get(name, q.question_id, turn, repeat)
        if done is None:
            break
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": done["output_text"]}]
        first = turn + 1
    if first == len(q.turns):
        tick()
        return None

    def prompt(turn: int) -> list[int]:
        messages.append({"role": "user", "content": q.turns[turn]})
        ids = target.chat_ids(messages)
        if len(ids) >= target.context_len:
            raise SpecdecError(f"turn {turn}: prompt of {len(ids)} tokens does not fit the model's context of "
                               f"{target.context_len}; shorten the question or use a longer-context model")
        return ids

    def done(turn: int, prompt_ids: list[int], res: TurnResult) -> None:
        text = target.tokenizer.decode(res.output_ids, skip_special_tokens=True)
        row = turn_row(name, q, turn, repeat, prompt_ids, res, text)
        log.append(row)
        on_row(row)
        messages.append({"role": "assistant", "content": text})
        if turn == len(q.turns) - 1:
            tick()

    def fail(turn: int, e: Exception) -> None:
        where = f"{name}/{q.question_id}" + (f"/repeat{repeat}" if repeat else "")
        failures[where] = str(e)
        tick()

    return Job(len(q.turns), prompt, lambda turn: turn_seed(seed, q.question_id, turn, repeat), done, first, fail)
