"""`python -m heads.contamination`: training prompts that share text with evaluation questions.

A training prompt is contaminated when it shares a 13-word n-gram (lowercased, whitespace-normalized) with any
evaluation turn shipped in the repository: the default offline suite (configs/data/default.yaml), every
`experiments/data/*.jsonl`, and the held-apart questions that choose defaults
(`experiments/heldapart/*.jsonl`: not evaluation data, but no more to be trained on). Prompts shorter than 13
words count when their whole word sequence equals an evaluation turn's. By default the prompts checked are
those the training-data builder (heads/distill_data.py, with the `data` settings of configs/train.yaml)
produces; `--prompts FILE` checks a file instead (jsonl: a string, or an object with `prompt`, `text` or
`turns`, a line; other files: one prompt a line). Lists every contaminated prompt and exits 1 if there is one.

    python -m heads.contamination
    python -m heads.contamination --prompts my_prompts.jsonl --eval held_apart.jsonl
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from specdec.errors import SpecdecError

N = 13
REPO = Path(__file__).resolve().parents[1]
EVAL_DIR = REPO / "experiments" / "data"
HELDAPART_DIR = REPO / "experiments" / "heldapart"

Gram = tuple[str, ...]


def words(text: str) -> list[str]:
    return text.lower().split()


def ngrams(text: str, n: int = N) -> set[Gram]:
    """The text's n-word windows; a text shorter than n words is one window of all its words."""
    w = words(text)
    if len(w) < n:
        return {tuple(w)} if w else set()
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


@dataclass(frozen=True)
class EvalTurn:
    source: str  # "default suite" or the file's path relative to the repository
    question_id: str
    turn: int
    text: str

    def where(self) -> str:
        return f"{self.source} question {self.question_id} turn {self.turn}"


@dataclass(frozen=True)
class Hit:
    index: int  # position of the prompt in the checked list
    prompt: str
    shared: str  # the shared n-gram, as words
    turn: EvalTurn


class EvalIndex:
    """Every n-gram of the evaluation turns -> the first turn it occurs in.

    Short texts (fewer than n words) live in their own table: they match only a whole equal text,
    never a window of a longer one, so a short phrase common to many prompts is not flagged.
    """

    def __init__(self, turns: Iterable[EvalTurn], n: int = N) -> None:
        self.n = n
        self.turns = list(turns)
        self._grams: dict[Gram, EvalTurn] = {}
        self._short: dict[Gram, EvalTurn] = {}
        for t in self.turns:
            w = words(t.text)
            table = self._short if len(w) < n else self._grams
            for g in ngrams(t.text, n):
                table.setdefault(g, t)

    def hit(self, prompt: str) -> tuple[Gram, EvalTurn] | None:
        """The first shared n-gram of `prompt` (in reading order) and its evaluation turn, or None."""
        w = words(prompt)
        if len(w) < self.n:
            turn = self._short.get(tuple(w))
            return (tuple(w), turn) if turn is not None else None
        for i in range(len(w) - self.n + 1):
            g = tuple(w[i:i + self.n])
            turn = self._grams.get(g)
            if turn is not None:
                return g, turn
        return None

    def clean(self, prompt: str) -> bool:
        return self.hit(prompt) is None

    def hits(self, prompts: Sequence[str]) -> list[Hit]:
        out = []
        for i, p in enumerate(prompts):
            found = self.hit(p)
            if found is not None:
                out.append(Hit(i, p, " ".join(found[0]), found[1]))
        return out


def default_suite_turns(per_category: int | None = None, seed: int | None = None) -> list[EvalTurn]:
    """Turns of the default offline suite; per_category and seed default to configs/data/default.yaml."""
    from omegaconf import OmegaConf

    from specdec.data import default_suite

    if per_category is None or seed is None:
        cfg = OmegaConf.load(REPO / "configs" / "data" / "default.yaml")
        per_category = int(cfg.per_category) if per_category is None else per_category
        seed = int(cfg.seed) if seed is None else seed
    label = "default suite" + (f" (seed {seed})" if seed else "")
    return [EvalTurn(label, q.question_id, i, t)
            for q in default_suite(per_category=per_category, seed=seed) for i, t in enumerate(q.turns)]


def file_turns(path: Path) -> list[EvalTurn]:
    from specdec.data import load_jsonl

    try:
        label = str(path.resolve().relative_to(REPO))
    except ValueError:
        label = str(path)
    return [EvalTurn(label, q.question_id, i, t) for q in load_jsonl(str(path)) for i, t in enumerate(q.turns)]


def evaluation_turns(per_category: int | None = None, seed: int | None = None,
                     extra: Sequence[Path] = ()) -> list[EvalTurn]:
    """Every evaluation turn shipped in the repository (the default suite, experiments/data/*.jsonl) and
    every held-apart turn (experiments/heldapart/*.jsonl), plus those of `extra` files."""
    turns = default_suite_turns(per_category, seed)
    for folder in (EVAL_DIR, HELDAPART_DIR):
        for path in sorted(folder.glob("*.jsonl")) if folder.is_dir() else []:
            turns += file_turns(path)
    for path in extra:
        turns += file_turns(Path(path))
    return turns


def check_clean(prompts: Sequence[str], index: EvalIndex, what: str = "training prompts") -> None:
    """Raise one line naming the first contaminated prompt, if any."""
    hits = index.hits(prompts)
    if hits:
        h = hits[0]
        raise SpecdecError(f"{len(hits)} of {len(prompts)} {what} share a {index.n}-word n-gram with evaluation "
                           f"questions, e.g. prompt {h.index} with {h.turn.where()} ({h.shared!r}); "
                           "run python -m heads.contamination for the list")


def builder_prompts() -> list[str]:
    """What the training-data builder produces with configs/train.yaml's `data` settings."""
    from omegaconf import OmegaConf

    from heads.distill_data import distill_prompts

    data = OmegaConf.load(REPO / "configs" / "train.yaml").data
    return distill_prompts(per_category=int(data.per_category), seeds=[int(s) for s in data.seeds],
                           exclude_per_category=int(data.exclude_per_category), exclude_seed=int(data.exclude_seed),
                           max_prompts=data.max_prompts, instructions=int(data.instructions or 0))


def read_prompts(path: Path) -> list[str]:
    """A jsonl file, gzipped or not (a string, or an object with prompt/text/turns or chat `messages`, a
    line), or one prompt a line."""
    if not path.is_file():
        raise SpecdecError(f"prompts file not found: {path}")
    gzipped = path.suffix == ".gz"
    try:
        text = gzip.decompress(path.read_bytes()).decode("utf-8") if gzipped else path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SpecdecError(f"{path}: cannot read it as {'gzip' if gzipped else 'UTF-8'} text ({e}); "
                           "pass a .jsonl, .jsonl.gz or plain-text file") from None
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if Path(path.stem if gzipped else path.name).suffix != ".jsonl":
        return lines
    prompts: list[str] = []
    for n, line in enumerate(lines, 1):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecdecError(f"{path} line {n}: not JSON ({e.msg})") from None
        if isinstance(obj, str):
            prompts.append(obj)
        elif isinstance(obj, dict) and isinstance(obj.get("prompt", obj.get("text")), str):
            prompts.append(obj.get("prompt", obj.get("text")))
        elif isinstance(obj, dict) and isinstance(obj.get("turns"), list):
            prompts += [t for t in obj["turns"] if isinstance(t, str)]
        elif isinstance(obj, dict) and isinstance(obj.get("messages"), list):   # the user turns of a chat
            prompts += [m["content"] for m in obj["messages"]
                        if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), str)]
        else:
            raise SpecdecError(f"{path} line {n}: expected a string or an object with prompt, text, turns or messages")
    return prompts


def _preview(text: str, width: int = 70) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[:width - 3] + "..."


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m heads.contamination", description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=Path, default=None,
                        help="training prompts to check (default: the training-data builder's)")
    parser.add_argument("--eval", type=Path, action="append", default=[],
                        help="another evaluation file (Spec-Bench jsonl), besides those shipped; repeatable")
    parser.add_argument("-n", type=int, default=N, help=f"n-gram length in words (default {N})")
    ns = parser.parse_args(argv)
    try:
        if ns.n < 1:
            raise SpecdecError(f"-n {ns.n}: give a length of at least 1 word")
        prompts = read_prompts(ns.prompts) if ns.prompts else builder_prompts()
        index = EvalIndex(evaluation_turns(extra=ns.eval), ns.n)
    except SpecdecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    hits = index.hits(prompts)
    for h in hits:
        print(f"prompt {h.index}: {_preview(h.prompt)!r} shares {h.shared!r} with {h.turn.where()}")
    source = str(ns.prompts) if ns.prompts else "the training-data builder"
    summary = (f"{len(prompts)} prompts from {source} against {len(index.turns)} evaluation turns "
               f"({ns.n}-word n-grams)")
    if hits:
        print(f"contaminated: {len(hits)} of {summary}")
        return 1
    print(f"clean: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
