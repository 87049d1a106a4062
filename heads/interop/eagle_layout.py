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

specdec's `EagleNet` (heads/eagle.py) is by default (`head.layout=specdec`) that network with two RMSNorms
more: on layer 0's input and on the output. Loading replaces both with `PassThroughNorm` (the identity), so
the published drafter is computed exactly, on the CPU kernels' fused layer stack too (it skips such norms).
The other way round, a drafter trained with `head.layout=eagle1` has neither norm and exports; one trained
with the two norms matches no published layout: its export is refused with one line (see docs/interop.md).

EAGLE-3 layout: `config.json` (the drafter's LlamaConfig plus `draft_vocab_size`, optionally
`target_hidden_size` and the target layers it reads, `eagle_aux_hidden_state_layer_ids`) and the weights:
`fc.weight` (D, 3 D_target) over three of the target's layers, `midlayer.*` (one decoder layer whose q/k/v
read [input_layernorm(embed); hidden_norm(feature)], 2D wide, plus `post_attention_layernorm` and the MLP),
`norm`, `lm_head` (draft_vocab, D), the maps `d2t` (draft row -> offset to its target id) and `t2d` (target
id -> kept), and optionally `embed_tokens.weight` (else the target's). `load_eagle_layout` reads and checks
every tensor against the config (`read_eagle3`); binding builds heads.eagle3.Eagle3Net, which the EAGLE
strategies run on the target's layer taps (`eagle3_target_layers` says which); `export_eagle3` writes it back.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from heads.draft_model import target_embedding, target_head
from heads.eagle import EagleNet
from heads.interop.hub import load_first, read_json, resolve_source
from specdec.errors import SpecdecError
from specdec.models.llama import Llama, LlamaArgs, PassThroughNorm, rope_inv_freq
from specdec.models.loader import LoadedModel

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_LAYER = re.compile(r"^layers\.(\d+)\.")


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
    args: LlamaArgs | None = None  # the midlayer's shape (n_layers 1, vocab_size the target's)


_MID = "midlayer."


def eagle3_shapes(a: LlamaArgs, target_hidden: int, draft_vocab: int) -> tuple[dict[str, tuple[int, ...]],
                                                                              dict[str, tuple[int, ...]]]:
    """(required, optional) tensor shapes of an EAGLE-3 drafter in SafeAILab's layout."""
    D, FF, q, kv = a.dim, a.hidden_dim, a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    need = {"fc.weight": (D, 3 * target_hidden), "norm.weight": (D,), "lm_head.weight": (draft_vocab, D),
            _MID + "hidden_norm.weight": (D,), _MID + "input_layernorm.weight": (D,),
            _MID + "post_attention_layernorm.weight": (D,),
            _MID + "self_attn.q_proj.weight": (q, 2 * D), _MID + "self_attn.k_proj.weight": (kv, 2 * D),
            _MID + "self_attn.v_proj.weight": (kv, 2 * D), _MID + "self_attn.o_proj.weight": (D, q),
            _MID + "mlp.gate_proj.weight": (FF, D), _MID + "mlp.up_proj.weight": (FF, D),
            _MID + "mlp.down_proj.weight": (D, FF)}
    biases = {_MID + "self_attn.q_proj.bias": (q,), _MID + "self_attn.k_proj.bias": (kv,),
              _MID + "self_attn.v_proj.bias": (kv,)}
    if a.qkv_bias:
        need |= biases
    optional = {"embed_tokens.weight": (a.vocab_size, D), "d2t": (draft_vocab,), "t2d": (a.vocab_size,)}
    return need, optional


def _eagle3_args(config: dict[str, Any], where: Path) -> LlamaArgs:
    from dataclasses import asdict

    args = _llama_args(config, where)
    bias = args.qkv_bias or bool(config.get("attention_bias", False))  # vLLM's name for q/k/v biases
    return LlamaArgs(**(asdict(args) | {"n_layers": 1, "qkv_bias": bias}))


def read_eagle3(config: dict[str, Any], state: dict[str, Tensor], where: Path) -> Eagle3Layout:
    """Check every EAGLE-3 tensor's presence and shape against the config and decode the vocabulary maps."""
    args = _eagle3_args(config, where)
    D, V = args.dim, args.vocab_size
    tD = int(config.get("target_hidden_size") or D)
    dv = int(config.get("draft_vocab_size") or V)
    need, optional = eagle3_shapes(args, tD, dv)
    missing = [k for k in need if k not in state]
    if missing:
        raise SpecdecError(f"{where} lacks EAGLE-3 tensors {missing[:3]}; is it a complete EAGLE-3 drafter? "
                           "Re-download or re-export the folder")
    odd = [k for k in state if k not in need and k not in optional and not k.endswith("rotary_emb.inv_freq")]
    if odd:
        raise SpecdecError(f"{where} holds tensors an EAGLE-3 drafter in SafeAILab's layout does not ({odd[:3]}); "
                           "pass a folder with one `midlayer` (EAGLE-3) or `layers.N` (EAGLE-1/2)")
    for k, v in state.items():
        want = need.get(k) or optional.get(k)
        if want is not None and tuple(v.shape) != want:
            raise SpecdecError(f"{where}: {k} is {tuple(v.shape)} but config.json (hidden {D}, target hidden {tD}, "
                               f"draft vocab {dv}, vocab {V}) makes it {want}; weights and config.json are from "
                               "different drafters: re-download the folder")
    if "d2t" in state:
        ids = torch.arange(dv) + state["d2t"].long()
        if ids.min() < 0 or ids.max() >= V:
            raise SpecdecError(f"{where}: d2t maps draft rows outside the target's vocabulary of {V}")
        if "t2d" in state and not bool(state["t2d"].bool()[ids].all()):
            raise SpecdecError(f"{where}: d2t and t2d disagree on which target ids the drafter keeps")
    else:  # no map: rows are the first target ids
        ids = torch.arange(dv)
    return Eagle3Layout(D, tD, V, ids, args)


def eagle3_target_layers(config: dict[str, Any], n_layers: int, where: Path | str) -> tuple[int, ...]:
    """The target layers whose inputs (the residual stream entering each) an EAGLE-3 drafter reads: config.json's
    `eagle_aux_hidden_state_layer_ids` (vLLM's field: these very indices), else `eagle_config.
    eagle_aux_hidden_state_layer_ids` (SGLang's: layer outputs, so each + 1), else EAGLE-3's default (2, n/2, n-3)."""
    from heads.eagle3 import default_layers

    top = config.get("eagle_aux_hidden_state_layer_ids")
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = [int(i) for i in top] if top else [int(i) + 1 for i in nested] if nested else list(
        default_layers(n_layers))
    if top and nested and sorted(layers) != sorted(int(i) + 1 for i in nested):
        raise SpecdecError(f"{where}/config.json names two sets of target layers (eagle_aux_hidden_state_layer_ids "
                           f"{list(top)}, eagle_config's {list(nested)} + 1); keep the one the drafter was trained on")
    if len(set(layers)) != 3 or min(layers) < 0 or max(layers) >= n_layers:
        fix = (f"set eagle_aux_hidden_state_layer_ids in its config.json to the three layer inputs (0..{n_layers - 1}) "
               "it was trained on" if n_layers >= 3 else "an EAGLE-3 drafter needs a target of at least 3 layers")
        raise SpecdecError(f"{where}: target layers {layers} are not three distinct layers of the target's "
                           f"{n_layers}; {fix}")
    return tuple(sorted(layers))


class _BuiltOncePerTarget:
    """`bind(target)` builds the drafter for `target` on first use and hands back the same one after."""

    def bind(self, target: LoadedModel) -> Any:
        bound: dict[int, Any] = self.__dict__.setdefault("_bound", {})
        if id(target) not in bound:
            bound[id(target)] = self.build(target)
        return bound[id(target)]

    def build(self, target: LoadedModel) -> Any:
        raise NotImplementedError


@dataclass
class PublishedEagle3(_BuiltOncePerTarget):
    """An EAGLE-3 drafter read from its published layout; `bind(target)` builds it (once per target) as a
    heads.eagle3.Eagle3Net, what `strategy=eagle3`'s `drafter` must provide."""

    folder: Path
    config: dict[str, Any]
    state: dict[str, Tensor]
    layout: Eagle3Layout
    weights: str = "fp32"  # the CPU kernels' copy of the matrices: fp32, bf16 or int8 (as PublishedEagle's)

    def build(self, target: LoadedModel) -> Any:
        from heads.eagle3 import Eagle3Net
        from specdec.models.llama import interleave_rows

        where, cfg, st, lay = self.folder, self.config, self.state, self.layout
        a = lay.args
        assert a is not None
        if (lay.target_hidden_size, lay.vocab_size) != (target.hidden_size, target.vocab_size):
            raise SpecdecError(f"the EAGLE-3 drafter in {where} is for a model of hidden {lay.target_hidden_size} and "
                               f"vocab {lay.vocab_size}, not {target.name} (hidden {target.hidden_size}, vocab "
                               f"{target.vocab_size}); use a drafter trained for this target")
        n = int(target.model.args.n_layers if target.backend == "compact" else target.model.config.num_hidden_layers)
        layers = eagle3_target_layers(cfg, n, where)
        f32 = {k: v.float() for k, v in st.items()}
        m = _MID + "self_attn."
        own = {"fc.weight": f32["fc.weight"], "norm.weight": f32["norm.weight"],
               "lm_head.weight": f32["lm_head.weight"],
               "embed.weight": f32.get("embed_tokens.weight", target_embedding(target).detach().float().cpu()),
               "input_norm.weight": f32[_MID + "input_layernorm.weight"],
               "hidden_norm.weight": f32[_MID + "hidden_norm.weight"],
               "mlp_norm.weight": f32[_MID + "post_attention_layernorm.weight"],
               "attn.wo.weight": f32[m + "o_proj.weight"],
               "mlp.w_gate_up.weight": torch.cat([f32[_MID + "mlp.gate_proj.weight"],
                                                  f32[_MID + "mlp.up_proj.weight"]]),
               "mlp.w_down.weight": f32[_MID + "mlp.down_proj.weight"]}
        for kind in ("weight", "bias") if a.qkv_bias else ("weight",):  # q/k rows interleaved for specdec's rope
            own[f"attn.wqkv.{kind}"] = torch.cat([interleave_rows(f32[m + f"q_proj.{kind}"], a.n_heads, a.head_dim),
                                                  interleave_rows(f32[m + f"k_proj.{kind}"], a.n_kv_heads, a.head_dim),
                                                  f32[m + f"v_proj.{kind}"]])
        with torch.device("meta"):
            net = Eagle3Net(a, lay.target_hidden_size, len(lay.draft_ids), layers,
                            bool(cfg.get("norm_before_residual", False)))
        net.load_state_dict({k: v.to(device=target.device, dtype=target.dtype) for k, v in own.items()},
                            strict=True, assign=True)
        net.inv_freq = rope_inv_freq(net.args).to(target.device)  # the meta-device buffer holds no values
        rows = torch.arange(len(lay.draft_ids))
        identity = len(rows) == target.vocab_size and bool((lay.draft_ids == rows).all())
        net.token_ids = None if identity else lay.draft_ids.to(target.device)  # None: rows are target ids
        net.eval().requires_grad_(False)
        if target.matmul != "torch":  # the target's CPU kernels; its 2D-wide layer runs as plain linears
            from specdec.models.cpu_linear import use_matmul

            use_matmul(net, target.matmul, self.weights)
        return net


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
class PublishedEagle(_BuiltOncePerTarget):
    """An EAGLE-1/2 drafter read from its published layout; `bind(target)` builds it (once per target) as a
    specdec EagleNet that computes it exactly, what `strategy=eagle`'s `drafter` must provide."""

    folder: Path
    config: dict[str, Any]
    state: dict[str, Tensor]
    weights: str = "fp32"  # the CPU kernels' copy of the matrices: fp32, bf16 or int8 (heads.eagle.load_eagle)

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
        hf.setdefault("model.layers.0.input_layernorm.weight", torch.ones(D))  # PassThroughNorm's unused weight
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
            net = EagleNet(args, V, "eagle1")  # PassThroughNorm on layer 0's input and the output
        own = {k: v.to(device=target.device, dtype=target.dtype) for k, v in own.items()}
        net.load_state_dict(own, strict=True, assign=True)
        net.inv_freq = rope_inv_freq(args).to(target.device)  # the meta-device buffer holds no values
        net.eval().requires_grad_(False)
        net.token_ids = None  # rows are target ids: the full target head
        if target.matmul != "torch":
            from specdec.models.cpu_linear import use_matmul

            use_matmul(net, target.matmul, self.weights)  # the fused stack skips the PassThroughNorms
        return net


def load_eagle_layout(path: str, hub: bool = False, revision: str | None = None, weights: str = "fp32",
                      **_unused: Any) -> PublishedEagle | PublishedEagle3:
    """Strategy config entry (`strategy.drafter._target_`): the EAGLE-1/2 or EAGLE-3 drafter in the folder
    `path` (or, with hub=true only, the hub id `path`), read and checked; `bind(target)` builds it."""
    folder = resolve_source(path, hub, revision)
    config, state, where = read_eagle(folder)
    if is_eagle3(config, state):  # checked now, built for a target by bind (heads/eagle3.py)
        return PublishedEagle3(folder, config, state, read_eagle3(config, state, where), weights)
    return PublishedEagle(folder, config, state, weights)


SPECDEC_EAGLE_REFUSAL = ("specdec's EAGLE drafter {where} normalises its first block's input and its output "
                         "(RMSNorm, head.layout=specdec), which EAGLE-1/2's layout (and vLLM's and SGLang's EAGLE) "
                         "lacks, so no published layout computes it; retrain it with python -m heads.train "
                         "head=eagle head.layout=eagle1 to export it")


def export_eagle(net: EagleNet, out: str | Path, target_embed: Tensor | None = None, base_model: str = "",
                 dtype: torch.dtype = torch.float16, where: str = "") -> Path:
    """Write `net`, an EagleNet that computes an EAGLE-1/2 drafter (`is_published_shape`; e.g. one loaded
    by `load_eagle_layout`), in EAGLE-1/2's layout: `out/config.json` and `out/model.safetensors`.
    `target_embed`: the target's (V, D) embedding; the drafter's own is written only where it differs."""
    if not is_published_shape(net):
        raise SpecdecError(SPECDEC_EAGLE_REFUSAL.format(where=where or "here"))
    if net.token_ids is not None:
        raise SpecdecError("this EAGLE drafter scores a reduced vocabulary; EAGLE-1/2's layout uses the target's "
                           "whole output head, so it cannot be exported (retrain it with head.layout=eagle1)")
    if net.args.o_bias:
        raise SpecdecError("this EAGLE drafter has an o_proj bias, which EAGLE-1/2's layout lacks; it cannot be "
                           "exported (use a target without one)")

    a: LlamaArgs = net.args
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim

    def cast(t: Tensor) -> Tensor:
        return t.detach().float().cpu().to(dtype).contiguous()

    # fc.bias always, zeros included: SGLang's fc, and EAGLE's without a `bias` field (default true), have one.
    # No `bias` field either: vLLM's and SGLang's Llama layers read `bias: true` as q/k/v/o biases, absent here.
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
        "vocab_size": a.vocab_size, "tie_word_embeddings": False, "initializer_range": 0.02, "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."), "base_model_name_or_path": base_model,
    }
    if a.qkv_bias:
        config["qkv_bias"] = True
    if a.rope_scaling:
        config["rope_scaling"] = dict(a.rope_scaling)
    return _write_folder(out, tensors, config)


def export_eagle3(net: Any, out: str | Path, target_embed: Tensor | None = None, base_model: str = "",
                  dtype: torch.dtype = torch.float16) -> Path:
    """Write `net`, a heads.eagle3.Eagle3Net (e.g. one `load_eagle_layout` built), in SafeAILab's EAGLE-3
    layout: `out/config.json` and `out/model.safetensors`, what vLLM (`eagle3`) and SGLang (`EAGLE3`) load.
    `target_embed`: the target's (V, D) embedding; the drafter's own is written only where it differs."""

    a: LlamaArgs = net.args
    q, kv, V, dv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.vocab_size, net.lm_head.out_features

    def cast(t: Tensor) -> Tensor:
        return t.detach().float().cpu().to(dtype).contiguous()

    m = _MID + "self_attn."
    gate_up = net.mlp.w_gate_up.weight.detach()
    tensors: dict[str, Tensor] = {
        "fc.weight": cast(net.fc.weight), "norm.weight": cast(net.norm.weight),
        "lm_head.weight": cast(net.lm_head.weight),
        _MID + "input_layernorm.weight": cast(net.input_norm.weight),
        _MID + "hidden_norm.weight": cast(net.hidden_norm.weight),
        _MID + "post_attention_layernorm.weight": cast(net.mlp_norm.weight),
        m + "o_proj.weight": cast(net.attn.wo.weight),
        _MID + "mlp.gate_proj.weight": cast(gate_up[:a.hidden_dim]),
        _MID + "mlp.up_proj.weight": cast(gate_up[a.hidden_dim:]),
        _MID + "mlp.down_proj.weight": cast(net.mlp.w_down.weight)}
    for kind in ("weight", "bias") if a.qkv_bias else ("weight",):
        fused = getattr(net.attn.wqkv, kind).detach()
        tensors[m + f"q_proj.{kind}"] = cast(deinterleave_rows(fused[:q], a.n_heads, a.head_dim))
        tensors[m + f"k_proj.{kind}"] = cast(deinterleave_rows(fused[q:q + kv], a.n_kv_heads, a.head_dim))
        tensors[m + f"v_proj.{kind}"] = cast(fused[q + kv:])
    # the vocabulary maps always (EAGLE's and vLLM's code expect them): row r is target id r + d2t[r]
    ids = torch.arange(dv) if net.token_ids is None else net.token_ids.detach().cpu().long()
    tensors["d2t"] = (ids - torch.arange(dv)).contiguous()
    tensors["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill(0, ids, True)
    embed = net.embed.weight.detach().float().cpu()
    if target_embed is None or not torch.equal(embed, target_embed.detach().float().cpu()):
        tensors["embed_tokens.weight"] = cast(embed)
    layers = list(net.target_layers)
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": a.dim, "intermediate_size": a.hidden_dim, "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_kv_heads, "head_dim": a.head_dim, "num_hidden_layers": 1,
        "rms_norm_eps": a.norm_eps, "rope_theta": a.rope_theta, "max_position_embeddings": a.max_position,
        "vocab_size": V, "draft_vocab_size": dv, "target_hidden_size": net.fc.in_features // len(layers),
        "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch."),
        "base_model_name_or_path": base_model,
        # the layers fc reads, for vLLM (layer inputs) and SGLang (layer outputs: one less)
        "eagle_aux_hidden_state_layer_ids": layers,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers], "use_aux_hidden_state": True},
    }
    if a.qkv_bias:
        config["qkv_bias"] = True  # EAGLE's field (vLLM reads `attention_bias` as an o_proj bias too)
    if net.norm_before_residual:
        config["norm_before_residual"] = True
    if a.rope_scaling:
        config["rope_scaling"] = dict(a.rope_scaling)
    return _write_folder(out, tensors, config)


def _write_folder(out: str | Path, tensors: dict[str, Tensor], config: dict[str, Any]) -> Path:
    """model.safetensors + config.json in `out`, as the EAGLE repository, vLLM and SGLang read them."""
    from safetensors.torch import save_file

    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir
