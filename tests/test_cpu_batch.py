"""The CPU kernels' fused pass over several sequences at once (cpu_layer.FusedStack.run_segments): each
sequence's rows get bitwise what running that sequence alone through the batch-1 fused pass gives, and
each sequence's cache gets exactly the K/V (and panels) the lone run writes. A pass reads nothing but its
own sequence's filled slots (poisoned unused slots and other sequences change nothing), and gives the same
bits every time with one numba thread too."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import numba
import numpy as np
import pytest
import torch
from helpers import random_ids
from torch import Tensor

from specdec.engine.kv_cache import KVCache
from specdec.models import cpu_kernels, cpu_layer
from specdec.models.llama import Llama
from specdec.models.loader import LoadedModel

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="needs numba")

VOCAB, MAX_LEN = 512, 64
PARTS = ("k", "v", "key_panels", "value_panels")


def chain(n: int) -> Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


@pytest.fixture(scope="module")
def model(load_tiny: Callable[..., LoadedModel]) -> Llama:
    m = load_tiny("llama", matmul="numba").model
    assert type(m.fused).__name__ == "FusedStack"
    return m


def prefilled(model: Llama, lengths: list[int]) -> KVCache:
    """A batch cache whose sequence b holds a random prompt of lengths[b] tokens, each prefilled alone
    (a batch-1 cache per prompt, its K/V copied in; panels then built from them)."""
    cache = model.new_cache(MAX_LEN, batch=len(lengths))
    for b, n in enumerate(lengths):
        one = model.new_cache(MAX_LEN)
        model.forward(torch.tensor([random_ids(n, VOCAB, seed=20 + b)]), torch.arange(n)[None], one,
                      one.attention_mask(None, n))
        cache.k[:, b], cache.v[:, b] = one.k[:, 0], one.v[:, 0]
    cache.lengths = list(lengths)
    cache.keep_panels(model.fused.att_panel)
    return cache


def alone(cache: KVCache, b: int) -> KVCache:
    """A batch-1 copy of sequence b's cache (K/V, panels, length)."""
    one = KVCache(cache.k.shape[0], 1, cache.k.shape[2], cache.max_len, cache.k.shape[4], cache.k.dtype, "cpu")
    for part in PARTS:
        setattr(one, part, getattr(cache, part)[:, b:b + 1].clone())
    one.lengths = [cache.lengths[b]]
    return one


def check_segmented(model: Llama, lengths: list[int], plan: list[tuple[int, Tensor]], masked: bool = True) -> None:
    """plan: (b, new-token mask (n, n)) per segment, in row order. One run_segments call over them
    against each segment run alone (batch-1 __call__, the same mask) from the same cache state."""
    fused = model.fused
    cache = prefilled(model, lengths)
    before = {part: getattr(cache, part).clone() for part in PARTS}
    lone = [alone(cache, b) for b, _ in plan]
    segments, positions = [], []
    for b, tree in plan:
        segments.append([b, lengths[b], sum(s[3] for s in segments), len(tree)])
        positions.append(lengths[b] + tree.sum(1) - 1)  # depth in the tree (a chain: 0, 1, ...)
    R, S = sum(s[3] for s in segments), max(s[1] + s[3] for s in segments)
    mask = torch.zeros(R, S, dtype=torch.bool)
    for (_, start, r0, n), (_, tree) in zip(segments, plan):
        mask[r0:r0 + n, :start] = True
        mask[r0:r0 + n, start:start + n] = tree
    x = torch.randn(R, model.args.dim, generator=torch.Generator().manual_seed(3))
    pos = torch.cat(positions)
    h = fused.run_segments(model, x, pos, cache, np.array(segments, dtype=np.int64),
                           mask.numpy() if masked else None)
    assert h.shape == (R, model.args.dim)
    assert cache.lengths == lengths  # the caller advances them
    for (b, start, r0, n), one in zip(segments, lone):
        m = mask[r0:r0 + n, :start + n][None, None] if masked else None
        ref = fused(model, x[r0:r0 + n][None], pos[r0:r0 + n][None], one, m)
        assert torch.equal(h[r0:r0 + n], ref[0]), b
        for part in PARTS:  # the whole sequence: the new slots, and nothing else changed
            assert torch.equal(getattr(cache, part)[:, b], getattr(one, part)[:, 0]), (b, part)
        new = slice(start, start + n)
        assert not torch.equal(cache.k[:, b, :, new], before["k"][:, b, :, new])  # written, not left as was
    for b in set(range(len(lengths))) - {b for b, _ in plan}:
        for part in PARTS:
            assert torch.equal(getattr(cache, part)[:, b], before[part][:, b]), (b, part)


@torch.inference_mode()
def test_chains_of_three_sequences_equal_their_lone_passes(model: Llama) -> None:
    check_segmented(model, [5, 9, 13], [(0, chain(1)), (1, chain(3)), (2, chain(2))])


@torch.inference_mode()
def test_one_token_each_without_a_mask(model: Llama) -> None:
    check_segmented(model, [5, 9, 13], [(0, chain(1)), (1, chain(1)), (2, chain(1))], masked=False)


@torch.inference_mode()
def test_tree_segment_equals_the_lone_tree_pass(model: Llama) -> None:
    # node 2 does not see its sibling 1; 3 sits under 1, 4 under 2
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                        dtype=torch.bool)
    check_segmented(model, [7, 4], [(0, chain(2)), (1, tree)])


@torch.inference_mode()
def test_segments_out_of_batch_order_leave_the_idle_sequence_alone(model: Llama) -> None:
    check_segmented(model, [5, 9, 13], [(2, chain(3)), (0, chain(2))])  # sequence 1 gets no rows


@torch.inference_mode()
def test_segments_that_do_not_split_the_rows_are_refused(model: Llama) -> None:
    cache = model.new_cache(16, batch=2)
    x, pos = torch.zeros(3, model.args.dim), torch.zeros(3, dtype=torch.long)
    bad = [[[0, 0, 0, 2]],  # row 2 belongs to no segment
           [[0, 0, 0, 2], [1, 0, 1, 2]],  # rows overlap
           [[2, 0, 0, 3]],  # no sequence 2
           [[0, 15, 0, 3]]]  # past the cache's end
    for segments in bad:
        with pytest.raises(ValueError, match="segments"):
            model.fused.run_segments(model, x, pos, cache, np.array(segments, dtype=np.int64), None)
    with pytest.raises(ValueError, match="mask"):
        model.fused.run_segments(model, x, pos, cache, np.array([[0, 4, 0, 3]], dtype=np.int64),
                                 np.ones((3, 6), dtype=np.bool_))


@pytest.fixture
def one_numba_thread() -> Iterator[None]:
    """Run numba's parallel loops on the calling thread alone (as NUMBA_NUM_THREADS=1 does): their
    allocations then come from the caller's heap, where memory an array was freed from is reused at once."""
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        yield
    finally:
        numba.set_num_threads(before)


@torch.inference_mode()
@pytest.mark.usefixtures("one_numba_thread")
def test_passes_with_one_numba_thread_repeat_bitwise_and_match_the_torch_path(model: Llama) -> None:
    # The attention kernel once freed its queries before the loop that reads them (by address): with one
    # thread that loop's first allocation reused the block and overwrote some queries, for some row counts
    # and not others, differently from run to run.
    gen = torch.Generator().manual_seed(5)
    for T in range(1, 17):
        x = torch.randn(1, T, model.args.dim, generator=gen)
        pos = torch.arange(T)[None]
        outs = []
        for _ in range(3):
            cache = model.new_cache(MAX_LEN)
            outs.append(model.fused(model, x, pos, cache, cache.attention_mask(None, T)))
        ref_cache = model.new_cache(MAX_LEN)  # taps: the layers' own forward, not the fused stack
        ref = model.run_layers(x, pos, ref_cache, ref_cache.attention_mask(None, T), taps=(0,), seen=[])
        for out in outs:
            assert torch.equal(out, outs[0]), (T, float((out - outs[0]).abs().max()))
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@torch.inference_mode()
@pytest.mark.usefixtures("one_numba_thread")
def test_segments_with_one_numba_thread_equal_their_lone_passes(model: Llama) -> None:
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                        dtype=torch.bool)
    for _ in range(3):
        check_segmented(model, [5, 9, 13], [(0, chain(4)), (1, chain(6)), (2, chain(3))])
        check_segmented(model, [7, 4], [(0, chain(8)), (1, tree)])


def test_the_kernels_divide_exactly_in_every_copy_of_a_loop() -> None:
    # A vectorised loop has a scalar copy for its tail and for arrays its runtime checks find too close;
    # with a reciprocal estimate in one copy and a true division in the other, a row's bits hung on where
    # its arrays lay in memory (the one-thread test above failed on an AVX2 host). Compiled afresh here:
    # numba shows no machine code for functions it loaded from its disk cache.
    NB, D, n_heads, n_kv, T = cpu_kernels.kernels().isa.panel, 16, 4, 2, 3
    f32 = np.float32
    calls = [(cpu_layer._silu_mul, (np.ones((T, 2 * 40), f32), 40, np.empty((T, 40), f32))),
             (cpu_layer._attend, (np.ones((T, (n_heads + 2 * n_kv) * D), f32), np.ones((T, D // 2, 2), f32),
                                  np.zeros((n_kv, 64, D), f32), np.zeros((n_kv, 64, D), f32),
                                  np.zeros((n_kv, 64 // NB, D, NB), f32), np.zeros((n_kv, -(-D // NB), 64, NB), f32),
                                  0, np.ones((T, T), np.bool_), True, n_heads, n_kv, D,
                                  np.zeros((T, n_heads * D), f32), cpu_kernels.kernels().by_kind["fp32"]))]
    for fn, args in calls:
        fresh = numba.njit(**{k: v for k, v in fn.targetoptions.items() if k not in ("cache", "nopython")})(fn.py_func)
        fresh(*args)
        asm = "\n".join(fresh.inspect_asm().values())
        assert "div" in asm, fn.__name__  # the division is there to find
        assert not re.search(r"\b(v?rcp\w*|frecpe)\b", asm), f"{fn.__name__} divides by a reciprocal estimate"


def poison(cache: KVCache, b: int, start: int, value: float) -> None:
    """Fill sequence b's slots from `start` on, and the panels' padding, with `value`: everything a pass
    that starts there must not read before it writes (or ever)."""
    nb = cache.key_panels.shape[-1]
    slots = torch.arange(start, cache.key_panels.shape[3] * nb)  # up to the end of the last key panel
    cache.k[:, b, :, start:] = value
    cache.v[:, b, :, start:] = value
    cache.key_panels[:, b][..., slots // nb, :, slots % nb] = value
    cache.value_panels[:, b, :, :, start:] = value
    D = cache.v.shape[-1]
    if D % nb:  # value dims past D in the last panel
        cache.value_panels[:, b, :, -1, :, D % nb:] = value


@torch.inference_mode()
@pytest.mark.parametrize("value", [float("nan"), 1e30])
def test_unused_slots_and_other_sequences_do_not_reach_a_pass(model: Llama, value: float) -> None:
    lengths = [5, 9, 13]
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                        dtype=torch.bool)
    plan = [(2, chain(3)), (0, tree)]  # sequence 1 gets no rows
    segments, r0 = [], 0
    for b, t in plan:
        segments.append([b, lengths[b], r0, len(t)])
        r0 += len(t)
    R, S = r0, max(s[1] + s[3] for s in segments)
    mask = torch.zeros(R, S, dtype=torch.bool)
    positions = []
    for (_, start, r, n), (_, t) in zip(segments, plan):
        mask[r:r + n, :start] = True
        mask[r:r + n, start:start + n] = t
        positions.append(start + t.sum(1) - 1)
    pos = torch.cat(positions)
    x = torch.randn(R, model.args.dim, generator=torch.Generator().manual_seed(4))
    clean = prefilled(model, lengths)
    dirty = prefilled(model, lengths)
    for b in range(len(lengths)):
        poison(dirty, b, lengths[b], value)
    dirty.k[:, 1], dirty.v[:, 1] = value, value  # the idle sequence: all of it
    dirty.key_panels[:, 1], dirty.value_panels[:, 1] = value, value
    segs = np.array(segments, dtype=np.int64)
    h_clean = model.fused.run_segments(model, x, pos, clean, segs, mask.numpy())
    h_dirty = model.fused.run_segments(model, x, pos, dirty, segs, mask.numpy())
    assert torch.isfinite(h_clean).all()
    assert torch.equal(h_dirty, h_clean)
    for (b, start, r, n), _ in zip(segments, plan):  # batch-1 passes over poisoned copies, alike
        one_dirty = alone(dirty, b)  # at length `start`: run_segments left the lengths as they were
        poison(one_dirty, 0, start, value)  # the slots that pass wrote, too
        for one in (alone(clean, b), one_dirty):
            m = mask[r:r + n, :start + n][None, None]
            out = model.fused(model, x[r:r + n][None], pos[r:r + n][None], one, m)
            assert torch.equal(out[0], h_clean[r:r + n]), b
        for part in ("k", "v"):  # the new slots hold exactly what the clean run wrote
            new = slice(start, start + n)
            assert torch.equal(getattr(dirty, part)[:, b, :, new], getattr(clean, part)[:, b, :, new])
