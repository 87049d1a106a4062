"""`python -m heads.magpie_tasks`: requests over a document, where the target writes the document too.

Plain Magpie requests (heads/magpie.py) are short and self-contained; much of what people ask comes with a
text to work on: summarize this article, translate this paragraph, pull the figures out of this report,
answer from this passage, rewrite this email. Here the target first writes the document (sampled, seeded,
on a topic), then a task instruction wraps it; for questions over a passage the target also writes the
question, Magpie-style, inside the user turn. Nothing is read from any benchmark or corpus: the only text
is the model's own plus the instruction phrasings below. Training draws from `magpie.DOMAINS` with
TRAIN_PHRASINGS; `--domains heldapart` draws from the held-apart domains with other phrasings, so a choice
made on those questions rewards neither the topics nor the wording of training. Every prompt sharing a
13-word n-gram with an evaluation or held-apart question shipped in the repository is dropped.

    python -m heads.magpie_tasks --n 1200 --seed 0 --out heads/data/magpie-tasks-smollm2-135m.jsonl.gz
    python -m heads.magpie_tasks --n 40 --seed 101 --domains heldapart --questions \\
        --out experiments/heldapart/tasks_heldapart.jsonl
"""

from __future__ import annotations

import random
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from heads import magpie
from specdec.engine.sampling import SamplingParams
from specdec.errors import SpecdecError
from specdec.models.cpu_linear import use_matmul
from specdec.models.loader import LoadedModel

# task -> the request that makes the target write the document ({topic}, {lang})
DOCUMENTS = {
    "summarization": "Write a short news article about {topic}.",
    "translation": "Write a short paragraph in {lang} about {topic}.",
    "extraction": "Write a short report about {topic} that mentions people, places, dates and numbers.",
    "qa": "Write an encyclopedia paragraph about {topic}.",
    "rewriting": "Write a short, casual email to a friend about {topic}.",
}
LANGUAGES = ("German", "French", "Spanish")
# task -> instruction phrasings around the document ({doc}, {lang}, {question}); the two sets share none
TRAIN_PHRASINGS = {
    "summarization": ("Summarize the following article in a few sentences.\n\n{doc}",
                      "{doc}\n\nWhat are the main points of this text?",
                      "Write a one-paragraph summary of this:\n{doc}"),
    "translation": ("Translate the following {lang} text into English.\n\n{doc}",
                    "{lang}: {doc}\nEnglish:",
                    "Please translate this into English:\n\n{doc}"),
    "extraction": ("List every person, place, date and number mentioned in the text below.\n\n{doc}",
                   "{doc}\n\nExtract the key facts from this report as bullet points.",
                   "From the following report, make a table of the names and figures it mentions.\n\n{doc}"),
    "qa": ("Answer the question using only the passage.\n\nPassage: {doc}\n\nQuestion: {question}",
           "{doc}\n\nBased on the text above, {question}",
           "Context:\n{doc}\n\nQ: {question}\nA:"),
    "rewriting": ("Rewrite the following email so that it sounds formal and polite.\n\n{doc}",
                  "{doc}\n\nFix the grammar of this message and make it clearer.",
                  "Make this text shorter without losing anything important:\n\n{doc}"),
}
HELDAPART_PHRASINGS = {
    "summarization": ("Give me a brief summary of the article below.\n\n{doc}",
                      "Article:\n{doc}\n\nSummarize it in two sentences."),
    "translation": ("Translate from {lang} to English: {doc}",
                    "Here is a {lang} paragraph. What does it say in English?\n\n{doc}"),
    "extraction": ("Which names, dates and amounts appear in this report?\n\n{doc}",
                   "Report:\n{doc}\n\nPull out all the numbers and say what each refers to."),
    "qa": ("Read this passage and answer the question that follows.\n\n{doc}\n\nQuestion: {question}",
           "Passage:\n{doc}\n\nUsing the passage, answer: {question}"),
    "rewriting": ("Rewrite this email for a professional audience:\n\n{doc}",
                  "Polish the wording of the following message.\n\n{doc}"),
}
QUESTION_CUE = "Read the passage and write one question it answers.\n\nPassage: {doc}\n\nQuestion:"
SENTENCE_END = re.compile(r"[.!?](?=\s|$)")


def whole_sentences(text: str, min_words: int = 30) -> str | None:
    """`text` cut after its last full sentence, if that leaves `min_words` words and no loop."""
    ends = [m.end() for m in SENTENCE_END.finditer(text)]
    if not ends:
        return None
    return magpie.clean(text[:ends[-1]], min_words=min_words, max_words=400)


def first_question(text: str) -> str | None:
    """The first line of a sampled question, if it is one."""
    line = text.strip().split("\n")[0].strip()
    return line if line.endswith("?") and 3 <= len(line.split()) <= 40 else None


def generate(target: LoadedModel, n: int, seed: int = 0, batch_size: int = 32, max_doc_tokens: int = 200,
             temperature: float = 0.8, top_p: float = 0.95, max_minutes: float | None = None,
             domains: Sequence[str] = magpie.DOMAINS,
             phrasings: dict[str, Sequence[str]] = TRAIN_PHRASINGS) -> list[dict[str, Any]]:
    """Up to `n` decontaminated one-turn requests over a document the target wrote, tasks in turn."""
    from heads.contamination import EvalIndex, evaluation_turns

    if n < 1 or batch_size < 1:
        raise SpecdecError(f"magpie_tasks needs n and batch_size >= 1; got {n}, {batch_size}")
    index = EvalIndex(evaluation_turns())
    params = SamplingParams(temperature=temperature, top_p=top_p)
    stop = set(target.eos_ids) | {t for t in [target.tokenizer.convert_tokens_to_ids("<|im_end|>")] if t is not None}
    gen = torch.Generator(device=target.device).manual_seed(seed)
    pick = random.Random(seed)
    tasks = list(DOCUMENTS)
    seen: set[str] = set()
    kept: list[dict[str, Any]] = []
    start, made = time.monotonic(), 0
    if getattr(target.model, "fused", None) is None:
        use_matmul(target.model, "torch")
    try:
        while len(kept) < n:
            if max_minutes is not None and time.monotonic() - start > 60 * max_minutes:
                break
            jobs = [{"task": tasks[(made + b) % len(tasks)], "topic": pick.choice(domains),
                     "lang": pick.choice(LANGUAGES), "phrasing": pick.randrange(1 << 30)} for b in range(batch_size)]
            made += batch_size
            asks = [target.chat_ids([{"role": "user", "content": DOCUMENTS[j["task"]].format(**j)}]) for j in jobs]
            for j, ids in zip(jobs, magpie.complete(target, asks, max_doc_tokens, params, gen, stop)):
                j["doc"] = whole_sentences(target.tokenizer.decode(ids, skip_special_tokens=True))
            jobs = [j for j in jobs if j["doc"] is not None]
            qa = [j for j in jobs if j["task"] == "qa"]
            if qa:  # the question, sampled inside the user turn after the passage
                cues = [magpie.turn_prefix(target, []) + target.tokenizer.encode(
                    QUESTION_CUE.format(**j), add_special_tokens=False) for j in qa]
                for j, ids in zip(qa, magpie.complete(target, cues, 40, params, gen, stop)):
                    j["question"] = first_question(target.tokenizer.decode(ids, skip_special_tokens=True))
            for j in jobs:
                if j["task"] == "qa" and j["question"] is None:
                    continue
                forms = phrasings[j["task"]]
                text = forms[j["phrasing"] % len(forms)].format(**j)
                key = " ".join(j["doc"].lower().split())
                if key in seen or not index.clean(text):
                    continue
                seen.add(key)
                kept.append({"messages": [{"role": "user", "content": text}], "domain": j["topic"], "task": j["task"]})
            print(f"magpie_tasks: {len(kept)}/{n} requests from {made} documents, "
                  f"{(time.monotonic() - start) / 60:.1f} min", file=sys.stderr, flush=True)
    finally:
        use_matmul(target.model, target.matmul)
    return kept[:n]


def as_questions(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Requests as a question file (`data=jsonl`): the task as category."""
    return [{"question_id": i, "category": r["task"], "turns": [r["messages"][0]["content"]]}
            for i, r in enumerate(rows)]


def main(argv: Sequence[str] | None = None) -> int:
    p = magpie.cli("python -m heads.magpie_tasks", __doc__.split("\n")[0], 1200,
                   "train: training domains and phrasings; heldapart: others training never draws from")
    a = p.parse_args(argv)
    held = a.domains == "heldapart"
    try:
        rows = generate(magpie.load_target(a.model, "model.matmul=numba"), a.n, a.seed, a.batch_size,
                        max_minutes=a.max_minutes, domains=magpie.HELDAPART_DOMAINS if held else magpie.DOMAINS,
                        phrasings=HELDAPART_PHRASINGS if held else TRAIN_PHRASINGS)
    except SpecdecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    magpie.write(as_questions(rows) if a.questions else rows, a.out)
    print(f"wrote {len(rows)} requests to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
