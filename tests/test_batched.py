"""Batched decoding (generation.batch_size): every sequence's tokens are its batch-of-one tokens.

References are the batch-1 loop (`Strategy.generate`) and fresh prefills; both the torch path (padded
rows under masks) and the CPU kernels' segmented pass are checked.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from specdec.engine.batch import BatchEngine, Feed
from specdec.engine.engine import StaticEngine
from specdec.errors import SpecdecError
from specdec.models import cpu_kernels
from specdec.models.loader import LoadedModel, load_model
from specdec.models.tiny import tiny_folder
from specdec.strategies.base import GenerationParams, TurnResult
from specdec.strategies.batched import Job
from specdec.strategies.draft import DraftStrategy
from specdec.strategies.greedy import Greedy
from specdec.strategies.prompt_lookup import PromptLookup
from specdec.strategies.schedules import FixedLength
from specdec.trees import tree_depth, tree_mask

PATHS = ["torch", pytest.param("numba", marks=pytest.mark.skipif(not cpu_kernels.available(), reason="needs numba"))]


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # repeated n-grams give prompt lookup something to copy
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(4, 12))] * rng.randrange(1, 4) for _ in range(n)]


def batched_outputs(strategy: Greedy, jobs_prompts: list[list[int]], params: GenerationParams,
                    batch: int, draft_length: int | None = None) -> list[list[int]]:
    outs: dict[int, list[int]] = {}
    proposed = []

    def job(i: int, p: list[int]) -> Job:
        def done(t: int, ids: list[int], res: TurnResult) -> None:
            outs[i] = res.output_ids
            proposed.append(res.proposed)
        return Job(1, lambda t: p, lambda t: 0, done)

    decoder = strategy.batch_decoder(batch, params)
    if draft_length is not None:  # a fixed length, so that drafting (and rejection) surely happens
        decoder.proposer.length = lambda: draft_length  # type: ignore[union-attr]
    decoder.run([job(i, p) for i, p in enumerate(jobs_prompts)])
    assert draft_length is None or sum(proposed) > 0
    return [outs[i] for i in range(len(jobs_prompts))]


@pytest.mark.parametrize("matmul", PATHS)
@pytest.mark.parametrize("kind", ["greedy", "prompt_lookup", "draft"])
def test_each_sequence_decodes_its_batch_of_one_tokens(load_tiny: Callable[..., LoadedModel], matmul: str,
                                                       kind: str) -> None:
    target = load_tiny("llama", matmul=matmul)
    if kind == "draft":  # another random model on the same tokenizer: some drafts accepted, most not
        other = load_model("tiny-llama-other", str(tiny_folder(model_type="llama", seed=7)), matmul=matmul)
        strategy: Greedy = DraftStrategy(target, "draft", other, FixedLength(3), 256, 64)  # type: ignore[assignment]
    else:
        strategy = (Greedy(target, "greedy", max_len=256) if kind == "greedy"
                    else PromptLookup(target, "prompt_lookup", max_len=256, gate=False))
    ps = prompts(6)
    params = GenerationParams(max_new_tokens=24)
    alone = [strategy.generate(p, params, 0).output_ids for p in ps]
    # an EOS token from the middle of one answer: that sequence (at least) ends early, its slot is refilled
    eos = alone[2][10]
    params = dataclasses.replace(params, eos_ids=(eos,))
    alone = [strategy.generate(p, params, 0).output_ids for p in ps]
    assert len({len(a) for a in alone}) > 1
    assert batched_outputs(strategy, ps, params, batch=4, draft_length=3 if kind == "draft" else None) == alone


@pytest.mark.parametrize("matmul", PATHS)
def test_later_turns_prefill_only_what_the_slot_does_not_hold(load_tiny: Callable[..., LoadedModel],
                                                              matmul: str) -> None:
    target = load_tiny("llama", matmul=matmul)
    strategy = Greedy(target, "greedy", max_len=512)
    strategy.reuse_prefix(True)  # generation.prefix_cache, as the runner sets it
    params = GenerationParams(max_new_tokens=12)
    extra = prompts(9, seed=1)
    decoder = strategy.batch_decoder(2, params)
    prompt_rows = []  # tokens fed as prompt chunks (feeds with no logits for their first row)
    step = decoder.engine.step

    def counting(feeds: dict[int, Feed]) -> dict:
        prompt_rows.extend(len(f.tokens) for f in feeds.values() if f.logits_from > 0)
        return step(feeds)

    decoder.engine.step = counting  # type: ignore[method-assign]

    convs: dict[int, list[list[int]]] = {i: [] for i in range(3)}  # each conversation's prompts
    outs: dict[tuple[int, int], list[int]] = {}

    def job(i: int) -> Job:
        def prompt(t: int) -> list[int]:
            before = convs[i][-1] + outs[i, t - 1] if t else []
            convs[i].append(before + extra[3 * i + t])
            return convs[i][-1]
        return Job(3, prompt, lambda t: 0, lambda t, ids, res: outs.__setitem__((i, t), res.output_ids))

    decoder.run([job(i) for i in range(3)])
    for i in range(3):
        for t in range(3):
            assert outs[i, t] == strategy.generate(convs[i][t], params, 0).output_ids
    # turn 0 prefills whole; turns 1 and 2 reuse all but the last answer token of the turn before
    expected = sum(len(convs[i][0]) for i in range(3)) + sum(
        len(convs[i][t]) - (len(convs[i][t - 1]) + len(outs[i, t - 1]) - 1) for i in range(3) for t in (1, 2))
    assert sum(prompt_rows) == expected


@pytest.mark.parametrize("matmul", PATHS)
@pytest.mark.parametrize("seed", range(4))
def test_ragged_rollback_and_compaction_match_a_fresh_prefill(load_tiny: Callable[..., LoadedModel], matmul: str,
                                                              seed: int) -> None:
    model = load_tiny("llama", matmul=matmul).model
    rng = random.Random(seed)
    engine = BatchEngine(model, batch=3, max_len=128)
    held: list[list[int]] = []
    for b in range(3):
        held.append([rng.randrange(500) for _ in range(rng.randrange(2, 30))])
        engine.prefill(b, held[b])
    for _ in range(8):
        fed = rng.sample(range(3), rng.randrange(1, 4))
        feeds, plans = {}, {}
        for b in fed:
            n = rng.randrange(0, 5)
            parents = [rng.randrange(0, i + 1) if rng.random() < 0.5 else i for i in range(n)]
            tokens = torch.tensor([rng.randrange(500) for _ in range(n + 1)])
            feeds[b] = Feed(tokens, tree_depth(parents), tree_mask(parents)) if n else Feed(tokens)
            node = rng.randrange(0, n + 1)  # accept the path from the root to a random node
            path = [node]
            while path[-1]:
                path.append(parents[path[-1] - 1])
            plans[b] = (tokens.tolist(), sorted(path))
        bases = {b: engine.length(b) for b in fed}
        engine.step(feeds)
        for b in fed:
            tokens, keep = plans[b]
            engine.compact(b, bases[b], [bases[b] + k for k in keep])
            held[b] += [tokens[k] for k in keep]
    for b in range(3):
        assert engine.length(b) == len(held[b])
        fresh = StaticEngine(model, 128)
        fresh.prefill(held[b])
        n = len(held[b])
        torch.testing.assert_close(engine.cache.k[:, b, :, :n], fresh.cache.k[:, 0, :, :n], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(engine.cache.v[:, b, :, :n], fresh.cache.v[:, 0, :, :n], atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(not cpu_kernels.available(), reason="needs numba")
def test_one_slots_tree_past_one_fused_call_equals_the_batch_1_pass(load_tiny: Callable[..., LoadedModel]) -> None:
    """A single feed of more rows than one fused call takes (a 100-node tree) runs through the slot's own view of
    the batch cache: its logits, and the next step's that reads the K/V and panels it wrote, are bitwise the
    batch-1 engine's, beside another slot, and a node's are those of decoding its path one token at a time. Two
    slots' trees in one pass, more wanted logits than one fused call's rows, are each the batch-1 pass's too."""
    model = load_tiny("llama", matmul="numba").model
    rng = random.Random(5)
    parents = [rng.randrange(0, i // 3 + 1) for i in range(100)]
    tokens = torch.tensor([rng.randrange(500) for _ in range(101)])
    prompt, other = [rng.randrange(500) for _ in range(20)], [rng.randrange(500) for _ in range(9)]
    engine, lone, lone0 = BatchEngine(model, batch=2, max_len=256), StaticEngine(model, 256), StaticEngine(model, 256)
    engine.prefill(0, other)
    engine.prefill(1, prompt)
    lone.prefill(prompt)
    lone0.prefill(other)
    got = engine.step({1: Feed(tokens, tree_depth(parents), tree_mask(parents))})[1].logits
    assert torch.equal(got, lone.forward(tokens, tree_depth(parents), tree_mask(parents)).logits)
    nxt = torch.tensor([7])
    assert torch.equal(engine.step({1: Feed(nxt)})[1].logits, lone.forward(nxt).logits)
    path, n = [100], 100  # the last node, decoded along its path one token at a time
    while n:
        n = parents[n - 1]
        path.insert(0, n)
    steps = StaticEngine(model, 256)
    steps.prefill(prompt)
    for n in path:
        last = steps.forward(tokens[n:n + 1]).logits
    assert torch.equal(got[100], last[0])
    # both slots at once, 2 x 41 rows: one fused pass whose logits (Llama.head) exceed one call's rows
    small = [rng.randrange(0, i + 1) for i in range(40)]
    feed = Feed(tokens[:41], tree_depth(small), tree_mask(small))
    both = engine.step({0: feed, 1: feed})
    assert torch.equal(both[0].logits, lone0.forward(feed.tokens, feed.depth, feed.mask).logits)
    assert torch.equal(both[1].logits, lone.forward(feed.tokens, feed.depth, feed.mask).logits)


def test_a_strategy_that_cannot_batch_says_so(tiny_target: LoadedModel) -> None:
    from specdec.strategies.lookahead import Lookahead

    with pytest.raises(SpecdecError, match="cannot decode in batches yet.*batch_size=1"):
        Lookahead(tiny_target, "lookahead", max_len=128).batch_decoder(2, GenerationParams())


def test_batched_draft_length_follows_the_costs_and_probes_one_slot() -> None:
    from specdec.strategies.batched_draft import BatchCosts, BatchedDraft

    def proposer(verify: list[float], draft: float, alpha: float) -> BatchedDraft:
        p = BatchedDraft(None, None, 10, BatchCosts(verify, draft), max_gamma=4, probe_every=3,  # type: ignore[arg-type]
                         prior_alpha=alpha)
        return p

    flat = [1.0, 1.0, 1.02, 1.04, 1.06, 1.08, 1.1]  # a batch that leaves the products room: drafting pays
    full = [1.0, 1.0, 1.9, 2.8, 3.7, 4.6, 5.5]  # every extra token per slot costs almost a pass: it does not
    assert proposer(flat, 0.05, 0.8).length() == 4
    assert proposer(full, 0.05, 0.8).length() == 0
    assert proposer(flat, 0.05, 0.05).length() == 0  # nothing is accepted: no draft is worth its cost
    barely = [1.0, 1.0, 1.25, 1.5, 1.75, 2.0, 2.25]  # one token at alpha 0.35: 1.35 / 1.3, about 4% better
    assert proposer(barely, 0.05, 0.35).length() == 0  # under the 5% margin: not worth the risk
    off = proposer(full, 0.05, 0.8)
    rounds = [off._drafting({0: 5, 1: 5, 2: 5}) for _ in range(9)]
    assert [r for r in rounds if r] == [{1: 1}, {2: 1}, {0: 1}]  # every third round, one slot in turn


def test_the_runner_decodes_in_batches_resumes_and_records_the_batch(tmp_path: Path) -> None:
    """`generation.batch_size=3` end to end: 2-turn questions, every answer equal to the batch-1 run's,
    the batch size in the summary, and a second call (resume) answering nothing twice."""
    from run_helpers import make_cfg, read_answers, write_questions

    from specdec.run import run

    data = write_questions(tmp_path / "q.jsonl", 5, turns=2)
    over = ["data=jsonl", f"data.path={data}", "strategies=[greedy,prompt_lookup]", "generation.max_new_tokens=12"]
    one = run(make_cfg(tmp_path / "b1", *over))
    three = run(make_cfg(tmp_path / "b3", *over, "generation.batch_size=3"))
    assert three["environment"]["batch_size"] == 3 and one["environment"]["batch_size"] == 1
    key = lambda r: (r["strategy"], r["question_id"], r["turn"])  # noqa: E731
    a, b = sorted(read_answers(tmp_path / "b1"), key=key), sorted(read_answers(tmp_path / "b3"), key=key)
    assert len(b) == 20 and [r["output_ids"] for r in a] == [r["output_ids"] for r in b]
    assert all(s["matches_baseline"] == 1.0 for s in three["strategies"].values())
    run(make_cfg(tmp_path / "b3", *over, "generation.batch_size=3"))
    assert len(read_answers(tmp_path / "b3")) == 20


@pytest.mark.parametrize("matmul", PATHS)
def test_a_long_prompt_is_prefilled_in_chunks_between_the_others_steps(load_tiny: Callable[..., LoadedModel],
                                                                     matmul: str) -> None:
    target = load_tiny("llama", matmul=matmul)
    strategy = Greedy(target, "greedy", max_len=256, prefill_chunk=8)
    short, long = prompts(1, seed=3)[0][:5], prompts(1, seed=4)[0] * 8
    assert len(long) >= 40
    params = GenerationParams(max_new_tokens=12)
    decoder = strategy.batch_decoder(2, params)
    calls: list[tuple[set[int], set[int]]] = []  # per pass: slots decoding, slots fed a prompt chunk
    step = decoder.engine.step

    def recording(feeds: dict[int, Feed]) -> dict:
        calls.append(({b for b, f in feeds.items() if f.logits_from == 0},
                      {b for b, f in feeds.items() if f.logits_from}))
        return step(feeds)

    decoder.engine.step = recording  # type: ignore[method-assign]
    outs: dict[int, list[int]] = {}
    decoder.run([Job(1, lambda t, p=p: p, lambda t: 0, lambda t, ids, res, i=i: outs.__setitem__(i, res.output_ids))
                 for i, p in enumerate([short, long])])
    chunks = [i for i, (_, fed) in enumerate(calls) if 1 in fed]
    assert len(chunks) == -(-len(long) // 8)  # the long prompt in chunks of 8
    assert any(0 in dec for dec, _ in calls[chunks[0]:chunks[-1] + 1])  # slot 0 decodes meanwhile
    assert outs == {0: strategy.generate(short, params, 0).output_ids, 1: strategy.generate(long, params, 0).output_ids}


def test_batched_times_add_up(tiny_target: LoadedModel) -> None:
    """Shares of each step: ttft_s <= wall_time_s for every answer, the wall-clock latency beside it."""
    strategy = Greedy(tiny_target, "greedy", max_len=256, prefill_chunk=8)
    results: list[TurnResult] = []
    jobs = [Job(1, lambda t, p=p: p, lambda t: 0, lambda t, ids, res: results.append(res)) for p in prompts(6)]
    strategy.batch_decoder(3, GenerationParams(max_new_tokens=10)).run(jobs)
    assert len(results) == 6
    for r in results:
        assert 0 < r.ttft_s <= r.wall_time_s and r.ttft_wall_s is not None and r.ttft_wall_s >= r.ttft_s
