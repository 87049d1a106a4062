"""A drafter's pass as one compiled call (specdec/models/cpu_drafter.py): bitwise what the module path computes,
and the path EAGLE's proposer and a trained draft's engine take on the CPU kernels."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import saved_eagle

from heads.draft_model import DraftTrainable
from heads.eagle import load_eagle
from specdec.engine.engine import StaticEngine
from specdec.errors import SpecdecError
from specdec.models import cpu_kernels
from specdec.models.cpu_drafter import DrafterPass
from specdec.strategies.base import GenerationParams
from specdec.strategies.draft import DraftStrategy
from specdec.strategies.eagle import EagleStrategy
from specdec.strategies.eagle_tree import Eagle2
from specdec.strategies.greedy import Greedy
from specdec.strategies.schedules import FixedLength

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="needs numba")


def same_cache(a: Any, b: Any) -> None:
    assert a.lengths == b.lengths
    for x, y in ((a.k, b.k), (a.v, b.v), (a.key_panels, b.key_panels), (a.value_panels, b.value_panels)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("weights", ["fp32", "int8"])
@pytest.mark.parametrize("layout", ["specdec", "eagle1"])
def test_eagle_drafter_pass_is_the_module_pass_bitwise(load_tiny: Any, tmp_path: Path, layout: str,
                                                       weights: str) -> None:
    """Catch-up passes (several pairs, causal), single pairs and a pass after a rollback: the same logits of the
    last pair, hidden states and cache (K, V and their panels), bit for bit, with and without EAGLE-1's norms."""
    target = load_tiny("llama", matmul="numba")
    net = load_eagle(str(saved_eagle(load_tiny("llama"), tmp_path, layout)), weights=weights).bind(target)
    assert DrafterPass.fits(net)
    kernel = DrafterPass(net)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, target.vocab_size, (12,), generator=gen)
    feats = torch.randn(12, target.hidden_size, generator=gen)
    ref, cache = net.new_cache(64), net.new_cache(64)
    for a, b in ((0, 5), (5, 6), (6, 7), (4, 8), (8, 9), (9, 12)):  # (4, 8): after a rollback to 4
        if a < ref.lengths[0]:
            ref.rollback(a)
            cache.rollback(a)
        n = b - a
        with torch.no_grad():
            want_logits, want_h = net(tokens[None, a:b], feats[None, a:b], torch.arange(a, b)[None], ref,
                                      ref.attention_mask(None, n), logits_from=n - 1)
        logits, h = kernel(tokens[a:b].numpy(), feats[a:b].numpy(), cache)
        assert logits.shape[0] == 1 and torch.equal(logits[0], want_logits[0, -1]) and torch.equal(h, want_h[0])
        same_cache(cache, ref)


def test_eagle_drafter_pass_takes_a_tree_mask_bitwise(load_tiny: Any, tmp_path: Path) -> None:
    """An EAGLE-2 expansion pass: rows at one position, each seeing the prefix, one earlier tree slot and itself,
    with every row's logits: bitwise the module path with the same mask and positions."""
    target = load_tiny("llama", matmul="numba")
    net = load_eagle(str(saved_eagle(load_tiny("llama"), tmp_path, "specdec")), weights="int8").bind(target)
    kernel = DrafterPass(net)
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, target.vocab_size, (10,), generator=gen)
    feats = torch.randn(10, target.hidden_size, generator=gen)
    ref, cache = net.new_cache(64), net.new_cache(64)
    with torch.no_grad():
        net(tokens[None, :7], feats[None, :7], torch.arange(7)[None], ref, ref.attention_mask(None, 7))
    kernel(tokens[:7].numpy(), feats[:7].numpy(), cache)
    mask = np.zeros((3, 10), dtype=np.bool_)
    mask[:, :5] = True  # the real prefix; slots 5 and 6 are the tree's first depth
    mask[0, 5] = mask[1, 5] = mask[2, 6] = True
    mask[np.arange(3), 7 + np.arange(3)] = True
    positions = np.full(3, 6)
    with torch.no_grad():
        want_logits, want_h = net(tokens[None, 7:], feats[None, 7:], torch.from_numpy(positions)[None], ref,
                                  torch.from_numpy(mask)[None, None])
    logits, h = kernel(tokens[7:].numpy(), feats[7:].numpy(), cache, mask, positions, 0)
    assert torch.equal(logits, want_logits[0]) and torch.equal(h, want_h[0])
    same_cache(cache, ref)
    with pytest.raises(ValueError, match="mask of shape"):
        kernel(tokens[:2].numpy(), feats[:2].numpy(), cache, mask)


def trained_draft(target: Any) -> Any:
    """A random 1-layer distilled draft for `target` (its own layer, the target's embedding and head rows)."""
    trainable = DraftTrainable(layers=1, kept_vocab=0, save_dtype="fp32")
    return trainable, trainable.build(target, None)


def test_draft_engine_next_logits_is_forwards_last_row(load_tiny: Any, tmp_path: Path) -> None:
    """A trained draft on the CPU kernels (no fc: its own embedding) feeds chains through one call: the last
    row of `forward`'s logits, bit for bit, the same cache and the same held tokens for prefix reuse."""
    from heads.draft_model import load_draft

    target = load_tiny("llama", matmul="numba")
    trainable, module = trained_draft(load_tiny("llama"))
    trainable.save(module, tmp_path, {"steps": 0})
    net = load_draft(str(tmp_path)).bind(target)
    assert DrafterPass.fits(net) and getattr(net, "fc", None) is None
    ref, fast = (StaticEngine(net, 64, prefix_cache=True) for _ in range(2))
    ids = torch.randint(0, target.vocab_size, (15,), generator=torch.Generator().manual_seed(4))
    ref.prefill(ids[:6].tolist())
    fast.prefill(ids[:6].tolist())
    assert fast._drafter_pass() is not None and ref._drafter_pass() is not None
    for a, b in ((6, 9), (9, 10), (7, 11), (11, 15)):  # (7, 11): after a rollback to 7
        for engine in (ref, fast):
            engine.rollback(min(engine.length, a))
        want = ref.forward(ids[a:b]).logits[-1]
        got = fast.next_logits(ids[a:b])
        assert torch.equal(got, want)
        same_cache(fast.cache, ref.cache)
        n = fast.length  # held slots past the length are stale (and never allocated as zeros)
        assert torch.equal(fast.held.ids[:n], ref.held.ids[:n]) and torch.equal(fast.held.hidden[:n],
                                                                                ref.held.hidden[:n])


def test_strategies_on_the_cpu_kernels_call_the_drafter_pass(load_tiny: Any, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """EAGLE's and EAGLE-2's proposers and a trained draft's engine take the one-call path on the CPU kernels, and
    stay lossless."""
    from heads.draft_model import load_draft

    calls = []
    original = DrafterPass.__call__

    def counted(self: DrafterPass, *args: Any) -> Any:
        calls.append(len(args) > 3 and args[3] is not None)  # whether it was given a tree mask
        return original(self, *args)

    monkeypatch.setattr(DrafterPass, "__call__", counted)
    target, reference = load_tiny("llama", matmul="numba"), load_tiny("llama")
    trainable, module = trained_draft(reference)
    trainable.save(module, tmp_path / "draft", {"steps": 0})
    eagle = EagleStrategy(target, "eagle", load_eagle(str(saved_eagle(reference, tmp_path / "eagle", "specdec"))),
                          FixedLength(3), 256, 64)
    draft = DraftStrategy(target, "draft", load_draft(str(tmp_path / "draft")), FixedLength(3), 256, 64)
    eagle2 = Eagle2(target, "eagle2", load_eagle(str(tmp_path / "eagle")), depth=3, topk=2, nodes=5, max_len=256,
                    prefill_chunk=64)
    assert eagle.kernel is not None and eagle2.kernel is not None
    for strategy in (eagle, draft, eagle2):
        calls.clear()
        for seed in (3, 4):
            prompt = torch.randint(3, 200, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
            want = Greedy(reference, "greedy", 256, 64).generate(prompt, GenerationParams(30), 0).output_ids
            res = strategy.generate(prompt, GenerationParams(30), 0)
            assert res.output_ids == want and res.proposed > 0
        assert len(calls) > 10, strategy.name
        assert any(calls) == (strategy is eagle2)  # EAGLE-2's expansions too


def test_eagle2_expands_more_nodes_than_one_call_takes(load_tiny: Any, tmp_path: Path) -> None:
    """A depth's frontier past FUSED_ROWS nodes (topk > 64) goes through the module path and stays lossless."""
    target, reference = load_tiny("llama", matmul="numba"), load_tiny("llama")
    eagle2 = Eagle2(target, "eagle2", load_eagle(str(saved_eagle(reference, tmp_path / "eagle", "specdec"))),
                    depth=2, topk=70, nodes=8, max_len=512, prefill_chunk=64)
    assert eagle2.kernel is not None
    prompt = torch.randint(3, 200, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    want = Greedy(reference, "greedy", 512, 64).generate(prompt, GenerationParams(12), 0).output_ids
    assert eagle2.generate(prompt, GenerationParams(12), 0).output_ids == want


def test_drafter_pass_refuses_what_it_cannot_run(load_tiny: Any, tmp_path: Path) -> None:
    target = load_tiny("llama", matmul="numba")
    net = load_eagle(str(saved_eagle(load_tiny("llama"), tmp_path, "specdec"))).bind(target)
    kernel, cache = DrafterPass(net), net.new_cache(8)
    feats = np.zeros((1, target.hidden_size), np.float32)
    with pytest.raises(IndexError, match="out of range"):
        kernel(np.array([target.vocab_size]), feats, cache)
    with pytest.raises(ValueError, match="features"):
        kernel(np.array([1, 2]), feats, cache)
    with pytest.raises(ValueError, match="1..64 tokens"):
        kernel(np.zeros(65, np.int64), np.zeros((65, target.hidden_size), np.float32), cache)
    kernel(np.arange(8), np.zeros((8, target.hidden_size), np.float32), cache)
    with pytest.raises(SpecdecError, match="KV cache overflow"):
        kernel(np.array([1]), feats, cache)
    assert cache.lengths == [8]
    assert not DrafterPass.fits(target.model)  # a tied embedding (read from the head's panels) keeps the module path
