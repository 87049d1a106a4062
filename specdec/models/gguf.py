"""GGUF files -> a cached Hugging Face folder of safetensors, config and tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from specdec.errors import SpecdecError
from specdec.models.cache import build_folder_atomically, cache_root, sha256_file
from specdec.models.cpu_kernels import release_freed_memory


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize with transformers' GGUF reader once; later loads read plain safetensors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:  # the GGUF reader raises many kinds of errors on damaged files
        detail = " ".join(str(e).split())[:120]
        raise SpecdecError(f"cannot read GGUF file {gguf}: {type(e).__name__}: {detail} "
                           "(truncated or unsupported; delete it and fetch it again)") from e
    # transformers refuses save_pretrained on GGUF-loaded models, so write the parts ourselves.
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "specdec_source.json").write_text(json.dumps({"gguf": gguf.name}))


def cached_gguf_folder(gguf: Path, name: str | None = None, sha256: str | None = None) -> Path:
    """The cache folder for a GGUF file, converting it on first use (keyed by content hash)."""
    if not gguf.is_file():
        raise SpecdecError(f"GGUF file not found: {gguf} (check model.path)")
    with open(gguf, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise SpecdecError(f"{gguf} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); "
                           "check model.path or fetch the file again")
    digest = sha256 or sha256_file(gguf)
    final = cache_root() / "models" / f"{name or gguf.stem}-{digest[:12]}"
    folder = build_folder_atomically(final, lambda tmp: convert_gguf(gguf, tmp))
    release_freed_memory()  # a conversion's model and state dicts, before the model loads
    return folder
