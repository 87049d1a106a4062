"""Tests for specdec.report: tables checked against numbers computed here from synthetic answers."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from specdec.errors import SpecdecError
from specdec.metrics import add_speedup_ci, summarize
from specdec.report import find_runs, load_runs, main, overall_table, sweep_axis, write_report

# (strategy, question, category, repeat) -> (new_tokens, wall_time_s, accept_lengths)
ANSWERS: dict[tuple[str, str, str, int], tuple[int, float, list[int]]] = {
    ("greedy", "1", "code", 0): (20, 2.0, [1] * 20),
    ("greedy", "2", "qa", 0): (10, 1.25, [1] * 10),
    ("greedy", "1", "code", 1): (20, 2.2, [1] * 20),
    ("greedy", "2", "qa", 1): (10, 1.1, [1] * 10),
    ("prompt_lookup", "1", "code", 0): (20, 0.8, [1, 3, 3, 4, 1, 4, 4]),
    ("prompt_lookup", "2", "qa", 0): (10, 1.0, [1, 1, 2, 1, 2, 1, 2]),
    ("prompt_lookup", "1", "code", 1): (20, 1.0, [1, 3, 3, 4, 1, 4, 4]),
    ("prompt_lookup", "2", "qa", 1): (10, 0.9, [1, 1, 2, 1, 2, 1, 2]),
}
DRAFT = 3  # prompt_lookup proposes 3 tokens a step in these rows


def _row(key: tuple[str, str, str, int], value: tuple[int, float, list[int]]) -> dict[str, Any]:
    strategy, qid, category, repeat = key
    new_tokens, wall, accepts = value
    assert sum(accepts) == new_tokens
    drafting = strategy != "greedy"
    accepted = [a - 1 for a in accepts[1:]]  # each pass commits its accepted drafts plus one token
    return {
        "question_id": qid, "category": category, "turn": 0, "strategy": strategy, "prompt_tokens": 30,
        "new_tokens": new_tokens, "output_ids": list(range(new_tokens)), "output_text": "x",
        "wall_time_s": wall, "ttft_s": 0.1, "decode_steps": len(accepts) - 1, "accept_lengths": accepts,
        "proposed_tokens": DRAFT * len(accepted) if drafting else 0,
        "accepted_tokens": sum(accepted) if drafting else 0,
        "proposed_by_pos": [len(accepted)] * DRAFT if drafting else None,
        "accepted_by_pos": [sum(a > k for a in accepted) for k in range(DRAFT)] if drafting else None,
        "draft_time_s": 0.01 if drafting else 0.0, "repeat": repeat,
    }


def write_run(path: Path, answers: dict[tuple[str, str, str, int], tuple[int, float, list[int]]],
              config: dict[str, Any] | None = None, overrides: list[str] | None = None) -> Path:
    """A results folder as specdec.run writes it: answers.jsonl, summary.json, .hydra/overrides.yaml."""
    rows = [_row(k, v) for k, v in answers.items()]
    path.mkdir(parents=True)
    (path / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"generation": {"temperature": 0.0, "max_new_tokens": 20}, "model": {"name": "tiny-llama"},
           "strategy": {"name": "prompt_lookup", "num_draft_tokens": DRAFT}, "seed": 0, "repeats": 2,
           "environment": {"torch": "9.9.9", "threads": 7, "dtype": "float32", "platform": "TestOS-1",
                           "date": "2000-01-02 03:04:05"}} | (config or {})
    summary = summarize(rows, "greedy", 0.0, ["greedy", "prompt_lookup"], cfg)
    add_speedup_ci(summary)
    (path / "summary.json").write_text(json.dumps(summary))
    if overrides is not None:
        (path / ".hydra").mkdir()
        (path / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    return path


def tables(markdown: str) -> dict[str, dict[str, dict[str, str]]]:
    """Each table under its nearest heading: {heading: {first cell: {column: cell}}} (first occurrence)."""
    out: dict[str, dict[str, dict[str, str]]] = {}
    heading, header = "", None
    for line in markdown.splitlines():
        if line.startswith("#"):
            heading, header = line.lstrip("# ").strip(), None
        elif line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if header is None:
                header = cells
            elif not set(cells[0]) <= {"-", ":"}:
                out.setdefault(heading, {}).setdefault(cells[0], dict(zip(header, cells)))
        else:
            header = None
    return out


def tps(strategy: str, category: str | None = None, repeat: int | None = None) -> float:
    picked = [v for k, v in ANSWERS.items() if k[0] == strategy and category in (None, k[2])
              and repeat in (None, k[3])]
    return sum(v[0] for v in picked) / sum(v[1] for v in picked)


def ci95(values: list[float]) -> float:
    from scipy import stats

    return float(stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values)))


def assert_png(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 0
    with Image.open(path) as img:
        assert img.format == "PNG"
        assert img.size[0] > 100 and img.size[1] > 100
        img.verify()


def test_overall_and_category_tables_match_the_answers(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", ANSWERS, overrides=["model=tiny-llama", "strategies=[greedy,prompt_lookup]"])
    path, text = write_report([run])
    assert path == run / "report.md" and path.read_text() == text
    t = tables(text)

    overall = t["Overall"]
    assert overall["greedy"]["tokens/s"].split(" ± ")[0] == f"{tps('greedy'):.2f}"
    speedup = tps("prompt_lookup") / tps("greedy")
    pl = overall["prompt_lookup"]
    assert pl["tokens/s"].split(" ± ")[0] == f"{tps('prompt_lookup'):.2f}"
    # two repeats: a 95% interval over the per-repeat tokens/s and per-repeat speedups
    per_repeat = [tps("prompt_lookup", repeat=r) for r in (0, 1)]
    assert pl["tokens/s"] == f"{tps('prompt_lookup'):.2f} ± {ci95(per_repeat):.2f}"
    ratios = [tps("prompt_lookup", repeat=r) / tps("greedy", repeat=r) for r in (0, 1)]
    assert pl["speedup"] == f"{speedup:.2f} ± {ci95(ratios):.2f}"
    accepts = [a for k, v in ANSWERS.items() if k[0] == "prompt_lookup" for a in v[2]]
    assert pl["tau"] == f"{statistics.fmean(accepts):.2f}"
    accepted = [a - 1 for k, v in ANSWERS.items() if k[0] == "prompt_lookup" for a in v[2][1:]]
    assert pl["alpha longest path"] == f"{sum(accepted) / (DRAFT * len(accepted)):.2f}"
    assert pl["matches baseline"] == "1.00"
    assert pl["TTFT p50 (ms)"] == "100.0"
    assert overall["greedy"]["alpha longest path"] == overall["greedy"]["alpha per node"] == "-"
    assert pl["predicted speedup"] not in ("", "-")

    by_cat = t["speedup"]
    for cat in ("code", "qa"):
        assert by_cat["prompt_lookup"][cat] == f"{tps('prompt_lookup', cat) / tps('greedy', cat):.2f}"
        assert t["tokens/s"]["greedy"][cat] == f"{tps('greedy', cat):.2f}"
    assert by_cat["prompt_lookup"]["overall"] == f"{speedup:.2f}"

    env = t["Environment"]
    assert env["torch"]["value"] == "9.9.9" and env["threads"]["value"] == "7"
    assert env["platform"]["value"] == "TestOS-1" and env["date"]["value"] == "2000-01-02 03:04:05"
    assert "python -m specdec.run model=tiny-llama strategies=[greedy,prompt_lookup]" in text


def test_plots_are_valid_pngs_and_linked(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", ANSWERS)
    _, text = write_report([run], tmp_path / "out")
    names = ("speedup_by_category", "acceptance_by_position", "accept_length_histogram")
    for name in names:
        assert f"(plots/{name}.png)" in text
        assert_png(tmp_path / "out" / "plots" / f"{name}.png")
    assert (tmp_path / "out" / "report.md").is_file()
    assert not (run / "report.md").exists()


def test_sweep_over_one_strategy_setting(tmp_path: Path) -> None:
    # a draft-length sweep: the longer draft is slower here, so the speedups must come out different
    slower = {k: (v[0], v[1] * (1.5 if k[0] == "prompt_lookup" else 1.0), v[2]) for k, v in ANSWERS.items()}
    sweep = tmp_path / "multirun"
    write_run(sweep / "0", ANSWERS, {"strategy": {"name": "prompt_lookup", "num_draft_tokens": 2}})
    write_run(sweep / "1", slower, {"strategy": {"name": "prompt_lookup", "num_draft_tokens": 8}})
    runs = load_runs([sweep])
    assert [r.label for r in runs] == ["strategy.num_draft_tokens=2", "strategy.num_draft_tokens=8"]
    assert sweep_axis(runs) == ("strategy.num_draft_tokens", [2.0, 8.0])
    _, text = write_report([sweep])
    assert_png(sweep / "plots" / "sweep_strategy_num_draft_tokens.png")
    compared = [line for line in text.splitlines() if line.startswith("| strategy.num_draft_tokens=")]
    speedups = {line.split("|")[1].strip(): line.split("|")[4].strip() for line in compared if "prompt_lookup" in line}
    assert speedups == {"strategy.num_draft_tokens=2": f"{tps('prompt_lookup') / tps('greedy'):.2f}",
                        "strategy.num_draft_tokens=8": f"{tps('prompt_lookup') / 1.5 / tps('greedy'):.2f}"}
    for i in (0, 1):  # per-run plots are kept apart
        assert_png(sweep / "plots" / f"speedup_by_category-{i}.png")


def test_no_sweep_plot_when_two_settings_differ(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", ANSWERS, {"strategy": {"name": "prompt_lookup", "num_draft_tokens": 2}, "seed": 0})
    b = write_run(tmp_path / "b", ANSWERS, {"strategy": {"name": "prompt_lookup", "num_draft_tokens": 4}, "seed": 1})
    assert sweep_axis(load_runs([a, b])) is None
    _, text = write_report([a, b], tmp_path / "out")
    assert "![sweep]" not in text and not list((tmp_path / "out" / "plots").glob("sweep_*"))
    assert "seed=1, strategy.num_draft_tokens=4" in text


def test_multirun_folder_jobs_in_numeric_order(tmp_path: Path) -> None:
    for job in ("10", "2", "0"):
        write_run(tmp_path / "sweep" / job, ANSWERS)
    (tmp_path / "sweep" / "notes").mkdir()  # no summary.json: not a job
    assert [p.name for p in find_runs([tmp_path / "sweep"])] == ["0", "2", "10"]


def test_breakdowns_come_from_answers_when_the_summary_lacks_them(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", ANSWERS)
    summary = json.loads((run / "summary.json").read_text())
    for s in summary["strategies"].values():  # a summary with the contract's fields only
        for key in ("categories", "acceptance_by_position", "accept_length_histogram", "repeats"):
            s.pop(key)
    (run / "summary.json").write_text(json.dumps(summary))
    t = tables(write_report([run])[1])
    assert t["speedup"]["prompt_lookup"]["qa"] == f"{tps('prompt_lookup', 'qa') / tps('greedy', 'qa'):.2f}"
    assert_png(run / "plots" / "acceptance_by_position.png")


@pytest.mark.parametrize("setup, expected", [
    (lambda p: p / "missing", "not found"),
    (lambda p: (p / "empty").mkdir() or p / "empty", "no summary.json"),
    (lambda p: (p / "bad").mkdir() or (p / "bad" / "summary.json").write_text("{oops") and p / "bad",
     "not valid JSON"),
    (lambda p: (p / "other").mkdir() or (p / "other" / "summary.json").write_text('{"a": 1}') and p / "other",
     "no per-strategy results"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          setup: Any, expected: str) -> None:
    target = setup(tmp_path)
    assert main([str(target)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and expected in err and "\n" not in err
    with pytest.raises(SpecdecError):
        write_report([target])


def test_histogram_leaves_out_every_turns_prefill() -> None:
    # two turns: each accept_lengths starts with its prefill's 1, which is no decode pass
    rows = [_row(("prompt_lookup", "1", "code", 0), (20, 0.8, [1, 3, 3, 4, 1, 4, 4])),
            _row(("prompt_lookup", "2", "qa", 0), (10, 1.0, [1, 1, 2, 1, 2, 1, 2]))]
    s = summarize(rows, "prompt_lookup", 0.0)["strategies"]["prompt_lookup"]
    assert s["accept_length_histogram"] == {1: 4, 2: 3, 3: 2, 4: 3}
    assert sum(s["accept_length_histogram"].values()) == s["decode_steps"] == 12
    assert s["mean_accepted_tokens"] == pytest.approx(30 / 14)  # tau still counts the prefill (CONTRACT.md)


def test_tree_alpha_per_node_and_per_longest_path() -> None:
    # a tree step verifies 5 nodes whose longest path is 3 deep; 2 tokens accepted a step
    row = _row(("medusa", "1", "code", 0), (7, 1.0, [1, 3, 3]))
    row |= {"proposed_tokens": 6, "accepted_tokens": 4, "proposed_nodes": 10}
    s = summarize([row], "medusa", 0.0)["strategies"]["medusa"]
    assert s["alpha_longest_path"] == s["acceptance_rate"] == pytest.approx(4 / 6)
    assert s["alpha_per_node"] == pytest.approx(4 / 10)
    # the report names both columns; the cells are the summary's
    header, *rows = overall_table(summarize([row], "medusa", 0.0)).splitlines()
    line = next(x for x in rows if x.startswith("| medusa"))
    cells = dict(zip([h.strip() for h in header.split("|")], [c.strip() for c in line.split("|")]))
    assert cells["alpha longest path"] == "0.67" and cells["alpha per node"] == "0.40"
    del row["proposed_nodes"]  # rows written before the field: no per-node figure rather than a wrong one
    assert summarize([row], "medusa", 0.0)["strategies"]["medusa"]["alpha_per_node"] is None


def test_bootstrap_interval_holds_the_speedup_and_is_reproducible() -> None:
    import random

    rng = random.Random(5)
    answers = {}
    for q in range(30):
        tokens, base_wall = rng.randint(20, 60), rng.uniform(1.0, 3.0)
        answers[("greedy", str(q), "qa", 0)] = (tokens, base_wall, [1] * tokens)
        answers[("prompt_lookup", str(q), "qa", 0)] = (tokens, base_wall / rng.uniform(1.1, 1.8),
                                                       [1] * tokens)
    rows = [_row(k, v) for k, v in answers.items()]
    summary = summarize(rows, "greedy", 0.0)
    pl = summary["strategies"]["prompt_lookup"]
    lo, hi = pl["speedup_ci"]
    assert lo < pl["speedup"] < hi and 1.0 < lo and hi < 1.8
    assert summary["strategies"]["greedy"]["speedup_ci"] == [1.0, 1.0]
    assert summarize(rows, "greedy", 0.0)["strategies"]["prompt_lookup"]["speedup_ci"] == [lo, hi]
    # a quarter of the questions: a wider interval
    few = summarize([r for r in rows if int(r["question_id"]) < 8], "greedy", 0.0)["strategies"]["prompt_lookup"]
    assert few["speedup_ci"][1] - few["speedup_ci"][0] > hi - lo


def test_report_marks_lossy_rows(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", ANSWERS)
    summary = json.loads((run / "summary.json").read_text())
    summary["strategies"]["prompt_lookup"]["lossless"] = False
    summary["strategies"]["greedy"]["lossless"] = True
    (run / "summary.json").write_text(json.dumps(summary))
    t = tables(write_report([run])[1])
    assert t["Overall"]["prompt_lookup"]["lossless"] == "**no (lossy)**"
    assert t["Overall"]["greedy"]["lossless"] == "yes"
    lo, hi = summary["strategies"]["prompt_lookup"]["speedup_ci"]
    assert t["Overall"]["prompt_lookup"]["speedup 95% CI"] == f"[{lo:.2f}, {hi:.2f}]"
