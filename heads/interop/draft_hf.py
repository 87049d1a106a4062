"""specdec's distilled draft (heads/draft_model.py) as a plain transformers causal LM.

Terms. specdec's *draft* is a few decoder layers of the target's shape on the target's frozen token
embedding, a final norm, and the target's output head cut to the `kept_ids` rows (the most frequent
tokens of the distillation data); only layers and norm are saved. Its logits are -inf outside the
kept rows.

The export writes `config.json` of a `LlamaForCausalLM` (or the target family's class) and
`model.safetensors` under transformers' key names, with the target's whole embedding and output head,
plus the target's tokenizer files: `AutoModelForCausalLM.from_pretrained(DIR)` loads it, and vLLM
(`method: draft_model`) and SGLang (`STANDALONE`) can run it. A plain causal LM has no way to give
dropped rows -inf, so it scores every token with the target's head: on the kept ids its logits are
specdec's draft's exactly; elsewhere specdec's draft has -inf and the export the target head's score.
`export_draft` checks the first part on a short sequence and records the check in `specdec_export.json`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from heads.draft_model import (
    CONFIG,
    FORMAT,
    WEIGHTS,
    DraftCheckpoint,
    _config_from_dict,
    check_drafter_meta,
    target_embedding,
    target_head,
)
from heads.interop.hub import read_json
from specdec.errors import SpecdecError
from specdec.models.loader import LoadedModel

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")
CHECK_IDS = [1, 17, 40, 99, 23, 5, 9, 31, 7, 2, 64, 128]


def _draft_logits(target: LoadedModel, folder: Path, ids: list[int]) -> tuple[Tensor, Tensor]:
    """specdec's own draft in `folder` over `ids`: (T, K) logits over its kept rows and the (K,) kept ids."""
    net = DraftCheckpoint(folder, read_json(folder / CONFIG)).bind(target)
    cache = net.new_cache(len(ids) + 1)
    tokens = torch.tensor([ids], device=target.device)
    with torch.no_grad():
        logits, _ = net(tokens, torch.arange(len(ids), device=target.device)[None], cache,
                        cache.attention_mask(None, len(ids)))
    assert net.token_ids is not None
    return logits[0].float().cpu(), net.token_ids.cpu()


def exact_dtype(tensors: list[Tensor]) -> torch.dtype:
    """The smallest of float16, bfloat16, float32 that holds every value of `tensors` exactly."""
    for dt in (torch.float16, torch.bfloat16):
        if all(torch.equal(t.float().to(dt).float(), t.float()) for t in tensors):
            return dt
    return torch.float32


def export_draft(folder: str | Path, target: LoadedModel, out: str | Path, dtype: torch.dtype | None = None,
                 check_ids: list[int] | None = None, atol: float = 1e-3) -> Path:
    """Write the specdec draft saved in `folder` (trained for `target`) to `out` as a transformers model;
    `dtype`: the written weights' (default: the smallest that holds the draft's and the target's tensors
    exactly, `exact_dtype`). Loads the result back and checks its
    logits on the kept ids against specdec's draft over `check_ids` (a one-line error beyond `atol`)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    src = Path(folder)
    if not (src / CONFIG).is_file() or not (src / WEIGHTS).is_file():
        raise SpecdecError(f"no specdec draft in {src} (needs {CONFIG} and {WEIGHTS}); train one with "
                           "python -m heads.train head=draft")
    meta = read_json(src / CONFIG)
    if meta.get("format") != FORMAT:
        raise SpecdecError(f"{src / CONFIG} is not a specdec draft ({FORMAT}); is it already exported?")
    check_drafter_meta(meta, target, f"the draft in {src}", "export it with the target it was trained for (--model)")
    saved = load_file(str(src / WEIGHTS))
    kept = saved.pop("kept_ids").long()
    embed = target_embedding(target).detach().float().cpu()
    head = target_head(target).detach().float().cpu()
    tied = torch.equal(embed, head)
    save_dtype = dtype or exact_dtype([embed, head, *saved.values()])
    cfg = _config_from_dict(meta["hf_config"])
    cfg.tie_word_embeddings = tied
    cfg.vocab_size = embed.shape[0]
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    state = {k: v.float() for k, v in saved.items()} | {"model.embed_tokens.weight": embed}
    if not tied:
        state["lm_head.weight"] = head
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise SpecdecError(f"the draft in {src} does not fit a {cfg.model_type} of {cfg.num_hidden_layers} layers "
                           f"(missing {missing[:2]}, unexpected {unexpected[:2]}); retrain the draft")
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(save_dtype).save_pretrained(out_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (target.folder / name).is_file():
            shutil.copy(target.folder / name, out_dir / name)
    ids = [i % cfg.vocab_size for i in (check_ids or CHECK_IDS)]
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = reloaded(torch.tensor([ids])).logits[0].float()  # (T, V)
    mine, kept_ids = _draft_logits(target, src, ids)
    diff = float((theirs[:, kept_ids] - mine).abs().max())
    scale = float(mine.abs().max()) or 1.0
    if diff > atol * max(1.0, scale):
        fix = "write it with --dtype fp32" if save_dtype != torch.float32 else "do not use it (report this as a bug)"
        raise SpecdecError(f"the exported draft in {out_dir} gives logits {diff:.3g} away from specdec's draft on the "
                           f"kept ids ({str(save_dtype).removeprefix('torch.')} weights); {fix}")
    info: dict[str, Any] = {
        "exported_by": "specdec heads.export draft", "source": str(src), "base_model": meta.get("base_model"),
        "dtype": str(save_dtype).removeprefix("torch."), "kept_ids": kept.tolist(),
        "check": {"ids": ids, "max_abs_logit_diff_on_kept_ids": diff},
        "note": "specdec's draft scores only kept_ids (-inf elsewhere); this model scores every id with the "
                "target's head, identical on kept_ids",
    }
    (out_dir / "specdec_export.json").write_text(json.dumps(info))
    return out_dir
