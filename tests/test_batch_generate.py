"""heads.batch_generate: continuous batching on the CPU kernels gives what the padded batches give."""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import Tensor

from heads.batch_generate import _generate_batch, continuous, generate_with_hidden
from heads.contamination import HELDAPART_DIR, evaluation_turns
from specdec.models import cpu_kernels
from specdec.models.loader import LoadedModel

needs_numba = pytest.mark.skipif(not cpu_kernels.available(), reason="needs numba")


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 500, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@needs_numba
def test_continuous_slots_equal_the_padded_batch_tokens_and_hidden_states(
        load_tiny: Callable[..., LoadedModel]) -> None:
    target = load_tiny("llama", matmul="numba")
    ps = prompts(7)
    whole = _generate_batch(target, ps, 12)
    stop = {whole[3].continuation[5]}  # a token from the middle of one answer: some end early, slots refill
    target.eos_ids = tuple(stop)  # type: ignore[misc]
    try:
        padded = _generate_batch(target, ps, 12)
        slotted = continuous(target, ps, 12, slots=3, stop=stop)
        via_dispatch = generate_with_hidden(target, ps, 12, batch_size=3)
    finally:
        target.eos_ids = ()  # type: ignore[misc]
    assert len({len(g.continuation) for g in padded}) > 1
    assert [g.continuation for g in slotted] == [g.continuation for g in padded]
    assert [g.continuation for g in via_dispatch] == [g.continuation for g in padded]
    for a, b, p in zip(slotted, padded, ps):
        assert a.hidden.shape == b.hidden.shape == (len(p) + len(a.continuation), target.model.args.dim)
        np.testing.assert_allclose(a.hidden.astype(np.float32), b.hidden.astype(np.float32), atol=2e-2)


@needs_numba
def test_seeded_sampling_does_not_depend_on_the_number_of_slots(load_tiny: Callable[..., LoadedModel]) -> None:
    target = load_tiny("llama", matmul="numba")
    ps = prompts(6)

    def run(slots: int, seed: int) -> list[list[int]]:
        gens = [torch.Generator().manual_seed(seed * 100 + i) for i in range(len(ps))]

        def pick(i: int, logits: Tensor) -> int:
            return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gens[i]))

        return [g.continuation for g in continuous(target, ps, 10, slots, stop=set(), pick=pick)]

    assert run(2, 1) == run(5, 1)
    assert run(2, 1) != run(2, 2)


def test_held_apart_questions_count_as_never_to_be_trained_on() -> None:
    files = sorted(HELDAPART_DIR.glob("*.jsonl"))
    assert files, "experiments/heldapart/ holds the committed held-apart questions"
    turns = {t.text for t in evaluation_turns()}
    for f in files:
        first = json.loads(f.read_text().splitlines()[0])["turns"][0]
        assert first in turns, f.name


def test_reading_the_end_less_often_gives_the_same_tokens_and_states(load_tiny: Callable[..., LoadedModel]) -> None:
    # A GPU reads whether every row has ended only every 8 steps; the steps it runs past the end are cut off.
    target = load_tiny("llama")
    ps = prompts(7)
    stop = {_generate_batch(target, ps, 12)[2].continuation[4]}
    target.eos_ids = tuple(stop)  # type: ignore[misc]
    try:
        each = _generate_batch(target, ps, 12, check_every=1)
        seldom = _generate_batch(target, ps, 12, check_every=5)
    finally:
        target.eos_ids = ()  # type: ignore[misc]
    assert len({len(g.continuation) for g in each}) > 1  # some rows end early
    assert [g.continuation for g in seldom] == [g.continuation for g in each]
    for a, b, p in zip(seldom, each, ps):
        assert a.hidden.shape == (len(p) + len(a.continuation), target.model.args.dim)
        np.testing.assert_array_equal(a.hidden, b.hidden)


@pytest.mark.parametrize("compiled", [False, True])
def test_static_steps_give_the_eager_loops_tokens_and_states(load_tiny: Callable[..., LoadedModel],
                                                             compiled: bool) -> None:
    """The GPU's loop (static-shape steps over a reused cache, compiled when the target is) against the eager
    one, with rows ending early; then a second, narrower batch in the same cache, whose stale slots no row
    reads, through the same graph."""
    from dataclasses import replace

    from torch._dynamo.utils import counters

    eager = load_tiny("llama")
    target = replace(eager, compile=compiled)
    ps = prompts(7)
    stop = {_generate_batch(eager, ps, 12)[2].continuation[4]}
    target.eos_ids = eager.eos_ids = tuple(stop)  # type: ignore[misc]
    try:
        want = _generate_batch(eager, ps, 12, static=False)
        got = _generate_batch(target, ps, 12, static=True)
        graphs = counters["stats"]["unique_graphs"]
        narrow = [p[:4] for p in ps]  # other widths and lengths, the same cache and graph
        want2, got2 = _generate_batch(eager, narrow, 12, static=False), _generate_batch(target, narrow, 12, static=True)
    finally:
        target.eos_ids = eager.eos_ids = ()  # type: ignore[misc]
    assert len({len(g.continuation) for g in want}) > 1  # some rows end early
    for a, b in ((got, want), (got2, want2)):
        assert [g.continuation for g in a] == [g.continuation for g in b]
        for x, y in zip(a, b):
            np.testing.assert_allclose(x.hidden.astype(np.float32), y.hidden.astype(np.float32), atol=1e-2)
    if compiled:
        assert counters["stats"]["unique_graphs"] == graphs  # no new graph for the second batch
        # the distillation's entry point takes this loop on a compiled target, then frees its cache for training
        assert "_greedy_cache" in target.model.__dict__
        via_dispatch = generate_with_hidden(target, narrow, 12, batch_size=7)
        assert [g.continuation for g in via_dispatch] == [g.continuation for g in _generate_batch(eager, narrow, 12)]
        assert "_greedy_cache" not in target.model.__dict__


def test_auto_generation_batch(load_tiny: Callable[..., LoadedModel], monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace

    from heads.distill_data import AUTO_BATCH_CPU, AUTO_BATCH_CUDA, generation_batch
    from specdec.errors import SpecdecError

    target = load_tiny("llama")
    assert generation_batch(24, target, 128) == 24
    assert generation_batch("auto", target, 128) == AUTO_BATCH_CPU  # a CPU target
    with pytest.raises(SpecdecError, match="data.batch_size"):
        generation_batch("big", target, 128)
    # On a GPU: the largest power-of-two share of 256 whose cache fits in half the free memory.
    on_gpu = replace(target, device=torch.device("cuda"))
    args = target.model.args
    per_row = (1024 + 128) * (2 * args.n_layers * args.n_kv_heads * args.head_dim * 4 + 2 * args.dim)
    for free, want in [(10**12, AUTO_BATCH_CUDA), (2 * 100 * per_row, 64), (2 * 20 * per_row, 16), (0, 16)]:
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, f=free: (f, 2 * f))
        assert generation_batch("auto", on_gpu, 128) == want
