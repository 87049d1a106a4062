"""summary.json records what ran (CONTRACT.md, "What ran"): per strategy its config, whether its output is
exact and a bootstrap interval for its speedup; per run the machine, the code and the weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from specdec.cli_checks import CONFIG_DIR, strategy_config
from specdec.metrics import lossless
from specdec.provenance import git_state, weights_source
from specdec.report import write_report
from specdec.results import earlier_strategy_configs
from specdec.run import run

CHECK_RESULTS = Path(__file__).resolve().parents[2] / "shared" / "tools" / "check_results.py"
TINY = ["model=tiny-llama", "generation.max_new_tokens=6", "warmup=0", "data.limit=3"]


def compose_run(overrides: list[str]) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose("run", overrides=overrides)


def check_strict(out: Path) -> None:
    if not CHECK_RESULTS.is_file():
        pytest.skip(f"{CHECK_RESULTS} is absent (shared/ is not checked out next to the repo)")
    proc = subprocess.run([sys.executable, str(CHECK_RESULTS), "--strict", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def two_strategies(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("provenance")
    # prompt_lookup is a list entry and also the composed strategy, whose override must reach its config
    cfg = compose_run([*TINY, "strategies=[greedy,prompt_lookup]", "strategy=prompt_lookup",
                       "strategy.num_draft_tokens=3", f"output_dir={out}"])
    run(cfg)
    return out, json.loads((out / "summary.json").read_text())


def test_every_strategy_records_its_config_exactness_and_interval(two_strategies: tuple[Path, dict[str, Any]]) -> None:
    out, summary = two_strategies
    greedy, pl = summary["strategies"]["greedy"], summary["strategies"]["prompt_lookup"]
    assert greedy["config"]["name"] == "greedy" and greedy["config"]["_target_"].endswith("Greedy")
    assert pl["config"]["name"] == "prompt_lookup" and pl["config"]["num_draft_tokens"] == 3  # as it ran
    assert greedy["lossless"] is True and pl["lossless"] is True  # temperature 0
    assert greedy["speedup_ci"] == [1.0, 1.0]
    lo, hi = pl["speedup_ci"]
    assert lo <= pl["speedup"] <= hi
    check_strict(out)


def test_environment_names_device_code_and_weights(two_strategies: tuple[Path, dict[str, Any]]) -> None:
    _, summary = two_strategies
    env = summary["environment"]
    assert env == summary["config"]["environment"]
    assert env["device"] == "cpu" and env["gpu"] is None and env["dtype"] == "float32"
    assert env["compile"] is False and env["matmul"] == "torch"
    # the kernel target is named once this process has compiled CPU kernels (an earlier test may have)
    from specdec.models import cpu_kernels

    assert (env["kernel_target"] is None) == (not getattr(cpu_kernels, "_compiled", None))
    assert isinstance(env["cpu"], str) and env["cpu"]
    commit, dirty = git_state()
    assert env["commit"] == commit and env["dirty"] == dirty
    if commit is not None:  # a git checkout: the full hash and a bool
        assert len(commit) == 40 and isinstance(dirty, bool)
    assert env["weights"] == {"format": "random", "source": "builtin:tiny-llama", "seed": 0}
    (key, curve), = env["pass_cost_curves"].items()  # the one curve prompt lookup's gate sized its drafts by
    assert key.startswith("StaticEngine, ") and curve["1"] == 1.0 and len(curve) >= 16
    assert all(v > 0 for v in curve.values())


def test_report_shows_intervals(two_strategies: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    out, summary = two_strategies
    _, text = write_report([out], tmp_path / "report")
    lo, hi = summary["strategies"]["prompt_lookup"]["speedup_ci"]
    row = next(line for line in text.splitlines() if line.startswith("| prompt_lookup |"))
    assert f"[{lo:.2f}, {hi:.2f}]" in row and "| yes |" in row
    assert str(out) not in text  # no local absolute path
    curve = next(iter(summary["environment"]["pass_cost_curves"].values()))
    assert f"| pass cost at start-up | 2: {curve['2']:.2f}, 4: {curve['4']:.2f}, 8: " in text


def test_the_default_models_weights_name_the_gguf_quantization() -> None:
    w = weights_source({"path": "builtin:smollm2-135m"}, None)  # type: ignore[arg-type]
    assert w["file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert w["quantization"] == "Q4_1" and w["dequantized_to"] == "fp32" and w["format"] == "gguf"


def medusa_config(*overrides: str) -> dict[str, Any]:
    cfg = compose_run(["model=tiny-llama", "strategy=medusa", *overrides])
    out = OmegaConf.to_container(strategy_config(cfg, "medusa"), resolve=True)
    assert isinstance(out, dict)
    return out


def test_typical_acceptance_above_temperature_zero_is_lossy() -> None:
    typical = medusa_config("strategy.acceptance=typical")
    assert lossless(typical, 0.7) is False
    assert lossless(typical, 0.0) is True  # greedy match at temperature 0
    assert lossless(medusa_config("strategy.acceptance=exact"), 0.7) is True
    # a hybrid keeps its drafter's rule, in its `inner` config
    assert lossless({"name": "h", "inner": {"acceptance": "typical"}}, 0.7) is False
    assert lossless({"name": "prompt_lookup"}, 0.7) is True
    assert lossless(None, 0.7) is False  # nothing known: not claimed exact


def test_typical_acceptance_run_is_marked_lossy_in_summary_and_report(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = compose_run([*TINY, "data.limit=2", "strategies=[greedy,medusa]", "strategy=medusa",
                       "strategy.heads.path=null", "strategy.acceptance=typical", "generation.temperature=0.7",
                       f"output_dir={out}"])
    summary = run(cfg)
    assert summary["strategies"]["medusa"]["lossless"] is False
    assert summary["strategies"]["greedy"]["lossless"] is True
    assert summary["strategies"]["medusa"]["config"]["acceptance"] == "typical"
    check_strict(out)
    _, text = write_report([out])
    row = next(line for line in text.splitlines() if line.startswith("| medusa |"))
    assert "no (lossy)" in row and "**Lossy**: medusa" in text


def test_a_resumed_folder_keeps_the_configs_of_earlier_strategies(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run(compose_run([*TINY, "data.limit=1", "strategies=[greedy,prompt_lookup]", f"output_dir={out}"]))
    assert earlier_strategy_configs(out, {"prompt_lookup"})["prompt_lookup"]["num_draft_tokens"] == 7
    summary = run(compose_run([*TINY, "data.limit=1", "strategies=[greedy]", f"output_dir={out}"]))
    assert summary["strategies"]["prompt_lookup"]["config"]["num_draft_tokens"] == 7
    check_strict(out)


def test_paths_inside_the_repository_are_recorded_relative_to_it(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # a run in a worktree or a clone must record the same config as one in the main checkout
    from specdec.export import main as export_main
    from specdec.resolvers import REPO_ROOT

    out = tmp_path / "run"
    run(compose_run([*TINY, "data.limit=1", "strategies=[greedy]", "data=jsonl",
                     "data.path=${specdec.repo:experiments/heldapart/offline_clean.jsonl}", f"output_dir={out}"]))
    text = (out / "summary.json").read_text()
    assert json.loads(text)["config"]["data"]["path"] == "experiments/heldapart/offline_clean.jsonl"
    assert f"{REPO_ROOT}/" not in text and str(out) in text  # paths outside the repository stay whole
    monkeypatch.chdir(tmp_path)  # the export finds the questions file from any working directory
    assert export_main(["specbench", str(out), "--out", str(tmp_path / "sb")]) == 0
    line = json.loads((tmp_path / "sb" / "greedy.jsonl").read_text().splitlines()[0])
    first = json.loads((REPO_ROOT / "experiments/heldapart/offline_clean.jsonl").read_text().splitlines()[0])
    assert line["question_id"] == first["question_id"]
