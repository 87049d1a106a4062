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

from specdec.cli_checks import CONFIG_DIR, options, strategy_config
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


def test_a_strategy_file_over_another_reads_the_same_from_a_list(tmp_path: Path) -> None:
    # medusa_heads.yaml is `defaults: [medusa, _self_]` plus its own keys: a run that lists it must see
    # what Hydra composes for strategy=medusa_heads
    alone = compose_run(["strategy=medusa_heads", f"output_dir={tmp_path}"])
    listed = compose_run(["strategies=[greedy,medusa_heads]", f"output_dir={tmp_path}"])
    assert "defaults" in OmegaConf.load(CONFIG_DIR / "strategy" / "medusa_heads.yaml")
    got, want = strategy_config(listed, "medusa_heads"), strategy_config(alone, "medusa_heads")
    assert got == want and got.copy_tokens == 0 and got.name == "medusa_heads"
    assert got.heads == strategy_config(listed, "medusa").heads  # the rest is medusa's


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
    elif group == "generation":
        params = generation_params(cfg, tiny_target.eos_ids)
        assert params.max_new_tokens == cfg.generation.max_new_tokens and params.eos_ids == tiny_target.eos_ids
        assert params.sampling.temperature == cfg.generation.temperature
    elif group == "logger":
        logger = instantiate(cfg.logger)
        assert isinstance(logger, NullLogger)  # WandbLogger subclasses it; nothing runs until start()
    else:  # experiments are presets: every strategy they name must exist
        names = list(cfg.strategies or []) or [cfg.strategy.name]
        assert all(n in options("strategy") for n in names)
        assert cfg.baseline is None or cfg.baseline in names
