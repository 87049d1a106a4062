"""EAGLE drafters in SafeAILab's published layouts (github.com/SafeAILab/EAGLE), in and out of specdec.

Terms. The *feature* h_t is the target's final-norm hidden state of token t. An EAGLE drafter reads the
pair (h_t, token x_{t+1}) and guesses h_{t+1}; the target's output head turns the guess into a
distribution over x_{t+2}.

EAGLE-1 / EAGLE-2 layout (the same weights; EAGLE-2 only drafts a dynamic tree with them):
`config.json`, a LlamaConfig of the drafter (`num_hidden_layers` decoder layers of the target's shape,
plus `bias`: whether `fc` has one, default true, and optionally `qkv_bias`), and `pytorch_model.bin` or
`model.safetensors` holding `fc.weight` (D, 2D) / `fc.bias` over [embed(x_{t+1}); h_t], the decoder
layers as `layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `layers.{i}.mlp.{gate,up,down}_proj.weight`,
`layers.{i}.input_layernorm.weight` (none for layer 0: EAGLE skips that norm) and
`layers.{i}.post_attention_layernorm.weight`, and optionally `embed_tokens.weight` (else the target's).
There is no final norm: the last layer's output is the guessed feature, fed to the target's head.

specdec's `EagleNet` (heads/eagle.py) is that network with two RMSNorms more: on layer 0's input and on
the output. Loading replaces both with `PassThroughNorm` (the identity), so the published drafter is
computed exactly; the CPU kernels' fused layer stack, which always normalises, is switched off for it.
The other way round, a drafter specdec trained keeps both norms, which no published layout has: its
export is refused with one line (see docs/interop.md).

EAGLE-3 layout: `fc` (D, 3 D_target) over three of the target's layers, `midlayer.*` (a decoder layer whose
attention reads [input_layernorm(embed); hidden_norm(h)], 2D wide), `norm`, `lm_head` over a reduced draft
vocabulary and the maps `d2t` (draft row -> offset to its target id) and `t2d` (target id -> kept).
specdec's EagleNet reads one final-norm feature through one fc and has no such layer, so `load_eagle_layout`
reads and checks an EAGLE-3 folder (`read_eagle3`) and then refuses it in one line.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from heads.draft_model import target_embedding, target_head
from heads.eagle import EagleNet
from heads.interop.hub import load_first, read_json, resolve_source
from specdec.errors import SpecdecError
from specdec.models.llama import Llama, LlamaArgs, rope_inv_freq
from specdec.models.loader import LoadedModel

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_LAYER = re.compile(r"^layers\.(\d+)\.")


class PassThroughNorm(nn.Module):
    """Stands where specdec's model has an RMSNorm that the published drafter lacks: returns its input.
    Keeps a `weight` of ones (never applied) so code that reads a norm's device, dtype or eps still works."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return x


def is_published_shape(net: EagleNet) -> bool:
    """True when `net` computes an EAGLE-1/2 drafter: no norm on layer 0's input nor on its output."""
    return isinstance(net.norm, PassThroughNorm) and isinstance(net.layers[0].attn_norm, PassThroughNorm)


def deinterleave_rows(w: Tensor, n_heads: int, head_dim: int) -> Tensor:
    """Inverse of specdec.models.llama.interleave_rows: rows [0, D/2, 1, D/2+1, ...] back to [0..D/2, D/2..D]."""
    rest = w.shape[1:]
    return w.reshape(n_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(n_heads * head_dim, *rest)


def read_eagle(folder: Path) -> tuple[dict[str, Any], dict[str, Tensor], Path]:
    """(config, tensors, weights file) of the EAGLE drafter in `folder`."""
    if not (folder / "config.json").is_file():
        raise SpecdecError(f"no config.json in {folder}; an EAGLE drafter folder holds config.json and "
                           "pytorch_model.bin or model.safetensors")
    config = read_json(folder / "config.json")
    found = load_first(folder, WEIGHT_FILES)
    if found is None:
        raise SpecdecError(f"no drafter weights in {folder} (expected {' or '.join(WEIGHT_FILES)})")
    return config, found[1], found[0]


def is_eagle3(config: dict[str, Any], state: dict[str, Tensor]) -> bool:
    return "draft_vocab_size" in config or any(k.startswith("midlayer.") or k in ("d2t", "t2d") for k in state)


@dataclass(frozen=True)
class Eagle3Layout:
    """What an EAGLE-3 folder holds, checked: sizes and the draft vocabulary as target ids."""

    hidden_size: int  # the drafter's width D
    target_hidden_size: int  # width of each of the three target features fc reads
    vocab_size: int  # the target's vocabulary
    draft_ids: Tensor  # (draft_vocab,) target id of each lm_head row: row + d2t[row]


def read_eagle3(config: dict[str, Any], state: dict[str, Tensor], where: Path) -> Eagle3Layout:
    """Check an EAGLE-3 drafter's tensors against its config and decode its vocabulary maps."""
    need = ("fc.weight", "norm.weight", "lm_head.weight", "midlayer.hidden_norm.weight",
            "midlayer.input_layernorm.weight", "midlayer.self_attn.q_proj.weight")
    missing = [k for k in need if k not in state]
    if missing:
        raise SpecdecError(f"{where} lacks EAGLE-3 tensors {missing[:3]}; is it a complete EAGLE-3 drafter?")
    D = int(config["hidden_size"])
    tD = int(config.get("target_hidden_size", D))
    V = int(config["vocab_size"])
    dv = int(config.get("draft_vocab_size", V))
    if tuple(state["fc.weight"].shape) != (D, 3 * tD) or tuple(state["lm_head.weight"].shape) != (dv, D):
        raise SpecdecError(f"{where}: fc {tuple(state['fc.weight'].shape)} and lm_head "
                           f"{tuple(state['lm_head.weight'].shape)} do not fit config.json (hidden {D}, target "
                           f"hidden {tD}, draft vocab {dv})")
    if "d2t" in state:
        ids = torch.arange(dv) + state["d2t"].long()
        if ids.min() < 0 or ids.max() >= V:
            raise SpecdecError(f"{where}: d2t maps draft rows outside the target's vocabulary of {V}")
        if "t2d" in state and not bool(state["t2d"].bool()[ids].all()):
            raise SpecdecError(f"{where}: d2t and t2d disagree on which target ids the drafter keeps")
    else:  # full vocabulary: rows are target ids
        ids = torch.arange(dv)
    return Eagle3Layout(D, tD, V, ids)


EAGLE3_REFUSAL = ("{where} is an EAGLE-3 drafter: it fuses three target layers (fc over 3 x {tD} features) and "
                  "normalises embedding and feature apart before a 2D-wide attention (midlayer), which specdec's "
                  "EagleNet (one final-norm feature through fc([embed; h])) cannot compute; run it with vLLM "
                  "(method eagle3) or SGLang (EAGLE3), or load an EAGLE-1/2 drafter here")


def _llama_args(config: dict[str, Any], where: Path) -> LlamaArgs:
    """The drafter's block shape from its config.json: EAGLE's own Llama layer whatever the base model
    (q/k/v biases only with `qkv_bias`, never an o_proj bias), read field by field as EAGLE's code does."""
    try:
        D, H = int(config["hidden_size"]), int(config["num_attention_heads"])
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
        args = LlamaArgs(
            vocab_size=int(config["vocab_size"]), dim=D, hidden_dim=int(config["intermediate_size"]),
            n_layers=int(config["num_hidden_layers"]), n_heads=H,
            n_kv_heads=int(config.get("num_key_value_heads") or H), head_dim=int(config.get("head_dim") or D // H),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
            max_position=int(config.get("max_position_embeddings", 2048)), tie_embeddings=False,
            qkv_bias=bool(config.get("qkv_bias", False)), o_bias=False,
            rope_scaling=rope if kind == "llama3" else None)
    except (KeyError, TypeError, ValueError) as e:
        raise SpecdecError(f"{where}/config.json lacks or garbles a field of the drafter's layer ({type(e).__name__}: "
                           f"{e}); is it an EAGLE drafter's config?") from None
    if kind not in ("default", "llama3"):
        raise SpecdecError(f"{where}: rope scaling {kind!r} is not implemented in specdec's drafter (default, llama3)")
    return args


@dataclass
class PublishedEagle:
    """An EAGLE-1/2 drafter read from its published layout; `bind(target)` builds it (once per target) as a
    specdec EagleNet that computes it exactly, what `strategy=eagle`'s `drafter` must provide."""

    folder: Path
    config: dict[str, Any]
    state: dict[str, Tensor]
    weights: str = "fp32"  # the CPU kernels' copy of the matrices: fp32, bf16 or int8 (heads.eagle.load_eagle)
    _bound: dict[int, EagleNet] = field(default_factory=dict, repr=False)

    def bind(self, target: LoadedModel) -> EagleNet:
        key = id(target)
        if key not in self._bound:
            self._bound[key] = self.build(target)
        return self._bound[key]

    def build(self, target: LoadedModel) -> EagleNet:
        where, cfg, state = self.folder, self.config, self.state
        D, V = int(cfg.get("hidden_size", -1)), int(cfg.get("vocab_size", -1))
        if (D, V) != (target.hidden_size, target.vocab_size):
            raise SpecdecError(f"the EAGLE drafter in {where} is for a model of hidden {D} and vocab {V}, not "
                               f"{target.name} (hidden {target.hidden_size}, vocab {target.vocab_size}); use a drafter "
                               "trained for this target")
        args = _llama_args(cfg, where)
        layers = sorted({int(m[1]) for k in state if (m := _LAYER.match(k))})
        if layers != list(range(args.n_layers)):
            raise SpecdecError(f"{where} holds decoder layers {layers} but config.json says num_hidden_layers="
                               f"{args.n_layers}")
        known = ("fc.weight", "fc.bias", "embed_tokens.weight")
        odd = [k for k in state if k not in known and not _LAYER.match(k)]
        if odd or "fc.weight" not in state:
            raise SpecdecError(f"{where} is not an EAGLE-1/2 drafter (unexpected {odd[:3]}, fc.weight "
                               f"{'present' if 'fc.weight' in state else 'missing'})")
        f32 = {k: v.float() for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
        hf = {f"model.{k}": v for k, v in f32.items() if _LAYER.match(k)}
        hf.setdefault("model.layers.0.input_layernorm.weight", torch.ones(D))  # replaced by PassThroughNorm below
        hf["model.norm.weight"] = torch.ones(D)  # likewise
        embed = f32.get("embed_tokens.weight", target_embedding(target).detach().float().cpu())
        hf["model.embed_tokens.weight"] = embed
        hf["lm_head.weight"] = target_head(target).detach().float().cpu()
        with torch.device("meta"):
            plain = Llama(args)
        plain.load_hf_state_dict(hf)  # q/k rows interleaved for specdec's rope, q/k/v and gate/up fused
        own = dict(plain.state_dict())
        own["fc.weight"] = f32["fc.weight"]
        own["fc.bias"] = f32.get("fc.bias", torch.zeros(D))  # bias=false drafters: an exact zero
        if tuple(own["fc.weight"].shape) != (D, 2 * D):
            raise SpecdecError(f"{where}: fc.weight is {tuple(own['fc.weight'].shape)}, expected ({D}, {2 * D}) "
                               "over [embedding; feature]")
        with torch.device("meta"):
            net = EagleNet(args, V)
        own = {k: v.to(device=target.device, dtype=target.dtype) for k, v in own.items()}
        net.load_state_dict(own, strict=True, assign=True)
        for holder, name in ((net.layers[0], "attn_norm"), (net, "norm")):
            setattr(holder, name, PassThroughNorm(D, args.norm_eps).to(device=target.device, dtype=target.dtype))
        net.inv_freq = rope_inv_freq(args).to(target.device)  # the meta-device buffer holds no values
        net.eval().requires_grad_(False)
        net.token_ids = None  # rows are target ids: the full target head
        if target.matmul != "torch":
            from specdec.models.cpu_layer import use_layer_by_layer
            from specdec.models.cpu_linear import use_matmul

            use_matmul(net, target.matmul, self.weights)
            use_layer_by_layer(net)  # the fused stack normalises every block's input; layer 0 must not be
        return net


def load_eagle_layout(path: str, hub: bool = False, revision: str | None = None, weights: str = "fp32",
                      **_unused: Any) -> PublishedEagle:
    """Strategy config entry (`strategy.drafter._target_`): the EAGLE-1/2 drafter in the folder `path` (or,
    with hub=true only, the hub id `path`). An EAGLE-3 folder is read, checked and refused in one line."""
    folder = resolve_source(path, hub, revision)
    config, state, where = read_eagle(folder)
    if is_eagle3(config, state):
        layout = read_eagle3(config, state, where)
        raise SpecdecError(EAGLE3_REFUSAL.format(where=folder, tD=layout.target_hidden_size))
    return PublishedEagle(folder, config, state, weights)


SPECDEC_EAGLE_REFUSAL = ("specdec's EAGLE drafter {where} normalises its first block's input and its output "
                         "(RMSNorm); EAGLE-1/2's layout (and vLLM's and SGLang's EAGLE) has neither norm and EAGLE-3 "
                         "reads three target layers, so no published layout computes it; export the draft model "
                         "instead (python -m heads.export draft ...)")


def export_eagle(net: EagleNet, out: str | Path, target_embed: Tensor | None = None, base_model: str = "",
                 dtype: torch.dtype = torch.float16, where: str = "") -> Path:
    """Write `net`, an EagleNet that computes an EAGLE-1/2 drafter (`is_published_shape`; e.g. one loaded
    by `load_eagle_layout`), in EAGLE-1/2's layout: `out/config.json` and `out/model.safetensors`.
    `target_embed`: the target's (V, D) embedding; the drafter's own is written only where it differs."""
    if not is_published_shape(net):
        raise SpecdecError(SPECDEC_EAGLE_REFUSAL.format(where=where or "here"))
    if net.token_ids is not None:
        raise SpecdecError("this EAGLE drafter scores a reduced vocabulary; EAGLE-1/2's layout uses the target's "
                           "whole output head, so it cannot be exported")
    from safetensors.torch import save_file

    a: LlamaArgs = net.args
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim

    def cast(t: Tensor) -> Tensor:
        return t.detach().float().cpu().to(dtype).contiguous()

    # fc.bias always, zeros included: SGLang's and EAGLE's own fc have a bias and would keep a random one
    tensors: dict[str, Tensor] = {"fc.weight": cast(net.fc.weight), "fc.bias": cast(net.fc.bias)}
    for i, block in enumerate(net.layers):
        p = f"layers.{i}."
        kinds = ("weight", "bias") if a.qkv_bias else ("weight",)
        for kind in kinds:
            fused = getattr(block.attn.wqkv, kind).detach()
            tensors[p + f"self_attn.q_proj.{kind}"] = cast(deinterleave_rows(fused[:q], a.n_heads, a.head_dim))
            tensors[p + f"self_attn.k_proj.{kind}"] = cast(deinterleave_rows(fused[q:q + kv], a.n_kv_heads, a.head_dim))
            tensors[p + f"self_attn.v_proj.{kind}"] = cast(fused[q + kv:])
        tensors[p + "self_attn.o_proj.weight"] = cast(block.attn.wo.weight)
        gate_up = block.mlp.w_gate_up.weight.detach()
        tensors[p + "mlp.gate_proj.weight"] = cast(gate_up[:a.hidden_dim])
        tensors[p + "mlp.up_proj.weight"] = cast(gate_up[a.hidden_dim:])
        tensors[p + "mlp.down_proj.weight"] = cast(block.mlp.w_down.weight)
        if i > 0:
            tensors[p + "input_layernorm.weight"] = cast(block.attn_norm.weight)
        tensors[p + "post_attention_layernorm.weight"] = cast(block.mlp_norm.weight)
    embed = net.embed.weight.detach().float().cpu()
    if target_embed is None or not torch.equal(embed, target_embed.detach().float().cpu()):
        tensors["embed_tokens.weight"] = cast(embed)
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": a.dim, "intermediate_size": a.hidden_dim, "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_kv_heads, "head_dim": a.head_dim, "num_hidden_layers": a.n_layers,
        "rms_norm_eps": a.norm_eps, "rope_theta": a.rope_theta, "max_position_embeddings": a.max_position,
        "vocab_size": a.vocab_size, "tie_word_embeddings": False, "bias": True,
        "torch_dtype": str(dtype).removeprefix("torch."), "base_model_name_or_path": base_model,
    }
    if a.qkv_bias:
        config["qkv_bias"] = True
    if a.rope_scaling:
        config["rope_scaling"] = dict(a.rope_scaling)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir
