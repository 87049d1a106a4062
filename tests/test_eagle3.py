"""EAGLE-3 drafters (heads/eagle3.py, heads/interop/eagle_layout.py): a tiny random drafter in SafeAILab's published
layout is loaded and checked against its forward written out from the raw tensors, run lossless in the strategy on
the target's layer taps, exported and re-imported unchanged, and refused in one line when corrupted.

The target is tiny-llama with 8 layers (the interop tests' model, deeper): EAGLE-3's default taps, the inputs of
layers 2, n/2 and n-3, need n >= 7 to be three distinct layers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_draws_follow, assert_kv_matches_fresh, eagle3_checkpoint, rand, reference_attention, rms
from hydra.utils import instantiate
from omegaconf import OmegaConf
from safetensors.torch import save_file
from torch import Tensor

from heads.draft_model import target_embedding
from heads.eagle3 import Eagle3Net, default_layers
from heads.interop.eagle_layout import (
    PublishedEagle3,
    eagle3_target_layers,
    export_eagle3,
    load_eagle_layout,
    read_eagle,
)
from specdec.cli_checks import CONFIG_DIR, group_config
from specdec.engine.engine import HFEngine, StaticEngine
from specdec.engine.sampling import SamplingParams, warp
from specdec.engine.static_step import StaticStep
from specdec.errors import SpecdecError
from specdec.models.loader import LoadedModel, load_model
from specdec.strategies.base import DecodeState, GenerationParams
from specdec.strategies.eagle import EagleStrategy
from specdec.strategies.greedy import Greedy
from specdec.strategies.schedules import FixedLength

PROMPT = [1, 17, 40, 99, 23, 17, 40, 99, 23, 5]


@pytest.fixture(scope="module")
def deep() -> LoadedModel:
    return load_model("tiny-llama", "builtin:tiny-llama", matmul="torch", compile=False,
                      tiny={"num_hidden_layers": 8})


def eagle3_reference(cfg: dict[str, Any], st: dict[str, Tensor], embed: Tensor, ids: Tensor,
                     g: Tensor) -> tuple[Tensor, Tensor]:
    """EAGLE-3's midlayer written out over one sequence from position 0: ids (T,), the pairs' fused features
    g (T, D) -> draft-vocabulary logits (T, K) and pre-norm outputs (T, D)."""
    H, KV, eps, m = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rms_norm_eps"], "midlayer."
    x = torch.cat([rms(embed[ids], st[m + "input_layernorm.weight"], eps),
                   rms(g, st[m + "hidden_norm.weight"], eps)], -1)  # (T, 2D): the embedding first
    o = reference_attention(x, st, m + "self_attn.", H, KV, cfg["rope_theta"])
    h = g + o @ st[m + "self_attn.o_proj.weight"].t()
    u = rms(h, st[m + "post_attention_layernorm.weight"], eps)
    h = h + (F.silu(u @ st[m + "mlp.gate_proj.weight"].t()) * (u @ st[m + "mlp.up_proj.weight"].t())) @ \
        st[m + "mlp.down_proj.weight"].t()
    return rms(h, st["norm.weight"], eps) @ st["lm_head.weight"].t(), h


def taps_of(target: LoadedModel, ids: list[int], layers: tuple[int, ...]) -> Tensor:
    """The residual stream entering `layers`, from transformers itself: hidden_states[i] is layer i's input."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target.folder, dtype=torch.float32).eval()
    with torch.no_grad():
        hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i][0] for i in layers], -1)


# --------------------------------------------------------------------------------------------------


def test_target_layers_from_config_or_default() -> None:
    assert default_layers(32) == (2, 16, 29) and eagle3_target_layers({}, 32, "x") == (2, 16, 29)
    assert eagle3_target_layers({"eagle_aux_hidden_state_layer_ids": [30, 1, 15]}, 32, "x") == (1, 15, 30)  # vLLM's
    nested = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 29]}}  # SGLang's: layer outputs
    assert eagle3_target_layers(nested, 32, "x") == (2, 16, 30)
    with pytest.raises(SpecdecError, match="two sets of target layers"):
        eagle3_target_layers(nested | {"eagle_aux_hidden_state_layer_ids": [2, 16, 29]}, 32, "x")
    with pytest.raises(SpecdecError, match=r"not three distinct layers of the target's 6; set eagle_aux_hidden"):
        eagle3_target_layers({}, 6, "x")  # (2, 3, 3)


def test_engines_tap_the_layer_inputs_only_when_asked(deep: LoadedModel) -> None:
    layers = default_layers(8)  # (2, 4, 5)
    ref = taps_of(deep, PROMPT + [7, 8, 9], layers)  # (13, 3D)
    for engine in (StaticEngine(deep.model, 64, 4), StaticEngine(deep.model, 64, 4, static=True),
                   HFEngine(deep.hf_model(), 64, 4)):
        assert engine.prefill(PROMPT).taps is None  # ordinary strategies: nothing tapped, nothing paid
        engine.use_taps(layers)
        engine.reuse_prefix(True)
        out = engine.prefill(PROMPT)  # chunks of 4
        torch.testing.assert_close(out.taps, ref[:10], atol=1e-4, rtol=1e-4)
        step = engine.forward(torch.tensor([7, 8, 9]))
        torch.testing.assert_close(step.taps, ref[10:], atol=1e-4, rtol=1e-4)
        engine.rollback(11)
        again = engine.prefill(PROMPT + [7, 8])  # reuses the 11 cached slots: taps from the held rows
        assert engine.prefilled == 1
        torch.testing.assert_close(again.taps, ref[:12], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("D,file", [(64, "model.safetensors"), (48, "pytorch_model.bin")])
def test_loaded_drafter_computes_the_published_drafter(deep: LoadedModel, tmp_path: Path, D: int, file: str) -> None:
    cfg, st = eagle3_checkpoint(tmp_path, deep, D, file)
    drafter = load_eagle_layout(str(tmp_path))
    assert isinstance(drafter, PublishedEagle3)
    net = drafter.bind(deep)
    assert isinstance(net, Eagle3Net) and net.target_layers == (2, 4, 5)
    assert torch.equal(net.token_ids, st["d2t"] + torch.arange(200))  # row r is target id r + d2t[r]
    ids, taps = torch.tensor([5, 9, 31, 7, 2, 44]), rand(6, 3 * deep.hidden_size, seed=20)
    embed = st.get("embed_tokens.weight", target_embedding(deep).float())
    cache = net.new_cache(64)
    with torch.no_grad():  # catch up on 5 pairs with target taps, then one pair on the drafter's own output
        logits, h = net(ids[None, :5], taps[None, :5], torch.arange(5)[None], cache, cache.attention_mask(None, 5))
        logits2, h2 = net(ids[None, 5:], h[:, -1:], torch.tensor([[5]]), cache)
    g = torch.cat([taps[:5] @ st["fc.weight"].t(), h[0, -1:]])  # fc over the taps; the own output as it is
    ref_logits, ref_h = eagle3_reference(cfg, st, embed, ids, g)
    torch.testing.assert_close(torch.cat([h[0], h2[0]]), ref_h, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat([logits[0], logits2[0]]), ref_logits, atol=1e-4, rtol=1e-4)
    # the static-shape step a compiled target gives the drafter (engine/static_step.py), run eagerly here
    static_cache = net.new_cache(64 + 64)
    step = StaticStep(net, static_cache, compile=False)
    rows = []
    for n, (tok, feat) in enumerate([(ids[:5], taps[:5]), (ids[5:], h[0, -1:])]):
        static_cache.reserve(len(tok))
        rows.append(step(tok, None, None, 5 * n, feat))
        static_cache.advance(len(tok))
    torch.testing.assert_close(torch.cat([r[1] for r in rows]), ref_h, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat([r[0] for r in rows]), ref_logits, atol=1e-4, rtol=1e-4)


def test_eagle3_strategy_reproduces_greedy(deep: LoadedModel, tmp_path: Path) -> None:
    eagle3_checkpoint(tmp_path, deep)
    scfg = group_config("strategy", "eagle3")  # composed: its schedule comes from the defaults list
    scfg.drafter.path = str(tmp_path)
    scfg.schedule.threshold = 0.0  # always draft max_gamma tokens
    eagle3 = instantiate(scfg)(target=deep, max_len=512, prefill_chunk=8)
    greedy = Greedy(deep, "greedy", 512, 8)
    eagle3.reuse_prefix(True)
    for prompt in (PROMPT, PROMPT + [3, 4, 5, 6, 7, 8, 9, 10, 11]):  # the second turn reuses the first's prefix
        res = eagle3.generate(prompt, GenerationParams(24), 0)
        assert res.output_ids == greedy.generate(prompt, GenerationParams(24), 0).output_ids
        assert res.proposed > 0 and sum(res.accept_lengths) == len(res.output_ids)
    with pytest.raises(SpecdecError, match="strategy eagle3 cannot decode in batches yet; run it with generation"):
        eagle3.batch_decoder(2, GenerationParams(8))
    # EAGLE-2's dynamic tree over the same drafter (strategy=eagle2 with this drafter)
    tcfg = OmegaConf.load(CONFIG_DIR / "strategy" / "eagle2.yaml")
    tcfg.drafter = {"_target_": "heads.interop.eagle_layout.load_eagle_layout", "path": str(tmp_path)}
    tcfg.size = "fixed"  # every round verifies `nodes` nodes (a random drafter's trees never pay for themselves)
    tree = instantiate(tcfg)(target=deep, max_len=512, prefill_chunk=8)
    res = tree.generate(PROMPT, GenerationParams(24), 0)
    assert res.output_ids == greedy.generate(PROMPT, GenerationParams(24), 0).output_ids and res.proposed_nodes > 0


@pytest.mark.parametrize("temperature", [0.0, 50.0])
def test_drafter_features_stay_in_step_with_the_target(deep: LoadedModel, tmp_path: Path, temperature: float) -> None:
    """After every round the drafter holds one pair per committed token but the newest, on the target's taps:
    greedy rounds reject (a random drafter), very hot ones accept most drafts (p and q both near uniform)."""
    eagle3_checkpoint(tmp_path, deep, draft_vocab=deep.vocab_size)  # the whole vocabulary: rows are target ids
    strategy = EagleStrategy(deep, "eagle3", load_eagle_layout(str(tmp_path)), FixedLength(3), 512, 8)
    assert strategy.net.token_ids is None
    params = GenerationParams(200, SamplingParams(temperature))
    out = strategy.engine.prefill(PROMPT)
    gen = None if temperature == 0 else torch.Generator().manual_seed(0)
    state = DecodeState(list(PROMPT), len(PROMPT), params, gen)
    state.ids.append(strategy._pick(out.logits[-1], state))
    proposer = strategy.make_proposer()
    proposer.start(state, out)
    rejected = accepted = 0
    for _ in range(8):
        proposal = proposer.propose(state)
        verdict, out = strategy._step(state, proposal)
        state.ids.extend(verdict.tokens)
        proposer.commit(state, verdict, out)
        rejected += len(verdict.nodes) < len(proposal.tokens)
        accepted += len(verdict.nodes)
        assert_kv_matches_fresh(strategy.engine, state.ids[:-1])
        assert proposer.fed + len(proposer.pending) == len(state.ids) - 1 == strategy.cache.lengths[0] + len(
            proposer.pending)
        fresh = strategy.engine.prefill(state.ids[:-1]).taps  # the target's taps (and its cache as it was)
        torch.testing.assert_close(proposer.pending, fresh[proposer.fed:], atol=1e-4, rtol=1e-4)
    assert rejected >= 4 if temperature == 0 else accepted >= 8


def test_speculative_sampling_keeps_the_target_distribution(deep: LoadedModel, tmp_path: Path) -> None:
    """Above temperature 0 the drafter's q, over its draft vocabulary mapped to target ids (zero elsewhere),
    is what the exact rule corrects: the committed token follows the target's p."""
    eagle3_checkpoint(tmp_path, deep, draft_vocab=40)
    sp = SamplingParams(temperature=1.0, top_p=0.95)
    strategy = EagleStrategy(deep, "eagle3", load_eagle_layout(str(tmp_path)), FixedLength(2), 256, 8)
    prompt, base = PROMPT, len(PROMPT) - 1
    out = strategy.engine.prefill(prompt[:-1])
    proposer = strategy.make_proposer()
    counts = torch.zeros(deep.vocab_size)
    for seed in range(300):
        state = DecodeState(list(prompt), base, GenerationParams(8, sp), torch.Generator().manual_seed(seed))
        proposer.start(state, out)
        proposal = proposer.propose(state)
        assert proposal is not None and proposal.probs is not None
        assert float(proposal.probs[0].sum()) == pytest.approx(1.0, abs=1e-5)
        outside = torch.ones(deep.vocab_size, dtype=torch.bool)
        outside[strategy.net.token_ids] = False
        assert float(proposal.probs[0][outside].sum()) == 0.0  # q is zero outside the draft vocabulary
        verdict, _ = strategy._step(state, proposal)
        counts[verdict.tokens[0]] += 1
        strategy.engine.rollback(base)
    assert_draws_follow(counts, warp(strategy.engine.prefill(prompt).logits[-1], sp))


def test_export_round_trips(deep: LoadedModel, tmp_path: Path) -> None:
    cfg, st = eagle3_checkpoint(tmp_path / "in", deep, 48, extra={"eagle_aux_hidden_state_layer_ids": [1, 3, 6]})
    net = load_eagle_layout(str(tmp_path / "in")).bind(deep)
    assert net.target_layers == (1, 3, 6)
    out = export_eagle3(net, tmp_path / "out", target_embedding(deep), "tiny-llama", torch.float32)
    cfg2, st2, _ = read_eagle(out)
    assert sorted(st2) == sorted(st)
    for key in st:
        assert st2[key].dtype == st[key].dtype or key in ("d2t",), key
        assert torch.equal(st2[key], st[key].to(st2[key].dtype)), key
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "draft_vocab_size", "target_hidden_size", "rms_norm_eps", "rope_theta", "num_hidden_layers"):
        assert cfg2[key] == cfg[key], key
    assert cfg2["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]
    assert cfg2["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 5]  # SGLang's: layer outputs
    back = load_eagle_layout(str(out)).bind(deep)
    ids, taps = torch.tensor([[5, 9, 31]]), rand(1, 3, 3 * deep.hidden_size, seed=21)
    with torch.no_grad():
        c1, c2 = net.new_cache(8), back.new_cache(8)
        a, b = net(ids, taps, torch.arange(3)[None], c1, c1.attention_mask(None, 3)), \
            back(ids, taps, torch.arange(3)[None], c2, c2.attention_mask(None, 3))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # a drafter on the target's embedding is written without one
    eagle3_checkpoint(tmp_path / "d64", deep)
    net64 = load_eagle_layout(str(tmp_path / "d64")).bind(deep)
    out64 = export_eagle3(net64, tmp_path / "out64", target_embedding(deep))
    assert "embed_tokens.weight" not in read_eagle(out64)[1]


def test_corrupted_checkpoints_are_refused_in_one_line(deep: LoadedModel, tiny_target: LoadedModel,
                                                       tmp_path: Path) -> None:
    def refused(folder: Path, pattern: str, target: LoadedModel | None = None) -> None:
        with pytest.raises(SpecdecError, match=pattern) as err:
            drafter = load_eagle_layout(str(folder))
            drafter.bind(target or deep)
        assert "\n" not in str(err.value)

    cfg, st = eagle3_checkpoint(tmp_path / "ok", deep)
    for name, change, pattern in [
        ("missing", lambda s: s.pop("midlayer.mlp.up_proj.weight"), r"lacks EAGLE-3 tensors \['midlayer.mlp.up_proj"
                                                                    r".*Re-download"),
        ("shape", lambda s: s.update({"lm_head.weight": s["lm_head.weight"][:150]}),
         r"lm_head.weight is \(150, 64\) but config.json .* makes it \(200, 64\); .*re-download"),
        ("odd", lambda s: s.update({"layers.0.mlp.up_proj.weight": torch.zeros(2)}), "does not .*layers.0.mlp"),
        ("d2t", lambda s: s.update({"d2t": s["d2t"] + 1000}), "outside the target's vocabulary"),
    ]:
        bad = dict(st)
        change(bad)
        (tmp_path / name).mkdir()
        save_file(bad, str(tmp_path / name / "model.safetensors"))
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        refused(tmp_path / name, pattern)
    refused(tmp_path / "ok", r"target layers \[2, 1, -1\] are not three distinct layers of the target's 2; an "
                             "EAGLE-3 drafter needs a target of at least 3 layers", tiny_target)
    eagle3_checkpoint(tmp_path / "wide", deep, extra={"vocab_size": 600})
    refused(tmp_path / "wide", r"t2d is \(512,\) but config.json")
    cfg, st = eagle3_checkpoint(tmp_path / "other", deep, extra={"target_hidden_size": 32})
    save_file(st | {"fc.weight": rand(64, 96, seed=1)}, str(tmp_path / "other" / "model.safetensors"))
    refused(tmp_path / "other", r"is for a model of hidden 32 and vocab 512, not tiny-llama \(hidden 64, vocab 512\); "
                                "use a drafter trained for this target")


def test_cpu_kernels_fused_stack_returns_the_taps(tmp_path: Path, capsys: Any) -> None:
    """On numba's kernels the fused stack runs a tapped pass as one call per stretch of layers between taps: its
    taps and final state are the layer-by-layer pass's, and the eagle3 strategy over it stays lossless."""
    pytest.importorskip("numba")
    target = load_model("tiny-llama", "builtin:tiny-llama", matmul="numba", compile=False,
                        tiny={"num_hidden_layers": 8})
    model = target.model
    assert model.fused is not None
    ids = torch.tensor([PROMPT])
    pos = torch.arange(len(PROMPT))[None]
    outs, stack = [], model.fused
    for fused in (stack, None):  # the fused stack, then layer by layer on the same kernels
        model.fused, cache = fused, model.new_cache(64)
        outs.append(model.forward_tapped(ids, pos, cache, cache.attention_mask(None, len(PROMPT)), len(PROMPT),
                                         (0, 2, 5)))
    model.fused = stack
    for got, want in zip(outs[0][1:], outs[1][1:], strict=True):
        assert got.shape == want.shape  # the kernels' attention differs from torch's at float rounding only
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs[0][2][..., :model.args.dim], model.embed(ids), atol=0, rtol=0)  # layer 0's input
    eagle3_checkpoint(tmp_path, target)
    want = Greedy(target, "greedy", 512, 8).generate(PROMPT, GenerationParams(24), 0).output_ids
    for weights in ("fp32", "int8"):  # the drafter on the target's kernels too, int8 as strategy.drafter.weights asks
        eagle3 = EagleStrategy(target, "eagle3", load_eagle_layout(str(tmp_path), weights=weights), FixedLength(3),
                               512, 8)
        assert type(eagle3.net.fc).__name__ == "NumbaLinear" and type(eagle3.net.attn.wqkv).__name__ == "NumbaLinear"
        res = eagle3.generate(PROMPT, GenerationParams(24), 0)
        assert res.output_ids == want and res.proposed > 0
    assert capsys.readouterr().err == ""


def test_transformers_target(tmp_path: Path) -> None:
    """A target run through transformers (model.backend=hf) taps hidden_states[i], layer i's input."""
    target = load_model("tiny-llama", "builtin:tiny-llama", backend="hf", compile=False, tiny={"num_hidden_layers": 8})
    eagle3_checkpoint(tmp_path, target)
    eagle3 = EagleStrategy(target, "eagle3", load_eagle_layout(str(tmp_path)), FixedLength(3), 512, 8)
    assert eagle3.net.target_layers == (2, 4, 5)
    res = eagle3.generate(PROMPT, GenerationParams(16), 0)
    assert res.output_ids == Greedy(target, "greedy", 512, 8).generate(PROMPT, GenerationParams(16), 0).output_ids


def test_export_command(deep: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    import heads.export as export

    cfg, st = eagle3_checkpoint(tmp_path / "in", deep, file="pytorch_model.bin")
    monkeypatch.setattr(export, "load_target", lambda name: deep)  # configs/model has no 8-layer tiny-llama
    assert export.main(["eagle3", str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--model", "x"]) == 0
    again = read_eagle(tmp_path / "out")[1]
    assert again["fc.weight"].dtype == torch.float16 and torch.equal(again["d2t"], st["d2t"])
    assert export.main(["eagle3", str(tmp_path / "in"), "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pass --model NAME" in err and not (tmp_path / "o2").exists()
