"""`specdec.run` end to end on tiny-llama through Hydra's compose API, the module as a subprocess, and
every config file of every group composing (and building, where that is cheap)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from specdec.cli_checks import (
    CONFIG_DIR,
    ENTRIES,
    check_overrides,
    group_config,
    hydra_error_line,
    native_overrides,
    options,
    strategy_config,
    submitit_installed,
)
from specdec.errors import SpecdecError
from specdec.loggers import NullLogger
from specdec.models.loader import LoadedModel
from specdec.run import build_strategies, generation_params, load_questions, run
from specdec.strategies.base import GenerationParams, Strategy
from specdec.strategies.greedy import Greedy

REPO = Path(__file__).resolve().parents[1]
CHECK_RESULTS = Path(__file__).resolve().parents[2] / "shared" / "tools" / "check_results.py"
TINY = ["model=tiny-llama", "generation.max_new_tokens=8", "warmup=1"]


def compose_run(overrides: list[str]) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose("run", overrides=overrides)


def read_answers(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]


def check_rows(rows: list[dict[str, Any]], max_new: int) -> None:
    """The contract's per-row invariants (CONTRACT.md), asserted here rather than trusted to the tool."""
    for r in rows:
        assert r["new_tokens"] == len(r["output_ids"]) and 1 <= r["new_tokens"] <= max_new
        assert r["prompt_tokens"] > 0 and r["wall_time_s"] > 0 and 0 <= r["ttft_s"] <= r["wall_time_s"]
        if r["strategy"] == "hf_generate":
            assert r["decode_steps"] is None and r["accept_lengths"] is None
        else:
            assert sum(r["accept_lengths"]) == r["new_tokens"]
            assert len(r["accept_lengths"]) == r["decode_steps"] + 1
            assert r["accept_lengths"] == [1] * r["new_tokens"]  # greedy: one token per pass


def run_check_results(out: Path) -> None:
    if not CHECK_RESULTS.is_file():
        pytest.skip(f"{CHECK_RESULTS} is absent (shared/ is not checked out next to the repo)")
    proc = subprocess.run([sys.executable, str(CHECK_RESULTS), str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def greedy_vs_hf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], DictConfig]:
    out = tmp_path_factory.mktemp("run")
    cfg = compose_run([*TINY, "strategies=[greedy,hf_generate]", "data.limit=3", f"output_dir={out}"])
    return out, run(cfg), cfg


def test_run_writes_the_contract(greedy_vs_hf: tuple[Path, dict[str, Any], DictConfig],
                                 tiny_target: LoadedModel) -> None:
    out, summary, _ = greedy_vs_hf
    rows = read_answers(out)
    assert len(rows) == 6 and {r["strategy"] for r in rows} == {"greedy", "hf_generate"}
    check_rows(rows, 8)
    by_key = {(r["strategy"], r["question_id"], r["turn"]): r for r in rows}
    for (name, qid, turn), r in by_key.items():
        assert r["output_text"] == tiny_target.tokenizer.decode(r["output_ids"], skip_special_tokens=True)
        if name == "hf_generate":
            assert r["output_ids"] == by_key[("greedy", qid, turn)]["output_ids"]
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["baseline"] == summary["baseline"] == "greedy"
    assert on_disk["failures"] == {} and on_disk["interrupted"] is False
    for name, s in on_disk["strategies"].items():
        mine = [r for r in rows if r["strategy"] == name]
        tokens, wall = sum(r["new_tokens"] for r in mine), sum(r["wall_time_s"] for r in mine)
        assert s["new_tokens"] == tokens
        assert s["tokens_per_s"] == pytest.approx(tokens / wall)
        assert s["matches_baseline"] == 1.0
    greedy, hf = on_disk["strategies"]["greedy"], on_disk["strategies"]["hf_generate"]
    assert greedy["speedup"] == pytest.approx(1.0) and greedy["mean_accepted_tokens"] == pytest.approx(1.0)
    assert greedy["acceptance_rate"] is None
    assert hf["speedup"] == pytest.approx(hf["tokens_per_s"] / greedy["tokens_per_s"])
    assert on_disk["config"]["model"]["name"] == "tiny-llama"
    env = on_disk["config"]["environment"]  # machines of one kind differ (AMD, Intel): each result names its CPU
    assert isinstance(env["cpu"], str) and env["cpu"]
    if env["matmul"] == "numba":
        from specdec.models import cpu_kernels

        assert env["kernels"] == cpu_kernels.describe()


def test_results_pass_the_shared_checker(greedy_vs_hf: tuple[Path, dict[str, Any], DictConfig]) -> None:
    run_check_results(greedy_vs_hf[0])


def test_multi_turn_jsonl_and_resume(tmp_path: Path, tiny_target: LoadedModel) -> None:
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"question_id": 7, "category": "chat", "turns": ["Say hi.", "Again, louder."]})
                    + "\n")
    out = tmp_path / "out"
    overrides = [*TINY, "strategy=greedy", "data=jsonl", f"data.path={data}", f"output_dir={out}", "warmup=0"]
    run(compose_run(overrides))
    rows = read_answers(out)
    assert [(r["question_id"], r["category"], r["turn"]) for r in rows] == [("7", "chat", 0), ("7", "chat", 1)]
    check_rows(rows, 8)
    # turn 1 is answered with the conversation so far, through the chat template
    history = [{"role": "user", "content": "Say hi."},
               {"role": "assistant", "content": rows[0]["output_text"]},
               {"role": "user", "content": "Again, louder."}]
    assert rows[1]["prompt_tokens"] == len(tiny_target.chat_ids(history))
    # the same command with the same output_dir has nothing left to do and keeps the answers
    before = (out / "answers.jsonl").read_text()
    summary = run(compose_run(overrides))
    assert (out / "answers.jsonl").read_text() == before
    assert summary["strategies"]["greedy"]["new_tokens"] == sum(r["new_tokens"] for r in rows)
    run_check_results(out)


def test_bad_baseline_is_a_clear_error(tmp_path: Path) -> None:
    cfg = compose_run([*TINY, "strategies=[greedy]", "baseline=hf_generate", f"output_dir={tmp_path}"])
    with pytest.raises(SpecdecError, match="baseline=hf_generate is not among"):
        run(cfg)


def _module(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "specdec.run", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=300)


def test_module_entry_point(tmp_path: Path) -> None:
    out = tmp_path / "res"
    proc = _module(["model=tiny-llama", "strategy=greedy", "data.limit=1", "generation.max_new_tokens=4",
                    "warmup=0", f"output_dir={out}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "results:" in proc.stdout and "greedy" in proc.stdout
    rows = read_answers(out)
    assert len(rows) == 1
    check_rows(rows, 4)


@pytest.mark.parametrize(("args", "problem"), [
    (["strategy=no_such_strategy"], "unknown strategy 'no_such_strategy'"),
    (["strategies=[greedy,nope]"], "unknown strategy 'nope'"),
    (["data=jsonl"], "data.path"),
])
def test_bad_input_is_one_line_and_nonzero(args: list[str], problem: str, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # in process: the same main() as `python -m specdec.run`, without paying for a second interpreter
    from specdec.run import main

    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")  # main() sets it for Hydra; restored after the test
    monkeypatch.setattr(sys, "argv", ["specdec.run", "model=tiny-llama", *args, f"output_dir={tmp_path}",
                                      "hydra.output_subdir=null", "hydra/job_logging=disabled"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code not in (0, None)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and problem in err[0], err
    assert not (tmp_path / "answers.jsonl").exists() or not (tmp_path / "answers.jsonl").read_text()


# --- every config file of every group composes; the cheap ones are built ----------------------------

GROUP_FILES = [(g, name) for g in ("model", "strategy", "data", "generation", "logger", "experiment")
               for name in options(g)]


@pytest.fixture(scope="module")
def tiny_jsonl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "q.jsonl"
    rows = [{"question_id": i, "category": "qa", "turns": [f"Question {i}?"]} for i in range(3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _mentions(cfg: DictConfig, text: str) -> bool:
    return text in json.dumps(OmegaConf.to_container(cfg, resolve=True), default=str)


DERIVED = [n for n in options("strategy") if "defaults" in OmegaConf.load(CONFIG_DIR / "strategy" / f"{n}.yaml")]


@pytest.mark.parametrize("name", DERIVED or ["greedy"])
def test_a_strategy_file_over_another_reads_the_same_from_a_list(name: str, tmp_path: Path) -> None:
    # e.g. `defaults: [medusa, _self_]` plus its own keys: listed, with or without an entry of its own, it
    # must be what Hydra composes for strategy=NAME
    alone = compose_run([f"strategy={name}", f"output_dir={tmp_path}"])
    listed = compose_run([f"strategies=[greedy,{name}]", f"output_dir={tmp_path}"])
    entry = compose_run([f"strategies=[greedy,{name}]", f"+strategy@{ENTRIES}.{name}={name}", f"output_dir={tmp_path}"])
    want = strategy_config(alone, name)
    assert strategy_config(listed, name) == want == strategy_config(entry, name)
    assert want.name == name and want._partial_ is True


@pytest.mark.parametrize(("group", "name"), GROUP_FILES, ids=[f"{g}={n}" for g, n in GROUP_FILES])
def test_every_config_composes(group: str, name: str, tiny_jsonl: Path, tiny_target: LoadedModel,
                               tmp_path: Path) -> None:
    overrides = [f"{group}={name}", f"output_dir={tmp_path}"]
    if group != "model" and group != "experiment":
        overrides.append("model=tiny-llama")
    if group == "data" and name in ("jsonl", "hf"):
        overrides.append(f"data.path={tiny_jsonl}")
    cfg = compose_run(overrides)
    if group == "model":
        assert cfg.model._target_ == "specdec.models.load_model" and cfg.model.name == name
        if name == "tiny-llama":
            built = instantiate(cfg.model)
            assert isinstance(built, LoadedModel) and built.backend == "compact"
    elif group == "strategy":
        scfg = strategy_config(cfg, name)
        assert scfg.name == name and scfg._partial_ is True
        if _mentions(scfg, "smollm2"):
            return  # would load the real model; test_real_model covers it
        try:
            built = build_strategies(cfg, tiny_target)[name]
        except SpecdecError as e:  # e.g. a trained checkpoint that tests do not have
            assert "\n" not in str(e) and len(str(e)) < 400
            return
        assert isinstance(built, Strategy) and built.name == name
        # lossless at temperature 0: whatever it drafts, the output is greedy's, with honest counts
        text = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n"
        prompt = tiny_target.chat_ids([{"role": "user", "content": text * 2}])
        params = GenerationParams(12, eos_ids=tiny_target.eos_ids)
        res = built.generate(prompt, params, 0)
        assert res.output_ids == Greedy(tiny_target, "greedy").generate(prompt, params, 0).output_ids
        if res.accept_lengths is not None:
            assert sum(res.accept_lengths) == len(res.output_ids)
            assert len(res.accept_lengths) == res.decode_steps + 1
    elif group == "data":
        questions = load_questions(OmegaConf.merge(cfg.data, {"limit": 2}))
        assert 1 <= len(questions) <= 2 and all(q.turns for q in questions)
        if len(questions) == 2:  # every data config takes data.skip: the draw after the first question
            assert load_questions(OmegaConf.merge(cfg.data, {"skip": 1, "limit": 1})) == questions[1:]
    elif group == "generation":
        params = generation_params(cfg, tiny_target.eos_ids)
        assert params.max_new_tokens == cfg.generation.max_new_tokens and params.eos_ids == tiny_target.eos_ids
        assert params.sampling.temperature == cfg.generation.temperature
    elif group == "logger":
        logger = instantiate(cfg.logger)
        assert isinstance(logger, NullLogger)  # WandbLogger subclasses it; nothing runs until start()
    else:  # experiments are presets: every strategy they name must exist, as a file or an entry of theirs
        names = list(cfg.strategies or []) or [cfg.strategy.name]
        assert all(n in options("strategy") or n in cfg.strategy_configs for n in names)
        assert cfg.baseline is None or cfg.baseline in names
        for entry in cfg.strategy_configs:  # the preset's own variants resolve under their names
            assert strategy_config(cfg, entry).name == entry


# --- listed strategies through Hydra's own composition ------------------------------------------------


def compose_native(argv: list[str], hydra: bool = False) -> DictConfig:
    """Compose as `python -m specdec.run ARGV` does: the shorthand turned into Hydra's spelling first."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose("run", overrides=native_overrides(argv), return_hydra_config=hydra)


def _plain(cfg: DictConfig) -> dict[str, Any]:
    out = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(out, dict)
    return out


def test_shorthand_becomes_hydras_own_spelling() -> None:
    argv = ["strategies=[greedy,draft,draft_fixed]", "strategies.draft_fixed.schedule.gamma=2",
            "strategies.draft.schedule.max_gamma=5", "strategies.draft_fixed.draft.weights=bf16", "-m",
            f"{ENTRIES}.prompt_lookup.ngram_max=2"]
    assert native_overrides(argv) == [
        "strategies=[greedy,draft,draft_fixed]",
        f"+strategy@{ENTRIES}.draft_fixed=draft_fixed", f"{ENTRIES}.draft_fixed.schedule.gamma=2",
        f"+strategy@{ENTRIES}.draft=draft", f"{ENTRIES}.draft.schedule.max_gamma=5",
        f"{ENTRIES}.draft_fixed.draft.weights=bf16", "-m",
        f"+strategy@{ENTRIES}.prompt_lookup=prompt_lookup", f"{ENTRIES}.prompt_lookup.ngram_max=2"]
    # selected already (e.g. under another file): not selected twice
    own = [f"+strategy@{ENTRIES}.g4=draft_fixed", "strategies.g4.schedule.gamma=4"]
    assert native_overrides(own) == [own[0], f"{ENTRIES}.g4.schedule.gamma=4"]
    # what is not a listed strategy's key is left alone
    assert native_overrides(["strategy.gamma=3", "strategies=[a,b]", "strategies.0=greedy"]) == \
        ["strategy.gamma=3", "strategies=[a,b]", "strategies.0=greedy"]


def test_an_override_of_one_listed_strategy_changes_only_that_one(tmp_path: Path) -> None:
    base = ["strategies=[greedy,draft,draft_fixed]", f"output_dir={tmp_path}"]
    plain = compose_run(base)
    before = {n: _plain(strategy_config(plain, n)) for n in ("greedy", "draft", "draft_fixed")}
    assert before["draft_fixed"]["schedule"]["gamma"] == 3
    for argv in ([*base, "strategies.draft_fixed.schedule.gamma=2"],  # the shorthand
                 [*base, f"+strategy@{ENTRIES}.draft_fixed=draft_fixed",  # Hydra's own spelling
                  f"{ENTRIES}.draft_fixed.schedule.gamma=2"]):
        cfg = compose_native(argv)
        after = {n: _plain(strategy_config(cfg, n)) for n in ("greedy", "draft", "draft_fixed")}
        assert after["draft_fixed"]["schedule"]["gamma"] == 2
        after["draft_fixed"]["schedule"]["gamma"] = 3
        assert after == before  # nothing else moved
        assert list(cfg.strategies) == ["greedy", "draft", "draft_fixed"]
    # two entries at once, each with its own keys
    cfg = compose_native([*base, "strategies.draft_fixed.schedule.gamma=2", "strategies.draft.schedule.max_gamma=5"])
    assert strategy_config(cfg, "draft_fixed").schedule.gamma == 2
    assert strategy_config(cfg, "draft").schedule.max_gamma == 5


def test_one_file_twice_under_two_names(tmp_path: Path) -> None:
    argv = ["strategies=[greedy,g2,g4]", f"+strategy@{ENTRIES}.g2=draft_fixed", f"+strategy@{ENTRIES}.g4=draft_fixed",
            "strategies.g2.schedule.gamma=2", "strategies.g4.schedule.gamma=4", f"output_dir={tmp_path}"]
    check_overrides(native_overrides(argv))  # g2 and g4 are not files, but entries
    cfg = compose_native(argv)
    g2, g4 = strategy_config(cfg, "g2"), strategy_config(cfg, "g4")
    assert (g2.name, g2.schedule.gamma, g4.name, g4.schedule.gamma) == ("g2", 2, "g4", 4)
    with pytest.raises(SpecdecError, match="unknown strategy 'g3'"):
        check_overrides(native_overrides([*argv, "strategies=[greedy,g3]"]))


def test_the_strategy_group_still_sets_the_strategy_of_its_name(tmp_path: Path) -> None:
    # a sweep preset sets and sweeps strategy.*: listing the strategy again must not lose those settings
    preset = ["experiment=sweep_prompt_lookup", "strategy.num_draft_tokens=4", f"output_dir={tmp_path}"]
    for extra in ([], ["strategies=[greedy,prompt_lookup,hf_prompt_lookup]"],
                  [f"+strategy@{ENTRIES}.prompt_lookup=prompt_lookup"]):
        scfg = strategy_config(compose_native([*preset, *extra]), "prompt_lookup")
        assert scfg.num_draft_tokens == 4 and scfg.adaptive is False
    both = compose_native([*preset, "strategies.prompt_lookup.ngram_max=2"])
    with pytest.raises(SpecdecError, match="set all of its keys in one of the two"):
        strategy_config(both, "prompt_lookup")


USER_STRATEGY = """# a strategy of the user's, over a shipped one
defaults:
  - prompt_lookup
  - _self_
name: mine
num_draft_tokens: 2
"""


@pytest.fixture
def user_configs(tmp_path: Path) -> Path:
    folder = tmp_path / "user_configs"
    (folder / "strategy").mkdir(parents=True)
    (folder / "strategy" / "mine.yaml").write_text(USER_STRATEGY)
    return folder


def test_user_config_folders_on_the_searchpath(user_configs: Path, tmp_path: Path) -> None:
    searchpath = f"hydra.searchpath=['file://{user_configs}']"
    with pytest.raises(SpecdecError, match="unknown strategy 'mine'"):
        check_overrides(["strategy=mine"])
    for argv in (["strategy=mine"], ["strategies=[greedy,mine]"], [f"+strategy@{ENTRIES}.x=mine"]):
        check_overrides([searchpath, *argv])
    assert "mine" in options("strategy", [f"file://{user_configs}"]) and "mine" not in options("strategy")
    want = {**_plain(group_config("strategy", "prompt_lookup")), "name": "mine", "num_draft_tokens": 2}
    assert _plain(group_config("strategy", "mine", [f"file://{user_configs}"])) == want
    # a single run; a listed one found through the run's searchpath; an entry with a key of its own
    alone = compose_native([searchpath, "strategy=mine", f"output_dir={tmp_path}"])
    assert _plain(strategy_config(alone, "mine")) == want
    listed = compose_native([searchpath, "strategies=[greedy,mine]", f"output_dir={tmp_path}"], hydra=True)
    assert _plain(strategy_config(listed, "mine")) == want
    entry = compose_native([searchpath, "strategies=[greedy,mine]", "strategies.mine.ngram_max=2",
                            f"output_dir={tmp_path}"])
    assert _plain(strategy_config(entry, "mine")) == {**want, "ngram_max": 2}


def _main(args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`python -m specdec.run ARGS` in this process (no second interpreter to pay for); its results folder."""
    from specdec.run import main

    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")  # main() sets it for Hydra; restored after the test
    monkeypatch.setattr(sys, "argv", ["specdec.run", *args, f"output_dir={out}", f"hydra.run.dir={tmp_path / 'run'}",
                                      "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"])
    main()
    return out


def test_listed_strategies_overridden_one_by_one_from_a_user_folder(user_configs: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    out = _main(["model=tiny-llama", "strategies=[greedy,mine,lookahead]", f"hydra.searchpath=['file://{user_configs}']",
                 "strategies.mine.ngram_max=2", "strategies.lookahead.window=3", "data.limit=1",
                 "generation.max_new_tokens=6", "warmup=0"], tmp_path, monkeypatch)
    summary = json.loads((out / "summary.json").read_text())
    ran = {name: s["config"] for name, s in summary["strategies"].items()}
    lookahead = _plain(group_config("strategy", "lookahead"))
    assert ran["lookahead"] == {**OmegaConf.to_container(OmegaConf.create(lookahead), resolve=True), "window": 3}
    assert ran["mine"]["num_draft_tokens"] == 2 and ran["mine"]["ngram_max"] == 2 and ran["mine"]["name"] == "mine"
    assert ran["greedy"]["_target_"].endswith("Greedy")
    assert summary["strategies"]["mine"]["matches_baseline"] == 1.0  # still lossless
    assert summary["config"]["strategies"] == ["greedy", "mine", "lookahead"]
    assert summary["config"][ENTRIES]["lookahead"]["window"] == 3  # a sweep's report finds what differs
    assert {r["strategy"] for r in read_answers(out)} == {"greedy", "mine", "lookahead"}


@pytest.mark.skipif(submitit_installed(), reason="hydra-submitit-launcher is installed")
def test_slurm_launcher_without_its_plugin_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _main(["-m", "hydra/launcher=slurm", "model=tiny-llama"], tmp_path, monkeypatch)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "specdec[slurm]" in err[0] and "hydra/launcher=slurm" in err[0], err
    from hydra.errors import MissingConfigException

    line = hydra_error_line(MissingConfigException("In 'hydra/launcher/slurm': Could not find "
                                                   "'hydra/launcher/submitit_slurm'"), [])
    assert "specdec[slurm]" in line and "\n" not in line
