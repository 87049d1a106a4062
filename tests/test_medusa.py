"""Medusa: heads, tree verification against sequential decoding, losslessness, training, tree tuning."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_cache_matches_fresh, chain_forward, random_ids, spy_compactions, tiny_train_overrides
from omegaconf import OmegaConf

from heads.medusa import CONFIG_FILE, MedusaHeads, load_heads, medusa_heads, output_weight
from heads.medusa_train import MedusaTrainable
from heads.tree_tuning import (
    expected_accepted,
    greedy_tree,
    joint_estimate,
    pass_cost,
    product_estimate,
    rank_accuracy,
    tune,
)
from specdec.cli_checks import CONFIG_DIR
from specdec.engine.engine import StaticEngine
from specdec.engine.sampling import SamplingParams
from specdec.errors import SpecdecError
from specdec.models import cpu_kernels
from specdec.models.loader import LoadedModel, load_model
from specdec.strategies.base import DecodeState, GenerationParams, TurnResult
from specdec.strategies.greedy import Greedy
from specdec.strategies.medusa import Medusa, MedusaProposer, chain_tree, load_tree
from specdec.trees import paths_to_parents, tree_depth, tree_mask
from specdec.verify import Proposal, verify_typical

VOCAB = 512
CHAIN = chain_tree(4)
WIDE = [(r,) for r in range(8)] + [(0, 0), (1, 0)]
DEEP = [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (1,), (1, 0), (1, 0, 0), (0, 1), (0, 1, 0)]
# the paper's 63-node tree for the shipped heads (experiment=paper_trees): ranks up to 7, four levels deep
PAPER63 = str(CONFIG_DIR.parent / "heads" / "trees" / "smollm2-135m-medusa-63.yaml")
TREES = {"chain": CHAIN, "wide": WIDE, "deep": DEEP, "default": "default", "paper63": PAPER63}


def path_of(parents: list[int], node: int) -> list[int]:
    path = []
    while node != 0:
        path.append(node)
        node = parents[node - 1]
    return path[::-1]


# ------------------------------------------------------------------------------------------------
# tree verification at the engine level
# ------------------------------------------------------------------------------------------------


def test_tree_logits_equal_sequential_decoding_and_compaction_equals_fresh(tiny_target: LoadedModel) -> None:
    prompt = random_ids(11, VOCAB, seed=21)
    parents, _ = paths_to_parents(DEEP + WIDE)
    tokens = random_ids(len(parents), VOCAB, seed=22)
    nodes = [prompt[-1], *tokens]
    engine = StaticEngine(tiny_target.model, 96)
    engine.prefill(prompt[:-1])
    base = engine.length
    out = engine.forward(torch.tensor(nodes), tree_depth(parents), tree_mask(parents))
    for node in range(len(nodes)):
        seq = prompt[:-1] + [nodes[0]] + [nodes[n] for n in path_of(parents, node)]
        _, ref = chain_forward(tiny_target.model, seq)
        torch.testing.assert_close(out.logits[node], ref[-1], atol=1e-5, rtol=1e-4)
    deepest = max(range(len(nodes)), key=lambda n: (len(path_of(parents, n)), n))  # a late branch: not contiguous
    keep = [0, *path_of(parents, deepest)]
    assert keep != list(range(len(keep)))
    engine.compact(base, [base + n for n in keep])
    assert_cache_matches_fresh(engine, prompt[:-1] + [nodes[n] for n in keep])


# ------------------------------------------------------------------------------------------------
# heads
# ------------------------------------------------------------------------------------------------


def test_heads_shapes_and_kept_vocab_ids(tiny_target: LoadedModel) -> None:
    heads = medusa_heads(tiny_target, num_heads=3, num_layers=2, head_vocab=100, seed=0)
    h = torch.randn(2, 5, 64)
    assert heads(h).shape == (2, 5, 3, 100)
    top = heads.topk(h[0, 0], 4)
    assert top.shape == (3, 4)
    assert set(top.flatten().tolist()) <= set(heads.kept_ids.tolist())
    if cpu_kernels.available():  # two blocks per head on the CPU kernels: the same stacks, the same ranking
        heads.use_cpu_kernels()
        want = torch.stack([blocks(h[0, 0]) for blocks in heads.blocks]).numpy()  # (3, dim)
        np.testing.assert_allclose(heads._cpu_features(h[0, 0], 3), want, rtol=1e-5, atol=1e-5)
        assert torch.equal(heads.topk(h[0, 0], 4), top)
    full = medusa_heads(tiny_target, num_heads=3, seed=0)
    assert full(h).shape == (2, 5, 3, VOCAB)


@pytest.mark.parametrize("projection", ["shared", "own"])
def test_topk_runs_only_the_heads_asked_for(tiny_target: LoadedModel, projection: str) -> None:
    heads = medusa_heads(tiny_target, num_heads=3, projection=projection, head_vocab=100, seed=2)
    h = torch.randn(64)
    logits = heads(h)  # (3, 100): every head, the training path
    want = heads.kept_ids[logits.topk(4, dim=-1).indices]  # (3, 4)
    assert torch.equal(heads.topk(h, 4), want)
    assert torch.equal(heads.topk(h, 4, depth=2), want[:2])
    heads.use_cpu_kernels()  # the target's few-row CPU kernels: the blocks and the projection, shared or own
    assert (heads.proj_panels is not None) == (projection == "shared" and cpu_kernels.available())
    assert (heads.own_panels is not None) == (projection == "own" and cpu_kernels.available())
    assert (heads.block_panels is not None) == cpu_kernels.available()
    assert torch.equal(heads.topk(h, 4, depth=1), want[:1])
    if cpu_kernels.available():  # an int8 copy of the projection ranks by the rounded weights; blocks stay fp32
        heads.use_cpu_kernels("int8")
        assert heads.block_panels is not None and heads.block_panels[0][0].dtype == np.float32
        features = torch.stack([blocks(h) for blocks in heads.blocks[:2]]).numpy()  # (2, dim)
        np.testing.assert_allclose(heads._cpu_features(h, 2), features, rtol=1e-5, atol=1e-5)
        if heads.proj_panels is not None:
            assert heads.proj_panels.dtype == np.int8
            rounded = cpu_kernels.to_int8(heads.proj.numpy())
            logits = cpu_kernels.matmul(heads._cpu_features(h, 2), heads.proj_panels, len(rounded))
            np.testing.assert_allclose(logits, features @ rounded.T, rtol=1e-4, atol=1e-4)
            ranked = heads.kept_ids[torch.from_numpy(logits).topk(4, dim=-1).indices]
            assert torch.equal(heads.topk(h, 4, depth=2), ranked)
        if heads.own_panels is not None:  # each head's rows through its own rounded copy
            assert [p.dtype for p in heads.own_panels] == [np.int8] * 3
            rounded = [cpu_kernels.to_int8(w.numpy()) for w in heads.proj[:2]]
            logits = np.stack([f @ r.T for f, r in zip(features, rounded)])  # (2, V')
            np.testing.assert_allclose(heads._step_logits(h[None], 2)[0].numpy(), logits, rtol=1e-4, atol=1e-4)
    with pytest.raises(SpecdecError, match="not one of"):
        heads.use_cpu_kernels("fp8")


def test_untrained_heads_start_as_the_target_head(tiny_target: LoadedModel) -> None:
    heads = medusa_heads(tiny_target, num_heads=2)
    h = torch.randn(64)
    want = tiny_target.model.lm_head(h[None])[0].argmax()
    assert heads.topk(h, 1)[:, 0].tolist() == [int(want)] * 2


@pytest.mark.parametrize("projection", ["shared", "own"])
def test_head_blocks_are_independent(tiny_target: LoadedModel, projection: str) -> None:
    heads = medusa_heads(tiny_target, num_heads=3, num_layers=2, projection=projection, seed=1)
    blocks = [m for m in heads.modules() if type(m).__name__ == "ResBlock"]
    assert len(blocks) == 6 and len({id(b) for b in blocks}) == 6
    ptrs = [p.data_ptr() for p in heads.parameters()]
    assert len(ptrs) == len(set(ptrs))
    h = torch.randn(4, 64)
    before = heads(h)
    with torch.no_grad():
        heads.blocks[1][0].linear.weight.add_(0.5)
    after = heads(h)
    changed = [not torch.equal(before[:, k], after[:, k]) for k in range(3)]
    assert changed == [False, True, False]


@pytest.mark.parametrize("projection", ["shared", "own"])
def test_save_load_round_trip(tiny_target: LoadedModel, tmp_path: Path, projection: str) -> None:
    cfg = medusa_heads(tiny_target, num_heads=3, projection=projection, head_vocab=64).cfg
    # kept ids that are not a prefix: they must travel with the weights
    heads = MedusaHeads(cfg, output_weight(tiny_target), torch.arange(64) * 7)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape) * 0.1)
    heads.save(tmp_path / "m", {"steps": 3})
    loaded = load_heads(tiny_target, tmp_path / "m")
    h = torch.randn(6, 64)
    torch.testing.assert_close(loaded(h), heads(h), rtol=0, atol=0)
    assert loaded.kept_ids.tolist() == heads.kept_ids.tolist()
    assert loaded.cfg == heads.cfg


def test_more_rows_widen_shared_heads_and_stay_lossless(tiny_target: LoadedModel, tmp_path: Path) -> None:
    cfg = medusa_heads(tiny_target, num_heads=3, head_vocab=64).cfg
    heads = MedusaHeads(cfg, output_weight(tiny_target), torch.arange(64) * 7)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape) * 0.1)
    heads.save(tmp_path / "m", {"steps": 3})
    wide = load_heads(tiny_target, tmp_path / "m", rows=160)
    assert wide.kept_ids[:64].tolist() == heads.kept_ids.tolist() and wide.cfg.head_vocab == 160
    assert wide.kept_ids[64:].tolist() == sorted(set(range(VOCAB)) - set(heads.kept_ids.tolist()))[:96]
    h = torch.randn(6, 64)
    torch.testing.assert_close(wide(h)[..., :64], heads(h))  # the trained rows score as before
    medusa = Medusa(tiny_target, max_len=256, heads=wide, tree=TREES["default"])
    for prompt, want in zip(PROMPTS, _greedy_outputs(tiny_target, PROMPTS, 30)):
        assert medusa.generate(prompt, GenerationParams(30), 0).output_ids == want
    MedusaHeads(replace(cfg, projection="own"), output_weight(tiny_target), torch.arange(64)).save(tmp_path / "own")
    with pytest.raises(SpecdecError, match="own projections"):
        load_heads(tiny_target, tmp_path / "own", rows=160)


def test_heads_of_another_model_are_refused(tiny_target: LoadedModel, load_tiny, tmp_path: Path) -> None:
    medusa_heads(tiny_target, num_heads=2, seed=0).save(tmp_path / "m")
    other = load_tiny("llama")  # same shape and name, other weights
    with pytest.raises(SpecdecError, match="trained for tiny-llama") as err:
        load_heads(other, tmp_path / "m")
    assert "\n" not in str(err.value)
    wide = load_model("tiny-wide", "builtin:tiny-llama", matmul="torch", tiny={"hidden_size": 32})
    with pytest.raises(SpecdecError, match="hidden size 64"):
        load_heads(wide, tmp_path / "m")
    with pytest.raises(SpecdecError, match="no Medusa heads"):
        load_heads(tiny_target, tmp_path / "missing")
    (tmp_path / "m" / CONFIG_FILE).write_text("{oops")
    with pytest.raises(SpecdecError, match="not a Medusa heads config"):
        load_heads(tiny_target, tmp_path / "m")


# ------------------------------------------------------------------------------------------------
# the strategy: lossless at temperature 0
# ------------------------------------------------------------------------------------------------


def _greedy_outputs(target: LoadedModel, prompts: list[list[int]], n: int) -> list[list[int]]:
    g = Greedy(target, "greedy", max_len=256)
    return [g.generate(p, GenerationParams(n), 0).output_ids for p in prompts]


PROMPTS = [random_ids(9 + 4 * i, VOCAB, seed=30 + i) for i in range(3)]


@pytest.mark.parametrize("tree", list(TREES))
def test_random_heads_reproduce_greedy(tiny_target: LoadedModel, tree: str) -> None:
    medusa = Medusa(tiny_target, max_len=256, heads=medusa_heads(tiny_target, num_heads=4, seed=5),
                    tree=TREES[tree])
    params = GenerationParams(40)
    for prompt, want in zip(PROMPTS, _greedy_outputs(tiny_target, PROMPTS, 40)):
        res = medusa.generate(prompt, params, 0)
        assert res.output_ids == want
        _check_accounting(res)


def test_own_projection_heads_on_the_cpu_kernels_reproduce_greedy(tiny_target: LoadedModel) -> None:
    """Heads with their own (perturbed) projections, each streamed from an int8 copy when the kernels exist:
    other candidates, the same output."""
    heads = medusa_heads(tiny_target, num_heads=3, projection="own", head_vocab=200, seed=7)
    with torch.no_grad():
        heads.proj.add_(torch.randn(heads.proj.shape, generator=torch.Generator().manual_seed(8)) * 0.5)
    heads.use_cpu_kernels("int8")
    assert (heads.own_panels is not None) == cpu_kernels.available()
    medusa = Medusa(tiny_target, max_len=256, heads=heads, tree=TREES["default"])
    for prompt, want in zip(PROMPTS, _greedy_outputs(tiny_target, PROMPTS, 40)):
        res = medusa.generate(prompt, GenerationParams(40), 0)
        assert res.output_ids == want
        _check_accounting(res)


def _check_accounting(res: TurnResult) -> None:
    assert res.accept_lengths is not None and res.decode_steps is not None
    assert sum(res.accept_lengths) == len(res.output_ids)
    assert len(res.accept_lengths) == res.decode_steps + 1


class OracleProposer(MedusaProposer):
    """Heads that often guess right: the true continuation at rank 0 or 1, noise elsewhere."""

    def __init__(self, reference: list[int], seed: int, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.reference = reference
        self.gen = torch.Generator().manual_seed(seed)

    def candidates(self, state: DecodeState) -> torch.Tensor:
        K = self.heads.num_heads
        top = torch.randint(3, VOCAB, (K, self.width), generator=self.gen)
        root = state.output_len - 1  # index of the root in the reference output
        for d in range(K):
            i = root + 1 + d
            u = float(torch.rand((), generator=self.gen))
            rank = 0 if u < 0.7 else 1 if u < 0.9 else None
            if i < len(self.reference) and rank is not None and rank < self.width:
                top[d, rank] = self.reference[i]
        return top


@pytest.mark.parametrize("tree", ["chain", "wide", "deep", "default", "paper63"])
def test_oracle_heads_accept_long_paths_and_stay_lossless(tiny_target: LoadedModel, tree: str) -> None:
    n = 48
    medusa = Medusa(tiny_target, max_len=256, heads=medusa_heads(tiny_target, num_heads=4), tree=TREES[tree])
    compactions = spy_compactions(medusa)
    longest = 0
    room = lambda: medusa.engine.max_len - medusa.engine.length - 1  # noqa: E731
    for i, (prompt, want) in enumerate(zip(PROMPTS, _greedy_outputs(tiny_target, PROMPTS, n + 8))):
        medusa.make_proposer = lambda w=want, s=i: OracleProposer(  # type: ignore[method-assign]
            w, s, medusa.heads, medusa.paths, room)
        res = medusa.generate(prompt, GenerationParams(n), 0)
        assert res.output_ids == want[:n]
        _check_accounting(res)
        longest = max(longest, max(res.accept_lengths or [0]))
    depth = max(len(p) for p in medusa.paths)
    assert longest == depth + 1  # a whole root-to-leaf path accepted in one pass
    if tree != "chain":  # a path through a rank-1 node sits behind its siblings: its K/V must move
        assert any(keep != list(range(len(keep))) for keep in compactions)


def test_tree_is_trimmed_to_the_cache(tiny_target: LoadedModel) -> None:
    prompt = random_ids(20, VOCAB, seed=40)
    medusa = Medusa(tiny_target, max_len=40, heads=medusa_heads(tiny_target, num_heads=4, seed=3), tree="default")
    res = medusa.generate(prompt, GenerationParams(19), 0)
    assert res.output_ids == _greedy_outputs(tiny_target, [prompt], 19)[0]


def test_tree_specs(tmp_path: Path) -> None:
    assert load_tree("chain", 3) == [(0,), (0, 0), (0, 0, 0)]
    assert all(len(p) <= 2 for p in load_tree("default", 2))
    (tmp_path / "t.yaml").write_text("choices:\n- [0]\n- [1]\n- [0, 0]\n")
    assert load_tree(str(tmp_path / "t.yaml"), 4) == [(0,), (1,), (0, 0)]
    with pytest.raises(SpecdecError, match="2 deep"):
        load_tree([[0], [0, 0]], 1)
    with pytest.raises(SpecdecError, match="not found"):
        load_tree(str(tmp_path / "none.yaml"), 4)


def test_strategy_config_builds(tiny_target: LoadedModel) -> None:
    cfg = OmegaConf.load(CONFIG_DIR / "strategy" / "medusa.yaml")
    cfg.heads.path = None
    from hydra.utils import instantiate

    factory = instantiate(cfg)
    strategy = factory(target=tiny_target, max_len=128, prefill_chunk=32)
    assert isinstance(strategy, Medusa) and isinstance(strategy.heads, MedusaHeads)
    assert strategy.name == "medusa"
    cfg.heads.path = "/nonexistent/heads"
    with pytest.raises(SpecdecError, match="no Medusa heads"):
        instantiate(cfg)(target=tiny_target, max_len=128, prefill_chunk=32)


# ------------------------------------------------------------------------------------------------
# typical acceptance (temperature > 0)
# ------------------------------------------------------------------------------------------------


def test_verify_typical_rule() -> None:
    V = 6
    logits = torch.full((5, V), -10.0)
    logits[0, 1], logits[0, 2] = 3.0, 2.5  # root: tokens 1 and 2 both plausible
    logits[1, 3] = 5.0  # after node 1: confident in 3
    logits[2, 4] = 5.0
    logits[3, 5] = 5.0
    # node 1 = token 1, node 2 = token 2 (both children of the root), node 3 = token 0 under node 1 (unlikely),
    # node 4 = token 4 under node 2 (the confident choice)
    proposal = Proposal(torch.tensor([1, 2, 0, 4]), [0, 0, 1, 2])
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    v = verify_typical(proposal, logits, params, gen, epsilon=0.09, delta=0.3)
    assert v.nodes == [2, 4]
    v2 = verify_typical(proposal, logits, params, torch.Generator().manual_seed(0), epsilon=0.09, delta=0.3)
    assert v2 == v
    # a stricter threshold than any probability here rejects everything; the target still gives a token
    strict = verify_typical(proposal, logits, params, gen, epsilon=1.0, delta=100.0)
    assert strict.nodes == [] and len(strict.tokens) == 1


def test_typical_acceptance_is_reproducible(tiny_target: LoadedModel) -> None:
    medusa = Medusa(tiny_target, max_len=256, heads=medusa_heads(tiny_target, num_heads=4), tree="default")
    params = GenerationParams(32, SamplingParams(temperature=0.8, top_p=0.95))
    runs = [medusa.generate(PROMPTS[0], params, seed).output_ids for seed in (7, 7, 8)]
    assert runs[0] == runs[1] and len(runs[0]) == 32
    assert runs[0] != runs[2]
    exact = Medusa(tiny_target, max_len=256, heads=medusa.heads, tree="default", acceptance="exact")
    assert exact.generate(PROMPTS[0], params, 7).output_ids == exact.generate(PROMPTS[0], params, 7).output_ids


def test_bad_acceptance_is_refused(tiny_target: LoadedModel) -> None:
    with pytest.raises(SpecdecError, match="acceptance"):
        Medusa(tiny_target, heads=medusa_heads(tiny_target), acceptance="greedy")


# ------------------------------------------------------------------------------------------------
# training
# ------------------------------------------------------------------------------------------------


def _distill_batch(target: LoadedModel, n_prompts: int, n_new: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The target's own greedy continuations: input_ids, labels (-100 on the prompt), hidden states."""
    prompts = [random_ids(6, VOCAB, seed=60 + i) for i in range(n_prompts)]
    outs = _greedy_outputs(target, prompts, n_new)
    ids = torch.tensor([p + o for p, o in zip(prompts, outs)])  # (B, T)
    labels = torch.full_like(ids, -100)
    labels[:, 5:-1] = ids[:, 6:]
    engine = StaticEngine(target.model, 128)
    hidden = torch.stack([engine.prefill(row.tolist()).hidden for row in ids])  # (B, T, dim)
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}, hidden


def test_short_training_lowers_the_loss(tiny_target: LoadedModel) -> None:
    torch.manual_seed(0)
    batch, hidden = _distill_batch(tiny_target, 6, 24)
    data = type("Data", (), {"column_names": ["labels"], "__getitem__": lambda s, k: batch["labels"].tolist()})()
    trainable = MedusaTrainable(num_heads=3, num_layers=1, head_vocab=256)
    module = trainable.build(tiny_target, data)
    heads = module.heads
    kept = set(heads.kept_ids.tolist())
    assert set(batch["labels"][batch["labels"] >= 0].tolist()) <= kept  # every label is in the kept vocabulary
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=3e-3)
    first, metrics = trainable.loss(module, batch, hidden)
    assert {"loss", "loss_0", "top1_0", "top5_2"} <= set(metrics)
    for _ in range(60):
        loss, metrics = trainable.loss(module, batch, hidden)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert metrics["loss"] < 0.7 * float(first.detach())
    assert metrics["top1_0"] > 0.3


# ------------------------------------------------------------------------------------------------
# tree tuning
# ------------------------------------------------------------------------------------------------


def _brute_force_best(prob, budget: int, width: int, depth: int) -> float:
    """Best sum of path probabilities over every prefix-closed set of `budget` nodes."""
    level = {frozenset()}
    for _ in range(budget):
        grown = set()
        for tree in level:
            for parent in [(), *tree]:
                if len(parent) < depth:
                    for r in range(width):
                        child = (*parent, r)
                        if child not in tree:
                            grown.add(tree | {child})
        level = grown
    return max(sum(prob(p) for p in t) for t in level)


def _synthetic_ranks(width: int, depth: int, n: int, seed: int) -> torch.Tensor:
    """Correlated heads: an 'easy' context makes every head more likely to rank the truth first."""
    gen = torch.Generator().manual_seed(seed)
    easy = torch.rand(n, 1, generator=gen) < 0.5
    base = torch.randint(0, width + 1, (n, depth), generator=gen)
    good = torch.randint(0, 2, (n, depth), generator=gen)
    return torch.where(easy, good, base)


@pytest.mark.parametrize("estimate", ["product", "joint"])
def test_greedy_tree_is_optimal_against_brute_force(estimate: str) -> None:
    width, depth = 3, 3
    ranks = _synthetic_ranks(width, depth, 400, seed=1)
    prob = (product_estimate(rank_accuracy(ranks, width)) if estimate == "product" else joint_estimate(ranks))
    for budget in range(1, 6):
        tree = greedy_tree(prob, budget, width, depth)
        assert len(tree) == budget and len(set(tree)) == budget
        assert all(p[:-1] in tree or len(p) == 1 for p in tree)  # prefix-closed
        assert all(tree.index(p[:-1]) < tree.index(p) for p in tree if len(p) > 1)  # parents first
        assert expected_accepted(tree, prob) == pytest.approx(_brute_force_best(prob, budget, width, depth))


def test_joint_estimate_counts_whole_paths() -> None:
    ranks = torch.tensor([[0, 0, 1], [0, 1, 0], [1, 0, 0], [0, 0, 0]])
    prob = joint_estimate(ranks)
    assert prob((0,)) == 0.75 and prob((0, 0)) == 0.5 and prob((0, 0, 0)) == 0.25 and prob((1, 0, 0)) == 0.25
    acc = rank_accuracy(ranks, 2)
    assert acc[0].tolist() == [0.75, 0.25] and acc[2].tolist() == [0.75, 0.25]


def test_pass_cost_interpolates() -> None:
    curve = {1: 1.0, 8: 1.4, 16: 1.9}
    assert pass_cost(1, curve) == 1.0 and pass_cost(8, curve) == pytest.approx(1.4)
    assert pass_cost(12, curve) == pytest.approx(1.65) and pass_cost(24, curve) == pytest.approx(2.4)


def test_tune_writes_a_tree_the_strategy_loads(tiny_target: LoadedModel, tmp_path: Path) -> None:
    from hydra import compose, initialize_config_dir

    out = tmp_path / "tree.yaml"
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        cfg = compose("tune_tree", overrides=[
            "model=tiny-llama", "heads.path=null", "+heads.num_heads=3", "+heads.seed=4",
            "calibration.prompts=3", "calibration.max_new_tokens=12", "tree.width=4",
            "tree.budgets=[2,5,9]", f"out={out}"])
    result = tune(cfg)
    assert result["budget"] in (2, 5, 9) and len(result["choices"]) == result["budget"]
    assert result["positions"] > 0 and len(result["rank_accuracy"]) == 3
    assert set(result["cost_curve"]) == {1, 3, 6, 10} and result["cost_curve"][1] == 1.0  # measured: root + nodes
    assert all(v > 0 for v in result["cost_curve"].values())
    tree = load_tree(str(out), 3)
    assert tree == [tuple(p) for p in result["choices"]]
    medusa = Medusa(tiny_target, max_len=256, heads=medusa_heads(tiny_target, num_heads=3, seed=4), tree=str(out))
    assert medusa.generate(PROMPTS[0], GenerationParams(16), 0).output_ids == _greedy_outputs(
        tiny_target, PROMPTS[:1], 16)[0]


def test_heads_train_entry_trains_and_ships_medusa_heads(tmp_path: Path, tiny_target: LoadedModel) -> None:
    from hydra import compose, initialize_config_dir

    from heads.train import train

    out = tmp_path / "medusa"
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        cfg = compose("train", overrides=[*tiny_train_overrides("medusa", out, tmp_path / "data", 24),
                                          "train.max_steps=40", "train.lr=1e-2", "train.warmup_steps=0",
                                          "head.num_heads=3", "head.head_vocab=128"])
    meta = train(cfg)
    assert meta["steps"] == 40 and meta["last_loss"] < 0.7 * meta["first_loss"]
    heads = load_heads(tiny_target, out)
    assert heads.num_heads == 3 and len(heads.kept_ids) == 128
    scfg = OmegaConf.load(CONFIG_DIR / "strategy" / "medusa.yaml")
    scfg.heads.path = str(out)
    from hydra.utils import instantiate

    medusa = instantiate(scfg)(target=tiny_target, max_len=256, prefill_chunk=64)
    assert medusa.generate(PROMPTS[1], GenerationParams(24), 0).output_ids == _greedy_outputs(
        tiny_target, PROMPTS[1:2], 24)[0]


def test_heads_can_start_from_saved_heads(tmp_path: Path, tiny_target: LoadedModel) -> None:
    """head.init_from: the saved heads' blocks and rows are where training starts, and their minutes count."""
    from hydra import compose, initialize_config_dir

    from heads.train import train

    def run(out: Path, *overrides: str) -> dict:
        with initialize_config_dir(str(CONFIG_DIR), version_base=None):
            return train(compose("train", overrides=[
                *tiny_train_overrides("medusa", out, tmp_path / "data", 24), "train.warmup_steps=0",
                "head.num_heads=3", "head.head_vocab=128", *overrides]))

    first = tmp_path / "first"
    fresh = run(first, "train.max_steps=40", "train.lr=1e-2")
    saved = load_heads(tiny_target, first)
    module = MedusaTrainable(num_heads=3, head_vocab=128, init_from=str(first)).build(tiny_target)  # no data: its rows
    assert torch.equal(module.heads.kept_ids, saved.kept_ids)
    for k in range(3):  # trained blocks, not fresh ones (zeros)
        assert saved.blocks[k][0].linear.weight.abs().sum() > 0
        torch.testing.assert_close(module.heads.blocks[k][0].linear.weight, saved.blocks[k][0].linear.weight)
    second = run(tmp_path / "second", "train.max_steps=2", f"head.init_from={first}")
    assert second["first_loss"] < 0.8 * fresh["first_loss"]
    assert second["minutes_in_all"] == pytest.approx(fresh["minutes"] + second["minutes"])
    assert f"Started from: the drafter in `{first}`" in (tmp_path / "second" / "README.md").read_text()
    with pytest.raises(SpecdecError, match="num_heads=3"):
        MedusaTrainable(num_heads=4, head_vocab=128, init_from=str(first)).build(tiny_target)
    with pytest.raises(SpecdecError, match="sequential=False"):
        MedusaTrainable(num_heads=3, num_layers=1, head_vocab=128, root_input=True, sequential=True,
                        init_from=str(first)).build(tiny_target)


def test_own_projections_grow_from_shared_heads(tmp_path: Path, tiny_target: LoadedModel) -> None:
    """head.projection=own with head.init_from shared heads: each head's copy starts as the frozen rows the
    start scored (the same logits), then trains apart from the target's head, which stays as it was."""
    from hydra import compose, initialize_config_dir

    from heads.train import train

    def run(out: Path, *overrides: str) -> dict:
        with initialize_config_dir(str(CONFIG_DIR), version_base=None):
            return train(compose("train", overrides=[
                *tiny_train_overrides("medusa", out, tmp_path / "data", 24), "train.warmup_steps=0",
                "head.num_heads=3", "head.head_vocab=128", *overrides]))

    first = tmp_path / "first"
    run(first, "train.max_steps=20", "train.lr=1e-2")
    shared = load_heads(tiny_target, first)
    module = MedusaTrainable(num_heads=3, head_vocab=128, projection="own", init_from=str(first)).build(tiny_target)
    assert module.heads.proj.shape == (3, 128, shared.proj.shape[1])
    hidden = torch.randn(5, shared.proj.shape[1])
    torch.testing.assert_close(module.heads(hidden), shared(hidden))
    head_before = output_weight(tiny_target).clone()
    run(tmp_path / "own", "train.max_steps=5", "train.lr=1e-2", "head.projection=own", f"head.init_from={first}")
    own = load_heads(tiny_target, tmp_path / "own")
    assert own.cfg.projection == "own" and not torch.equal(own.proj[0], shared.proj)
    assert torch.equal(output_weight(tiny_target), head_before)
    with pytest.raises(SpecdecError, match="projection=own"):  # own copies cannot shrink back onto the shared head
        MedusaTrainable(num_heads=3, head_vocab=128, init_from=str(tmp_path / "own")).build(tiny_target)


def test_trees_need_the_compact_engine_chains_do_not(load_tiny) -> None:
    hf = load_tiny("llama", backend="hf")
    heads = medusa_heads(hf, num_heads=3, seed=6)
    for tree in ("default", "dynamic"):
        with pytest.raises(SpecdecError, match="strategy.tree=chain"):
            Medusa(hf, max_len=128, heads=heads, tree=tree)
    Medusa(hf, max_len=128, heads=heads, tree="dynamic", nodes=1)  # one node is a chain
    compact = load_tiny("llama")
    prompt = random_ids(8, VOCAB, seed=70)
    want = Greedy(compact, "greedy", max_len=128).generate(prompt, GenerationParams(20), 0).output_ids
    chain = Medusa(hf, max_len=128, heads=heads, tree="chain")
    assert chain.generate(prompt, GenerationParams(20), 0).output_ids == want


def test_tuned_tree_is_the_tuners_file_for_this_model_else_the_default(tiny_target: LoadedModel, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import specdec.strategies.medusa as medusa_module

    heads = medusa_heads(tiny_target, num_heads=3, seed=4)
    monkeypatch.setattr(medusa_module, "tuned_tree_path",
                        lambda name, heads_name="medusa": tmp_path / f"{name}-{heads_name}.yaml")
    fallback = Medusa(tiny_target, max_len=128, heads=heads, tree="tuned")
    assert fallback.tree_source == "default" and fallback.paths == load_tree("default", 3)
    (tmp_path / "tiny-llama-medusa.yaml").write_text("budget: 2\nchoices:\n- [0]\n- [0, 0]\n")
    tuned = Medusa(tiny_target, max_len=128, heads=heads, tree="tuned")
    assert tuned.paths == [(0,), (0, 0)] and tuned.tree_source.endswith("tiny-llama-medusa.yaml")


def test_kl_to_the_target_adds_loss_and_its_gradient_lowers_it(tiny_target: LoadedModel) -> None:
    torch.manual_seed(0)
    batch, hidden = _distill_batch(tiny_target, 6, 24)
    trainable = MedusaTrainable(num_heads=2, num_layers=1, head_vocab=None, kl_weight=1.0)
    module = trainable.build(tiny_target)
    ids = batch["input_ids"]

    def kl_part() -> torch.Tensor:  # per head: the loss with the KL minus the cross-entropy alone
        return module(hidden, batch["labels"], ids, 0.0, 1.0)[0] - module(hidden, batch["labels"], ids, 0.0, 0.0)[0]

    with torch.no_grad():
        first = kl_part()
        hits = module(hidden, batch["labels"], ids, 0.0, 1.0)[1:], module(hidden, batch["labels"], ids, 0.0, 0.0)[1:]
    assert (first > 0).all()  # fresh heads copy the target's head at t, not its distribution at t + k + 1
    assert all(torch.equal(a, b) for a, b in zip(*hits))  # hit rates do not depend on the loss
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(40):  # the KL's own gradient (through head_loss's backward) pulls heads to the target
        loss = kl_part().sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        assert (kl_part() < 0.75 * first).all()
    assert trainable.loss(module, batch, hidden)[0] > 0
    with pytest.raises(SpecdecError, match="kl_weight must be >= 0"):
        MedusaTrainable(kl_weight=-1.0)
    with pytest.raises(SpecdecError, match="needs head.projection=shared"):
        MedusaTrainable(kl_weight=1.0, projection="own")


def test_prompt_positions_add_loss_but_not_metrics(tiny_target: LoadedModel) -> None:
    from heads.medusa_train import MedusaLoss

    torch.manual_seed(0)
    module = MedusaTrainable(num_heads=2, head_vocab=None).build(tiny_target)
    assert isinstance(module, MedusaLoss)
    hidden = torch.randn(1, 9, tiny_target.hidden_size)  # (B, T, D)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, -1]])  # prompt 5..9, continuation 10..12, padding
    labels = torch.tensor([[-100, -100, -100, -100, 10, 11, 12, -100, -100]])
    ce0, t1a, t5a = module(hidden, labels, ids, 0.0)
    ce1, t1b, t5b = module(hidden, labels, ids, 0.5)
    assert torch.equal(t1a, t1b) and torch.equal(t5a, t5b)  # hit rates: continuation only
    assert (ce1 > ce0).all()  # head 0 at t = 0..2 and head 1 at t = 0..1 see prompt tokens 7..9
    no_prompt = torch.full_like(ids, -1)  # nothing to learn from the prompt: the loss is unchanged
    torch.testing.assert_close(module(hidden, labels, no_prompt, 0.5)[0], ce0)
