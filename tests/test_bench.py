"""specdec.bench on a tiny model: the measurements are wired up and internally consistent."""

from __future__ import annotations

from hydra import compose, initialize_config_dir

from specdec.bench import bench, to_markdown, weight_bytes
from specdec.cli_checks import CONFIG_DIR
from specdec.models import load_model


def test_weight_bytes_counts_tied_matrices_once() -> None:
    m = load_model("tiny", "builtin:tiny-llama", matmul="torch")
    params = {p.data_ptr(): p.nbytes for p in m.model.parameters()}
    embed = m.model.embed.weight
    # tied: the output head is the embedding, read once per step as the head
    assert m.model.lm_head.weight.data_ptr() == embed.data_ptr()
    assert weight_bytes(m.model) == sum(params.values())


def test_bench_on_tiny_model(tmp_path) -> None:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose("bench", overrides=["model=tiny-llama", "prompts=1", "new_tokens=6", "rounds=1",
                                          "ks=[1,2,4]", "context=16", "reps=2", "strategies=[prompt_lookup,medusa]",
                                          f"output_dir={tmp_path}"])
    r = bench(cfg)
    assert set(r["verification_ms"]) == {1, 2, 4}
    assert r["verification_ratio"][1] == 1.0
    assert all(v > 0 for v in r["verification_ms"].values())
    for s in r["greedy_vs_hf"].values():
        assert s["tokens_per_s"] > 0 and 0 < s["fraction_of_bandwidth"]
    assert r["drafting"]["prompt_lookup"]["step_ms"] > 0
    assert r["memory_bandwidth_gb_per_s"] > 0 and r["peak_rss_mb"] > 0
    text = to_markdown(r)
    assert "| 4 |" in text and "greedy / hf_generate" in text
