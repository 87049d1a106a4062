"""Shared fixtures: tiny random models (built once into the user cache) and reference recomputations.

Every reference is computed the slow, obvious way (a fresh engine, one chain forward from an empty
cache, or transformers itself), so the engine's clever paths are checked against plain ones.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from omegaconf import OmegaConf

from specdec.cli_checks import CONFIG_DIR
from specdec.models.loader import LoadedModel, load_model
from specdec.models.tiny import tiny_folder

# Models are tiny but a forward still costs ~1 ms; property tests stay within seconds.
settings.register_profile("specdec", deadline=None, max_examples=25, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.load_profile("specdec")

MODEL_TYPES = ("llama", "qwen2", "mistral")

# Tiny matrices gain nothing from threads, and on a shared 2-core machine torch's spinning OpenMP
# workers made each tiny forward 10-50x slower.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_target() -> LoadedModel:
    """The `model=tiny-llama` config exactly as the CLI would build it."""
    cfg = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "model" / "tiny-llama.yaml"), resolve=True)
    assert isinstance(cfg, dict)
    cfg.pop("_target_")
    return load_model(**cfg)


def _randomize_biases(src: Path, dst: Path, seed: int) -> Path:
    """Copy a tiny model with non-zero attention biases: transformers initialises biases to zero,
    which would let a loader that drops them pass."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    model.save_pretrained(dst, safe_serialization=True)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(f, dst / f.name)
    return dst


@pytest.fixture(scope="session")
def tiny_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """model_type -> folder of a tiny random model of that family (qwen2 with random q/k/v biases)."""
    folders = {t: tiny_folder(model_type=t, seed=1) for t in MODEL_TYPES}
    folders["qwen2"] = _randomize_biases(folders["qwen2"], tmp_path_factory.mktemp("tiny-qwen2-bias"), seed=3)
    return folders


@pytest.fixture(scope="session")
def load_tiny(tiny_folders: dict[str, Path]) -> Callable[..., LoadedModel]:
    cache: dict[tuple[str, str, str], LoadedModel] = {}

    def load(model_type: str, backend: str = "compact", matmul: str = "torch") -> LoadedModel:
        key = (model_type, backend, matmul)
        if key not in cache:
            cache[key] = load_model(f"tiny-{model_type}", str(tiny_folders[model_type]), backend=backend,
                                    matmul=matmul)
        return cache[key]

    return load
