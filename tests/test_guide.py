"""docs/adding-a-strategy.md works as written: its files are written out, its Python blocks run in order
(the strategy is lossless against greedy on the tiny model), and its benchmark command runs."""

from __future__ import annotations

import json
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from specdec.cli_checks import ENTRIES, group_config, native_overrides

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "adding-a-strategy.md"
FENCE = re.compile(r"^```(?P<lang>[\w-]*)(?P<info>[^\n]*)\n(?P<body>.*?)^```\s*$", re.MULTILINE | re.DOTALL)


def blocks() -> list[tuple[str, str | None, str]]:
    """(language, title or None, body) of every fenced block, in order."""
    out = []
    for m in FENCE.finditer(GUIDE.read_text(encoding="utf-8")):
        title = re.search(r'title="([^"]+)"', m.group("info"))
        out.append((m.group("lang"), title.group(1) if title else None, m.group("body")))
    return out


@pytest.fixture
def guide_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder holding the guide's files, importable and the working directory."""
    for _, title, body in blocks():
        if title is not None:
            path = tmp_path / title
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(body, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "my_strategies" or m.startswith("my_strategies.")]:
        monkeypatch.delitem(sys.modules, name)
    yield tmp_path
    for name in [m for m in sys.modules if m == "my_strategies" or m.startswith("my_strategies.")]:
        del sys.modules[name]


def test_the_guide_has_its_parts() -> None:
    found = blocks()
    titles = {title for _, title, _ in found if title}
    assert {"my_strategies/bigram.py", "my_configs/strategy/bigram.yaml"} <= titles
    module = next(body for _, title, body in found if title == "my_strategies/bigram.py")
    code = [line for line in module.splitlines() if line.strip() and not line.strip().startswith(("#", '"""'))]
    assert len(code) <= 45, "the guide promises a strategy of about 30 lines"
    assert sum(lang == "python" and title is None for lang, title, _ in found) >= 2
    assert sum(lang == "bash" for lang, _, _ in found) == 1


def test_python_blocks_run_and_the_strategy_is_lossless(guide_dir: Path) -> None:
    namespace: dict[str, object] = {"__name__": "guide"}
    for lang, title, body in blocks():
        if lang == "python" and title is None:
            exec(compile(body, f"{GUIDE.name} block", "exec"), namespace)  # the guide's own code
    mine, reference = namespace["mine"], namespace["reference"]
    assert mine.output_ids == reference.output_ids  # type: ignore[attr-defined]
    assert mine.decode_steps <= reference.decode_steps  # type: ignore[attr-defined]
    assert mine.proposed > 0  # type: ignore[attr-defined]  # it did draft: the equality above is no accident


def test_the_spelled_out_overrides_are_what_the_shorthand_means() -> None:
    text = GUIDE.read_text(encoding="utf-8")
    assert " ".join(native_overrides(["strategies.bigram.max_tokens=6"])) in text
    assert f"+strategy@{ENTRIES}.bigram=bigram {ENTRIES}.bigram.max_tokens=6" in text


def test_the_benchmark_command_runs(guide_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from specdec.run import main

    command = next(body for lang, _, body in blocks() if lang == "bash")
    words = shlex.split(command.replace("\\\n", " ").replace("$PWD", str(guide_dir)))
    assert words[:4] == ["PYTHONPATH=.", "python", "-m", "specdec.run"]
    out = guide_dir / "out"
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")  # main() sets it for Hydra; restored after the test
    monkeypatch.setattr(sys, "argv", ["specdec.run", *words[4:], "generation.max_new_tokens=12", "warmup=0",
                                      f"output_dir={out}", f"hydra.run.dir={guide_dir / 'run'}",
                                      "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"])
    main()
    summary = json.loads((out / "summary.json").read_text())
    bigram = summary["strategies"]["bigram"]
    assert bigram["config"]["max_tokens"] == 6 and bigram["config"]["_target_"] == "my_strategies.bigram.Bigram"
    assert bigram["matches_baseline"] == 1.0 and bigram["lossless"] is True
    shipped = group_config("strategy", "prompt_lookup").num_draft_tokens
    assert summary["strategies"]["prompt_lookup"]["config"]["num_draft_tokens"] == shipped  # untouched
