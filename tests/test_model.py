"""Our compact Llama-family model and both engines against transformers on the same weights (fp32)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import chain_forward, filled, random_ids
from torch import Tensor

from specdec.engine.engine import HFEngine, StaticEngine
from specdec.errors import SpecdecError
from specdec.models import cpu_kernels, llama
from specdec.models.cpu_layer import FUSED_ROWS
from specdec.models.llama import LlamaArgs
from specdec.models.loader import LoadedModel

TYPES = ["llama", "qwen2", "mistral"]
ATOL = 1e-4
VOCAB = 512


@pytest.fixture(scope="module")
def hf_models(tiny_folders: dict[str, Path]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    return {t: AutoModelForCausalLM.from_pretrained(f, dtype=torch.float32).eval() for t, f in tiny_folders.items()}


def hf_forward(model: Any, ids: list[int]) -> tuple[Tensor, Tensor]:
    """transformers' logits (T, V) and final hidden states (T, dim) over the whole sequence at once."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0].float(), out.hidden_states[-1][0]


def test_qwen2_fixture_has_biases(load_tiny: Callable[..., LoadedModel]) -> None:
    # guards the comparison below: with zero biases a loader that drops them would still match
    model = load_tiny("qwen2").model
    assert model.args.qkv_bias and not model.args.o_bias
    assert model.layers[0].attn.wqkv.bias.abs().max() > 0.1


@pytest.mark.parametrize("model_type", TYPES)
def test_prefill_logits_match_transformers(model_type: str, load_tiny: Callable[..., LoadedModel],
                                           hf_models: dict[str, Any]) -> None:
    ids = random_ids(23, VOCAB, seed=0)
    _, logits = chain_forward(load_tiny(model_type).model, ids)
    ref, _ = hf_forward(hf_models[model_type], ids)
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("model_type", TYPES)
def test_chunked_prefill_matches_transformers(model_type: str, load_tiny: Callable[..., LoadedModel],
                                              hf_models: dict[str, Any]) -> None:
    ids = random_ids(19, VOCAB, seed=1)
    engine = StaticEngine(load_tiny(model_type).model, 64, prefill_chunk=4)
    out = engine.prefill(ids)
    ref, ref_hidden = hf_forward(hf_models[model_type], ids)
    assert out.logits.shape == (1, VOCAB) and engine.length == len(ids)
    torch.testing.assert_close(out.logits, ref[-1:], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(out.hidden, ref_hidden, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("model_type", TYPES)
def test_incremental_decode_matches_transformers(model_type: str, load_tiny: Callable[..., LoadedModel],
                                                 hf_models: dict[str, Any]) -> None:
    ids = random_ids(20, VOCAB, seed=2)
    ref, _ = hf_forward(hf_models[model_type], ids)
    engine = StaticEngine(load_tiny(model_type).model, 64, prefill_chunk=3)
    engine.prefill(ids[:8])
    for i in range(8, len(ids)):
        out = engine.forward(torch.tensor([ids[i]]))
        torch.testing.assert_close(out.logits, ref[i:i + 1], atol=ATOL, rtol=1e-4)
    assert engine.length == len(ids)


@pytest.mark.parametrize("matmul", ["numpy", "numba"])
def test_cpu_matmuls_match_torch(load_tiny: Callable[..., LoadedModel], matmul: str) -> None:
    ids = random_ids(12, VOCAB, seed=3)
    _, a = chain_forward(load_tiny("qwen2", matmul="torch").model, ids)
    _, b = chain_forward(load_tiny("qwen2", matmul=matmul).model, ids)
    torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4)


needs_numba = pytest.mark.skipif(not cpu_kernels.available(), reason="needs numba")


@needs_numba
@pytest.mark.parametrize("n_out", [64, 53])  # whole panels, and a ragged last panel
@pytest.mark.parametrize("n_in", [40, 576])  # a short k loop, and SmolLM2's width
def test_numba_kernels_are_batch_invariant(n_out: int, n_in: int) -> None:
    """Each row's product is bitwise the same whatever rows share the call (1..MAX_ROWS rows: one tile,
    several tiles per panel), and equals x @ W^T to rounding."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n_out, n_in), dtype=np.float32)
    panels = cpu_kernels.pack(w)
    x = rng.standard_normal((cpu_kernels.MAX_ROWS, n_in), dtype=np.float32)
    full = cpu_kernels.matmul_wt(x, w, panels)
    assert full.shape == (cpu_kernels.MAX_ROWS, n_out)
    np.testing.assert_allclose(full, x @ w.T, rtol=1e-4, atol=1e-4)
    assert cpu_kernels.matmul_wt(x[:0], w, panels).shape == (0, n_out)  # an empty pass writes nothing
    for rows in range(1, cpu_kernels.MAX_ROWS):
        for first in {0, cpu_kernels.MAX_ROWS - rows}:  # leading rows and trailing rows
            part = np.ascontiguousarray(x[first:first + rows])
            assert np.array_equal(cpu_kernels.matmul_wt(part, w, panels), full[first:first + rows]), (rows, first)


@needs_numba
@pytest.mark.parametrize("isa", [(8, 2, 4, "haswell", "+avx,+avx2,+fma"), (4, 4, 3, "x86-64", "")], ids=["avx2", "sse"])
def test_kernels_for_other_cpus_give_bitwise_the_same_products(isa: tuple[int, int, int, str, str]) -> None:
    """The kernels for narrower vectors (other CPUs) run the same in-order fma chain per output, so their
    products equal this CPU's bitwise: results do not depend on which machine verified a draft."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 targets")
    other = cpu_kernels.kernels(cpu_kernels.Isa(*isa))
    assert other.isa != cpu_kernels.kernels().isa
    rng = np.random.default_rng(3)
    w = rng.standard_normal((53, 576), dtype=np.float32)
    for rows in (1, 3, 6, 13):
        x = rng.standard_normal((rows, 576), dtype=np.float32)
        mine = cpu_kernels.matmul(x, cpu_kernels.pack(w), 53)
        theirs = cpu_kernels.matmul(x, cpu_kernels.pack(w, panel=other.isa.panel), 53, tiles=other.addresses)
        assert np.array_equal(mine, theirs), rows


@needs_numba
@pytest.mark.parametrize("isa", [None, (8, 2, 4, "haswell", "+avx,+avx2,+fma")], ids=["host", "avx2"])
def test_bf16_kernels_equal_float_kernels_on_rounded_weights(isa: tuple[int, int, int, str, str] | None) -> None:
    """bfloat16 panels widen exactly to float32, so their products equal the float32 kernels' on the
    rounded weights bitwise, for any rows; and rounding is to nearest (error within half a bf16 step)."""
    k = cpu_kernels.kernels(None if isa is None else cpu_kernels.Isa(*isa))
    rng = np.random.default_rng(5)
    w = rng.standard_normal((70, 576), dtype=np.float32)
    rounded = cpu_kernels.to_bf16(w)
    assert not np.array_equal(rounded, w)
    assert np.all(np.abs(rounded - w) <= np.abs(w) * 2.0 ** -8)
    half = cpu_kernels.pack(w, panel=k.isa.panel, kind="bf16")
    assert half.dtype == np.uint16 and half.nbytes * 2 == cpu_kernels.pack(w, panel=k.isa.panel).nbytes
    for rows in (1, 2, 5, 8, 11):
        x = rng.standard_normal((rows, 576), dtype=np.float32)
        got = cpu_kernels.matmul(x, half, 70, tiles=k.addresses_bf16)
        want = cpu_kernels.matmul(x, cpu_kernels.pack(rounded, panel=k.isa.panel), 70, tiles=k.addresses)
        assert np.array_equal(got, want), rows
        np.testing.assert_allclose(got, x @ rounded.T, rtol=1e-4, atol=1e-3)


@needs_numba
@pytest.mark.parametrize("isa", [None, (8, 2, 4, "haswell", "+avx,+avx2,+fma")], ids=["host", "avx2"])
def test_int8_kernels_scale_exact_integer_sums(isa: tuple[int, int, int, str, str] | None) -> None:
    """int8 panels hold q and a scale per output; the kernels sum x * q exactly as the float32 kernels
    do on q as floats, then scale once: bitwise that, for any rows; q * scale is within half a step of w."""
    k = cpu_kernels.kernels(None if isa is None else cpu_kernels.Isa(*isa))
    rng = np.random.default_rng(6)
    w = rng.standard_normal((70, 576), dtype=np.float32)
    w[3] = 0.0  # an all-zero row gets a usable scale
    q, scales = cpu_kernels.int8_rows(w)
    assert q.dtype == np.int8 and np.all(np.abs(cpu_kernels.to_int8(w) - w) <= scales[:, None] / 2 + 1e-7)
    panels = cpu_kernels.pack(w, panel=k.isa.panel, kind="int8")
    assert panels.dtype == np.int8 and panels.shape[1] == 576 + cpu_kernels.SCALE_ROWS
    for rows in (1, 2, 5, 8, 11):
        x = rng.standard_normal((rows, 576), dtype=np.float32)
        got = cpu_kernels.matmul(x, panels, 70, tiles=k.addresses_int8)
        sums = cpu_kernels.matmul(x, cpu_kernels.pack(q.astype(np.float32), panel=k.isa.panel), 70, tiles=k.addresses)
        assert np.array_equal(got, sums * scales), rows
        np.testing.assert_allclose(got, x @ cpu_kernels.to_int8(w).T, rtol=1e-4, atol=1e-3)


@needs_numba
def test_kernels_use_the_cpus_vectors() -> None:
    """The tile kernels compile to packed fused multiply-adds of this CPU's widest vectors (a scalar
    fallback would still pass the tests above, at a fraction of the speed)."""
    k = cpu_kernels.kernels()
    reg = {16: "zmm", 8: "ymm", 4: "xmm"}[k.isa.width]
    import platform

    if platform.machine() in ("x86_64", "AMD64"):
        assert f"vfmadd231ps\t%{reg}" in k.assembly or f"vfmadd231ps %{reg}" in k.assembly
    assert k.isa.panel == k.isa.width * k.isa.vectors and len(k.addresses) == k.isa.rows
    assert cpu_kernels.describe().startswith(f"tiles up to {k.isa.rows}x{k.isa.panel}, f32x{k.isa.width}")


def test_hf_engine_matches_static_engine(load_tiny: Callable[..., LoadedModel]) -> None:
    ids = random_ids(17, VOCAB, seed=4)
    ours = StaticEngine(load_tiny("llama").model, 64, prefill_chunk=5)
    theirs = HFEngine(load_tiny("llama", backend="hf").model, 64, prefill_chunk=5)
    a, b = ours.prefill(ids[:11]), theirs.prefill(ids[:11])
    assert theirs.length == 11
    torch.testing.assert_close(b.logits, a.logits, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(b.hidden, a.hidden, atol=ATOL, rtol=1e-4)
    tail = torch.tensor(ids[11:])
    torch.testing.assert_close(theirs.forward(tail).logits, ours.forward(tail).logits, atol=ATOL, rtol=1e-4)


def test_hf_engine_rollback_equals_fresh(load_tiny: Callable[..., LoadedModel], hf_models: dict[str, Any]) -> None:
    ids = random_ids(20, VOCAB, seed=5)
    wrong = random_ids(5, VOCAB, seed=6)
    ref, _ = hf_forward(hf_models["llama"], ids[:10] + wrong[:2] + ids[12:])
    engine = HFEngine(load_tiny("llama", backend="hf").model, 64)
    engine.prefill(ids[:10])
    engine.forward(torch.tensor(wrong))
    engine.rollback(12)  # keep two of the five
    assert engine.length == 12
    out = engine.forward(torch.tensor(ids[12:]))
    torch.testing.assert_close(out.logits, ref[12:], atol=ATOL, rtol=1e-4)
    engine.compact(15, [15, 16])  # a contiguous keep is just a rollback
    assert engine.length == 17
    torch.testing.assert_close(engine.forward(torch.tensor(ids[17:])).logits, ref[17:], atol=ATOL, rtol=1e-4)


def test_hf_engine_refuses_trees_and_overflow(load_tiny: Callable[..., LoadedModel]) -> None:
    engine = HFEngine(load_tiny("llama", backend="hf").model, 12)
    engine.prefill(random_ids(8, VOCAB, seed=7))
    with pytest.raises(SpecdecError, match="token trees"):
        engine.forward(torch.tensor([5, 6]), torch.tensor([0, 1]), torch.ones(2, 2, dtype=torch.bool).tril())
    with pytest.raises(SpecdecError, match="token trees"):
        engine.compact(8, [8, 10])
    with pytest.raises(SpecdecError, match="overflow: 13 positions needed but the cache holds 12"):
        engine.forward(torch.tensor([5, 6, 7, 8, 9]))
    assert engine.length == 8
    with pytest.raises(SpecdecError, match="does not fit the cache of 12"):
        engine.prefill(random_ids(12, VOCAB, seed=8))


def test_unsupported_architecture_is_refused() -> None:
    from transformers import GPT2Config

    with pytest.raises(SpecdecError, match="model.backend=hf"):
        LlamaArgs.from_hf(GPT2Config())


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_fused_cpu_layers_match_torch(load_tiny: Callable[..., LoadedModel], model_type: str) -> None:
    """matmul=numba runs passes of up to MAX_ROWS tokens through cpu_layer.layer_forward: after the same
    prefill, single tokens, odd and even chains and a token tree give the torch model's logits and
    leave the same K/V in the cache."""
    ref_model, fused_model = load_tiny(model_type, matmul="torch"), load_tiny(model_type, matmul="numba")
    assert type(fused_model.model.fused).__name__ == "FusedStack"  # passes of a few tokens: one call
    assert ref_model.model.fused is None
    ids = random_ids(30, VOCAB, seed=7)
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                        dtype=torch.bool)
    engines = [StaticEngine(m.model, 64, prefill_chunk=8) for m in (ref_model, fused_model)]
    outs: list[list[Tensor]] = [[], []]
    for engine, out in zip(engines, outs):
        engine.prefill(ids[:11])
        out.append(engine.forward(torch.tensor(ids[11:12])).logits)  # one token, no mask
        out.append(engine.forward(torch.tensor(ids[12:15])).logits)  # odd chain
        out.append(engine.forward(torch.tensor(ids[15:19])).logits)  # even chain
        out.append(engine.forward(torch.tensor(ids[19:24]), depth=torch.tensor([0, 1, 1, 2, 2]), mask=tree).logits)
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, atol=ATOL, rtol=1e-4)
    for a, b in zip(filled(engines[0]), filled(engines[1])):
        torch.testing.assert_close(b, a, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("forced", ["expand_kv", "fuse_norm"])
def test_cuda_eager_paths_match_the_reference(load_tiny: Callable[..., LoadedModel], forced: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA, attention repeats K/V to every query head where SDPA would otherwise fall back to its
    math kernel (llama.expand_kv), and RMSNorm runs as one kernel (llama.fuse_norm). Each forced on here:
    the same prefill, chains and token tree give the reference path's logits (for expand_kv: query
    head h reads K/V head h // (H / H_kv) either way)."""
    model = load_tiny("llama").model
    assert model.args.n_heads > model.args.n_kv_heads  # the tiny model groups its heads
    q = torch.zeros(1, 1, 1, 4)
    assert not llama.expand_kv(q, torch.ones(1, 1, 1, 1, dtype=torch.bool)) and not llama.fuse_norm(q)  # CPU
    ids = random_ids(30, VOCAB, seed=9)
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                        dtype=torch.bool)

    def passes() -> list[Tensor]:
        engine = StaticEngine(model, 64, prefill_chunk=8)
        engine.prefill(ids[:11])
        return [engine.forward(torch.tensor(ids[11:12])).logits, engine.forward(torch.tensor(ids[12:16])).logits,
                engine.forward(torch.tensor(ids[16:21]), depth=torch.tensor([0, 1, 1, 2, 2]), mask=tree).logits]

    reference = passes()
    monkeypatch.setattr(llama, forced, lambda *args: True)
    for a, b in zip(reference, passes()):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_fused_norm_keeps_the_reference_rounding_in_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """In bf16 the one-kernel norm still normalizes in fp32, rounds, then scales by the weight, as the
    reference does: bitwise the same output."""
    norm = llama.RMSNorm(64, 1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    x = torch.randn(3, 5, 64).to(torch.bfloat16)
    reference = norm(x)
    monkeypatch.setattr(llama, "fuse_norm", lambda x: True)
    assert torch.equal(norm(x), reference)


def test_fused_cpu_pass_is_batch_invariant(load_tiny: Callable[..., LoadedModel]) -> None:
    """With matmul=numba a pass over several chained tokens gives bitwise the logits that one-token
    steps give, so speculative verification decides on exactly the numbers greedy decoding sees."""
    model = load_tiny("llama", matmul="numba").model
    ids = random_ids(20, VOCAB, seed=8)
    one, many = StaticEngine(model, 64, prefill_chunk=8), StaticEngine(model, 64, prefill_chunk=8)
    one.prefill(ids[:12])
    many.prefill(ids[:12])
    steps = torch.cat([one.forward(torch.tensor([t])).logits for t in ids[12:]])
    assert torch.equal(many.forward(torch.tensor(ids[12:])).logits, steps)


def test_fused_cpu_tree_nodes_equal_their_paths_bitwise(load_tiny: Callable[..., LoadedModel]) -> None:
    """With matmul=numba each node of a token tree gets bitwise the logits that decoding its path one
    token at a time gives (masked slots add exact zeros; every kernel sums in the same shape), so
    Medusa and lookahead verify on exactly the numbers greedy decoding sees."""
    model = load_tiny("llama", matmul="numba").model
    ids = random_ids(17, VOCAB, seed=9)
    tokens = ids[12:17]
    parents = [-1, 0, 0, 1, 2]  # nodes 1 and 2 are siblings under node 0; 3 under 1, 4 under 2
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                        dtype=torch.bool)
    engine = StaticEngine(model, 64, prefill_chunk=8)
    engine.prefill(ids[:12])
    logits = engine.forward(torch.tensor(tokens), depth=torch.tensor([0, 1, 1, 2, 2]), mask=tree).logits
    for node in range(len(tokens)):
        path = []
        n = node
        while n >= 0:
            path.insert(0, tokens[n])
            n = parents[n]
        seq = StaticEngine(model, 64, prefill_chunk=8)
        seq.prefill(ids[:12])
        for t in path:
            last = seq.forward(torch.tensor([t])).logits
        assert torch.equal(last[-1], logits[node]), node


@pytest.mark.parametrize("nodes", [60, 100])
def test_fused_cpu_trees_past_one_call_equal_their_paths_bitwise(load_tiny: Callable[..., LoadedModel],
                                                                nodes: int) -> None:
    """The papers' tree sizes (about 60 nodes, experiment=paper_trees) pass more rows than one tile of the CPU
    kernels, and larger trees more than one fused call takes (FUSED_ROWS): each node still gets bitwise the
    logits of decoding its path one token at a time, so verification never sees a BLAS product's bits."""
    from specdec.trees import tree_depth, tree_mask

    model = load_tiny("llama", matmul="numba").model
    ids = random_ids(12, VOCAB, seed=11)
    gen = torch.Generator().manual_seed(3)
    parents = [int(torch.randint(0, max(1, i // 3 + 1), (), generator=gen)) for i in range(nodes)]  # node i+1's
    tokens = random_ids(nodes + 1, VOCAB, seed=12)  # the root, then one token per node
    assert len(tokens) > (cpu_kernels.MAX_ROWS if nodes < FUSED_ROWS else FUSED_ROWS)
    engine = StaticEngine(model, 160, prefill_chunk=8)
    engine.prefill(ids)
    logits = engine.forward(torch.tensor(tokens), depth=tree_depth(parents), mask=tree_mask(parents)).logits
    for node in range(len(tokens)):
        path, n = [], node
        while True:
            path.insert(0, tokens[n])
            if n == 0:
                break
            n = parents[n - 1]
        seq = StaticEngine(model, 160, prefill_chunk=8)
        seq.prefill(ids)
        for t in path:
            last = seq.forward(torch.tensor([t])).logits
        assert torch.equal(last[-1], logits[node]), node


def test_fused_stack_takes_long_passes_only_in_row_order(load_tiny: Callable[..., LoadedModel]) -> None:
    """Past FUSED_ROWS rows the fused stack runs consecutive calls, so it takes a long pass only when no row
    sees a token of a later call; otherwise (or with no mask to check) the torch path runs it."""
    model = load_tiny("llama", matmul="numba").model
    fused, T = model.fused, FUSED_ROWS + 36
    cache = model.new_cache(2 * T)
    x = torch.zeros(1, T, model.args.dim)
    chain = cache.attention_mask(None, T)  # (1, 1, T, S)
    assert fused.takes(x, chain, cache) and fused.takes(x[:, :FUSED_ROWS], None, cache)
    ahead = chain.clone()
    ahead[0, 0, FUSED_ROWS - 1, -1] = True  # the first call's last row sees the last row
    assert not fused.takes(x, ahead, cache) and not fused.takes(x, None, cache)
    assert not fused.takes(x, chain[..., :-1], cache)  # not over the cached slots plus the new tokens: unchecked
    assert not fused.takes(x.expand(2, T, -1), chain, cache) and not fused.takes(x[:, :8], chain[..., :8, :8])


def test_training_pass_of_one_short_sequence_runs_under_the_cpu_kernels(load_tiny: Callable[..., LoadedModel]) -> None:
    """A training forward has no KV cache (heads/batches.py NoCache): one short sequence, which the fused stack
    would otherwise take, runs the torch path, with and without EAGLE-3's layer taps."""
    from heads.batches import target_hidden

    ids = torch.tensor([random_ids(10, VOCAB, seed=13)])
    fast, plain = load_tiny("llama", matmul="numba"), load_tiny("llama")
    for taps in ((), (0, 1)):
        got, want = (target_hidden(m, ids, torch.ones_like(ids), taps) for m in (fast, plain))
        assert got.shape == want.shape == (1, 10, 64 * (1 + len(taps)))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_auto_matmul_leaves_the_model_running_the_kind_it_reports(load_tiny: Callable[..., LoadedModel]) -> None:
    """matmul=auto times each kind in turn and keeps the fastest: the model afterwards runs exactly that
    kind's layers (the last one timed stays in place rather than being rebuilt) and the torch logits."""
    from specdec.models.cpu_layer import FusedStack
    from specdec.models.cpu_linear import MATMULS, NumbaLinear, NumpyLinear, pick_faster_linears

    model = load_tiny("llama", matmul="torch").model
    ids = random_ids(12, VOCAB, seed=10)
    _, ref = chain_forward(model, ids)
    try:
        kind = pick_faster_linears(model, steps=1)
        assert kind in MATMULS
        mods = list(model.modules())
        assert any(isinstance(m, NumbaLinear) for m in mods) == (kind == "numba")
        assert isinstance(model.fused, FusedStack) == (kind == "numba")
        assert any(isinstance(m, NumpyLinear) for m in mods) == (kind == "numpy")
        _, logits = chain_forward(model, ids)
        torch.testing.assert_close(logits, ref, atol=ATOL, rtol=1e-4)
    finally:
        from specdec.models.cpu_linear import use_matmul

        use_matmul(model, "torch")  # the fixture's models are shared between tests
