"""experiment=NAME presets compose (and run on the tiny model); the Spec-Bench-style file; the SLURM launcher."""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from specdec.cli_checks import CONFIG_DIR, PRESET_STRATEGIES, check_overrides, native_overrides, strategy_config
from specdec.data import load_jsonl
from specdec.errors import SpecdecError
from specdec.run import run

PRESETS = sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml"))
DATA_FILE = CONFIG_DIR.parent / "experiments" / "data" / "specbench_style.jsonl"
SPEC_BENCH_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
                         "translation", "summarization", "qa", "math_reasoning", "rag"}
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def composed(*overrides: str, hydra: bool = False) -> DictConfig:
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        return compose("run", overrides=list(overrides), return_hydra_config=hydra)


def test_the_presets_named_in_the_docs_exist() -> None:
    assert {"headline", "foundation", "training_free", "specbench_style", "sweep_prompt_lookup"} <= set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_composes_with_built_strategies(name: str) -> None:
    assert (CONFIG_DIR / "experiment" / f"{name}.yaml").read_text().startswith("# @package _global_")
    cfg = composed(f"experiment={name}", hydra=True)
    names = list(cfg.strategies)
    entries = set(cfg.strategy_configs)  # variants the preset defines for its own comparison
    for strategy in names:
        assert (CONFIG_DIR / "strategy" / f"{strategy}.yaml").is_file() or strategy in entries, \
            f"{name} names unbuilt {strategy}"
    for entry in entries:  # each entry composes and is filed under its own name
        scfg = strategy_config(cfg, entry)
        assert scfg.name == entry and scfg._partial_ is True and "_target_" in scfg
    assert cfg.baseline in names
    assert cfg.model.name == "smollm2-135m"  # tables are on the default model, pinned
    assert cfg.generation.temperature == (0.7 if name.endswith("_sampling") else 0.0)
    assert name in cfg.hydra.sweep.dir  # results land in a folder named for the preset


def test_preset_contents() -> None:
    headline = composed("experiment=headline")
    assert list(headline.strategies) == ["greedy", "hf_generate", "prompt_lookup", "hf_prompt_lookup", "lookahead"]
    assert headline.baseline == "greedy" and headline.data.name == "default"
    foundation = composed("experiment=foundation")
    assert list(foundation.strategies) == ["greedy", "hf_generate"] and foundation.baseline == "hf_generate"
    free = composed("experiment=training_free")
    assert list(free.strategies) == ["greedy", "prompt_lookup", "lookahead", "hf_prompt_lookup"]
    spec = composed("experiment=specbench_style")
    assert list(spec.strategies) == list(headline.strategies) and spec.data.name == "jsonl"
    assert Path(spec.data.path) == DATA_FILE  # found through ${specdec.repo:...}, not the working directory
    trained, trained_spec = composed("experiment=trained"), composed("experiment=trained_specbench")
    assert list(trained.strategies) == list(trained_spec.strategies) == ["greedy", "draft", "hf_assisted", "medusa",
                                                                         "hydra", "hydra_copy"]
    assert trained.data.name == "default" and Path(trained_spec.data.path) == DATA_FILE
    schedules = composed("experiment=draft_schedules")
    assert list(schedules.strategies) == ["greedy", "draft_fixed", "draft_heuristic", "draft_confidence",
                                          "draft_cost_aware"]
    ran = {s: strategy_config(schedules, s) for s in [*schedules.strategies, "draft_sitout"] if s != "greedy"}
    assert {s.schedule._target_.rsplit(".", 1)[1] for s in ran.values()} == \
        {"FixedLength", "Heuristic", "Confidence", "CostAware", "SitOut"}
    # the same draft as draft_fixed, each under its own schedule
    assert all(s.draft == ran["draft_fixed"].draft for s in ran.values())
    assert ran["draft_cost_aware"].schedule.siblings == 0 and ran["draft_confidence"].schedule.max_gamma == 8
    assert ran["draft_sitout"].schedule.inner._target_.endswith("Confidence")
    reuse = composed("experiment=prefix_cache")
    full = strategy_config(reuse, "greedy_full")
    assert full.prefix_cache is False and {k: v for k, v in full.items() if k not in ("name", "prefix_cache")} == \
        {k: v for k, v in strategy_config(reuse, "greedy").items() if k != "name"}


def test_every_preset_strategy_is_where_the_moved_names_say() -> None:
    # a name taken out of configs/strategy/ is an entry of the preset PRESET_STRATEGIES names, and the
    # error for it elsewhere says so
    for name, preset in PRESET_STRATEGIES.items():
        assert not (CONFIG_DIR / "strategy" / f"{name}.yaml").is_file()
        assert name in composed(f"experiment={preset}").strategy_configs
        with pytest.raises(SpecdecError, match=f"experiment={preset}"):
            check_overrides([f"strategies=[greedy,{name}]"])
        check_overrides([f"experiment={preset}", f"strategies=[greedy,{name}]"])  # known there
    defined = {e for p in PRESETS for e in composed(f"experiment={p}").strategy_configs}
    assert defined == set(PRESET_STRATEGIES)


def test_a_preset_entry_takes_overrides_of_its_own() -> None:
    argv = ["experiment=draft_schedules", "strategies=[greedy,draft,draft_sitout]",
            "strategies.draft_sitout.schedule.probe_every=4"]
    native = native_overrides(argv)
    assert native == [*argv[:2], "strategy_configs.draft_sitout.schedule.probe_every=4"]  # not selected again
    cfg = composed(*native)
    assert strategy_config(cfg, "draft_sitout").schedule.probe_every == 4
    assert strategy_config(cfg, "draft_sitout").schedule.inner.threshold == 0.4


def test_sweep_preset_sweeps_draft_tokens_of_the_composed_strategy() -> None:
    cfg = composed("experiment=sweep_prompt_lookup", hydra=True)
    assert cfg.strategy.name == "prompt_lookup" and "prompt_lookup" in cfg.strategies
    values = str(cfg.hydra.sweeper.params["strategy.num_draft_tokens"]).split(",")
    assert [int(v) for v in values] == [2, 4, 8, 12]
    assert "num_draft_tokens" in cfg.strategy and cfg.strategy.adaptive is False


def test_draft_sweep_preset_sweeps_gamma_of_a_fixed_schedule() -> None:
    cfg = composed("experiment=sweep_draft", hydra=True)
    assert cfg.strategy.name == "draft_fixed" and cfg.strategy.schedule._target_.endswith("FixedLength")
    values = str(cfg.hydra.sweeper.params["strategy.schedule.gamma"]).split(",")
    assert [int(v) for v in values] == [1, 2, 3, 4, 6]


def test_command_line_overrides_win_over_presets() -> None:
    cfg = composed("experiment=headline", "model=tiny-llama", "repeats=1", "generation.max_new_tokens=5")
    assert cfg.model.name == "tiny-llama" and cfg.repeats == 1 and cfg.generation.max_new_tokens == 5


def test_foundation_preset_runs_on_the_tiny_model(tmp_path: Path) -> None:
    cfg = composed("experiment=foundation", "model=tiny-llama", "data.limit=1", "generation.max_new_tokens=3",
                   "repeats=1", "warmup=0", f"output_dir={tmp_path}")
    summary = run(cfg)
    assert summary["baseline"] == "hf_generate"
    assert set(summary["strategies"]) == {"greedy", "hf_generate"}
    assert summary["strategies"]["greedy"]["matches_baseline"] == 1.0  # same weights, same greedy tokens
    assert (tmp_path / "answers.jsonl").is_file()
    assert 50 < summary["peak_rss_mb"] < 100_000  # MB, not KiB or bytes


def test_specbench_style_file() -> None:
    lines = DATA_FILE.read_text(encoding="utf-8").splitlines()
    raw = [json.loads(line) for line in lines]
    assert all(isinstance(r["question_id"], int) for r in raw)
    assert len({r["question_id"] for r in raw}) == len(raw)
    questions = load_jsonl(str(DATA_FILE))
    assert 25 <= len(questions) <= 40
    counts = Counter(q.category for q in questions)
    assert set(counts) == SPEC_BENCH_CATEGORIES
    for group in ("translation", "summarization", "qa", "math_reasoning", "rag"):
        assert 4 <= counts[group] <= 6
    assert 5 <= sum(counts[c] for c in MT_BENCH) <= 16
    for q in questions:
        assert all(0 < len(t) < 1000 for t in q.turns)
        assert len(q.turns) == (2 if q.category in MT_BENCH else 1)


def test_specbench_style_path_resolves_from_another_directory(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PWD", str(tmp_path))
    cfg = composed("experiment=specbench_style")
    assert len(load_jsonl(OmegaConf.to_container(cfg.data, resolve=True)["path"])) == len(load_jsonl(str(DATA_FILE)))


def test_no_launcher_plugin_needed_unless_selected() -> None:
    cfg = composed(hydra=True)
    assert "BasicLauncher" in cfg.hydra.launcher._target_


def _submitit_installed() -> bool:
    try:  # find_spec raises, rather than returning None, when the hydra_plugins namespace is absent
        return importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(not _submitit_installed(), reason="hydra-submitit-launcher is not installed")
def test_slurm_launcher_composes() -> None:
    cfg = composed("hydra/launcher=slurm", "hydra.launcher.partition=gpu", "experiment=sweep_prompt_lookup",
                   hydra=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert launcher.partition == "gpu" and launcher.gpus_per_node == 1 and launcher.timeout_min > 0


def test_chat_heldapart_leaves_out_every_shipped_training_draw() -> None:
    # The file judges drafters on prose they never saw: one prompt of a training draw in it would
    # flatter exactly the drafters it is meant to test (it did, with the 4800 draw, until 2026-12-01).
    spec = importlib.util.spec_from_file_location(
        "chat_heldapart", Path(__file__).resolve().parent.parent / "experiments" / "chat_heldapart.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from heads.instruction_prompts import instruction_prompts

    questions = [q["turns"][0] for q in module.chat_questions()]
    assert len(questions) == 14 and len(set(questions)) == 14
    assert 4800 in module.SHIPPED_DRAWS
    for draw in module.SHIPPED_DRAWS:
        assert not set(questions) & set(instruction_prompts(draw, seed=1)), draw


def test_repetition_counts_repeated_4grams_per_strategy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location(
        "repetition", Path(__file__).resolve().parent.parent / "experiments" / "repetition.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.repeated_share([1, 2, 3, 4, 5, 6]) == 0.0
    assert module.repeated_share([1, 2, 3, 4] * 3) == pytest.approx(1 - 4 / 9)  # 9 grams, 4 distinct
    assert module.repeated_share([1, 2]) == 0.0  # too short for one 4-gram
    rows = [{"strategy": "a", "output_ids": [1, 2, 3, 4] * 3}, {"strategy": "a", "output_ids": [5, 6, 7, 8]},
            {"strategy": "b", "output_ids": [9] * 10}]
    (tmp_path / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    module.main([str(tmp_path)])
    assert f"a {(1 - 4 / 9) / 2:.3f}, b {1 - 1 / 7:.3f}" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="not found"):
        module.main([str(tmp_path / "missing")])


def test_scaling_table_orders_drafters_by_their_training_tokens(tmp_path: Path) -> None:
    script = Path(__file__).parents[1] / "experiments" / "scaling_table.py"
    spec = importlib.util.spec_from_file_location("scaling_table", script)
    assert spec is not None and spec.loader is not None
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    strategies = {"greedy": {"config": {}}}
    for name, tokens in (("big", 900), ("small", 100)):
        folder = tmp_path / "ckpt" / name
        folder.mkdir(parents=True)
        train = {"target_tokens": tokens, "sequences": tokens // 10, "steps": 3, "val/acc": 0.5}
        (folder / "eagle.json").write_text(json.dumps({"train": train}))
        strategies[name] = {"config": {"drafter": {"path": f"ckpt/{name}"}}, "mean_accepted_tokens": tokens / 100,
                            "acceptance_rate": 0.3, "speedup": 1.2, "speedup_ci": [1.1, 1.3]}
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").write_text(json.dumps({"strategies": strategies}))
    rows = table.rows(tmp_path / "run", tmp_path)
    assert [(r["strategy"], r["tokens"], r["tau"]) for r in rows] == [("small", 100, 1.0), ("big", 900, 9.0)]
    assert table.table(tmp_path / "run", tmp_path).splitlines()[2].startswith("| small | 100 | 10 | 3 | 0.500 | 1.00")


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, CONFIG_DIR.parent / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_heldapart_overlap_and_paired_exclude_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # A checkpoint trained on a held-apart question's passage must not be judged on it: the overlap finder
    # names exactly the questions sharing a 13-gram; paired.py drops them (--exclude) or keeps only them (--only).
    passage = " ".join(f"w{i}" for i in range(20))
    questions = [{"question_id": "seen", "category": "qa", "turns": ["intro", f"Summarize: {passage} please"]},
                 {"question_id": "apart", "category": "qa", "turns": [" ".join(f"v{i}" for i in range(20))]},
                 {"question_id": "short", "category": "qa", "turns": ["w0 w1 w2"]}]
    qfile = tmp_path / "q.jsonl"
    qfile.write_text("".join(json.dumps(q) + "\n" for q in questions))
    overlap = _script("heldapart_overlap")
    assert overlap.overlapping([f"Please read {passage[:60]} and {passage}"], qfile) == ["seen"]
    assert overlap.overlapping([" ".join(f"w{i}" for i in range(12))], qfile) == []  # 12 shared words: clean

    # "seen" is where B is slow; leaving it out flips the verdict from A better to a tie.
    rows = [{"question_id": q, "strategy": s, "new_tokens": 100, "wall_time_s": t}
            for q, ta, tb in [("seen", 1.0, 3.0), ("apart", 1.0, 1.0), ("short", 1.0, 1.0)]
            for s, t in (("a", ta), ("b", tb))]
    (tmp_path / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "skip.txt").write_text("# comment\nseen\n")
    paired = _script("paired")
    monkeypatch.setattr("sys.argv", ["paired.py", str(tmp_path), "a", "b"])
    paired.main()
    assert "a / b: 1.667" in capsys.readouterr().out
    monkeypatch.setattr("sys.argv", ["paired.py", str(tmp_path), "a", "b", "--exclude", str(tmp_path / "skip.txt")])
    paired.main()
    assert "a / b: 1.000 [1.000, 1.000] (a tie, 2 answers after --exclude)" in capsys.readouterr().out
    monkeypatch.setattr("sys.argv", ["paired.py", str(tmp_path), "a", "b", "--only", str(tmp_path / "skip.txt")])
    paired.main()
    assert "a / b: 3.000 [3.000, 3.000] (better, 1 answers after --only)" in capsys.readouterr().out
    (tmp_path / "skip.txt").write_text("nowhere\n")
    with pytest.raises(SystemExit, match="not in this run"):
        paired.main()


def test_paired_pools_several_runs_with_one_unit_per_question(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    # Two held-apart runs whose question ids collide ("q0" in both): pooled, A's 4 answers against B's give
    # 400 tokens in 5 s against 400 in 8 s, and the bootstrap draws four units, not the two distinct ids.
    for name, times in (("one", [(1.0, 2.0), (1.0, 2.0)]), ("two", [(1.5, 2.0), (1.5, 2.0)])):
        (tmp_path / name).mkdir()
        rows = [{"question_id": f"q{i}", "strategy": s, "new_tokens": 100, "wall_time_s": t}
                for i, (ta, tb) in enumerate(times) for s, t in (("a", ta), ("b", tb))]
        (tmp_path / name / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    paired = _script("paired")
    monkeypatch.setattr("sys.argv", ["paired.py", str(tmp_path / "one"), str(tmp_path / "two"), "a", "b"])
    paired.main()
    out = capsys.readouterr().out
    assert out.startswith("a / b: 1.600 [1.333, 2.000] (better, pooled over 2 runs)")
    # with ids merged across runs the units would be two pairs of equal questions: [1.6, 1.6] at every draw
    monkeypatch.setattr("sys.argv", ["paired.py", str(tmp_path / "one"), "a", "b"])
    paired.main()
    assert capsys.readouterr().out.startswith("a / b: 2.000 [2.000, 2.000] (better)")
    # the same pair under other names in the second run: one name per run
    rows = [json.loads(line) for line in (tmp_path / "two" / "answers.jsonl").read_text().splitlines()]
    (tmp_path / "two" / "answers.jsonl").write_text("".join(json.dumps(dict(r, strategy=r["strategy"] + "2")) + "\n"
                                                         for r in rows))
    monkeypatch.setattr("sys.argv", ["paired.py", str(tmp_path / "one"), str(tmp_path / "two"), "a,a2", "b,b2"])
    paired.main()
    assert capsys.readouterr().out.startswith("a,a2 / b,b2: 1.600 [1.333, 2.000] (better, pooled over 2 runs)")
    monkeypatch.setattr("sys.argv", ["paired.py", str(tmp_path / "one"), str(tmp_path / "two"), "a,a2,a3", "b"])
    with pytest.raises(SystemExit, match="names 3 strategies for 2 runs"):
        paired.main()
    monkeypatch.setattr("sys.argv", ["paired.py", str(tmp_path / "one"), str(tmp_path / "none"), "a", "b"])
    with pytest.raises(SystemExit, match="none: no answers.jsonl"):
        paired.main()


def test_phase_split_reads_each_questions_phase_from_the_baseline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # Questions q0-q3 ran while a greedy step took 10 ms, q4-q7 while it took 20: A, at 25 ms a round of 2
    # tokens, is 0.8x greedy in the first phase and 1.6x in the second; over all, 8 / 6 of greedy's speed.
    rows = []
    for i in range(8):
        step = 0.010 if i < 4 else 0.020
        rows += [{"question_id": f"q{i}", "strategy": "greedy", "new_tokens": 100, "ttft_s": 0.0,
                  "wall_time_s": 100 * step, "decode_steps": 100, "accept_lengths": [1] * 100},
                 {"question_id": f"q{i}", "strategy": "a", "new_tokens": 100, "ttft_s": 0.0,
                  "wall_time_s": 50 * 0.025, "decode_steps": 50, "accept_lengths": [2] * 50,
                  "draft_time_s": 50 * 0.005}]
    (tmp_path / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "summary.json").write_text(json.dumps({"baseline": "greedy"}))
    script = _script("phase_split")
    monkeypatch.setattr("sys.argv", ["phase_split.py", str(tmp_path), "a"])
    script.main()
    out = capsys.readouterr().out
    assert "split at 15.0 ms (Otsu)" in out and "one state" not in out
    assert "all 8 questions: a / greedy 1.200" in out
    assert ("fast (4 questions, greedy 10.0 ms a step): a / greedy 0.800 [0.800, 0.800], tau 2.00 and 1.00; "
            "a round costs 2.00 + 0.50 (drafting) steps of greedy") in out
    assert "slow (4 questions, greedy 20.0 ms a step): a / greedy 1.600 [1.600, 1.600]" in out
    assert "a round costs 1.00 + 0.25 (drafting)" in out
    monkeypatch.setattr("sys.argv", ["phase_split.py", str(tmp_path), "a", "--split", "25"])
    script.main()
    out = capsys.readouterr().out
    assert "split at 25.0 ms (given)" in out and "fast (8 questions" in out and "slow (" not in out
    monkeypatch.setattr("sys.argv", ["phase_split.py", str(tmp_path), "b"])
    with pytest.raises(SystemExit, match="no answers of b; it holds a, greedy"):
        script.main()
    for r in rows:  # greedy at 10 and 11 ms a step: two groups, one state
        if r["strategy"] == "greedy" and r["wall_time_s"] > 1.5:
            r["wall_time_s"] = 1.1
    (tmp_path / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr("sys.argv", ["phase_split.py", str(tmp_path), "a"])
    script.main()
    assert "the groups' mean step times differ by 10%: one state" in capsys.readouterr().out


def test_phase_split_by_a_third_strategys_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    # Two drafters compared per state, the state read from greedy's steps (10 ms, then 20): a is 0.8x c in the
    # first state and 1.25x in the second; c's own steps (20 ms throughout) hold no state.
    rows = []
    for i in range(8):
        fast = i < 4
        rows += [{"question_id": f"q{i}", "strategy": "greedy", "new_tokens": 100, "ttft_s": 0.0,
                  "wall_time_s": 1.0 if fast else 2.0, "decode_steps": 100, "accept_lengths": [1] * 100},
                 {"question_id": f"q{i}", "strategy": "a", "new_tokens": 100, "ttft_s": 0.0,
                  "wall_time_s": 1.25 if fast else 0.8, "decode_steps": 50, "accept_lengths": [2] * 50,
                  "draft_time_s": 0.1},
                 {"question_id": f"q{i}", "strategy": "c", "new_tokens": 100, "ttft_s": 0.0,
                  "wall_time_s": 1.0, "decode_steps": 50, "accept_lengths": [2] * 50, "draft_time_s": 0.1}]
    (tmp_path / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "summary.json").write_text(json.dumps({"baseline": "greedy"}))
    script = _script("phase_split")
    monkeypatch.setattr("sys.argv", ["phase_split.py", str(tmp_path), "a", "c", "--by", "greedy"])
    script.main()
    out = capsys.readouterr().out
    assert "greedy's step time per question split at 15.0 ms (Otsu)" in out
    assert "fast (4 questions, greedy 10.0 ms a step): a / c 0.800 [0.800, 0.800]" in out
    assert "slow (4 questions, greedy 20.0 ms a step): a / c 1.250 [1.250, 1.250]" in out
    monkeypatch.setattr("sys.argv", ["phase_split.py", str(tmp_path), "a", "c", "--by", "d"])
    with pytest.raises(SystemExit, match="no answers of d"):
        script.main()


def test_row_coverage_counts_the_baselines_tokens_in_the_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({"kept_ids": torch.tensor([1, 2, 3], dtype=torch.int32)}, str(tmp_path / "eagle.safetensors"))
    rows = [{"strategy": "greedy", "category": "qa", "output_ids": [1, 2, 5, 9]},
            {"strategy": "greedy", "category": "code", "output_ids": [3, 3, 4, 0]},
            {"strategy": "eagle", "category": "qa", "output_ids": [7, 7, 7, 7]}]  # not the baseline: not counted
    (tmp_path / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "summary.json").write_text(json.dumps({"baseline": "greedy"}))
    script = _script("row_coverage")
    # rows=5 adds the lowest ids not kept: 0 and 4
    monkeypatch.setattr("sys.argv", ["row_coverage.py", str(tmp_path), str(tmp_path), "--rows", "5", "--vocab", "10"])
    script.main()
    out = capsys.readouterr().out
    assert "8 output tokens in 3 kept rows: 0.500; qa 0.500, code 0.500" in out and "rows=5: 0.750" in out
    monkeypatch.setattr("sys.argv", ["row_coverage.py", str(tmp_path), str(tmp_path / "none")])
    with pytest.raises(SystemExit, match="holds none of"):
        script.main()


def test_row_coverage_counts_the_requests_own_tokens(tmp_path: Path, tiny_target: object) -> None:
    # an answer's tokens: one kept, one from its prompt, then a token twice (the second time it is an earlier one)
    script = _script("row_coverage")
    turns = ["alpha beta gamma", "delta epsilon"]
    (tmp_path / "q.jsonl").write_text(json.dumps({"question_id": "q", "category": "qa", "turns": turns}) + "\n")
    model = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "model" / "tiny-llama.yaml"), resolve=True)
    config = {"model": model, "data": {"path": str(tmp_path / "q.jsonl")}}
    (tmp_path / "summary.json").write_text(json.dumps({"config": config}))
    chat = tiny_target.chat_ids  # type: ignore[attr-defined]
    first = chat([{"role": "user", "content": turns[0]}])
    said = "zeta"
    second = chat([{"role": "user", "content": turns[0]}, {"role": "assistant", "content": said},
                   {"role": "user", "content": turns[1]}])
    kept = next(t for t in range(500, 0, -1) if t not in first + second)
    new = next(t for t in range(400, 500) if t not in first + second + [kept])
    alone = chat([{"role": "user", "content": turns[1]}])
    later = next(t for t in second if t not in first + alone)  # from turn 0's answer, in the second turn's prompt
    rows = [{"question_id": "q", "category": "qa", "turn": 0, "output_ids": [kept, first[-4], new, new],
             "output_text": said},
            {"question_id": "q", "category": "qa", "turn": 1, "output_ids": [later, new, kept, new],
             "output_text": "x"}]
    shares = {c: v for c, *v in script.request_coverage(tmp_path, rows, {kept})}
    assert shares["all"] == [8, 0.25, 0.5, 0.75] and shares["qa"] == shares["all"]


def test_state_curves_takes_each_sizes_median_ratio_and_never_falls() -> None:
    script = _script("state_curves")
    # three timings of one state: a pass over n tokens at 1 + 0.1 (n - 1) of its own one-token pass, but the
    # middle timing's 3-token pass dipped below its 2-token one
    timings = [{n: t1 * (1 + 0.1 * (n - 1)) for n in script.SIZES} for t1 in (0.010, 0.012, 0.014)]
    timings[1][3] = 0.012 * 1.05
    curve = script.state_curve(timings)
    assert len(curve) == len(script.SIZES) and curve[0] == 1.0
    assert curve[1] == pytest.approx(1.1) and curve[2] == pytest.approx(1.2)  # the median ignores the dip
    assert curve[15] == pytest.approx(2.5)
    timings = [{n: 0.01 * (1.0 if n != 4 else 0.9) for n in script.SIZES}] * 3
    assert script.state_curve(timings)[3] == 1.0  # a dip below the size before it is lifted


def test_schedule_calibration_logs_each_strategys_rounds_and_tables_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    script = _script("schedule_calibration")
    # the tiny model drafting for itself under the cost-aware schedule: every drafted token is the target's own
    monkeypatch.setattr("sys.argv", ["schedule_calibration.py"])
    log = tmp_path / "rounds.jsonl"
    script.record(log, ["model=tiny-llama", "data.limit=1", "generation.max_new_tokens=12", "warmup=0",
                        "strategies=[greedy,draft_lm]", "strategies.draft_lm.draft.path=builtin:tiny-llama",
                        "strategies.draft_lm.draft.matmul=torch",
                        "strategies.draft_lm.schedule._target_=specdec.strategies.schedules.CostAware",
                        "~strategies.draft_lm.schedule.gamma",
                        f"hydra.run.dir={tmp_path / 'run'}"])
    rounds = [json.loads(line) for line in log.read_text().splitlines()]
    assert rounds and {r["strategy"] for r in rounds} == {"draft_lm"}  # greedy keeps no schedule
    assert all(r["accepted"] == r["drafted"] >= 1 for r in rounds)
    from specdec.strategies import base, schedules
    assert "record" not in repr(base.SpeculativeStrategy.generate) + repr(schedules.CostAware.update)  # restored
    # tables: two rounds, confidences 0.9 then 0.1 at depth 1-2; the first accepts both, the second none
    log.write_text("".join(json.dumps(r) + "\n" for r in [
        {"strategy": "a", "confidences": [0.9, 0.1], "accepted": 2, "drafted": 2, "siblings": 1, "draft_s": 0.002},
        {"strategy": "a", "confidences": [0.1, 0.9], "accepted": 0, "drafted": 2, "siblings": 0, "draft_s": 0.004}]))
    script.tables(log)
    out = capsys.readouterr().out
    assert "a: 2 rounds, 2.00 chain tokens and 0.50 second choices a round; drafting ms a round by tokens " \
           "drafted: 2: 3.00" in out
    # depth 1: one 0.1 token rejected, one 0.9 accepted; depth 2: the 0.1 token accepted, the 0.9 one untested
    assert "| 1 | 1, 0.10, 0.00 | - | - | - | 1, 0.90, 1.00 |" in out
    assert "| 2 | 1, 0.10, 1.00 | - | - | - | - |" in out
    with gzip.open(tmp_path / "rounds.jsonl.gz", "wt") as f:  # the committed runs keep their rounds compressed
        f.write(log.read_text())
    monkeypatch.setattr("sys.argv", ["schedule_calibration.py", "--tables", str(tmp_path / "rounds.jsonl.gz")])
    script.main()
    assert "| 1 | 1, 0.10, 0.00 | - | - | - | 1, 0.90, 1.00 |" in capsys.readouterr().out
