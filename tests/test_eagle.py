"""EAGLE-style drafting: losslessness, the drafter's pair bookkeeping, sampling, training, artifacts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    assert_draws_follow,
    assert_kv_matches_fresh,
    save_random_eagle,
    saved_eagle,
    speculative_rounds,
    tiny_train_overrides,
)
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from heads.draft_model import target_head
from heads.eagle import EagleTrainable, load_eagle
from heads.train import train
from specdec.cli_checks import CONFIG_DIR, group_config
from specdec.engine.kv_cache import KVCache
from specdec.engine.sampling import SamplingParams, warp
from specdec.errors import SpecdecError
from specdec.models.loader import LoadedModel, load_model
from specdec.strategies.base import DecodeState, GenerationParams
from specdec.strategies.eagle import EagleStrategy
from specdec.strategies.greedy import Greedy
from specdec.strategies.schedules import Confidence, CostAware, FixedLength

PROMPTS = ["Summarize: the quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return"]


def prompt_ids(target: LoadedModel, text: str) -> list[int]:
    return target.chat_ids([{"role": "user", "content": text}])


def greedy_ids(target: LoadedModel, prompt: list[int], n: int) -> list[int]:
    return Greedy(target, "greedy", 512, 64).generate(prompt, GenerationParams(n), 0).output_ids


@pytest.fixture(scope="module")
def untrained(tiny_target: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised drafter, saved and loaded the way a trained one is."""
    return save_random_eagle(tiny_target, tmp_path_factory.mktemp("eagle"))


class OracleNet:
    """A test drafter that is always right at temperature 0: it ignores the features and runs the target
    itself over x_0 and the pairs' tokens. Its answers are right only if the proposer feeds the pairs at
    the right slots and positions and rolls back exactly the guessed ones."""

    token_ids = None

    def __init__(self, target: LoadedModel, first_token: int) -> None:
        self.model = target.model
        self.first = first_token
        self.device = target.model.device
        self.inner = target.model.new_cache(512)  # the target's K/V of x_0 and of every pair's token

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        return KVCache(1, batch, 1, max_len, 1, torch.float32, "cpu")  # only its lengths are used

    def __call__(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                 mask: torch.Tensor | None = None, logits_from: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = cache.lengths[0]
        assert int(positions[0, 0]) == pairs and features.shape[:2] == tokens.shape  # pair j at slot/position j
        self.inner.rollback(pairs + 1 if pairs else 0)
        if not pairs:
            tokens, positions = torch.cat([torch.tensor([[self.first]]), tokens], 1), torch.cat(
                [positions[:, :1] - 1, positions], 1)
        attn = self.inner.attention_mask(None, tokens.shape[1])
        logits, h = self.model(tokens, positions + 1, self.inner, attn)
        cache.reserve(tokens.shape[1])
        cache.advance(features.shape[1])
        n = features.shape[1]
        return logits[:, -n:][:, logits_from:], h[:, -n:]


class SecondBestNet(OracleNet):
    """The oracle with its first two choices swapped at every third position: there its chain token is
    wrong and its second choice is the target's."""

    def __call__(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                 mask: torch.Tensor | None = None, logits_from: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        logits, h = super().__call__(tokens, features, positions, cache, mask, logits_from)
        top2 = logits.topk(2, dim=-1).indices  # (B, T, 2)
        swap = (positions[:, logits_from:] % 3 == 0).unsqueeze(-1)  # (B, T, 1)
        values = logits.gather(-1, top2)
        return logits.scatter(-1, top2, torch.where(swap, values.flip(-1), values)), h


@pytest.mark.parametrize("schedule", [FixedLength(4), Confidence(0.3, 3)], ids=["fixed4", "confidence"])
def test_eagle_reproduces_greedy(tiny_target: LoadedModel, untrained: Path, schedule: Any) -> None:
    strategy = EagleStrategy(tiny_target, "eagle", load_eagle(str(untrained)), schedule, 512, 64)
    for text in PROMPTS:
        prompt = prompt_ids(tiny_target, text)
        res = strategy.generate(prompt, GenerationParams(40), 0)
        assert res.output_ids == greedy_ids(tiny_target, prompt, 40)
        assert res.proposed > 0


def test_an_always_right_drafter_gets_every_token_accepted(tiny_target: LoadedModel) -> None:
    for text in PROMPTS:
        prompt = prompt_ids(tiny_target, text)
        strategy = EagleStrategy(tiny_target, "eagle", OracleNet(tiny_target, prompt[0]), FixedLength(3), 512, 64)
        res = strategy.generate(prompt, GenerationParams(41), 0)
        assert res.output_ids == greedy_ids(tiny_target, prompt, 41)
        assert res.accepted == res.proposed == 30  # ten rounds of 3 drafted + 1 bonus token, all accepted
        assert res.accept_lengths == [1] + [4] * 10


def test_target_cache_matches_recomputation_after_rejections(tiny_target: LoadedModel, untrained: Path) -> None:
    strategy = EagleStrategy(tiny_target, "eagle", load_eagle(str(untrained)), FixedLength(3), 512, 64)
    rejected = 0
    for state, proposal, verdict, proposer in speculative_rounds(strategy, prompt_ids(tiny_target, PROMPTS[0]), 8,
                                                                 GenerationParams(200)):
        rejected += len(verdict.nodes) < len(proposal.tokens)
        assert_kv_matches_fresh(strategy.engine, state.ids[:-1])
        # the drafter keeps only pairs on real features: one per committed token but the newest
        assert proposer.fed + len(proposer.pending) == len(state.ids) - 1 == strategy.cache.lengths[0] + len(
            proposer.pending)
        fresh = strategy.engine.prefill(state.ids[:-1]).hidden  # the target's features (and cache as it was)
        torch.testing.assert_close(proposer.pending, fresh[proposer.fed:], atol=1e-4, rtol=1e-4)
    assert rejected >= 4


def test_second_choices_beside_the_chain_keep_greedy_and_the_pairs_right(tiny_target: LoadedModel) -> None:
    # The cost-aware schedule with free verification (a flat pass-cost curve) verifies the drafter's second
    # choice beside every chain token. When the target takes one, the drafter's next pairs must be built on
    # that token's real feature, not on the rejected chain token's.
    prompt = prompt_ids(tiny_target, PROMPTS[1])
    schedule = CostAware(max_gamma=3, cost_ratio=0.0, verify_cost=0.0, siblings=3)
    strategy = EagleStrategy(tiny_target, "eagle", SecondBestNet(tiny_target, prompt[0]), schedule, 512, 64)
    assert schedule.curve is not None
    schedule.curve = [1.0] * len(schedule.curve)
    trees = sibling_wins = 0
    for state, proposal, verdict, proposer in speculative_rounds(strategy, prompt, 30, GenerationParams(300)):
        drafted = next((i for i, p in enumerate(proposal.parents) if p != i), len(proposal.parents))
        trees += not proposal.is_chain
        sibling_wins += bool(verdict.nodes) and verdict.nodes[-1] > drafted
        assert_kv_matches_fresh(strategy.engine, state.ids[:-1])
        fresh = strategy.engine.prefill(state.ids[:-1]).hidden
        torch.testing.assert_close(proposer.pending, fresh[proposer.fed:], atol=1e-4, rtol=1e-4)
    assert trees >= 20 and sibling_wins >= 5
    assert strategy.generate(prompt, GenerationParams(60), 0).output_ids == greedy_ids(tiny_target, prompt, 60)


def test_more_rows_score_more_of_the_target_head_and_stay_lossless(tiny_target: LoadedModel,
                                                                   tmp_path: Path) -> None:
    # A drafter trained on 64 kept rows, loaded with 160: the first 64 rows and their logits are the trained
    # ones, the rest the lowest other target ids scored by the same (target's) head.
    trainable = EagleTrainable(kept_vocab=64, save_dtype="fp32")
    rows = [{"input_ids": list(range(100, 300)), "labels": list(range(101, 301))}]
    module = trainable.build(tiny_target, rows)
    with torch.no_grad():
        module.net.fc.weight.mul_(8)
    trainable.save(module, tmp_path, {"steps": 0})
    kept, wide = load_eagle(str(tmp_path)).bind(tiny_target), load_eagle(str(tmp_path), rows=160).bind(tiny_target)
    assert kept.token_ids is not None and wide.token_ids is not None
    assert len(kept.token_ids) == 64 and len(wide.token_ids) == 160 and len(set(wide.token_ids.tolist())) == 160
    assert torch.equal(wide.token_ids[:64], kept.token_ids)
    extra = sorted(set(range(tiny_target.vocab_size)) - set(kept.token_ids.tolist()))[:96]
    assert wide.token_ids[64:].tolist() == extra
    ids, feats = torch.tensor([[5, 9, 31]]), torch.randn(1, 3, tiny_target.hidden_size)
    with torch.no_grad():
        small, _ = kept(ids, feats, torch.arange(3)[None], kept.new_cache(16), None)
        big, _ = wide(ids, feats, torch.arange(3)[None], wide.new_cache(16), None)
    torch.testing.assert_close(big[..., :64], small)
    torch.testing.assert_close(wide.lm_head.weight[64:], target_head(tiny_target)[wide.token_ids[64:]])
    strategy = EagleStrategy(tiny_target, "eagle", load_eagle(str(tmp_path), rows=160), FixedLength(3), 512, 64)
    proposed_outside, trained = 0, set(kept.token_ids.tolist())
    for text in PROMPTS:
        prompt = prompt_ids(tiny_target, text)
        assert strategy.generate(prompt, GenerationParams(40), 0).output_ids == greedy_ids(tiny_target, prompt, 40)
    prompt = prompt_ids(tiny_target, PROMPTS[0])
    for _, proposal, _, _ in speculative_rounds(strategy, prompt, 10, GenerationParams(100)):
        proposed_outside += sum(t not in trained for t in proposal.tokens)
    assert proposed_outside > 0  # the added rows really get proposed
    with pytest.raises(SpecdecError, match="below the 64 rows"):
        load_eagle(str(tmp_path), rows=32).bind(tiny_target)


@pytest.mark.parametrize("drafter", ["oracle", "random"])
def test_speculative_sampling_preserves_target_distribution(tiny_target: LoadedModel, untrained: Path,
                                                            drafter: str) -> None:
    sp = SamplingParams(temperature=0.3, top_p=0.9)
    prompt = prompt_ids(tiny_target, "Hello")
    net = OracleNet(tiny_target, prompt[0]) if drafter == "oracle" else load_eagle(str(untrained))
    strategy = EagleStrategy(tiny_target, "eagle", net, FixedLength(3), 256, 64)
    base = len(prompt) - 1  # the last prompt token is the root
    params = GenerationParams(8, sp)
    counts = torch.zeros(tiny_target.vocab_size)
    n = 300
    out = strategy.engine.prefill(prompt[:-1])
    proposer = strategy.make_proposer()
    qs = []
    for seed in range(n):
        state = DecodeState(list(prompt), base, params, torch.Generator().manual_seed(seed))
        proposer.start(state, out)
        proposal = proposer.propose(state)
        assert proposal is not None and proposal.probs is not None
        qs.append(proposal.probs[0])
        verdict, _ = strategy._step(state, proposal)
        counts[verdict.tokens[0]] += 1
        strategy.engine.rollback(base)
    p = warp(strategy.engine.prefill(prompt).logits[-1], sp)  # (V,) the target's distribution
    assert_draws_follow(counts, p)
    tv = 0.5 * float((p - qs[0]).abs().sum())
    assert (tv < 1e-4) if drafter == "oracle" else (tv > 0.5)  # the two cases really differ


def test_saved_drafter_round_trips_and_refuses_another_target(tiny_target: LoadedModel, untrained: Path) -> None:
    meta = json.loads((untrained / "eagle.json").read_text())
    assert meta["base_model"] == "tiny-llama" and meta["hidden_size"] == tiny_target.hidden_size
    ckpt = load_eagle(str(untrained))
    net = ckpt.bind(tiny_target)
    trainable = EagleTrainable(kept_vocab=0, save_dtype="fp32")
    module = trainable.build(tiny_target, None)
    with torch.no_grad():
        module.net.fc.weight.mul_(8)
    ids = torch.tensor([[5, 9, 31, 7, 2]])
    feats = torch.randn(1, 5, tiny_target.hidden_size)
    with torch.no_grad():
        ref_h = module(ids, feats)[0]
        ref_logits = module.net.lm_head(ref_h)
        cache = net.new_cache(64)
        logits, h = net(ids, feats, torch.arange(5)[None], cache, cache.attention_mask(None, 5))
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(h, ref_h, atol=1e-5, rtol=1e-4)
    other = load_model("tiny-wide", "builtin:tiny-llama", matmul="torch", tiny={"hidden_size": 32})
    with pytest.raises(SpecdecError, match="trained for tiny-llama"):
        ckpt.bind(other)
    with pytest.raises(SpecdecError, match="head=eagle"):
        load_eagle(str(untrained / "missing"))


def test_short_training_lowers_loss_and_ships_a_lossless_drafter(tmp_path: Path, tiny_target: LoadedModel) -> None:
    out = tmp_path / "eagle"
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        cfg = compose("train", overrides=[*tiny_train_overrides("eagle", out, tmp_path / "data"),
                                          "train.max_steps=30", "train.lr=3e-3", "head.kept_vocab=128"])
    meta = train(cfg)
    assert meta["steps"] == 30 and meta["last_loss"] < 0.8 * meta["first_loss"]  # a fifth off in 30 steps
    card = (out / "README.md").read_text()
    assert "# eagle for tiny-llama" in card and "`reg_weight=1.0` `kl_weight=0.1`" in card  # unnamed defaults too
    scfg = group_config("strategy", "eagle")  # composed: its schedule comes from the defaults list
    scfg.drafter.path = str(out)
    strategy = instantiate(scfg)(target=tiny_target, max_len=512, prefill_chunk=64)
    assert strategy.net.token_ids is not None and len(strategy.net.token_ids) == 128
    prompt = prompt_ids(tiny_target, "Rewrite this sentence politely.")
    res = strategy.generate(prompt, GenerationParams(24), 0)
    assert res.output_ids == greedy_ids(tiny_target, prompt, 24) and res.proposed > 0


@pytest.mark.parametrize("context", ["guessed", "drafting"])
def test_training_loss_is_the_plain_formula(tiny_target: LoadedModel, context: str) -> None:
    """The loss reads the kept rows through head_loss's chunks; its value and gradients are those of the
    plain formula over whole (rows, K) logits: smooth L1 on the guessed feature plus KL(target || drafter),
    averaged over the unrolled passes, each weighted as configured (here neither 1 nor the default), on real
    (unpadded) pairs only, and under head.context=drafting at pass s only on pairs t >= s - 1, which have real
    pairs before their guesses."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    trainable = EagleTrainable(kept_vocab=0, save_dtype="fp32", noise=0.0, unroll=3, context=context,
                               reg_weight=0.7, kl_weight=0.3)
    module = trainable.build(tiny_target, None).double()
    B, T, D = 3, 12, tiny_target.hidden_size
    ids = torch.randint(3, tiny_target.vocab_size, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 8:], mask[2, 5:] = 0, 0  # right padding
    labels = torch.where(mask.bool(), torch.roll(ids, -1, 1), -100)
    hidden = torch.randn(B, T, D, dtype=torch.float64)
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    params = [p for p in module.parameters() if p.requires_grad]

    loss, logs = trainable.loss(module, batch, hidden)
    got = torch.autograd.grad(loss, params)

    valid, head = mask[:, 1:].bool(), module.net.lm_head.weight
    feats, want_loss = hidden[:, :-1], torch.zeros((), dtype=torch.float64)
    passes = module(ids[:, 1:], feats, 3, context) if context == "drafting" else None  # their test: below
    for s in range(1, 4):
        if passes is None:  # guessed: one causal pass over the previous pass's guesses
            guess = module(ids[:, 1:], feats)[0]
            feats = torch.cat([feats[:, :1], guess[:, :-1]], 1)
        else:
            guess = passes[s - 1]
        keep = valid.clone()
        if context == "drafting":
            keep[:, :s - 1] = False
        nxt = hidden[:, 1:][keep]
        kl = F.kl_div(F.log_softmax(guess[keep] @ head.T, -1), F.log_softmax(nxt @ head.T, -1), log_target=True,
                      reduction="batchmean")
        want_loss = want_loss + (0.7 * F.smooth_l1_loss(guess[keep], nxt) + 0.3 * kl) / 3
    want = torch.autograd.grad(want_loss, params)
    torch.testing.assert_close(loss, want_loss)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert set(logs) == {f"{m}{k}" for m in ("reg", "kl", "acc") for k in ("", "2", "3")} and 0 <= logs["acc"] <= 1
    with pytest.raises(SpecdecError, match="head.context"):
        EagleTrainable(context="real")


@pytest.mark.parametrize("layers", [1, 2])
def test_drafting_context_passes_are_what_drafting_computes(layers: int) -> None:
    """head.context=drafting: pass s at pair j equals drafting's s-th token after the last verified pair
    j - (s - 1), the drafter run causally over real pairs and then over its own guesses, each fed to the next
    pair. The guessed context, whose later passes attend to guesses only, does not."""
    from heads.batches import NoCache
    from heads.eagle import EagleNet, EagleTrainModule
    from specdec.models.llama import LlamaArgs

    torch.manual_seed(0)
    args = LlamaArgs(dim=32, n_layers=layers, n_heads=4, n_kv_heads=2, vocab_size=64, hidden_dim=48, head_dim=8,
                     norm_eps=1e-5, rope_theta=10000.0, max_position=64, tie_embeddings=False, qkv_bias=False,
                     o_bias=False)
    net = EagleNet(args, 64).eval()
    module = EagleTrainModule(net)
    T, unroll = 9, 3
    tokens, feats = torch.randint(0, 64, (1, T)), torch.randn(1, T, 32)
    pos = torch.arange(T)[None]
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        exact, guessed = module(tokens, feats, unroll, "drafting"), module(tokens, feats, unroll, "guessed")
        torch.testing.assert_close(exact[0], guessed[0])  # pass 1: real features, causal, in both
        for s in range(1, unroll + 1):
            for j in range(s - 1, T):
                seen = feats[:, :j - s + 2]  # real pairs up to the last verified one
                while seen.shape[1] < j + 1:  # then each guess becomes the next pair's feature
                    n = seen.shape[1]
                    _, h = net(tokens[:, :n], seen, pos[:, :n], NoCache(), causal[..., :n, :n])
                    seen = torch.cat([seen, h[:, -1:]], 1)
                _, h = net(tokens[:, :j + 1], seen, pos[:, :j + 1], NoCache(), causal[..., :j + 1, :j + 1])
                torch.testing.assert_close(exact[s - 1][0, j], h[0, j], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(guessed[1][0, 2:], exact[1][0, 2:], atol=1e-3)


def test_training_can_start_from_a_saved_drafter(tmp_path: Path, tiny_target: LoadedModel) -> None:
    """head.init_from: the saved drafter's weights and rows are where training starts, not fresh ones."""
    first, data = tmp_path / "first", tmp_path / "data"
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        cfg = compose("train", overrides=[*tiny_train_overrides("eagle", first, data), "train.max_steps=30",
                                          "train.lr=3e-3", "head.kept_vocab=128"])
    fresh = train(cfg)
    net = load_eagle(str(first)).bind(tiny_target)
    trainable = EagleTrainable(kept_vocab=64, save_dtype="fp32", init_from=str(first))
    module = trainable.build(tiny_target, None)  # its own rows: no data needed to pick them
    assert trainable.kept_ids is not None and torch.equal(trainable.kept_ids, net.token_ids)
    ids, feats = torch.tensor([[5, 9, 31, 7, 2]]), torch.randn(1, 5, tiny_target.hidden_size)
    with torch.no_grad():
        cache = net.new_cache(64)
        want = net(ids, feats, torch.arange(5)[None], cache, cache.attention_mask(None, 5))
        guess = module(ids, feats)[0]
        torch.testing.assert_close(guess, want[1], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(module.net.lm_head(guess), want[0], atol=1e-5, rtol=1e-4)
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        cfg = compose("train", overrides=[*tiny_train_overrides("eagle", tmp_path / "second", data),
                                          "train.max_steps=3", f"head.init_from={first}"])
    second = train(cfg)
    assert second["first_loss"] < 0.8 * fresh["first_loss"]
    card = (tmp_path / "second" / "README.md").read_text()
    assert f"Started from: the drafter in `{first}`" in card
    # the drafter's whole training is counted across fine-tunes: fresh minutes, then each run's added
    assert second["minutes_in_all"] == pytest.approx(fresh["minutes"] + second["minutes"])
    assert "Training in all: " in card and "unknown" not in card
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        cfg = compose("train", overrides=[*tiny_train_overrides("eagle", tmp_path / "third", data),
                                          "train.max_steps=1", f"head.init_from={tmp_path / 'second'}"])
    third = train(cfg)
    assert third["minutes_in_all"] == pytest.approx(second["minutes_in_all"] + third["minutes"])
    with pytest.raises(SpecdecError, match="head.layers=2"):
        EagleTrainable(layers=2, init_from=str(first)).build(tiny_target, None)


@pytest.mark.parametrize("backend,matmul", [("hf", "torch"), ("compact", "numba")])
def test_eagle_runs_on_every_target_path(load_tiny: Any, tmp_path: Path, backend: str, matmul: str) -> None:
    """The transformers backend (features from its hidden states) and the numba CPU kernels (the drafter's
    blocks and linears swapped like the target's) stay lossless."""
    if matmul == "numba":
        pytest.importorskip("numba")
    target = load_tiny("llama", backend=backend, matmul=matmul)
    trainable = EagleTrainable(kept_vocab=0, save_dtype="fp32")
    module = trainable.build(target, None)
    with torch.no_grad():
        module.net.fc.weight.mul_(8)
    trainable.save(module, tmp_path, {"steps": 0})
    strategy = EagleStrategy(target, "eagle", load_eagle(str(tmp_path)), FixedLength(3), 256, 64)
    reference = load_tiny("llama")
    for seed in (3, 4):
        prompt = torch.randint(3, 200, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
        want = Greedy(reference, "greedy", 256, 64).generate(prompt, GenerationParams(30), 0).output_ids
        res = strategy.generate(prompt, GenerationParams(30), 0)
        assert res.output_ids == want and res.proposed > 0


# --------------------------------------------------------------------------------------------------
# head.layout=eagle1: EAGLE-1's published network (no norm on layer 0's input nor on the output)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["specdec", "eagle1"])
def test_fused_stack_computes_both_layouts(load_tiny: Any, tmp_path: Path, layout: str) -> None:
    """numba's fused layer stack runs the drafter (no fallback to the torch path) and matches torch's blocks,
    with layer 0's input norm and the output norm (specdec) or without them (eagle1)."""
    pytest.importorskip("numba")
    from specdec.models.cpu_layer import FusedStack

    torch_target, numba_target = load_tiny("llama"), load_tiny("llama", matmul="numba")
    folder = saved_eagle(torch_target, tmp_path, layout)
    ref, net = load_eagle(str(folder)).bind(torch_target), load_eagle(str(folder)).bind(numba_target)
    assert isinstance(net.fused, FusedStack) and ref.fused is None
    assert net.fused.attn_normed.tolist() == [layout == "specdec", True] and net.fused.final_normed == (
        layout == "specdec")
    ids = torch.tensor([[5, 9, 31, 7, 2, 44]])
    feats = torch.randn(1, 6, torch_target.hidden_size, generator=torch.Generator().manual_seed(5))
    outs = []
    for model in (ref, net):
        cache = model.new_cache(64)
        with torch.no_grad():  # a 5-pair pass (masked), then one pair (no mask)
            first = model(ids[:, :5], feats[:, :5], torch.arange(5)[None], cache, cache.attention_mask(None, 5))
            second = model(ids[:, 5:], feats[:, 5:], torch.tensor([[5]]), cache)
        outs.append([t for pair in (first, second) for t in pair])
    for want, got in zip(*outs, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_eagle1_layout_trains_and_exports(tmp_path: Path, tiny_target: LoadedModel) -> None:
    """head.layout=eagle1 for a couple of steps: the saved drafter loads as EAGLE-1's network and exports."""
    from safetensors.torch import load_file

    from heads.export import main as export_main

    out = tmp_path / "eagle"
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        cfg = compose("train", overrides=[*tiny_train_overrides("eagle", out, tmp_path / "data"),
                                          "train.max_steps=2", "head.layout=eagle1"])
    assert train(cfg)["steps"] == 2
    meta = json.loads((out / "eagle.json").read_text())
    assert meta["layout"] == "eagle1" and meta["kept_vocab"] == tiny_target.vocab_size
    net = load_eagle(str(out)).bind(tiny_target)
    assert net.token_ids is None and not net.fc.bias.any()  # the whole head; an exact zero fc bias
    assert export_main(["eagle", str(out), "--out", str(tmp_path / "export")]) == 0
    names = set(load_file(str(tmp_path / "export" / "model.safetensors")))
    assert "fc.bias" in names and "layers.0.self_attn.q_proj.weight" in names
    assert "layers.0.input_layernorm.weight" not in names and "embed_tokens.weight" not in names
