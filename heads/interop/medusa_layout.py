"""Medusa heads in FasterDecoding's published layout (github.com/FasterDecoding/Medusa) and in vLLM's.

Terms. A *head* k guesses token t + k + 2 from the target's final-norm hidden state of token t: a stack
of `num_layers` residual blocks x + SiLU(W x + b), then an output projection ("lm_head") to the
vocabulary. *Medusa choices* are the tree a decoder verifies: one tuple of top-k ranks per
root-to-node path, the d-th rank read from head d (specdec's `strategy.tree` uses the same tuples).

FasterDecoding's layout (Medusa-1): `config.json` with `medusa_num_heads`, `medusa_num_layers` and
`base_model_name_or_path`, and `medusa_lm_head.safetensors` (or the older `medusa_lm_head.pt`) holding
the state of an `nn.ModuleList` of heads: `{i}.{j}.linear.weight` / `.bias` for block j of head i and
`{i}.{num_layers}.weight` for head i's own full-vocabulary output projection. Medusa-2 checkpoints are
whole models whose head tensors carry a `medusa_head.` prefix; those load too. The upstream loader
notes that some published configs give fewer heads than the weights hold; the weights decide here.

specdec's `MedusaHeads` (heads/medusa.py) computes exactly these heads: the same blocks (with bias) and
either the target's own output head for every head ("shared") or one trained copy per head ("own").
Its `root_input` and `sequential` (Hydra-style) heads read tokens FasterDecoding's heads never see, so
they have no published layout and `export_medusa` refuses them.

vLLM's layout (`vllm/model_executor/models/medusa.py`): `config.json` with `model_type: medusa`,
`num_heads`, `num_hidden_layers`, `hidden_size`, `vocab_size`, `truncated_vocab_size`,
`medusa_fc_bias`, and `model.safetensors` with `blocks.{i}.layers.{j}.weight` / `.bias`,
`lm_heads.{i}.weight` over the kept rows and `token_map` (the kept rows' token ids), which is exactly
specdec's reduced head vocabulary (`kept_ids`). `export_medusa` writes it into `OUT/vllm/`.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from heads.interop.hub import load_first, read_json, resolve_source
from heads.medusa import CONFIG_FILE, MedusaConfig, MedusaHeads, _for_inference, fingerprint, output_weight
from specdec.errors import SpecdecError
from specdec.models.loader import LoadedModel

HEAD_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "medusa_lm_head.bin")
MODEL_FILES = ("model.safetensors", "pytorch_model.bin")  # Medusa-2: heads inside a whole model
CHOICES_FILE = "medusa_choices.json"
VLLM_DIR = "vllm"
_BLOCK = re.compile(r"^(\d+)\.(\d+)\.linear\.(weight|bias)$")
_PROJ = re.compile(r"^(\d+)\.(\d+)\.weight$")


def read_fasterdecoding(folder: Path) -> tuple[dict[str, Any], list[list[tuple[Tensor, Tensor]]], list[Tensor]]:
    """(config, blocks, projections) of the heads in `folder`: blocks[i][j] = (W (D, D), b (D,)) of block j
    of head i, projections[i] the (V, D) output projection of head i; every tensor as stored."""
    cfg_path = folder / "config.json"
    config = read_json(cfg_path) if cfg_path.is_file() else {}
    found = load_first(folder, HEAD_FILES)
    if found is None:
        found = load_first(folder, MODEL_FILES, keep="medusa_head.")
    if found is None or not found[1]:
        raise SpecdecError(f"no Medusa heads in {folder}: expected {HEAD_FILES[0]} (or .pt) in FasterDecoding's "
                           "layout, or a Medusa-2 model with medusa_head.* tensors")
    where, state = found
    state = {k.removeprefix("medusa_head."): v for k, v in state.items()}
    blocks: dict[int, dict[int, dict[str, Tensor]]] = {}
    projs: dict[int, dict[int, Tensor]] = {}
    for key, value in state.items():
        if m := _BLOCK.match(key):
            blocks.setdefault(int(m[1]), {}).setdefault(int(m[2]), {})[m[3]] = value
        elif m := _PROJ.match(key):
            projs.setdefault(int(m[1]), {})[int(m[2])] = value
        else:
            raise SpecdecError(f"{where} has tensor {key!r}, which FasterDecoding's Medusa layout does not name "
                               "({i}.{j}.linear.weight/bias, {i}.{num_layers}.weight); is it a Medusa head file?")
    heads = sorted(projs)
    if heads != list(range(len(heads))) or not heads:
        raise SpecdecError(f"{where}: head output projections {heads} are not numbered 0..K-1; the file is incomplete")
    out_blocks: list[list[tuple[Tensor, Tensor]]] = []
    out_projs: list[Tensor] = []
    layers = max(projs[0])
    for i in heads:
        if list(projs[i]) != [layers]:
            raise SpecdecError(f"{where}: head {i} has output projections at {sorted(projs[i])}, expected one at "
                               f"{layers} (every head the same number of blocks)")
        mine = blocks.get(i, {})
        if sorted(mine) != list(range(layers)) or any(set(b) != {"weight", "bias"} for b in mine.values()):
            raise SpecdecError(f"{where}: head {i} needs blocks 0..{layers - 1}, each with linear.weight and "
                               f"linear.bias; found {sorted(mine)}")
        out_blocks.append([(mine[j]["weight"], mine[j]["bias"]) for j in range(layers)])
        out_projs.append(projs[i][layers])
    extra = sorted(set(blocks) - set(heads))
    if extra:
        raise SpecdecError(f"{where}: blocks for heads {extra} but no output projection for them; the file is "
                           "incomplete")
    said = config.get("medusa_num_layers")
    if said is not None and int(said) != layers:
        raise SpecdecError(f"{cfg_path} says medusa_num_layers={said} but {where} holds {layers} blocks per head")
    said = config.get("medusa_num_heads")
    if said is not None and int(said) > len(heads):
        raise SpecdecError(f"{cfg_path} says medusa_num_heads={said} but {where} holds only {len(heads)} heads")
    return config, out_blocks, out_projs


def read_medusa_choices(source: str | Path, hub: bool = False,
                        revision: str | None = None) -> list[tuple[int, ...]] | None:
    """The tree a checkpoint ships with: `medusa_choices.json` (a list of rank paths, or {"choices": [...]})
    or a `medusa_choices` field of config.json; None when it names none (FasterDecoding keeps its trees in
    code, medusa/model/medusa_choices.py: pass one as strategy.tree)."""
    folder = resolve_source(source, hub, revision)
    data: Any = None
    if (folder / CHOICES_FILE).is_file():
        data = json.loads((folder / CHOICES_FILE).read_text())
        data = data.get("choices") if isinstance(data, dict) else data
    elif (folder / "config.json").is_file():
        data = read_json(folder / "config.json").get("medusa_choices")
    if data is None:
        return None
    try:
        return [tuple(int(r) for r in path) for path in data]
    except (TypeError, ValueError):
        raise SpecdecError(f"the Medusa choices in {folder} are not a list of rank lists such as "
                           "[[0], [0, 0], [1]]") from None


def load_fasterdecoding_heads(target: LoadedModel, path: str, hub: bool = False, revision: str | None = None,
                              weights: str = "fp32", block_weights: str = "fp32", **_unused: Any) -> MedusaHeads:
    """Strategy config entry (`strategy.heads._target_`): Medusa heads in FasterDecoding's layout from the
    folder `path` (or, with hub=true only, the hub id `path`) as specdec `MedusaHeads` for `target`.

    `weights` / `block_weights`: the CPU kernels' copies, as in `heads.medusa.medusa_heads`; the other keys of
    configs/strategy/medusa.yaml (num_heads, ...) are ignored: the checkpoint says what it holds. The heads
    must have been trained for a target of this hidden size and vocabulary (a one-line error otherwise).
    """
    folder = resolve_source(path, hub, revision)
    config, blocks, projs = read_fasterdecoding(folder)
    base = config.get("base_model_name_or_path", "an unnamed base model")
    V, dim = target.vocab_size, target.hidden_size
    shapes = {tuple(p.shape) for p in projs} | {tuple(w.shape) for b in blocks for w, _ in b}
    if shapes - {(V, dim), (dim, dim)}:
        raise SpecdecError(f"the Medusa heads in {folder} were trained for {base} (tensors of shapes "
                           f"{sorted(shapes)}), not {target.name} (hidden {dim}, vocab {V}); use heads trained for "
                           "this target")
    head = output_weight(target)  # (V, D) float32 on the target's device
    shared = all(torch.equal(p.to(head), head) for p in projs)
    cfg = MedusaConfig(target.name, fingerprint(head), dim, V, len(projs), len(blocks[0]),
                       "shared" if shared else "own")
    heads = MedusaHeads(cfg, head)
    with torch.no_grad():
        for k, stack in enumerate(blocks):
            for j, (w, b) in enumerate(stack):
                heads.blocks[k][j].linear.weight.copy_(w)
                heads.blocks[k][j].linear.bias.copy_(b)
        if not shared:
            heads.proj.copy_(torch.stack([p.to(head) for p in projs]))  # (K, V, D)
    return _for_inference(heads, target, weights, block_weights)


def check_exportable(cfg: MedusaConfig, where: str = "these") -> None:
    """A one-line SpecdecError unless heads of config `cfg` have a published layout (independent heads)."""
    if cfg.sequential or cfg.root_input:
        kind = "sequential (Hydra-style)" if cfg.sequential else "root-input"
        raise SpecdecError(f"{where} are {kind} Medusa heads: they read the tree's tokens, which FasterDecoding's and "
                           "vLLM's heads never see, so no published layout computes them; train independent heads "
                           "(head.sequential=false head.root_input=false) to export")


def _full_rows(heads: MedusaHeads, target_head: Tensor, k: int) -> Tensor:
    """(V, D) float32 output projection of head k over the whole vocabulary: the target's own rows where
    specdec's head keeps none (specdec gives those tokens no score at all; see docs/interop.md)."""
    if heads.proj.ndim == 2:  # shared: the kept rows are the target's rows
        return target_head.float().cpu().clone()
    full = target_head.float().cpu().clone()
    full[heads.kept_ids.cpu()] = heads.proj[k].detach().float().cpu()
    return full


def export_medusa(heads: MedusaHeads, target_head: Tensor, out: str | Path, base_model: str,
                  choices: list[tuple[int, ...]] | None = None, dtype: torch.dtype = torch.float16,
                  with_pt: bool = False, meta: dict[str, Any] | None = None) -> Path:
    """Write independent `heads` (and the target's (V, D) output head `target_head`) in FasterDecoding's
    layout to `out`, vLLM's to `out/vllm`, and `choices` (a tree) to `out/medusa_choices.json`.

    `base_model`: what the config names as `base_model_name_or_path` (a hub id or a folder).
    `with_pt`: also write `medusa_lm_head.pt` (FasterDecoding's current loader looks for that name).
    """
    cfg = heads.cfg
    check_exportable(cfg)
    out_dir = Path(out)
    (out_dir / VLLM_DIR).mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    K, L = cfg.num_heads, cfg.num_layers
    fd: dict[str, Tensor] = {}
    vl: dict[str, Tensor] = {}
    for k in range(K):
        for j in range(L):
            lin = heads.blocks[k][j].linear
            w, b = lin.weight.detach().cpu().to(dtype).contiguous(), lin.bias.detach().cpu().to(dtype).contiguous()
            fd[f"{k}.{j}.linear.weight"], fd[f"{k}.{j}.linear.bias"] = w, b
            vl[f"blocks.{k}.layers.{j}.weight"], vl[f"blocks.{k}.layers.{j}.bias"] = w.clone(), b.clone()
        fd[f"{k}.{L}.weight"] = _full_rows(heads, target_head, k).to(dtype).contiguous()
    shared = heads.proj.ndim == 2
    for k in range(1 if shared else K):
        vl[f"lm_heads.{k}.weight"] = (heads.proj if shared else heads.proj[k]).detach().cpu().to(dtype).contiguous()
    kept = len(heads.kept_ids)
    if kept < cfg.vocab_size:
        vl["token_map"] = heads.kept_ids.detach().cpu().long().contiguous()
    save_file(fd, str(out_dir / HEAD_FILES[0]), metadata={"format": "pt"})
    if with_pt:
        torch.save(fd, out_dir / HEAD_FILES[1])
    provenance = {"exported_by": "specdec heads.export", "specdec_config": asdict(cfg), "meta": meta or {}}
    (out_dir / "config.json").write_text(json.dumps({
        "medusa_num_heads": K, "medusa_num_layers": L, "base_model_name_or_path": base_model,
        "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size, "specdec": provenance}, indent=2, default=str))
    save_file(vl, str(out_dir / VLLM_DIR / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / VLLM_DIR / "config.json").write_text(json.dumps({
        "model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size, "num_heads": K, "num_hidden_layers": L, "truncated_vocab_size": kept,
        "medusa_fc_bias": True, "original_lm_head": shared, "max_paths": 64, "topk": 10,
        "base_model_name_or_path": base_model, "specdec": provenance}, indent=2, default=str))
    if choices:
        (out_dir / CHOICES_FILE).write_text(json.dumps([list(p) for p in choices]))
    return out_dir


def specdec_medusa_config(folder: Path) -> MedusaConfig:
    """The `MedusaConfig` of specdec heads saved in `folder` (medusa.json), read without the target."""
    from dataclasses import fields

    body = read_json(folder / CONFIG_FILE)
    known = {f.name for f in fields(MedusaConfig)}
    try:
        return MedusaConfig(**{k: v for k, v in body["config"].items() if k in known})
    except (KeyError, TypeError) as e:
        raise SpecdecError(f"{folder / CONFIG_FILE} is not a specdec Medusa config ({e}); retrain the heads") from None
