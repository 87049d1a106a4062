"""Bad input gives one line naming the problem and the fix, and a non-zero exit; a bad question
fails alone. A few checks go through the real CLI (each costs a process start); the rest call
run(cfg) and the checking functions directly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.cli_checks import check_overrides, hydra_error_line
from specdec.errors import SpecdecError
from specdec.models.tiny import tiny_folder
from specdec.run import generation_params, run
from tests.run_helpers import cli, make_cfg, one_error_line, read_answers, write_questions

# --- through the CLI -------------------------------------------------------------------------


def test_cli_missing_data_file(tmp_path: Path) -> None:
    res = cli("data=jsonl", f"data.path={tmp_path / 'nope.jsonl'}", f"output_dir={tmp_path / 'out'}", cwd=tmp_path)
    line = one_error_line(res.stderr)
    assert res.returncode == 2
    assert "data file not found" in line and "nope.jsonl" in line and "data.path" in line
    assert not (tmp_path / "out" / "answers.jsonl").exists()


def test_cli_unknown_strategy_lists_valid_ones(tmp_path: Path) -> None:
    res = cli("strategy=warp_drive", f"output_dir={tmp_path}", cwd=tmp_path)
    line = one_error_line(res.stderr)
    assert res.returncode == 2
    assert "'warp_drive'" in line and "greedy" in line and "hf_generate" in line


def test_cli_negative_max_new_tokens(tmp_path: Path) -> None:
    res = cli("generation.max_new_tokens=-4", f"output_dir={tmp_path}", cwd=tmp_path)
    line = one_error_line(res.stderr)
    assert res.returncode == 2
    assert "generation.max_new_tokens=-4" in line and "at least 1" in line


def test_cli_broken_third_jsonl_line(tmp_path: Path) -> None:
    data = tmp_path / "q.jsonl"
    good = json.dumps({"question_id": 1, "turns": ["hi"]})
    data.write_text(f"{good}\n{json.dumps({'question_id': 2, 'turns': ['yo']})}\n{{\"turns\": [\"x\"\n")
    res = cli("data=jsonl", f"data.path={data}", f"output_dir={tmp_path / 'out'}", cwd=tmp_path)
    line = one_error_line(res.stderr)
    assert res.returncode == 2
    assert "line 3" in line and "not valid JSON" in line
    assert not (tmp_path / "out" / "answers.jsonl").exists()  # reported before generating anything


def test_cli_hydra_unknown_key_is_one_line(tmp_path: Path) -> None:
    res = cli("generation.foo=1", f"output_dir={tmp_path}", cwd=tmp_path)
    line = one_error_line(res.stderr)
    assert res.returncode == 2
    assert "generation.foo" in line and "max_new_tokens" in line and "+generation.foo=1" in line


# --- settings, checked before the model loads ------------------------------------------------


@pytest.mark.parametrize(("override", "words"), [
    ("generation.temperature=-0.5", ["generation.temperature", "negative"]),
    ("generation.top_p=0", ["generation.top_p", "(0, 1]"]),
    ("generation.top_p=1.5", ["generation.top_p", "(0, 1]"]),
    ("generation.max_new_tokens=0", ["generation.max_new_tokens=0", "at least 1"]),
    ("generation.max_new_tokens=abc", ["generation.max_new_tokens='abc'", "not an integer"]),
    ("generation.temperature=warm", ["generation.temperature='warm'", "not a number"]),
    ("generation.stop=[1]", ["generation.stop", "strings"]),
])
def test_bad_generation_settings(tmp_path: Path, override: str, words: list[str]) -> None:
    cfg = make_cfg(tmp_path, override)
    with pytest.raises(SpecdecError) as err:
        generation_params(cfg)
    assert all(w in str(err.value) for w in words), str(err.value)
    assert "\n" not in str(err.value)


def test_bad_settings_fail_before_the_model_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_loading(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.setattr("specdec.models.load_model", no_loading)
    for override in ("generation.temperature=-1", "data=jsonl"):
        with pytest.raises(SpecdecError):
            run(make_cfg(tmp_path, override))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "turns": ["a"]}\n{"question_id": 2}\n')
    with pytest.raises(SpecdecError, match=r"line 2: no \"turns\""):
        run(make_cfg(tmp_path, "data=jsonl", f"data.path={bad}"))


@pytest.mark.parametrize(("override", "words"), [
    ("model=gpt-17", ["unknown model 'gpt-17'", "tiny-llama", "smollm2-135m"]),
    ("data=imaginary", ["unknown data 'imaginary'", "default", "jsonl"]),
    ("strategy=nope", ["unknown strategy 'nope'", "greedy"]),
    ("strategies=[greedy,nope]", ["unknown strategy 'nope'", "greedy"]),
])
def test_unknown_names_list_the_valid_ones(override: str, words: list[str]) -> None:
    with pytest.raises(SpecdecError) as err:
        check_overrides([override])
    assert all(w in str(err.value) for w in words), str(err.value)


def test_hydra_parse_error_names_the_override() -> None:
    from hydra.errors import OverrideParseException

    exc = OverrideParseException(override="x", message="no viable alternative at input '['\nSee https://x")
    line = hydra_error_line(exc, ["model=tiny-llama", "generation.max_new_tokens=["])
    assert "\n" not in line and "'generation.max_new_tokens=['" in line


# --- a question that cannot be answered fails alone --------------------------------------------


def test_prompt_longer_than_the_cache_fails_that_question_only(tmp_path: Path) -> None:
    data = write_questions(tmp_path / "q.jsonl", 3, long=400)  # q1 is far longer than max_len=128
    out = tmp_path / "out"
    with pytest.raises(SpecdecError) as err:
        run(make_cfg(out, "data=jsonl", f"data.path={data}", "generation.max_len=128"))
    message = str(err.value)
    assert "1 questions failed" in message and "greedy/q1" in message and "\n" not in message
    assert sorted(r["question_id"] for r in read_answers(out)) == ["q0", "q2"]
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["failures"]) == ["greedy/q1"]
    assert "does not fit the cache of 128" in summary["failures"]["greedy/q1"]


def test_prompt_longer_than_the_model_context_fails(tmp_path: Path) -> None:
    data = write_questions(tmp_path / "q.jsonl", 2, long=120)
    out = tmp_path / "out"
    # a model trained for 64 positions, with a cache large enough that only the context check can fire
    with pytest.raises(SpecdecError, match="greedy/q1"):
        run(make_cfg(out, "data=jsonl", f"data.path={data}", "+model.tiny.max_position_embeddings=64"))
    summary = json.loads((out / "summary.json").read_text())
    assert "context of 64" in summary["failures"]["greedy/q1"]
    assert [r["question_id"] for r in read_answers(out)] == ["q0"]


def test_nan_weights_fail_every_question_with_a_clear_error(tmp_path: Path) -> None:
    src = tiny_folder()
    broken = tmp_path / "nan-model"
    shutil.copytree(src, broken)
    state = load_file(str(broken / "model.safetensors"))
    state = {k: torch.full_like(v, float("nan")) if "layers.1.mlp" in k else v for k, v in state.items()}
    save_file(state, str(broken / "model.safetensors"), metadata={"format": "pt"})
    data = write_questions(tmp_path / "q.jsonl", 2)
    out = tmp_path / "out"
    with pytest.raises(SpecdecError, match="2 questions failed"):
        run(make_cfg(out, "model=custom", f"model.path={broken}", "model.device=cpu", "model.matmul=torch",
                     "data=jsonl", f"data.path={data}", "warmup=1"))
    failures = json.loads((out / "summary.json").read_text())["failures"]
    assert sorted(failures) == ["greedy/q0", "greedy/q1"]
    assert all("NaN or inf logits" in m for m in failures.values())
    assert read_answers(out) == []


def test_debug_true_shows_the_traceback(tmp_path: Path) -> None:
    res = cli("generation.foo=1", "debug=true", f"output_dir={tmp_path}", cwd=tmp_path)
    assert res.returncode != 0
    assert "Traceback" in res.stderr and "generation.foo" in res.stderr


def test_a_failed_multirun_job_lets_the_sweep_go_on(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    import specdec.run as runner

    monkeypatch.setattr(runner, "_in_multirun", lambda: True)
    with pytest.raises(runner.JobFailed) as failed:
        runner._fail("bad setting", runner.EXIT_USER)
    assert failed.value.code == 2
    with pytest.raises(SystemExit) as stopped:  # Ctrl-C stops the whole sweep
        runner._fail("interrupted", runner.EXIT_INTERRUPTED)
    assert stopped.value.code == 130
    monkeypatch.setattr(runner, "_in_multirun", lambda: False)
    with pytest.raises(SystemExit) as single:
        runner._fail("bad setting", runner.EXIT_USER)
    assert single.value.code == 2
    assert capsys.readouterr().err.splitlines() == ["error: bad setting", "error: interrupted", "error: bad setting"]
