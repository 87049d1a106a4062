"""The static KV cache: rollback, compaction, overflow and ragged batches against fresh recomputation."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from helpers import assert_cache_matches_fresh, assert_kv_matches_fresh, chain_forward, random_ids
from hypothesis import given
from hypothesis import strategies as st

from specdec.engine.engine import StaticEngine
from specdec.engine.kv_cache import KVCache
from specdec.errors import SpecdecError
from specdec.models import cpu_kernels
from specdec.models.cpu_layer import FUSED_ROWS
from specdec.models.loader import LoadedModel
from specdec.trees import tree_depth, tree_mask

VOCAB = 512


def test_rollback_then_reappend_equals_fresh(tiny_target: LoadedModel) -> None:
    ids = random_ids(24, VOCAB, seed=0)
    wrong = random_ids(6, VOCAB, seed=1)
    engine = StaticEngine(tiny_target.model, 64, prefill_chunk=5)
    engine.prefill(ids[:12])
    engine.forward(torch.tensor(wrong))  # two accepted, four rejected: their K/V must not leak
    engine.rollback(14)
    assert engine.length == 14
    engine.forward(torch.tensor(ids[14:24]))
    assert_cache_matches_fresh(engine, ids[:12] + wrong[:2] + ids[14:24])


def test_rollback_to_shorter_then_longer_chain(tiny_target: LoadedModel) -> None:
    # stale slots past the length are overwritten, never attended: a longer re-append sees none of them
    ids = random_ids(30, VOCAB, seed=2)
    engine = StaticEngine(tiny_target.model, 64)
    engine.prefill(ids[:20])
    engine.rollback(5)
    engine.forward(torch.tensor(ids[5:30]))
    assert_cache_matches_fresh(engine, ids)


def test_rollback_cannot_grow(tiny_target: LoadedModel) -> None:
    engine = StaticEngine(tiny_target.model, 32)
    engine.prefill(random_ids(5, VOCAB, seed=3))
    with pytest.raises(ValueError, match="may only shrink"):
        engine.rollback(6)
    assert engine.length == 5


def test_compact_tree_path_equals_fresh(tiny_target: LoadedModel) -> None:
    prompt = random_ids(9, VOCAB, seed=4)
    engine = StaticEngine(tiny_target.model, 64)
    engine.prefill(prompt[:-1])
    # root, then branch a (nodes 1-3) and branch b (nodes 4-6), both hanging off the root
    parents = [0, 1, 2, 0, 4, 5]
    nodes = [prompt[-1], *random_ids(6, VOCAB, seed=5)]
    base = engine.length
    engine.forward(torch.tensor(nodes), tree_depth(parents), tree_mask(parents))
    keep = [0, 4, 5]  # root + the first two nodes of branch b
    engine.compact(base, [base + n for n in keep])
    assert_cache_matches_fresh(engine, prompt[:-1] + [nodes[n] for n in keep])


def test_compact_moves_overlapping_slots() -> None:
    cache = KVCache(n_layers=2, batch=1, n_kv_heads=2, max_len=12, head_dim=4, dtype=torch.float32, device="cpu")
    cache.k.copy_(torch.randn(cache.k.shape))
    cache.v.copy_(torch.randn(cache.v.shape))
    cache.lengths = [9]
    k0, v0 = cache.k.clone(), cache.v.clone()
    keep = [3, 5, 6, 8]  # sources overlap the destinations 3..6
    cache.compact(3, keep)
    assert cache.lengths == [7]
    torch.testing.assert_close(cache.k[:, 0, :, 3:7], k0[:, 0, :, keep], rtol=0, atol=0)
    torch.testing.assert_close(cache.v[:, 0, :, 3:7], v0[:, 0, :, keep], rtol=0, atol=0)
    torch.testing.assert_close(cache.k[:, 0, :, :3], k0[:, 0, :, :3], rtol=0, atol=0)


@pytest.mark.parametrize("keep", [[4, 3], [1, 2], [3, 3], [3, 9]])
def test_compact_rejects_bad_slots(keep: list[int]) -> None:
    cache = KVCache(1, 1, 1, 12, 2, torch.float32, "cpu")
    cache.lengths = [9]
    with pytest.raises(ValueError, match="bad keep slots"):
        cache.compact(3, keep)
    assert cache.lengths == [9]


def test_overflow_raises_clear_error_and_keeps_cache(tiny_target: LoadedModel) -> None:
    ids = random_ids(16, VOCAB, seed=6)
    engine = StaticEngine(tiny_target.model, 16)
    engine.prefill(ids[:10])
    with pytest.raises(SpecdecError) as err:
        engine.forward(torch.tensor(ids[10:16] + [5]))
    msg = str(err.value)
    assert "\n" not in msg and "overflow" in msg and "17" in msg and "16" in msg and "max_new_tokens" in msg
    assert engine.length == 10  # nothing was written: the turn can go on with fewer tokens
    engine.forward(torch.tensor(ids[10:16]))  # exactly fills the cache
    assert_kv_matches_fresh(engine, ids)


def test_prompt_longer_than_cache_is_refused(tiny_target: LoadedModel) -> None:
    engine = StaticEngine(tiny_target.model, 16)
    with pytest.raises(SpecdecError, match="does not fit the cache of 16"):
        engine.prefill(random_ids(16, VOCAB, seed=7))
    with pytest.raises(SpecdecError, match="empty prompt"):
        engine.prefill([])


@pytest.mark.parametrize("n_new", [1, 3])
def test_ragged_batch_matches_each_sequence_alone(tiny_target: LoadedModel, n_new: int) -> None:
    model = tiny_target.model
    a, b = random_ids(8, VOCAB, seed=8), random_ids(11, VOCAB, seed=9)
    cache = model.new_cache(32, batch=2)
    # fill both rows to 11 slots (row 0 padded with junk), then cut row 0 back to its 8 real tokens
    padded = torch.tensor([a + [5, 6, 7], b])
    model(padded, torch.arange(11).expand(2, 11), cache, cache.attention_mask(None, 11))
    cache.rollback([8, 11])
    na, nb = random_ids(n_new, VOCAB, seed=10), random_ids(n_new, VOCAB, seed=11)
    positions = torch.tensor([list(range(8, 8 + n_new)), list(range(11, 11 + n_new))])
    mask = cache.attention_mask(None, n_new)
    assert mask is not None and mask.shape == (2, 1, n_new, 11 + n_new)
    logits, _ = model(torch.tensor([na, nb]), positions, cache, mask)
    assert cache.lengths == [8 + n_new, 11 + n_new]
    fresh_a, ref_a = chain_forward(model, a + na)
    _, ref_b = chain_forward(model, b + nb)
    torch.testing.assert_close(logits[0], ref_a[-n_new:], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(logits[1], ref_b[-n_new:], atol=1e-5, rtol=1e-4)
    # each row's cache holds its own sequence's K/V and nothing else
    torch.testing.assert_close(cache.k[:, 0, :, :8 + n_new], fresh_a.cache.k[:, 0, :, :8 + n_new], atol=1e-5, rtol=1e-4)


def test_attention_mask_none_only_when_safe() -> None:
    cache = KVCache(1, 2, 1, 8, 2, torch.float32, "cpu")
    cache.lengths = [3, 3]
    assert cache.attention_mask(None, 1) is None
    chain = cache.attention_mask(None, 2)
    assert chain is not None and chain[0, 0].tolist() == [[True] * 4 + [False], [True] * 5]
    cache.lengths = [2, 3]
    ragged = cache.attention_mask(None, 1)  # row 0 writes its new token at slot 2, slot 3 is stale
    assert ragged is not None and ragged[:, 0, 0].tolist() == [[True, True, True, False], [True] * 4]


# --- property: any mix of appends, rollbacks and tree compactions equals recomputation ---------------

tokens = st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=5)
append_op = st.tuples(st.just("append"), tokens)
rollback_op = st.tuples(st.just("rollback"), st.floats(0, 1))
tree_op = st.tuples(st.just("tree"), st.tuples(tokens, tokens, st.booleans(), st.integers(0, 5)))
ops = st.lists(st.one_of(append_op, rollback_op, tree_op), min_size=1, max_size=6)


@given(prompt=tokens, ops=ops, root=st.integers(3, VOCAB - 1))
def test_cache_operations_equal_recomputation(tiny_target: LoadedModel, prompt: list[int],
                                              ops: list[tuple[str, object]], root: int) -> None:
    engine = StaticEngine(tiny_target.model, 96)
    engine.prefill(prompt)
    seq = list(prompt)  # what the cache should hold
    for kind, arg in ops:
        if kind == "append":
            assert isinstance(arg, list)
            engine.forward(torch.tensor(arg))
            seq += arg
        elif kind == "rollback":
            assert isinstance(arg, float)
            m = int(arg * len(seq))
            engine.rollback(m)
            seq = seq[:m]
        else:
            assert isinstance(arg, tuple)
            branch_a, branch_b, take_b, n_keep = arg
            # root, then branch a as a chain off the root, then branch b as another chain off the root
            na = len(branch_a)
            parents = list(range(na)) + [0] + list(range(na + 1, na + len(branch_b)))
            base = engine.length
            engine.forward(torch.tensor([root, *branch_a, *branch_b]), tree_depth(parents), tree_mask(parents))
            branch, first = (branch_b, na + 1) if take_b else (branch_a, 1)
            n_keep = min(n_keep, len(branch))
            engine.compact(base, [base, *range(base + first, base + first + n_keep)])
            seq += [root, *branch[:n_keep]]
        assert engine.length == len(seq)
    if not seq:
        engine.forward(torch.tensor([root]))
        seq = [root]
    assert_cache_matches_fresh(engine, seq)


def _assert_panels_hold(cache: KVCache) -> None:
    """key_panels and value_panels say exactly what k and v say, for every filled slot of every row."""
    assert cache.key_panels is not None and cache.value_panels is not None
    nb, D = cache.key_panels.shape[-1], cache.k.shape[-1]
    for b, n in enumerate(cache.lengths):
        slots = torch.arange(n)
        keys = cache.key_panels[:, b][:, :, slots // nb, :, slots % nb]  # (n, L, H, D)
        values = cache.value_panels[:, b].movedim(-2, -3).flatten(-2)[..., :n, :D]  # (L, H, n, D)
        assert torch.equal(keys.movedim(0, -2), cache.k[:, b, :, :n])
        assert torch.equal(values, cache.v[:, b, :, :n])


@pytest.mark.parametrize("panel", [4, 32])  # narrower and wider than head_dim
def test_panels_follow_writes_and_compaction(panel: int) -> None:
    cache = KVCache(n_layers=2, batch=2, n_kv_heads=2, max_len=20, head_dim=8, dtype=torch.float32, device="cpu")
    for layer in range(2):
        cache.write(layer, torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8))
    cache.advance(5)
    cache.keep_panels(panel)  # filled from what is cached
    _assert_panels_hold(cache)
    cache.rollback([3, 5])  # ragged rows: each row writes after its own length
    for layer in range(2):
        cache.write(layer, torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8))
    cache.advance(6)
    _assert_panels_hold(cache)
    cache.compact(4, [5, 7, 8], b=1)
    cache.compact(2, [2, 4, 8], b=0)
    assert cache.lengths == [5, 7]
    _assert_panels_hold(cache)


@pytest.mark.skipif(not cpu_kernels.available(), reason="needs numba")
def test_fused_kernels_keep_the_panels(load_tiny: Callable[..., LoadedModel]) -> None:
    """The CPU kernels' attention writes new keys and values into the panels it reads as well as into k
    and v, through a chain, a tree and its compaction; passes over more than FUSED_ROWS tokens (torch's
    path) keep them through `write`."""
    engine = StaticEngine(load_tiny("llama", matmul="numba").model, 256)
    engine.forward(torch.tensor(random_ids(FUSED_ROWS + 2, VOCAB, seed=4)))  # the torch path, before there are panels
    engine.forward(torch.tensor(random_ids(3, VOCAB, seed=5)))  # the fused kernels: panels made and filled
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    base = engine.length
    engine.forward(torch.tensor(random_ids(4, VOCAB, seed=6)), depth=torch.tensor([0, 1, 1, 2]), mask=tree)
    engine.compact(base, [base, base + 2, base + 3])
    _assert_panels_hold(engine.cache)
    engine.forward(torch.tensor(random_ids(FUSED_ROWS + 5, VOCAB, seed=7)))  # torch's path again
    _assert_panels_hold(engine.cache)
