"""Prefix reuse across turns (generation.prefix_cache): same tokens, only the new part of a prompt prefilled.

A conversation's turn k + 1 prompt is turn k's prompt, its answer and the next user message, so with reuse
the engine keeps what its cache already holds of it. Checked: outputs and draft counts equal without reuse
for every kind of proposer, the tokens each prefill feeds, the engine's record of its cache under any
sequence of passes, compactions and rollbacks, and the runner end to end.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_kv_matches_fresh, random_ids, save_random_eagle
from hypothesis import given
from hypothesis import strategies as st
from run_helpers import make_cfg, read_answers, write_questions

from heads.eagle import load_eagle
from heads.medusa import medusa_heads
from specdec.engine.engine import HFEngine, StaticEngine, pass_times
from specdec.metrics import summarize
from specdec.models import cpu_kernels
from specdec.models.loader import LoadedModel, load_model
from specdec.report import ttft_turn_table
from specdec.run import run
from specdec.strategies.base import DecodeState, GenerationParams, SpeculativeStrategy
from specdec.strategies.draft import DraftStrategy
from specdec.strategies.eagle import EagleStrategy
from specdec.strategies.eagle_tree import Eagle2
from specdec.strategies.greedy import Greedy
from specdec.strategies.medusa import Medusa
from specdec.strategies.schedules import FixedLength
from specdec.trees import tree_depth, tree_mask
from specdec.verify import Proposal, Verdict

VOCAB = 512
TURNS = 3


def user_turn(target: LoadedModel, i: int) -> list[int]:
    """A follow-up user message as tokens (the template's opening dropped: it continues a conversation)."""
    return target.chat_ids([{"role": "user", "content": f"And then what, part {i}?"}])[1:]


def conversation(strategy: SpeculativeStrategy, target: LoadedModel, n: int = 24) -> list[dict[str, Any]]:
    """TURNS turns, each prompt the last one plus its answer plus a new user message, built on tokens so
    the shared prefix is exact; per turn: output, accept lengths, prompt and what each prefill fed."""
    prompt = target.chat_ids([{"role": "user", "content": "Tell me a story about a red fox."}])
    turns: list[dict[str, Any]] = []
    seen: list[torch.Tensor] = []  # the prompt's hidden states each proposer started from
    make = strategy.make_proposer

    def spying() -> Any:
        proposer = make()
        if proposer is not None:
            start = proposer.start
            proposer.start = lambda state, out: (seen.append(out.hidden.clone()), start(state, out))[1]
        return proposer

    strategy.make_proposer = spying  # type: ignore[method-assign]
    strategy.new_conversation()
    for i in range(TURNS):
        res = strategy.generate(prompt, GenerationParams(n), 0)
        turns.append({"prompt": prompt, "output": res.output_ids, "accepts": res.accept_lengths,
                      "proposed": res.proposed, "fed": [e.prefilled for e in strategy.engines()],
                      "hidden": seen.pop() if seen else None})
        prompt = prompt + res.output_ids + user_turn(target, i)
    return turns


class SiblingOracle:
    """Proposes a tree whose right branch is the target's own continuation, so every step compacts:
    node 1 a wrong token, node 2 (also a child of the root) the target's next token, node 3 the one after
    it. The continuation comes from a separate engine over the target, prefilled in full each time."""

    def __init__(self, target: LoadedModel) -> None:
        self.engine = StaticEngine(target.model, 512)

    def start(self, state: DecodeState, out: object) -> None:
        return None

    def propose(self, state: DecodeState) -> Proposal | None:
        if state.params.max_new_tokens - state.output_len < 3:
            return None
        first = int(self.engine.prefill(state.ids).logits[-1].argmax())
        second = int(self.engine.forward(torch.tensor([first])).logits[-1].argmax())
        return Proposal(torch.tensor([(first + 1) % VOCAB, first, second]), [0, 0, 2])

    def commit(self, state: DecodeState, verdict: Verdict, out: object) -> None:
        return None


class SiblingTree(SpeculativeStrategy):
    def make_proposer(self) -> SiblingOracle:
        return SiblingOracle(self.target)


@pytest.fixture(scope="module")
def eagle_drafter(tiny_target: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random EAGLE drafter, sharpened to draft with some confidence, saved as a trained one is."""
    return save_random_eagle(tiny_target, tmp_path_factory.mktemp("eagle-prefix"))


@pytest.fixture(scope="module")
def other_draft() -> LoadedModel:
    """The tiny model with other random weights and the same tokenizer: a draft that is often wrong."""
    return load_model("tiny-other", "builtin:tiny-llama", matmul="torch", tiny={"seed": 1})


def build(kind: str, target: LoadedModel, eagle_drafter: Path, other_draft: LoadedModel) -> SpeculativeStrategy:
    return {
        "greedy": lambda: Greedy(target, "greedy", 512, 16),
        "draft": lambda: DraftStrategy(target, "draft", other_draft, FixedLength(3), 512, 16),
        "draft_self": lambda: DraftStrategy(target, "draft", target, FixedLength(4), 512, 16),
        "eagle": lambda: EagleStrategy(target, "eagle", load_eagle(str(eagle_drafter)), FixedLength(3), 512, 16),
        "eagle2": lambda: Eagle2(target, "eagle2", load_eagle(str(eagle_drafter)), depth=3, topk=3, nodes=6,
                                 max_len=512, prefill_chunk=16),
        "medusa": lambda: Medusa(target, max_len=512, prefill_chunk=16, tree="default",
                                 heads=medusa_heads(target, num_heads=4, seed=5)),
        "hydra": lambda: Medusa(target, max_len=512, prefill_chunk=16, tree="dynamic", nodes=5,
                                heads=medusa_heads(target, num_heads=3, num_layers=1, root_input=True,
                                                   sequential=True, seed=6)),
        "sibling_tree": lambda: SiblingTree(target, "sibling_tree", 512, 16),
    }[kind]()


KINDS = ["greedy", "draft", "draft_self", "eagle", "eagle2", "medusa", "hydra", "sibling_tree"]


@pytest.mark.parametrize("kind", KINDS)
def test_reuse_gives_the_same_tokens_and_prefills_only_the_new_ones(kind: str, tiny_target: LoadedModel,
                                                                    eagle_drafter: Path,
                                                                    other_draft: LoadedModel) -> None:
    full = conversation(build(kind, tiny_target, eagle_drafter, other_draft), tiny_target)
    strategy = build(kind, tiny_target, eagle_drafter, other_draft)
    strategy.reuse_prefix(True)
    reused = conversation(strategy, tiny_target)
    for a, b in zip(reused, full):
        # same tokens, and the same drafting: each proposer started from the same prompt hidden states (P, D)
        assert (a["output"], a["accepts"], a["proposed"]) == (b["output"], b["accepts"], b["proposed"])
        if kind != "greedy":
            assert a["hidden"].shape == (len(a["prompt"]), tiny_target.model.args.dim)
            torch.testing.assert_close(a["hidden"], b["hidden"], atol=1e-5, rtol=1e-4)
    assert all(t["fed"][0] == len(t["prompt"]) for t in full)  # without reuse every prefill is whole
    assert reused[0]["fed"][0] == len(reused[0]["prompt"])
    for before, turn in zip(reused, reused[1:]):
        new = len(turn["prompt"]) - len(before["prompt"]) - len(before["output"])  # the user message
        # the cache held the last turn's prompt and all of its answer but (at least) the newest token
        assert 1 <= turn["fed"][0] <= new + 1
        if kind == "greedy":
            assert turn["fed"][0] == new + 1  # exactly: greedy's cache holds no token past the committed ones
        for fed in turn["fed"][1:]:  # a drafter's own engine reuses the prompt too
            assert fed <= len(turn["prompt"]) - len(before["prompt"])
    if kind == "sibling_tree":
        assert sum(t["proposed"] for t in reused) > 0


def test_reuse_follows_compactions(tiny_target: LoadedModel) -> None:
    """A tree step that keeps a sibling branch moves slots; the next turn's prefill must still find the
    committed tokens (a stale record would reuse the wrong K/V and change the output)."""
    strategy = SiblingTree(tiny_target, "sibling_tree", 512, 16)
    strategy.reuse_prefix(True)
    compactions = []
    real = strategy.engine.compact
    strategy.engine.compact = lambda start, keep: (compactions.append(keep), real(start, keep))[1]  # type: ignore[method-assign]
    turns = conversation(strategy, tiny_target, n=20)
    assert any(keep != list(range(keep[0], keep[0] + len(keep))) for keep in compactions)
    engine = strategy.engine
    assert engine.held is not None
    last = turns[-1]
    held = engine.held.ids[:engine.length].tolist()
    assert held == (last["prompt"] + last["output"])[:engine.length]
    assert engine.length >= len(last["prompt"]) + len(last["output"]) - 1
    assert_kv_matches_fresh(engine, held)


def test_reused_prefill_equals_a_full_one(tiny_target: LoadedModel) -> None:
    """K/V, logits and the whole prompt's hidden states (what EAGLE's drafter reads) as from scratch, also
    when the reuse point falls inside a prefill chunk."""
    first = random_ids(37, VOCAB, seed=1)
    later = first + random_ids(23, VOCAB, seed=2)
    plain = StaticEngine(tiny_target.model, 256, prefill_chunk=8)
    want = plain.prefill(later)
    engine = StaticEngine(tiny_target.model, 256, prefill_chunk=8, prefix_cache=True)
    engine.prefill(first)
    engine.forward(torch.tensor(later[37:40]))  # as decoding would, then a rejected tail
    engine.forward(torch.tensor([5, 6]))
    engine.rollback(39)
    got = engine.prefill(later)
    assert engine.prefilled == len(later) - 39
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-4)
    assert got.hidden.shape == want.hidden.shape == (len(later), tiny_target.model.args.dim)
    torch.testing.assert_close(got.hidden, want.hidden, atol=1e-5, rtol=1e-4)
    assert_kv_matches_fresh(engine, later)


def test_the_last_prompt_token_is_always_fed_and_reset_forgets(tiny_target: LoadedModel) -> None:
    ids = random_ids(20, VOCAB, seed=3)
    engine = StaticEngine(tiny_target.model, 128, prefix_cache=True)
    engine.prefill(ids)
    engine.prefill(ids)
    assert engine.prefilled == 1  # the same prompt again: its last token gives the logits
    engine.prefill([ids[0] + 1, *ids[1:]])
    assert engine.prefilled == 20  # differs at the first token
    engine.reset()
    engine.prefill(ids)
    assert engine.prefilled == 20
    pass_times(engine, ids, [1, 2], reps=1)  # prefills for its own reasons, then resets
    engine.prefill(ids)
    assert engine.prefilled == 20
    assert_kv_matches_fresh(engine, ids)


def test_reuse_off_keeps_no_record(tiny_target: LoadedModel) -> None:
    engine = StaticEngine(tiny_target.model, 128)
    ids = random_ids(12, VOCAB, seed=4)
    engine.prefill(ids)
    engine.prefill(ids)
    assert engine.held is None and engine.prefilled == 12


def test_reuse_on_the_cpu_kernels(tiny_target: LoadedModel) -> None:
    """The fused CPU passes keep K/V panels beside the cache (cpu_layer): a reused prefix and a partial
    prefill must leave them as consistent as a full prefill does."""
    if not cpu_kernels.available():
        pytest.skip("CPU kernels unavailable")
    target = load_model("tiny-llama", "builtin:tiny-llama", matmul="numba")  # the same weights
    assert target.model.fused is not None
    want = [t["output"] for t in conversation(Greedy(tiny_target, "greedy", 512, 16), tiny_target)]
    strategy = Greedy(target, "greedy", 512, 16)
    strategy.reuse_prefix(True)
    turns = conversation(strategy, target)
    assert [t["output"] for t in turns] == want
    assert turns[-1]["fed"][0] < len(turns[-1]["prompt"]) // 2


def test_hf_engine_reuses_too(load_tiny: Any) -> None:
    target = load_tiny("llama", backend="hf")
    full, strategy = Greedy(target, "greedy", 256, 16), Greedy(target, "greedy", 256, 16)
    strategy.reuse_prefix(True)
    assert isinstance(strategy.engine, HFEngine)
    a, b = conversation(strategy, target, n=10), conversation(full, target, n=10)
    assert [t["output"] for t in a] == [t["output"] for t in b]
    assert a[1]["fed"][0] == len(a[1]["prompt"]) - len(a[0]["prompt"]) - len(a[0]["output"]) + 1


OPS = st.lists(st.one_of(
    st.tuples(st.just("chain"), st.integers(1, 5)),
    st.tuples(st.just("tree"), st.lists(st.integers(0, 4), min_size=1, max_size=5)),
    st.tuples(st.just("compact"), st.lists(st.booleans(), min_size=1, max_size=6)),
    st.tuples(st.just("rollback"), st.integers(0, 8)),
    st.tuples(st.just("prefill"), st.integers(0, 6)),
), min_size=1, max_size=12)


@pytest.mark.parametrize("static", [False, True])
@given(ops=OPS, seed=st.integers(0, 1000))
def test_held_ids_follow_every_operation(tiny_target: LoadedModel, static: bool, ops: list[Any], seed: int) -> None:
    """Whatever runs (chains, trees, compactions of any slots, rollbacks, prefills), the engine's record of
    its cache is the tokens in its slots and their hidden states as each pass returned them."""
    gen = torch.Generator().manual_seed(seed)
    engine = StaticEngine(tiny_target.model, 128, prefill_chunk=4, static=static, prefix_cache=True)
    slots: list[tuple[int, torch.Tensor]] = []  # (token, hidden state (D,)) per slot, kept on the host
    for op, arg in ops:
        base = engine.length
        if op in ("chain", "tree"):
            n = arg if op == "chain" else len(arg) + 1
            if base + n > 96:
                continue
            tokens = torch.randint(3, VOCAB, (n,), generator=gen)
            if op == "chain":
                out = engine.forward(tokens)
            else:  # node i + 1's parent is one of the nodes before it
                parents = [min(p, i) for i, p in enumerate(arg)]
                out = engine.forward(tokens, tree_depth(parents), tree_mask(parents))
            slots += [(int(t), h) for t, h in zip(tokens, out.hidden)]
        elif op == "compact":
            start = max(0, engine.length - len(arg))
            keep = [start + i for i, k in enumerate(arg[:engine.length - start]) if k]
            engine.compact(start, keep)
            slots = slots[:start] + [slots[k] for k in keep]
        elif op == "rollback":
            engine.rollback(max(0, engine.length - arg))
            del slots[engine.length:]
        else:  # a prompt sharing the first `arg` held tokens, then new ones
            ids = [t for t, _ in slots[:arg]] + torch.randint(3, VOCAB, (3,), generator=gen).tolist()
            out = engine.prefill(ids)
            shared = next((i for i, (t, _) in enumerate(slots[:len(ids) - 1]) if t != ids[i]),
                          min(len(slots), len(ids) - 1))
            assert engine.prefilled == len(ids) - shared
            slots = slots[:shared] + [(t, h) for t, h in zip(ids[shared:], out.hidden[shared:])]
        assert engine.held is not None
        assert engine.held.ids[:engine.length].tolist() == [t for t, _ in slots]
        if slots:
            assert engine.held.hidden is not None
            torch.testing.assert_close(engine.held.hidden[:engine.length], torch.stack([h for _, h in slots]))


def test_run_reuses_within_a_conversation_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the runner: greedy (reuse, the default) and greedy_full (off) interleaved on 3-turn
    questions give the same answers; each conversation's first turn is prefilled whole, later ones only
    in part; the summary has TTFT per turn and records which strategy reused."""
    fed: dict[str, list[tuple[int, int]]] = {"on": [], "off": []}
    real = StaticEngine.prefill

    def spy(self: StaticEngine, ids: list[int]) -> Any:
        out = real(self, ids)
        fed["on" if self.held is not None else "off"].append((len(ids), self.prefilled))
        return out

    monkeypatch.setattr(StaticEngine, "prefill", spy)
    data = write_questions(tmp_path / "q.jsonl", 2, turns=3)
    out = tmp_path / "out"
    # greedy_full as experiment=prefix_cache defines it: greedy under a second name with prefix_cache false
    cfg = make_cfg(out, "data=jsonl", f"data.path={data}", "strategies=[greedy,greedy_full]",
                   "+strategy@strategy_configs.greedy_full=greedy", "+strategy_configs.greedy_full.prefix_cache=false",
                   "generation.max_new_tokens=6")
    summary = run(cfg)
    rows = read_answers(out)
    by = {(r["strategy"], r["question_id"], r["turn"]): r["output_ids"] for r in rows}
    assert len(rows) == 12 and all(by[("greedy", q, t)] == by[("greedy_full", q, t)] for _, q, t in by)
    assert [p for p, f in fed["off"] if p != f] == []
    on = fed["on"]
    assert len(on) == 6 and [p == f for p, f in on] == [True, False, False] * 2
    s = summary["strategies"]
    assert s["greedy"]["prefix_cache"] is True and s["greedy_full"]["prefix_cache"] is False
    assert s["greedy_full"]["config"]["prefix_cache"] is False  # the variant's provenance
    assert set(s["greedy"]["ttft_s_by_turn"]) == {"0", "1", "2"}
    assert s["greedy_full"]["matches_baseline"] == 1.0
    assert json.loads((out / "summary.json").read_text())["config"]["generation"]["prefix_cache"] is True
    table = ttft_turn_table(summary)
    assert table is not None and "turn 2" in table and "| greedy_full |" in table and "off" in table


def test_summary_means_ttft_per_turn() -> None:
    rows = [{"strategy": "s", "question_id": q, "category": "c", "turn": t, "ttft_s": v, "new_tokens": 2,
             "wall_time_s": 1.0, "output_ids": [1, 2]} for q, t, v in [("a", 0, 1.0), ("b", 0, 3.0), ("a", 1, 0.5)]]
    assert summarize(rows, "s", 0.0)["strategies"]["s"]["ttft_s_by_turn"] == {"0": 2.0, "1": 0.5}


def test_a_bad_prefix_cache_value_is_one_line(tmp_path: Path) -> None:
    from specdec.errors import SpecdecError
    from specdec.run import generation_params

    with pytest.raises(SpecdecError, match="generation.prefix_cache='maybe' is not a boolean"):
        generation_params(make_cfg(tmp_path, "generation.prefix_cache=maybe"))
