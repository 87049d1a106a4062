"""One copy of the weights: the CPU kernels' packed panels are the only copy of each matrix they hold
(a tied embedding reads its head's), `matmul=auto` frees the forms its timing rejected, and the
products and rows read back from panels are bitwise what the dense matrices gave."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import random_ids
from safetensors import safe_open
from torch import nn

from specdec.engine.engine import StaticEngine
from specdec.models import cpu_kernels, cpu_linear
from specdec.models.cpu_linear import NumbaLinear, NumpyLinear, PanelEmbedding, use_matmul
from specdec.models.loader import Checkpoint, LoadedModel, load_model
from specdec.models.tiny import tiny_folder

needs_numba = pytest.mark.skipif(not cpu_kernels.available(), reason="needs numba")

# Large enough that the weights dwarf what else a model holds (norms, the rope table of FusedStack).
SHAPE = {"vocab_size": 1024, "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2}
SLACK = 1.1  # held bytes / checkpoint bytes: one copy of every matrix, plus norms and small tables


@pytest.fixture(scope="module")
def folder() -> Path:
    return tiny_folder(**SHAPE)  # tied embeddings, as SmolLM2's


def checkpoint_bytes(folder: Path) -> int:
    total = 0
    for shard in folder.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            total += sum(f.get_tensor(name).nbytes for name in f.keys())
    return total


def _arrays(obj: object, seen: set[int]) -> Iterator[np.ndarray | torch.Tensor]:
    """Every tensor and NumPy array reachable from `obj` through modules, plain objects and containers."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor | np.ndarray):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _arrays(v, seen)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _arrays(v, seen)
    elif isinstance(obj, nn.Module) or type(obj).__module__.startswith("specdec."):
        yield from _arrays(vars(obj), seen)


def held_bytes(model: nn.Module) -> int:
    """Bytes of memory the model's tensors and arrays span, each byte once however many views share it."""
    spans = []
    for a in _arrays(model, set()):
        if isinstance(a, torch.Tensor):
            if a.device.type != "meta" and a.numel():
                s = a.untyped_storage()
                spans.append((s.data_ptr(), s.data_ptr() + s.nbytes()))
        elif a.size:
            base = a
            while isinstance(base.base, np.ndarray):
                base = base.base
            low = base.__array_interface__["data"][0]
            spans.append((low, low + base.nbytes) if base.flags.c_contiguous else _bounds(base))
    total, end = 0, 0
    for low, high in sorted(spans):
        if high > end:
            total += high - max(low, end)
            end = high
    return total


def _bounds(a: np.ndarray) -> tuple[int, int]:
    first = a.__array_interface__["data"][0]
    low = first + sum((n - 1) * s for n, s in zip(a.shape, a.strides) if s < 0)
    high = first + sum((n - 1) * s for n, s in zip(a.shape, a.strides) if s > 0)
    return low, high + a.itemsize


def load(folder: Path, matmul: str) -> LoadedModel:
    return load_model("tiny", str(folder), matmul=matmul, device="cpu")


@needs_numba
@pytest.mark.parametrize("matmul", ["torch", "numpy", "numba"])
def test_each_matmul_holds_one_copy_of_the_weights(folder: Path, matmul: str) -> None:
    """Before, the numba kernels' panels sat beside torch's matrices (2x the checkpoint) and NumPy's
    transposed output head beside the tied embedding (1.2x); now every form holds one copy."""
    model = load(folder, matmul).model
    assert held_bytes(model) <= SLACK * checkpoint_bytes(folder)


@needs_numba
@pytest.mark.parametrize("winner", ["torch", "numpy", "numba"])
def test_auto_frees_what_its_timing_rejected(folder: Path, winner: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """matmul=auto builds each form in turn: whichever wins, the others' copies are gone afterwards
    (not merely unreachable from the model) and the model holds one copy."""
    model = load(folder, "torch").model
    timed: dict[str, list[weakref.ref]] = {}
    real = cpu_linear._step_time

    def fake_time(m: nn.Module, threads: int, steps: int, width: int) -> float:
        real(m, threads, 1, width)  # still runs each form once
        kind = ("numba" if any(isinstance(x, NumbaLinear) for x in m.modules()) else
                "numpy" if any(isinstance(x, NumpyLinear) for x in m.modules()) else "torch")
        held = [x for x in m.modules() if isinstance(x, NumbaLinear | NumpyLinear | PanelEmbedding | nn.Linear
                                                    | nn.Embedding)]
        timed.setdefault(kind, []).extend(weakref.ref(x) for x in held)
        return 1.0 if kind == winner else 2.0

    monkeypatch.setattr(cpu_linear, "_step_time", fake_time)
    assert cpu_linear.pick_faster_linears(model) == winner
    gc.collect()
    assert set(timed) == {"torch", "numpy", "numba"}
    for kind, refs in timed.items():
        alive = [r() for r in refs if r() is not None]
        if kind != winner:
            assert not alive, f"{kind}'s {type(alive[0]).__name__} outlived the timing"
    form = {"torch": nn.Linear, "numpy": NumpyLinear, "numba": NumbaLinear}[winner]
    assert isinstance(model.lm_head, form) and isinstance(model.layers[0].mlp.w_down, form)
    assert held_bytes(model) <= SLACK * checkpoint_bytes(folder)


@needs_numba
def test_tied_embedding_reads_the_heads_panels(folder: Path) -> None:
    """The numba model's embedding is its output head's panels; rows and logits are bitwise the torch
    model's, and switching forms keeps the tie (one matrix) in each."""
    ref, fused = load(folder, "torch").model, load(folder, "numba").model
    assert isinstance(fused.embed, PanelEmbedding) and fused.embed.panels is fused.lm_head.panels
    ids = torch.tensor([random_ids(9, SHAPE["vocab_size"], seed=1)])
    assert torch.equal(fused.embed(ids), ref.embed(ids))
    assert torch.equal(fused.embed.weight, ref.embed.weight) and torch.equal(fused.lm_head.weight, ref.lm_head.weight)
    with pytest.raises(IndexError):
        fused.embed(torch.tensor([[SHAPE["vocab_size"]]]))
    use_matmul(fused, "numpy")
    assert fused.embed.weight.data_ptr() == fused.lm_head.weight_t.__array_interface__["data"][0]
    use_matmul(fused, "torch")
    assert fused.embed.weight is fused.lm_head.weight
    use_matmul(fused, "numba")
    assert isinstance(fused.embed, PanelEmbedding) and fused.embed.panels is fused.lm_head.panels


@needs_numba
def test_numba_prefill_and_decode_match_the_dense_model(folder: Path) -> None:
    """A prefill in fused chunks, a pass past FUSED_ROWS tokens (BLAS over unpacked panels) and decode
    steps (the kernels) give what the torch model gives."""
    from specdec.models.cpu_layer import FUSED_ROWS

    ref, fused = load(folder, "torch").model, load(folder, "numba").model
    ids = random_ids(FUSED_ROWS + 79, SHAPE["vocab_size"], seed=2)
    outs = []
    for model in (ref, fused):
        engine = StaticEngine(model, 256)
        first = engine.prefill(ids[:70]).logits
        long = engine.forward(torch.tensor(ids[70:-3])).logits
        outs.append((first, long, engine.forward(torch.tensor(ids[-3:])).logits))
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


@needs_numba
@pytest.mark.parametrize("kind", cpu_kernels.KINDS)
@pytest.mark.parametrize(("n_out", "n_in"), [(53, 70), (1000, 576), (3072, 576)])  # tiny, a ragged last panel, large
def test_products_over_panels_equal_blas_over_the_dense_matrix_bitwise(kind: str, n_out: int, n_in: int,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to TILED_ROWS rows NumbaLinear runs the tile kernels, each row bitwise as in a one-row pass. Above
    (prefill), BLAS over W unpacked from the panels (as W^T, in column blocks for large matrices): bitwise
    the GEMMs over the dense (rounded) W that its second copy fed, block by block. Whether a block's columns
    sum as a whole-matrix GEMM's do is the BLAS's choice (OpenBLAS 0.3.31's do not, by a last bit or two),
    so against the whole GEMM only to rounding."""
    rng = np.random.default_rng(n_out)
    w = rng.standard_normal((n_out, n_in), dtype=np.float32)
    dense = {"fp32": w, "bf16": cpu_kernels.to_bf16(w), "int8": cpu_kernels.to_int8(w)}[kind]
    panels = cpu_kernels.pack(w, kind=kind)
    assert np.array_equal(cpu_kernels.unpack(panels, 0, n_out), dense)
    assert np.array_equal(cpu_kernels.unpack_t(panels, 0, n_out), dense.T)
    x = rng.standard_normal((40, n_in), dtype=np.float32)  # a tree's or a draft's pass: the tile kernels,
    one_by_one = np.concatenate([cpu_kernels.matmul(r[None], panels, n_out) for r in x])  # each row as alone
    assert np.array_equal(cpu_kernels.matmul_panels(x, panels, n_out), one_by_one)
    for rows in (cpu_kernels.TILED_ROWS + 1, 130):  # prefill: BLAS
        x = rng.standard_normal((rows, n_in), dtype=np.float32)
        want = x @ dense.T
        assert np.array_equal(cpu_kernels.matmul_panels(x, panels, n_out), want), rows
        with monkeypatch.context() as m:
            m.setattr(cpu_kernels, "BLOCK_BYTES", 4 * n_in * 256)  # GEMMs of 256 columns
            got = cpu_kernels.matmul_panels(x, panels, n_out)
        if n_out * n_in <= cpu_kernels.SMALL_MATRIX:  # never blocked: one GEMM over W, as `want`
            per_block = want
        else:  # blocks of W^T's columns from row-major memory, as unpack_t lays them out
            per_block = np.concatenate([x @ np.ascontiguousarray(dense[s:s + 256].T)
                                        for s in range(0, n_out, 256)], 1)
        assert np.array_equal(got, per_block), (rows, "blocks")
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_the_loader_reads_each_tensor_once_when_it_is_needed(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No state dict of the whole checkpoint: `Checkpoint` lists names without reading tensors, and a load
    reads each tensor once, as the model takes it (a GPU target's host then holds one tensor at a time)."""
    import safetensors

    reads: list[str] = []
    real = safetensors.safe_open

    class Spy:
        def __init__(self, *args: object, **kwargs: object) -> None:
            self.f = real(*args, **kwargs)

        def __enter__(self) -> Spy:
            self.f.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.__exit__(*exc)

        def keys(self) -> list[str]:
            return self.f.keys()

        def get_tensor(self, name: str) -> torch.Tensor:
            reads.append(name)
            return self.f.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    ckpt = Checkpoint(folder, torch.bfloat16, torch.device("cpu"))
    name = "model.embed_tokens.weight"
    assert name in ckpt and "no.such.tensor" not in ckpt and len(list(ckpt)) == len(ckpt)
    assert reads == []
    with real(str(folder / "model.safetensors"), framework="pt") as f:
        want = f.get_tensor(name)
    t = ckpt[name]
    assert reads == [name] and t.dtype == torch.bfloat16 and torch.equal(t, want.to(torch.bfloat16))
    reads.clear()
    load(folder, "torch")
    assert sorted(reads) == sorted(ckpt)  # each once
