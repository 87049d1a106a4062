"""The static-shape step (engine/static_step.py), eager and compiled with inductor on the CPU.

What the GPU path relies on, checked where it can be: padded buckets and a device-built mask give the
eager engine's logits and cache; compiled and eager decode the same tokens for every strategy; the
step compiles as one graph per bucket (fullgraph) and nothing recompiles once the buckets are warm.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch
from torch._dynamo.utils import counters

from heads.eagle import EagleTrainable
from heads.medusa import medusa_heads
from specdec.engine.engine import StaticEngine
from specdec.engine.static_step import bucket
from specdec.errors import SpecdecError
from specdec.models.loader import LoadedModel, load_model
from specdec.strategies.base import GenerationParams, SpeculativeStrategy
from specdec.strategies.draft import DraftStrategy
from specdec.strategies.eagle import EagleStrategy
from specdec.strategies.eagle_tree import Eagle2
from specdec.strategies.greedy import Greedy
from specdec.strategies.hybrid import LookupHybrid
from specdec.strategies.lookahead import Lookahead
from specdec.strategies.medusa import Medusa
from specdec.strategies.prompt_lookup import PromptLookup
from specdec.strategies.schedules import CostAware, FixedLength
from specdec.trees import tree_depth, tree_mask
from tests.helpers import prompts, random_ids

MAX_LEN = 256  # one cache size throughout, so every test replays the same compiled graphs


def test_buckets() -> None:
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9, 33, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]


@pytest.mark.parametrize("parents", [[0, 1, 2], [0, 0, 1, 1, 2], [0, 1, 0, 3, 3, 1, 2]])
def test_static_step_gives_the_eager_logits_and_cache(tiny_target: LoadedModel, parents: list[int]) -> None:
    ids = random_ids(40, tiny_target.vocab_size, seed=len(parents))
    eager = StaticEngine(tiny_target.model, MAX_LEN)
    static = StaticEngine(tiny_target.model, MAX_LEN, static=True)
    nodes = torch.tensor(random_ids(len(parents) + 1, tiny_target.vocab_size, seed=7))
    for engine in (eager, static):
        engine.prefill(ids)
        for t in ids[:5]:  # single-token steps, then a chain of 3 (a padded bucket of 4)
            engine.forward(torch.tensor([t]))
        engine.forward(torch.tensor(ids[5:8]))
    a = eager.forward(nodes, tree_depth(parents), tree_mask(parents))
    b = static.forward(nodes, tree_depth(parents), tree_mask(parents))
    torch.testing.assert_close(b.logits, a.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(b.hidden, a.hidden, atol=1e-4, rtol=1e-4)
    n = eager.length
    assert static.length == n
    torch.testing.assert_close(static.cache.k[:, :, :, :n], eager.cache.k[:, :, :, :n], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(static.cache.v[:, :, :, :n], eager.cache.v[:, :, :, :n], atol=1e-5, rtol=1e-5)


def test_static_step_refuses_to_overflow(tiny_target: LoadedModel) -> None:
    engine = StaticEngine(tiny_target.model, 32, static=True)
    engine.prefill(list(range(3, 30)))
    with pytest.raises(SpecdecError, match="KV cache overflow"):
        engine.forward(torch.tensor([1, 2, 3, 4, 5, 6]))  # 27 + 6 > 32


def test_compile_refuses_the_cpu_kernels(load_tiny: object) -> None:
    numba = load_tiny("llama", matmul="numba")  # type: ignore[operator]
    with pytest.raises(SpecdecError, match="model.matmul=torch"):
        StaticEngine(numba.model, MAX_LEN, compile=True)


@pytest.fixture(scope="module")
def compiled(tiny_target: LoadedModel) -> LoadedModel:
    """The tiny target with compiled steps, every bucket traced up front."""
    target = dataclasses.replace(tiny_target, compile=True)
    engine = StaticEngine(target.model, MAX_LEN, compile=True)
    engine.prefill([1, 2, 3])
    engine.static.warm_up()  # type: ignore[union-attr]
    return target


def test_compiled_decode_varies_token_counts_without_recompiling(compiled: LoadedModel) -> None:
    engine = StaticEngine(compiled.model, MAX_LEN, compile=True)
    graphs = counters["stats"]["unique_graphs"]
    eager = StaticEngine(compiled.model, MAX_LEN)
    ids = random_ids(30, compiled.vocab_size, seed=3)
    for e in (engine, eager):
        e.prefill(ids)
    for n in (1, 3, 5, 2, 7, 1, 12, 4, 33, 1):  # every bucket but 64, at a new length each time
        feed = torch.tensor(random_ids(n, compiled.vocab_size, seed=n))
        a, b = engine.forward(feed), eager.forward(feed)
        assert torch.equal(a.logits.argmax(-1), b.logits.argmax(-1))
        keep = max(1, n // 2)  # roll back part of it, as verification does
        engine.rollback(engine.length - n + keep)
        eager.rollback(eager.length - n + keep)
    assert counters["stats"]["unique_graphs"] == graphs, "a decode step recompiled after warm-up"


def test_the_step_compiles_as_one_graph(tiny_target: LoadedModel) -> None:
    from specdec.engine.static_step import CacheView

    model = tiny_target.model
    cache = model.new_cache(64)
    tokens, positions = torch.zeros(1, 4, dtype=torch.long), torch.arange(4)[None]
    tree = torch.ones(4, 4, dtype=torch.bool).tril()
    explain = torch._dynamo.explain(lambda *a: model.forward_static(*a, CacheView(cache.k, cache.v)))
    report = explain(tokens, positions, torch.arange(4), tree)
    assert report.graph_break_count == 0 and report.graph_count == 1


def _branching(strategy: EagleStrategy) -> EagleStrategy:
    """Verification made free (a flat pass-cost curve): the cost-aware schedule adds second choices every round."""
    curve = strategy.schedule.curve  # type: ignore[attr-defined]
    strategy.schedule.curve = [1.0] * len(curve)  # type: ignore[attr-defined]
    return strategy


def _strategies(target: LoadedModel, draft: LoadedModel) -> dict[str, SpeculativeStrategy]:
    eagle_net = EagleTrainable(kept_vocab=0).build(target, None).net.eval()
    return {
        "greedy": Greedy(target, "greedy", MAX_LEN),
        "prompt_lookup": PromptLookup(target, max_len=MAX_LEN),
        "lookahead": Lookahead(target, max_len=MAX_LEN),
        "draft": DraftStrategy(target, "draft", draft, FixedLength(4), MAX_LEN),
        "medusa": Medusa(target, max_len=MAX_LEN, heads=medusa_heads(target, num_heads=3, seed=0), tree="default",
                         acceptance="exact"),
        "eagle": EagleStrategy(target, "eagle", eagle_net, FixedLength(3), MAX_LEN),
        "eagle_branching": _branching(EagleStrategy(target, "eagle", eagle_net, CostAware(3, 0.0, 0.0, siblings=2),
                                                    MAX_LEN)),
        "eagle2": Eagle2(target, "eagle2", eagle_net, depth=3, topk=2, nodes=5, max_len=MAX_LEN),
        "draft_lookup": LookupHybrid(target, "draft_lookup", partial(DraftStrategy, name="draft", draft=draft,
                                                                     schedule=FixedLength(4)), MAX_LEN),
    }


def test_every_strategy_decodes_the_same_tokens_compiled_and_eager(tiny_target: LoadedModel,
                                                                    compiled: LoadedModel) -> None:
    draft = load_model("tiny-draft", "builtin:tiny-llama", matmul="torch", tiny={"seed": 1})
    eager_runs = _strategies(tiny_target, draft)
    compiled_runs = _strategies(compiled, dataclasses.replace(draft, compile=True))
    assert compiled_runs["eagle"].static is not None  # type: ignore[attr-defined]  # the drafter compiles too
    assert compiled_runs["draft"].drafter.engine.static is not None  # type: ignore[attr-defined]
    params = GenerationParams(24)
    target_prompts = list(prompts(tiny_target).values())[:3]
    for name, eager in eager_runs.items():
        assert isinstance(compiled_runs[name].engine, StaticEngine)
        assert compiled_runs[name].engine.static is not None  # type: ignore[union-attr]
        for p in target_prompts:
            want = eager.generate(p, params, 0).output_ids
            got = compiled_runs[name].generate(p, params, 0).output_ids
            assert got == want, name


@pytest.mark.parametrize("kind", ["plain", "root", "sequential"])
@pytest.mark.parametrize("tree", ["dynamic", "default"])
def test_medusa_heads_compile_and_decode_the_eager_tokens(tiny_target: LoadedModel, compiled: LoadedModel,
                                                           kind: str, tree: str) -> None:
    opts = {"plain": {}, "root": {"root_input": True}, "sequential": {"root_input": True, "sequential": True}}[kind]

    def medusa(target: LoadedModel) -> Medusa:
        heads = medusa_heads(target, num_heads=3, seed=0, **opts)  # type: ignore[arg-type]
        return Medusa(target, max_len=MAX_LEN, heads=heads, tree=tree, nodes=5, acceptance="exact")

    eager, fast = medusa(tiny_target), medusa(compiled)
    assert getattr(eager.heads, "compiled", None) is None and fast.heads.compiled is not None  # type: ignore[attr-defined]
    graphs = counters["stats"]["unique_graphs"]  # every heads' graph was traced when the strategy was built
    params = GenerationParams(24)
    for p in list(prompts(tiny_target).values())[:3]:
        assert fast.generate(p, params, 0).output_ids == eager.generate(p, params, 0).output_ids
    assert counters["stats"]["unique_graphs"] == graphs, "the heads' step recompiled after warm-up"
