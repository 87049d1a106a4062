"""Checkpoints in and out (heads/interop, heads/export.py): published layouts built tiny on tiny-llama,
loaded and checked against a direct computation, exported and re-imported with the same outputs."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import rand, reference_attention, rms, write_checkpoint
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from torch import Tensor

from heads.draft_model import DraftCheckpoint, DraftTrainable, target_embedding, target_head
from heads.eagle import EagleTrainable, load_eagle
from heads.export import main as export_main
from heads.interop.draft_hf import export_draft
from heads.interop.eagle_layout import export_eagle, load_eagle_layout, read_eagle, read_eagle3
from heads.interop.hub import load_tensors, resolve_source
from heads.interop.medusa_layout import export_medusa, load_fasterdecoding_heads, read_medusa_choices
from heads.medusa import head_weight, medusa_heads
from specdec.cli_checks import CONFIG_DIR, group_config
from specdec.errors import SpecdecError
from specdec.models.loader import LoadedModel, load_model
from specdec.strategies.base import GenerationParams
from specdec.strategies.eagle import EagleStrategy
from specdec.strategies.greedy import Greedy
from specdec.strategies.schedules import FixedLength

REPO = Path(__file__).resolve().parent.parent
PROMPT = [1, 17, 40, 99, 23, 17, 40, 99, 23, 5]


def greedy_ids(target: LoadedModel, prompt: list[int], n: int) -> list[int]:
    return Greedy(target, "greedy", 512, 64).generate(prompt, GenerationParams(n), 0).output_ids


# --------------------------------------------------------------------------------------------------
# Medusa: FasterDecoding's layout
# --------------------------------------------------------------------------------------------------


def fasterdecoding_folder(out: Path, target: LoadedModel, heads: int = 3, layers: int = 2, own: bool = True,
                          file: str = "medusa_lm_head.safetensors", prefix: str = "",
                          config: dict[str, Any] | None = None) -> dict[str, Tensor]:
    """Heads as FasterDecoding's trainer saves them (an nn.ModuleList's state dict), random weights."""
    D = target.hidden_size
    state: dict[str, Tensor] = {}
    for i in range(heads):
        for j in range(layers):
            state[f"{prefix}{i}.{j}.linear.weight"] = rand(D, D, seed=10 * i + j, scale=0.3 / math.sqrt(D))
            state[f"{prefix}{i}.{j}.linear.bias"] = rand(D, seed=100 + 10 * i + j, scale=0.1)
        base = head_weight(target).float().clone()
        state[f"{prefix}{i}.{layers}.weight"] = base + rand(*base.shape, seed=200 + i, scale=0.05) if own else base
    body = {"medusa_num_heads": heads, "medusa_num_layers": layers, "base_model_name_or_path": "tiny-llama",
            "transformers_version": "4.35.0"} | (config or {})
    write_checkpoint(out, state, body, file)
    return {k.removeprefix(prefix): v for k, v in state.items()}


def fasterdecoding_logits(state: dict[str, Tensor], hidden: Tensor, heads: int, layers: int) -> Tensor:
    """Medusa-1's forward written out: (..., D) -> (..., K, V)."""
    outs = []
    for i in range(heads):
        x = hidden
        for j in range(layers):
            x = x + F.silu(x @ state[f"{i}.{j}.linear.weight"].t() + state[f"{i}.{j}.linear.bias"])
        outs.append(x @ state[f"{i}.{layers}.weight"].t())
    return torch.stack(outs, -2)


@pytest.mark.parametrize("own,file", [(True, "medusa_lm_head.safetensors"), (False, "medusa_lm_head.pt")])
def test_fasterdecoding_heads_compute_the_published_heads(tiny_target: LoadedModel, tmp_path: Path, own: bool,
                                                          file: str) -> None:
    state = fasterdecoding_folder(tmp_path, tiny_target, own=own, file=file)
    heads = load_fasterdecoding_heads(tiny_target, str(tmp_path))
    assert heads.cfg.projection == ("own" if own else "shared") and heads.num_heads == 3 and heads.cfg.num_layers == 2
    assert not heads.cfg.sequential and not heads.reads_root
    hidden = rand(5, tiny_target.hidden_size, seed=7)
    with torch.no_grad():
        torch.testing.assert_close(heads(hidden), fasterdecoding_logits(state, hidden, 3, 2), atol=1e-5, rtol=1e-5)
        ref = fasterdecoding_logits(state, hidden[0], 3, 2)
    assert torch.equal(heads.topk(hidden[0], 4), ref.topk(4, dim=-1).indices)  # full-vocabulary ids


def test_medusa2_model_and_config_checks(tiny_target: LoadedModel, tmp_path: Path) -> None:
    # Medusa-2: the heads inside a whole model under medusa_head.*; other tensors are not read
    state = fasterdecoding_folder(tmp_path / "m2", tiny_target, heads=2, layers=1, file="model.safetensors",
                                  prefix="medusa_head.")
    whole = load_file(str(tmp_path / "m2" / "model.safetensors")) | {"model.norm.weight": torch.ones(64)}
    save_file(whole, str(tmp_path / "m2" / "model.safetensors"))
    heads = load_fasterdecoding_heads(tiny_target, str(tmp_path / "m2"))
    hidden = rand(3, tiny_target.hidden_size, seed=8)
    with torch.no_grad():
        torch.testing.assert_close(heads(hidden), fasterdecoding_logits(state, hidden, 2, 1), atol=1e-5, rtol=1e-5)
    # the upstream configs may name fewer heads than the weights hold: the weights decide
    fasterdecoding_folder(tmp_path / "few", tiny_target, heads=3, layers=1, config={"medusa_num_heads": 2})
    assert load_fasterdecoding_heads(tiny_target, str(tmp_path / "few")).num_heads == 3
    fasterdecoding_folder(tmp_path / "lay", tiny_target, heads=2, layers=1, config={"medusa_num_layers": 2})
    with pytest.raises(SpecdecError, match="medusa_num_layers=2 but"):
        load_fasterdecoding_heads(tiny_target, str(tmp_path / "lay"))
    other = load_model("tiny-wide", "builtin:tiny-llama", matmul="torch", tiny={"hidden_size": 32})
    fasterdecoding_folder(tmp_path / "wide", other, heads=2, layers=1)
    with pytest.raises(SpecdecError, match="not tiny-llama"):
        load_fasterdecoding_heads(tiny_target, str(tmp_path / "wide"))
    with pytest.raises(SpecdecError, match="no Medusa heads"):
        load_fasterdecoding_heads(tiny_target, str(tmp_path))


def test_published_medusa_heads_run_in_the_strategy(tiny_target: LoadedModel, tmp_path: Path) -> None:
    from hydra.utils import instantiate

    fasterdecoding_folder(tmp_path, tiny_target, heads=3, layers=1, own=True)
    scfg = OmegaConf.load(CONFIG_DIR / "strategy" / "medusa.yaml")
    scfg.heads._target_ = "heads.interop.medusa_layout.load_fasterdecoding_heads"
    scfg.heads.path = str(tmp_path)
    scfg.tree = "default"
    medusa = instantiate(scfg)(target=tiny_target, max_len=256, prefill_chunk=64)
    assert medusa.heads.num_heads == 3
    assert medusa.generate(PROMPT, GenerationParams(20), 0).output_ids == greedy_ids(tiny_target, PROMPT, 20)


@pytest.mark.parametrize("projection,head_vocab", [("shared", None), ("own", 100)])
def test_medusa_export_round_trips(tiny_target: LoadedModel, tmp_path: Path, projection: str,
                                   head_vocab: int | None) -> None:
    heads = medusa_heads(tiny_target, num_heads=3, num_layers=2, projection=projection, head_vocab=head_vocab,
                         seed=4)
    if projection == "own":  # trained copies differ from the target's rows
        with torch.no_grad():
            heads.proj.add_(rand(*heads.proj.shape, seed=6, scale=0.05))
    choices = [(0,), (1,), (0, 0), (0, 0, 0)]
    out = export_medusa(heads, head_weight(tiny_target), tmp_path, "tiny-llama", choices, dtype=torch.float32)
    back = load_fasterdecoding_heads(tiny_target, str(out))
    assert back.cfg.projection == projection and back.cfg.num_layers == 2
    hidden = rand(4, tiny_target.hidden_size, seed=9)
    kept = heads.kept_ids
    with torch.no_grad():
        mine = heads(hidden)  # (4, K, V') over the kept rows
        torch.testing.assert_close(back(hidden)[..., kept], mine, atol=1e-5, rtol=1e-5)
    assert read_medusa_choices(out) == choices
    from specdec.strategies.medusa import load_tree

    assert load_tree(str(out / "medusa_choices.json"), 3) == choices
    # vLLM's layout, computed the way vllm/model_executor/models/medusa.py does
    cfg = json.loads((out / "vllm" / "config.json").read_text())
    vl = load_file(str(out / "vllm" / "model.safetensors"))
    assert cfg["model_type"] == "medusa" and cfg["num_heads"] == 3 and cfg["num_hidden_layers"] == 2
    assert cfg["truncated_vocab_size"] == len(kept) and cfg["original_lm_head"] == (projection == "shared")
    if head_vocab:
        assert torch.equal(vl["token_map"], kept)
    else:
        assert "token_map" not in vl
    for k in range(3):
        x = hidden
        for j in range(2):
            x = x + F.silu(x @ vl[f"blocks.{k}.layers.{j}.weight"].t() + vl[f"blocks.{k}.layers.{j}.bias"])
        small = x @ vl[f"lm_heads.{0 if cfg['original_lm_head'] else k}.weight"].t()
        torch.testing.assert_close(small, mine[:, k], atol=1e-5, rtol=1e-5)


def test_sequential_heads_are_refused(tiny_target: LoadedModel, tmp_path: Path, capsys: Any) -> None:
    heads = medusa_heads(tiny_target, num_heads=2, num_layers=1, root_input=True, sequential=True, seed=1)
    with pytest.raises(SpecdecError, match="sequential \\(Hydra-style\\) Medusa heads"):
        export_medusa(heads, head_weight(tiny_target), tmp_path, "tiny-llama")
    # the shipped sequential heads: refused from their config alone, before any model loads
    shipped = [p for p in (REPO / "heads/checkpoints").glob("*/medusa.json")
               if json.loads(p.read_text())["config"].get("sequential")]
    if not shipped:
        pytest.skip("no shipped sequential heads in heads/checkpoints")
    assert export_main(["medusa", str(shipped[0].parent), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no published layout" in err and not any(tmp_path.iterdir())


# --------------------------------------------------------------------------------------------------
# Safe reading and the hub
# --------------------------------------------------------------------------------------------------

CALLED: list[str] = []


def _payload() -> str:
    CALLED.append("ran")
    return "ran"


class Payload:
    """An object whose unpickling calls a function: what a full unpickle of a hostile checkpoint would run."""

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _payload, ()


def test_pickles_load_with_weights_only_and_objects_are_refused(tmp_path: Path) -> None:
    good = {"fc.weight": torch.ones(2, 2), "fc.bias": torch.zeros(2)}
    torch.save(good, tmp_path / "pytorch_model.bin")
    state = load_tensors(tmp_path / "pytorch_model.bin")
    assert set(state) == set(good) and torch.equal(state["fc.weight"], good["fc.weight"])
    torch.save({"fc.weight": torch.ones(2, 2), "evil": Payload()}, tmp_path / "evil.bin")
    with pytest.raises(SpecdecError, match="never unpickles"):
        load_tensors(tmp_path / "evil.bin")
    assert CALLED == []  # nothing ran
    torch.save({"fc.weight": torch.ones(2, 2), "note": "a string"}, tmp_path / "odd.pt")
    with pytest.raises(SpecdecError, match="not a flat mapping"):
        load_tensors(tmp_path / "odd.pt")


def test_hub_only_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    calls: list[tuple[str, Any]] = []

    def fake(repo_id: str, revision: Any = None, allow_patterns: Any = None) -> str:
        calls.append((repo_id, revision))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    with pytest.raises(SpecdecError, match="hub=true"):
        resolve_source("owner/medusa-heads")
    assert calls == []
    assert resolve_source("owner/medusa-heads", hub=True, revision="abc") == tmp_path
    assert calls == [("owner/medusa-heads", "abc")]


# --------------------------------------------------------------------------------------------------
# EAGLE-1/2 and EAGLE-3
# --------------------------------------------------------------------------------------------------


def eagle_folder(out: Path, target: LoadedModel, layers: int, bias: bool, file: str, own_embed: bool,
                 theta: float = 10000.0) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """An EAGLE-1 drafter as SafeAILab's code builds and saves it (cnets1.Model's state dict)."""
    D, V = target.hidden_size, target.vocab_size
    H, KV, FF = 4, 2, 96
    hd = D // H
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": D,
           "intermediate_size": FF, "num_attention_heads": H, "num_key_value_heads": KV, "num_hidden_layers": layers,
           "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": theta, "vocab_size": V,
           "tie_word_embeddings": False, "torch_dtype": "float16", "bias": bias, "pad_token_id": 0}
    s = 1 / math.sqrt(D)
    st: dict[str, Tensor] = {"fc.weight": rand(D, 2 * D, seed=1, scale=2 * s)}
    if bias:
        st["fc.bias"] = rand(D, seed=2, scale=0.1)
    for i in range(layers):
        p = f"layers.{i}."
        st[p + "self_attn.q_proj.weight"] = rand(H * hd, D, seed=10 + i, scale=s)
        st[p + "self_attn.k_proj.weight"] = rand(KV * hd, D, seed=20 + i, scale=s)
        st[p + "self_attn.v_proj.weight"] = rand(KV * hd, D, seed=30 + i, scale=s)
        st[p + "self_attn.o_proj.weight"] = rand(D, H * hd, seed=40 + i, scale=s)
        st[p + "mlp.gate_proj.weight"] = rand(FF, D, seed=50 + i, scale=s)
        st[p + "mlp.up_proj.weight"] = rand(FF, D, seed=60 + i, scale=s)
        st[p + "mlp.down_proj.weight"] = rand(D, FF, seed=70 + i, scale=1 / math.sqrt(FF))
        if i > 0:
            st[p + "input_layernorm.weight"] = 1 + rand(D, seed=80 + i, scale=0.1)
        st[p + "post_attention_layernorm.weight"] = 1 + rand(D, seed=90 + i, scale=0.1)
    if own_embed:
        st["embed_tokens.weight"] = rand(V, D, seed=5, scale=0.5)
    write_checkpoint(out, st, cfg, file)
    return cfg, st


def eagle1_reference(cfg: dict[str, Any], st: dict[str, Tensor], embed: Tensor, head: Tensor, ids: Tensor,
                     feats: Tensor) -> tuple[Tensor, Tensor]:
    """EAGLE-1's drafter written out over one sequence: ids (T,), feats (T, D) -> logits (T, V), features (T, D)."""
    H, KV, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rms_norm_eps"]
    x = F.linear(torch.cat([embed[ids], feats], -1), st["fc.weight"], st.get("fc.bias"))
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = x if i == 0 else rms(x, st[p + "input_layernorm.weight"], eps)  # EAGLE: no norm before layer 0
        o = reference_attention(h, st, p + "self_attn.", H, KV, cfg["rope_theta"])
        x = x + o @ st[p + "self_attn.o_proj.weight"].t()
        h = rms(x, st[p + "post_attention_layernorm.weight"], eps)
        gate, up = h @ st[p + "mlp.gate_proj.weight"].t(), h @ st[p + "mlp.up_proj.weight"].t()
        x = x + (F.silu(gate) * up) @ st[p + "mlp.down_proj.weight"].t()
    return x @ head.t(), x  # no final norm: the last layer's output is the guessed feature


def run_net(net: Any, ids: Tensor, feats: Tensor) -> tuple[Tensor, Tensor]:
    cache = net.new_cache(64)
    with torch.no_grad():
        logits, h = net(ids[None], feats[None], torch.arange(len(ids))[None], cache,
                        cache.attention_mask(None, len(ids)))
    return logits[0], h[0]


EAGLE_CASES = [(1, True, "pytorch_model.bin", False), (2, False, "model.safetensors", True)]


@pytest.mark.parametrize("layers,bias,file,own_embed", EAGLE_CASES)
def test_eagle1_drafter_computes_the_published_drafter(tiny_target: LoadedModel, tmp_path: Path, layers: int,
                                                       bias: bool, file: str, own_embed: bool) -> None:
    cfg, st = eagle_folder(tmp_path, tiny_target, layers, bias, file, own_embed)
    net = load_eagle_layout(str(tmp_path)).bind(tiny_target)
    assert net.token_ids is None and len(net.layers) == layers
    ids = torch.tensor([5, 9, 31, 7, 2, 44])
    feats = rand(6, tiny_target.hidden_size, seed=3)
    embed = st["embed_tokens.weight"] if own_embed else target_embedding(tiny_target).float()
    ref_logits, ref_h = eagle1_reference(cfg, st, embed, target_head(tiny_target).float(), ids, feats)
    logits, h = run_net(net, ids, feats)
    torch.testing.assert_close(h, ref_h, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    # out again in the same layout, in again: the same drafter
    out = export_eagle(net, tmp_path / "export", target_embedding(tiny_target), "tiny-llama", torch.float32)
    again = read_eagle(out)[1]
    assert ("embed_tokens.weight" in again) == own_embed
    assert bias or torch.equal(again["fc.bias"], torch.zeros(tiny_target.hidden_size))  # written as exact zeros
    assert "layers.0.input_layernorm.weight" not in again and not any(k.startswith("norm") for k in again)
    for key in st:
        torch.testing.assert_close(again[key], st[key])
    back = load_eagle_layout(str(out)).bind(tiny_target)
    logits2, h2 = run_net(back, ids, feats)
    assert torch.equal(logits2, logits) and torch.equal(h2, h)


def test_published_eagle_drafter_on_the_cpu_kernels(load_tiny: Any, tmp_path: Path) -> None:
    """On numba's kernels the drafter runs on the fused layer stack, which skips its two absent norms."""
    pytest.importorskip("numba")
    from specdec.models.cpu_layer import FusedStack

    torch_target, numba_target = load_tiny("llama"), load_tiny("llama", matmul="numba")
    eagle_folder(tmp_path, torch_target, 2, True, "model.safetensors", False)
    ids, feats = torch.tensor([5, 9, 31, 7]), rand(4, torch_target.hidden_size, seed=4)
    ref_logits, ref_h = run_net(load_eagle_layout(str(tmp_path)).bind(torch_target), ids, feats)
    net = load_eagle_layout(str(tmp_path)).bind(numba_target)
    assert isinstance(net.fused, FusedStack) and not net.fused.final_normed and not net.fused.attn_normed[0]
    logits, h = run_net(net, ids, feats)
    torch.testing.assert_close(h, ref_h, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)


def test_published_eagle_drafter_runs_in_the_strategy(tiny_target: LoadedModel, tmp_path: Path) -> None:
    from hydra.utils import instantiate

    eagle_folder(tmp_path, tiny_target, 1, True, "pytorch_model.bin", False)
    scfg = group_config("strategy", "eagle")  # composed: its schedule comes from the defaults list
    scfg.drafter = {"_target_": "heads.interop.eagle_layout.load_eagle_layout", "path": str(tmp_path)}
    eagle = instantiate(scfg)(target=tiny_target, max_len=512, prefill_chunk=64)
    res = eagle.generate(PROMPT, GenerationParams(20), 0)
    assert res.output_ids == greedy_ids(tiny_target, PROMPT, 20) and res.proposed > 0


def test_eagle1_trained_drafter_round_trips_through_the_published_layout(tiny_target: LoadedModel,
                                                                          tmp_path: Path) -> None:
    """head.layout=eagle1 -> python -m heads.export eagle -> load_eagle_layout: the same drafter, the same tokens."""
    trainable = EagleTrainable(layers=2, kept_vocab=0, save_dtype="fp32", layout="eagle1")
    module = trainable.build(tiny_target, None)
    with torch.no_grad():
        module.net.fc.weight.mul_(8)
        for i, (name, p) in enumerate(module.net.named_parameters()):
            if p.requires_grad and "norm" in name:  # layer 1's input norm and the post-attention norms
                p.copy_(1 + rand(*p.shape, seed=100 + i, scale=0.2))
    trainable.save(module, tmp_path / "specdec", {"steps": 0})
    assert export_main(["eagle", str(tmp_path / "specdec"), "--out", str(tmp_path / "out"), "--dtype", "fp32"]) == 0
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and "bias" not in cfg  # EAGLE's default (fc has one), no attention biases
    written = read_eagle(tmp_path / "out")[1]
    assert torch.equal(written["fc.bias"], torch.zeros(tiny_target.hidden_size))
    assert "layers.1.input_layernorm.weight" in written and "layers.0.input_layernorm.weight" not in written
    mine = load_eagle(str(tmp_path / "specdec")).bind(tiny_target)
    back = load_eagle_layout(str(tmp_path / "out")).bind(tiny_target)
    ids, feats = torch.tensor([5, 9, 31, 7, 2, 44]), rand(6, tiny_target.hidden_size, seed=3)
    for got, want in zip(run_net(back, ids, feats), run_net(mine, ids, feats), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    want_ids = greedy_ids(tiny_target, PROMPT, 24)
    for net in (mine, back):
        eagle = EagleStrategy(tiny_target, "eagle", net, FixedLength(3), 512, 64)
        res = eagle.generate(PROMPT, GenerationParams(24), 0)
        assert res.output_ids == want_ids and res.proposed > 0


def test_specdec_eagle_drafter_is_refused(tiny_target: LoadedModel, tmp_path: Path, capsys: Any) -> None:
    trainable = EagleTrainable(kept_vocab=0, save_dtype="fp32")
    module = trainable.build(tiny_target, None)
    with pytest.raises(SpecdecError, match="normalises its first block's input and its output"):
        export_eagle(module.net, tmp_path, target_embedding(tiny_target))
    trainable.save(module, tmp_path / "specdec", {"steps": 0})
    assert export_main(["eagle", str(tmp_path / "specdec"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "head.layout=eagle1" in err and not (tmp_path / "out").exists()
    shipped = REPO / "heads/checkpoints/smollm2-135m-eagle"
    if not shipped.is_dir():
        pytest.skip("no shipped EAGLE drafter")
    assert export_main(["eagle", str(shipped), "--out", str(tmp_path / "shipped")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no published layout" in err and not (tmp_path / "shipped").exists()


def eagle3_folder(out: Path, V: int = 512, D: int = 64, draft_vocab: int = 100) -> Tensor:
    """An EAGLE-3 drafter as SafeAILab's EAGLE-3 code saves it; returns the target ids its rows stand for."""
    H, KV, hd, FF = 4, 2, 16, 96
    kept = torch.randperm(V, generator=torch.Generator().manual_seed(0))[:draft_vocab].sort().values
    st = {"fc.weight": rand(D, 3 * D, seed=1), "norm.weight": torch.ones(D),
          "lm_head.weight": rand(draft_vocab, D, seed=2),
          "midlayer.hidden_norm.weight": torch.ones(D), "midlayer.input_layernorm.weight": torch.ones(D),
          "midlayer.post_attention_layernorm.weight": torch.ones(D),
          "midlayer.self_attn.q_proj.weight": rand(H * hd, 2 * D, seed=3),
          "midlayer.self_attn.k_proj.weight": rand(KV * hd, 2 * D, seed=4),
          "midlayer.self_attn.v_proj.weight": rand(KV * hd, 2 * D, seed=5),
          "midlayer.self_attn.o_proj.weight": rand(D, H * hd, seed=6),
          "midlayer.mlp.gate_proj.weight": rand(FF, D, seed=7), "midlayer.mlp.up_proj.weight": rand(FF, D, seed=8),
          "midlayer.mlp.down_proj.weight": rand(D, FF, seed=9),
          "d2t": kept - torch.arange(draft_vocab), "t2d": torch.zeros(V, dtype=torch.bool).index_fill(0, kept, True)}
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": D,
           "intermediate_size": FF, "num_attention_heads": H, "num_key_value_heads": KV, "num_hidden_layers": 1,
           "vocab_size": V, "draft_vocab_size": draft_vocab, "target_hidden_size": D, "rms_norm_eps": 1e-6}
    write_checkpoint(out, st, cfg, "model.safetensors")
    return kept


def test_eagle3_is_read_and_checked(tmp_path: Path) -> None:
    # loading, running and exporting EAGLE-3 drafters: tests/test_eagle3.py
    kept = eagle3_folder(tmp_path)
    cfg, st, where = read_eagle(tmp_path)
    layout = read_eagle3(cfg, st, where)
    assert torch.equal(layout.draft_ids, kept) and layout.target_hidden_size == 64
    assert type(load_eagle_layout(str(tmp_path))).__name__ == "PublishedEagle3"
    st["t2d"] = torch.zeros_like(st["t2d"])
    with pytest.raises(SpecdecError, match="d2t and t2d disagree"):
        read_eagle3(cfg, st, where)


# --------------------------------------------------------------------------------------------------
# The draft model as a transformers model
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_draft(tiny_target: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """specdec's draft, one layer, 64 kept ids, saved the way heads.train saves it."""
    data = [{"input_ids": list(range(3, 300)), "labels": list(range(3, 300))}]
    trainable = DraftTrainable(layers=1, kept_vocab=64, save_dtype="fp32")
    module = trainable.build(tiny_target, data)
    out = tmp_path_factory.mktemp("draft")
    trainable.save(module, out, {"steps": 0})
    return out


def test_draft_exports_as_a_transformers_model(tiny_target: LoadedModel, saved_draft: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = export_draft(saved_draft, tiny_target, tmp_path / "hf")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_hidden_layers"] == 1
    names = set(load_file(str(out / "model.safetensors")))
    assert "model.layers.0.self_attn.q_proj.weight" in names and "model.embed_tokens.weight" in names
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert AutoTokenizer.from_pretrained(out)("hello")["input_ids"] == tiny_target.tokenizer("hello")["input_ids"]
    ids = [5, 9, 31, 7, 2, 44, 300, 12]
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0]
    net = DraftCheckpoint(saved_draft, json.loads((saved_draft / "config.json").read_text())).bind(tiny_target)
    cache = net.new_cache(16)
    with torch.no_grad():
        mine, _ = net(torch.tensor([ids]), torch.arange(len(ids))[None], cache, cache.attention_mask(None, len(ids)))
    kept = net.token_ids
    assert kept is not None and len(kept) == 64
    torch.testing.assert_close(theirs[:, kept], mine[0], atol=1e-5, rtol=1e-5)
    info = json.loads((out / "specdec_export.json").read_text())
    assert info["kept_ids"] == kept.tolist() and info["check"]["max_abs_logit_diff_on_kept_ids"] < 1e-4


def test_draft_export_refuses_another_target(saved_draft: Path, tmp_path: Path) -> None:
    other = load_model("tiny-wide", "builtin:tiny-llama", matmul="torch", tiny={"hidden_size": 32})
    with pytest.raises(SpecdecError, match="trained for tiny-llama"):
        export_draft(saved_draft, other, tmp_path)


def test_export_command_end_to_end(tiny_target: LoadedModel, saved_draft: Path, tmp_path: Path) -> None:
    """python -m heads.export for each kind, the target loaded from configs/model/tiny-llama.yaml."""
    heads = medusa_heads(tiny_target, num_heads=2, num_layers=1, seed=2)
    heads.save(tmp_path / "medusa", {"steps": 0})
    assert export_main(["medusa", str(tmp_path / "medusa"), "--out", str(tmp_path / "m"), "--tree", "chain",
                        "--dtype", "fp32", "--with-pt"]) == 0
    back = load_fasterdecoding_heads(tiny_target, str(tmp_path / "m"))
    hidden = rand(3, tiny_target.hidden_size, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(back(hidden), heads(hidden), atol=1e-5, rtol=1e-5)
    assert read_medusa_choices(tmp_path / "m") == [(0,), (0, 0)]
    assert set(load_tensors(tmp_path / "m" / "medusa_lm_head.pt")) == set(load_file(
        str(tmp_path / "m" / "medusa_lm_head.safetensors")))
    eagle_folder(tmp_path / "eagle", tiny_target, 1, True, "pytorch_model.bin", False)
    assert export_main(["eagle", str(tmp_path / "eagle"), "--out", str(tmp_path / "e"), "--model", "tiny-llama",
                        "--dtype", "fp32"]) == 0
    assert json.loads((tmp_path / "e" / "config.json").read_text())["num_hidden_layers"] == 1
    assert export_main(["draft", str(saved_draft), "--out", str(tmp_path / "d")]) == 0
    assert (tmp_path / "d" / "specdec_export.json").is_file()


@pytest.mark.slow
def test_shipped_draft_exports_with_the_same_logits(tmp_path: Path) -> None:
    """The shipped smollm2-135m draft as a transformers model: the export's own check (specdec's draft and the
    reloaded model on a short sequence, kept ids) passes with the exact dtype."""
    out, shipped = tmp_path / "draft", REPO / "heads/checkpoints/smollm2-135m-draft"
    if not shipped.is_dir():
        pytest.skip("no shipped draft")
    assert export_main(["draft", str(shipped), "--out", str(out)]) == 0
    info = json.loads((out / "specdec_export.json").read_text())
    print(f"shipped draft exported as {info['dtype']}, logit difference {info['check']}")
    assert info["check"]["max_abs_logit_diff_on_kept_ids"] < 1e-3 and len(info["kept_ids"]) == 8192
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
