"""Write held-apart questions that people wrote: requests from the ChatterBot corpus, which no training source draws on.

Every other held-apart set is text the target wrote (Magpie) or the offline suite's own sources; real users
write shorter, plainer and less tidy requests. This draws single-turn questions and requests from the
`chatterbot-corpus` 1.3.3 wheel on PyPI (BSD licence; fetched with pip and checked against a pinned
sha256): coding requests, tech-support complaints, trivia, science and general knowledge in English,
and a few in other languages. A question is kept when it has at least 4 words, asks something (ends in
"?" or opens with a request word) about the world rather than the bot, and shares neither a 13-word
n-gram with any evaluation or held-apart question in the repository (heads/contamination.py) nor its text
with any training prompt the shipped drafters drew on (heads/data/*.jsonl.gz and the built-in prompts).
Its output is committed as experiments/heldapart/human_heldapart.jsonl:

    python experiments/human_heldapart.py experiments/heldapart/human_heldapart.jsonl
    python -m specdec.run experiment=heldapart \\
        'data.path=${specdec.repo:experiments/heldapart/human_heldapart.jsonl}' \\
        "strategies=[greedy,prompt_lookup,draft,medusa,eagle,eagle2]"
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import yaml

from heads.contamination import REPO, EvalIndex, builder_prompts, evaluation_turns, read_prompts
from heads.instruction_prompts import SHIPPED_DRAWS, instruction_prompts
from specdec.errors import SpecdecError

WHEEL = "chatterbot_corpus-1.3.3-py2.py3-none-any.whl"
SHA256 = "86de5300afb9a80826386339d3bec79c0a72eb0358abb8327e2ecef5ae0ce154"
# category -> (corpus files as LANGUAGE/NAME, questions drawn)
CATEGORIES: dict[str, tuple[tuple[str, ...], int]] = {
    "coding": (("english/coding",), 8),
    "tech_support": (("english/tech_support",), 10),
    "trivia": (("english/trivia",), 10),
    "science": (("english/science", "english/computers"), 6),
    "knowledge": (tuple(f"english/{n}" for n in ("history", "literature", "movies", "money", "politics",
                                                  "sports", "food", "health")), 8),
    "non_english": (("french/trivia", "german/history", "italian/science", "italian/history",
                     "portuguese/linguistic_knowledge", "spanish/trivia"), 6),
}
OPENERS = {"can", "could", "how", "what", "why", "who", "which", "when", "where", "tell", "explain", "write",
           "my", "i", "is", "are", "do", "does"}
MIN_WORDS = 4


def fetch_wheel(folder: Path) -> Path:
    """The pinned corpus wheel in `folder`, downloaded with pip (no dependencies) if it is not there yet."""
    path = folder / WHEEL
    if not path.is_file():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(folder),
               "chatterbot-corpus==1.3.3"]
        if subprocess.run(cmd).returncode != 0 or not path.is_file():
            raise SpecdecError("could not download chatterbot-corpus==1.3.3 from PyPI; pass --wheel PATH to a copy")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SHA256:
        raise SpecdecError(f"{path}: sha256 {digest} is not the pinned {SHA256}; use chatterbot-corpus 1.3.3")
    return path


def read_corpus(wheel: Path) -> dict[str, list[list[str]]]:
    """LANGUAGE/NAME -> the file's conversations (lists of lines, the first one a person's)."""
    out: dict[str, list[list[str]]] = {}
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            parts = name.split("/")
            if len(parts) == 4 and parts[:2] == ["chatterbot_corpus", "data"] and name.endswith(".yml"):
                doc = yaml.safe_load(z.read(name).decode("utf-8"))
                convs = doc.get("conversations", []) if isinstance(doc, dict) else []
                out[f"{parts[2]}/{parts[3][:-4]}"] = [[str(x) for x in c] for c in convs if isinstance(c, list) and c]
    return out


REQUESTS = ("can you ", "could you ", "do you know ")


def asks(text: str) -> bool:
    """At least MIN_WORDS words, a question or a request, and about the world rather than the bot it was
    written for (no "you" past an opening "can you", "could you" or "do you know")."""
    words = text.split()
    if len(words) < MIN_WORDS or not (text.rstrip().endswith("?") or words[0].lower().strip(",") in OPENERS):
        return False
    rest = normal(text)
    rest = next((rest[len(r):] for r in REQUESTS if rest.startswith(r)), rest)
    return not {"you", "your", "yours", "yourself", "you're"} & {w.strip("?.,!") for w in rest.split()}


def normal(text: str) -> str:
    return " ".join(text.lower().split())


def select(corpus: dict[str, list[list[str]]], seed: int, unseen: Callable[[str], bool]) -> list[dict]:
    """Per category, `count` distinct first lines that ask something and pass `unseen`, drawn with `seed`."""
    rng = random.Random(seed)
    out: list[dict] = []
    taken: set[str] = set()
    for category, (files, count) in CATEGORIES.items():
        missing = [f for f in files if f not in corpus]
        if missing:
            raise SpecdecError(f"the corpus has no {missing[0]}.yml; is the wheel chatterbot-corpus 1.3.3?")
        pool = sorted({c[0].strip() for f in files for c in corpus[f] if asks(c[0])})
        rng.shuffle(pool)
        picked = []
        for text in pool:
            if len(picked) == count:
                break
            if normal(text) not in taken and unseen(text):
                taken.add(normal(text))
                picked.append(text)
        if len(picked) < count:
            raise SpecdecError(f"category {category}: only {len(picked)} of {count} usable questions (those in "
                               "another held-apart or evaluation file do not count); lower its count in CATEGORIES")
        out += [{"question_id": f"human-{category}-{i}", "category": category, "turns": [t]}
                for i, t in enumerate(picked)]
    return out


def training_text() -> str:
    """Every training prompt the shipped drafters drew on, normalized and joined: the builder's defaults, the
    instruction templates at every shipped draw and the committed Magpie files."""
    prompts = builder_prompts()
    for n in SHIPPED_DRAWS:
        prompts += instruction_prompts(n, seed=1)
    for path in sorted((REPO / "heads" / "data").glob("*.jsonl.gz")):
        prompts += read_prompts(path)
    return "\n".join(normal(p) for p in prompts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python experiments/human_heldapart.py", description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--wheel", type=Path, help="a local copy of " + WHEEL)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        if args.wheel is not None and args.wheel.name != WHEEL:
            raise SpecdecError(f"--wheel must name a file called {WHEEL}")
        wheel = fetch_wheel(args.wheel.parent if args.wheel is not None else Path(tempfile.mkdtemp()))
        # every evaluation and held-apart turn but those of the file being rewritten
        index = EvalIndex([t for t in evaluation_turns() if (REPO / t.source).resolve() != args.out.resolve()])
        seen = training_text()
        questions = select(read_corpus(wheel), args.seed,
                           lambda t: index.clean(t) and normal(t) not in seen)
    except SpecdecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.out.write_text("".join(json.dumps(q, ensure_ascii=False) + "\n" for q in questions), encoding="utf-8")
    print(f"wrote {len(questions)} questions to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
