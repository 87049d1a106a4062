"""Export specdec's trained heads and drafters in published layouts other tools run.

    python -m heads.export medusa heads/checkpoints/MODEL-medusa --out DIR   # FasterDecoding + vLLM (DIR/vllm)
    python -m heads.export eagle  FOLDER --out DIR                           # EAGLE-1/2 layout (head.layout=eagle1)
    python -m heads.export draft  heads/checkpoints/MODEL-draft --out DIR    # a transformers LlamaForCausalLM
    python -m heads.export eagle3 FOLDER --out DIR --model NAME              # EAGLE-3 layout (re-written)

The target the checkpoint was trained for is loaded (configs/model/NAME.yaml, NAME from the checkpoint
or --model; fp32 on the CPU) because the exports carry its output head and embedding. What each layout
holds, what cannot be exported and why, and the vLLM / SGLang settings: docs/interop.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from specdec.errors import SpecdecError

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# specdec model config name -> the hub id exports name as their base model
HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def load_target(name: str) -> Any:
    """The model of configs/model/NAME.yaml in fp32 on the CPU, its linears on torch (exact references)."""
    from omegaconf import OmegaConf

    from specdec.cli_checks import CONFIG_DIR
    from specdec.models.loader import load_model

    path = CONFIG_DIR / "model" / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in path.parent.glob("*.yaml")))
        raise SpecdecError(f"no model config {name!r} ({known}); pass --model NAME for the checkpoint's target")
    cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    assert isinstance(cfg, dict)
    cfg.pop("_target_", None)
    cfg |= {"dtype": "fp32", "device": "cpu", "matmul": "torch", "compile": False}
    return load_model(**cfg)


def base_model_id(name: str, target: Any, given: str | None) -> str:
    if given:
        return given
    return HUB_IDS.get(name, str(target.folder))


def _meta(folder: Path, name: str) -> dict[str, Any]:
    from heads.interop.hub import read_json

    path = folder / name
    if not path.is_file():
        raise SpecdecError(f"no {name} in {folder}; pass a specdec checkpoint folder (heads/checkpoints/MODEL-KIND)")
    return read_json(path)


def export_medusa_cli(folder: Path, out: Path, model: str | None, base: str | None, dtype: torch.dtype,
                      tree: str | None, with_pt: bool) -> Path:
    from heads.interop.medusa_layout import check_exportable, export_medusa, specdec_medusa_config
    from heads.medusa import head_weight, load_heads

    cfg = specdec_medusa_config(folder)
    check_exportable(cfg, f"the heads in {folder}")  # before loading any model
    name = model or cfg.base_model
    target = load_target(name)
    heads = load_heads(target, folder)
    choices = None
    if tree:
        from specdec.strategies.medusa import load_tree

        choices = load_tree(tree, cfg.num_heads)
    meta = _meta(folder, "medusa.json").get("meta", {})
    return export_medusa(heads, head_weight(target), out, base_model_id(name, target, base), choices, dtype,
                         with_pt, {"source": str(folder), "steps": meta.get("steps")})


def export_eagle_cli(folder: Path, out: Path, model: str | None, base: str | None, dtype: torch.dtype) -> Path:
    from heads.draft_model import target_embedding
    from heads.eagle import load_eagle
    from heads.interop.eagle_layout import SPECDEC_EAGLE_REFUSAL, export_eagle, load_eagle_layout

    if (folder / "eagle.json").is_file():  # specdec's own drafter: exports only when trained as EAGLE-1's network
        meta = _meta(folder, "eagle.json")
        if meta.get("layout", "specdec") != "eagle1":  # before loading any model
            raise SpecdecError(SPECDEC_EAGLE_REFUSAL.format(where=f"in {folder}"))
        model = model or str(meta.get("base_model", ""))
        target = load_target(model)
        net = load_eagle(str(folder)).bind(target)
    else:
        if not model:
            raise SpecdecError("an EAGLE-layout folder does not name specdec's model config; pass --model NAME")
        target = load_target(model)
        net = load_eagle_layout(str(folder)).bind(target)
    return export_eagle(net, out, target_embedding(target), base_model_id(model, target, base), dtype, str(folder))


def export_eagle3_cli(folder: Path, out: Path, model: str | None, base: str | None, dtype: torch.dtype) -> Path:
    """An EAGLE-3 folder loaded for its target and written back (e.g. in another dtype); specdec trains none."""
    from heads.draft_model import target_embedding
    from heads.interop.eagle_layout import PublishedEagle3, export_eagle3, load_eagle_layout

    drafter = load_eagle_layout(str(folder))  # checked before any model loads
    if not isinstance(drafter, PublishedEagle3):
        raise SpecdecError(f"{folder} is not an EAGLE-3 drafter; use python -m heads.export eagle for EAGLE-1/2")
    if not model:
        raise SpecdecError("an EAGLE-3 folder does not name specdec's model config; pass --model NAME")
    target = load_target(model)
    return export_eagle3(drafter.bind(target), out, target_embedding(target), base_model_id(model, target, base), dtype)


def export_draft_cli(folder: Path, out: Path, model: str | None, dtype: torch.dtype | None) -> Path:
    from heads.interop.draft_hf import export_draft

    name = model or str(_meta(folder, "config.json").get("base_model", ""))
    return export_draft(folder, load_target(name), out, dtype)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m heads.export", description=__doc__.split("\n")[0])
    parser.add_argument("kind", choices=("medusa", "eagle", "eagle3", "draft"))
    parser.add_argument("checkpoint", type=Path, help="the checkpoint folder (heads/checkpoints/MODEL-KIND)")
    parser.add_argument("--out", type=Path, required=True, help="folder to write")
    parser.add_argument("--model", default=None, help="specdec model config of the target (default: the checkpoint's)")
    parser.add_argument("--base-model", default=None,
                        help="base model id written into the exported config (default: the target's hub id)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="weights' dtype (default: fp16 for medusa/eagle; for draft the smallest that is exact)")
    parser.add_argument("--tree", default=None,
                        help="medusa: a tree (file, default, chain) written as medusa_choices.json")
    parser.add_argument("--with-pt", action="store_true", help="medusa: also write medusa_lm_head.pt")
    ns = parser.parse_args(argv)
    dtype = DTYPES[ns.dtype] if ns.dtype else None
    try:
        folder = ns.checkpoint.expanduser()
        if not folder.is_dir():
            raise SpecdecError(f"no folder {folder}; pass a checkpoint folder such as heads/checkpoints/smollm2-135m-"
                               f"{ns.kind}")
        if ns.kind == "medusa":
            out = export_medusa_cli(folder, ns.out, ns.model, ns.base_model, dtype or torch.float16, ns.tree,
                                    ns.with_pt)
        elif ns.kind == "eagle3":
            out = export_eagle3_cli(folder, ns.out, ns.model, ns.base_model, dtype or torch.float16)
        elif ns.kind == "eagle":
            out = export_eagle_cli(folder, ns.out, ns.model, ns.base_model, dtype or torch.float16)
        else:
            out = export_draft_cli(folder, ns.out, ns.model, dtype)
    except SpecdecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} (see docs/interop.md for vLLM and SGLang)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
