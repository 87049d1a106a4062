"""CPU linear layers that run their matrix products outside torch: NumPy's BLAS, or numba kernels.

Why: decoding one token is a chain of matrix-vector products that only memory bandwidth limits.
On the 2-core machines we measure on, OpenBLAS through NumPy (both cores) streamed weights faster than
torch's MKL GEMV (one core), and a SmolLM2-135M decode step got markedly cheaper (experiments/README.md,
"Figures moved out of code and configs"). torch's own thread pool must then run single-threaded, or its spinning
OpenMP workers fight OpenBLAS for the two cores (see `LoadedModel.torch_threads`).
BLAS is still slow for 2 to 24 rows (verification passes); `NumbaLinear` fixes that (see cpu_kernels).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor, nn

from specdec.models import cpu_kernels
from specdec.models.cpu_layer import use_fused_stacks, use_layer_by_layer
from specdec.models.llama import Llama


class NumpyLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        # (in, out) row-major: x @ W^T becomes one contiguous GEMV/GEMM in BLAS. The only copy of W:
        # the nn.Linear's goes with it (a tied embedding reads `weight`, a view of this one).
        self.weight_t: np.ndarray = linear.weight.detach().t().contiguous().numpy()
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.out_features = self.weight_t.shape[1]

    @property
    def weight(self) -> Tensor:
        """(out, in), as nn.Linear has it: a view of weight_t, no copy."""
        return torch.from_numpy(self.weight_t).t()

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1]).numpy()  # (M, in)
        rows = flat.shape[0]
        padded = padded_rows(rows)
        if padded != rows:  # an 8-row GEMM beats a 3-row one in OpenBLAS; the extra rows are discarded
            flat = np.concatenate([flat, np.zeros((padded - rows, flat.shape[1]), dtype=flat.dtype)])
        y = torch.from_numpy((flat @ self.weight_t)[:rows]).view(*x.shape[:-1], self.out_features)  # (..., out)
        return y if self.bias is None else y + self.bias


class NumbaLinear(nn.Module):
    """x @ W^T through specdec's few-row kernels, with W kept only as their packed panels: passes over
    more than MAX_ROWS rows (prefill) run BLAS over blocks unpacked on the fly
    (`cpu_kernels.matmul_panels`), and `weight` unpacks a copy for code that wants the matrix.

    `weights="bf16"` packs W as bfloat16 (half the bytes per pass) and `weights="int8"` as int8 with a
    scale per output (a quarter): for drafters, whose guesses the target checks anyway, never for the
    target. Prefill and `weight` then see the same rounded values, so every pass runs one model (to
    rounding: int8 kernels scale each sum once at the end). `out`: where to pack (a layer of a stack)."""

    def __init__(self, linear: nn.Linear, weights: str = "fp32", out: np.ndarray | None = None) -> None:
        super().__init__()
        if weights not in cpu_kernels.KINDS:
            raise ValueError(f"weights={weights!r}: one of {', '.join(cpu_kernels.KINDS)}")
        w = linear.weight.detach()  # (out, in)
        self.out_features, self.in_features = w.shape
        self.panels: np.ndarray = cpu_kernels.pack(w.numpy(), kind=weights, out=out)  # (P, in, NB) (+ scales)
        self.bias = None if linear.bias is None else linear.bias.detach()

    @property
    def weight(self) -> Tensor:
        """(out, in) float32, unpacked from the panels: a new tensor on every access."""
        return torch.from_numpy(cpu_kernels.unpack(self.panels, 0, self.out_features))

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1]).numpy()  # (M, in)
        y = cpu_kernels.matmul_panels(flat, self.panels, self.out_features)
        y = torch.from_numpy(np.ascontiguousarray(y)).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class PanelEmbedding(nn.Module):
    """A tied embedding read from its output head's float32 panels (NumbaLinear), so that the
    (vocab, dim) matrix is kept once: row n is column n % NB of panel n // NB. `weight` unpacks a copy."""

    def __init__(self, head: NumbaLinear) -> None:
        super().__init__()
        self.panels = head.panels  # shared with the head, never written
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    @property
    def weight(self) -> Tensor:
        """(vocab, dim) float32, unpacked from the panels: a new tensor on every access."""
        return torch.from_numpy(cpu_kernels.unpack(self.panels, 0, self.num_embeddings))

    def forward(self, tokens: Tensor) -> Tensor:
        ids = tokens.reshape(-1).numpy()
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_embeddings):
            raise IndexError(f"token id out of range for an embedding of {self.num_embeddings} rows")
        nb = self.panels.shape[2]
        rows = self.panels[ids // nb, :, ids % nb]  # (n, dim): the values themselves, bitwise
        return torch.from_numpy(rows).view(*tokens.shape, self.embedding_dim)


def padded_rows(rows: int) -> int:
    """Row count to run a GEMM at. Measured on this project's 2-core machines (SmolLM2-135M's
    matrices, OpenBLAS), 2-7 rows cost more than 8 (experiments/README.md, "Figures moved out of code and
    configs"), so odd sizes are padded up to the next multiple of 8."""
    return rows if rows == 1 or rows % 8 == 0 else (rows + 7) // 8 * 8


# A Llama block's linears, as (submodule, attribute): what FusedStack stacks across layers.
PROJECTIONS = (("attn", "wqkv"), ("attn", "wo"), ("mlp", "w_gate_up"), ("mlp", "w_down"))


def _swappable(module: nn.Module) -> bool:
    return (isinstance(module, nn.Linear) and module.weight.dtype == torch.float32
            and module.weight.device.type == "cpu")


def _tied(model: Llama) -> bool:
    """Whether the model's embedding and output head are one matrix (in whichever form they run)."""
    embed, head = model.embed, model.lm_head
    if isinstance(embed, PanelEmbedding):
        return isinstance(head, NumbaLinear) and embed.panels is head.panels
    if not isinstance(embed, nn.Embedding) or not isinstance(head, nn.Linear | NumpyLinear):
        return False
    a, b = embed.weight, head.weight
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def _tied_models(module: nn.Module) -> list[Llama]:
    return [m for m in module.modules() if isinstance(m, Llama) and _tied(m)]


def _embedding(weight: Tensor) -> nn.Embedding:
    embed = nn.Embedding(weight.shape[0], weight.shape[1], device="meta")
    embed.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
    return embed


def _swap_linears(module: nn.Module, kind: Callable[[nn.Linear], nn.Module]) -> int:
    swapped = 0
    for name, child in module.named_children():
        if _swappable(child):
            setattr(module, name, kind(child))  # the nn.Linear, and its W, go now: one matrix extra at a time
            cpu_kernels.release_freed_memory()
            swapped += 1
        else:
            swapped += _swap_linears(child, kind)
    return swapped


def use_numpy_linears(module: nn.Module, kind: Callable[[nn.Linear], nn.Module] = NumpyLinear) -> int:
    """Swap every fp32 CPU nn.Linear below `module` for `kind(linear)` (NumpyLinear or NumbaLinear);
    returns how many were swapped. A tied embedding then reads the head's copy (NumpyLinear's
    weight_t, or float32 panels through PanelEmbedding) and its own goes."""
    tied = _tied_models(module)
    swapped = _swap_linears(module, kind)
    for m in tied:
        if isinstance(m.lm_head, NumpyLinear):
            m.embed = _embedding(m.lm_head.weight)  # a (vocab, dim) view of weight_t
        elif isinstance(m.lm_head, NumbaLinear) and cpu_kernels.panel_kind(m.lm_head.panels) == "fp32":
            m.embed = PanelEmbedding(m.lm_head)
        # rounded panels (bf16, int8) are not the embedding's values: it keeps its own matrix
    return swapped


def _pack_layer_stacks(module: nn.Module, weights: str) -> int:
    """Pack each Llama's per-layer projections straight into one (L, P, K, NB) array per projection,
    the layout FusedStack reads, so no stacked second copy is made later; returns how many linears."""
    swapped = 0
    for m in [m for m in module.modules() if isinstance(m, Llama) and len(m.layers)]:
        for part, name in PROJECTIONS:
            owners = [getattr(block, part) for block in m.layers]
            linears = [getattr(o, name) for o in owners]
            if not all(_swappable(lin) for lin in linears) or len({lin.weight.shape for lin in linears}) != 1:
                continue
            shape = cpu_kernels.packed_shape(*linears[0].weight.shape, kind=weights)
            del linears  # each layer's W must go as soon as it is packed
            stack = np.empty((len(owners), *shape), dtype=cpu_kernels.PANEL_DTYPES[weights])
            for layer, owner in enumerate(owners):
                lin = getattr(owner, name)
                setattr(owner, name, NumbaLinear(lin, weights, out=stack[layer]))
                cpu_kernels.release_freed_memory()
                swapped += 1
    return swapped


def use_numba_linears(module: nn.Module, weights: str = "fp32") -> int:
    if not cpu_kernels.available():
        raise ImportError("model.matmul=numba needs the numba package: pip install numba")
    stacked = _pack_layer_stacks(module, weights)  # leaves output heads and embeddings to the next line
    return stacked + use_numpy_linears(module, functools.partial(NumbaLinear, weights=weights))


def use_torch_linears(module: nn.Module) -> None:
    """Undo use_numpy_linears: nn.Linear (and a tied nn.Embedding) again, over W rebuilt from the one
    copy each form keeps, which then goes."""
    tied = _tied_models(module)
    _restore_linears(module)
    for m in tied:
        if not (isinstance(m.embed, nn.Embedding) and m.embed.weight is m.lm_head.weight):
            m.embed = _embedding(m.lm_head.weight)


def _restore_linears(module: nn.Module) -> None:
    # A Llama's projections one at a time across its layers: the layers' panels are views of one stack
    # per projection (_pack_layer_stacks), which goes once its last layer is rebuilt.
    for m in [m for m in module.modules() if isinstance(m, Llama)]:
        for part, name in PROJECTIONS:
            for block in m.layers:
                _restore_child(getattr(block, part), name)
    for owner in list(module.modules()):
        for name in [n for n, _ in owner.named_children()]:
            _restore_child(owner, name)


def _restore_child(owner: nn.Module, name: str) -> None:
    child = getattr(owner, name)
    if not isinstance(child, NumpyLinear | NumbaLinear):
        return
    w = child.weight if isinstance(child, NumbaLinear) else torch.from_numpy(child.weight_t).t().contiguous()
    lin = nn.Linear(w.shape[1], w.shape[0], bias=child.bias is not None, device="meta")
    lin.weight = nn.Parameter(w, requires_grad=False)
    if child.bias is not None:
        lin.bias = nn.Parameter(child.bias, requires_grad=False)
    setattr(owner, name, lin)
    cpu_kernels.release_freed_memory()


def _step_time(model: nn.Module, threads: int, steps: int, width: int) -> float:
    """Seconds for `steps` forward passes over `width` new tokens each, after one warm-up pass."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cache = model.new_cache((steps + 1) * width)  # type: ignore[operator]
        tok = torch.zeros(1, width, dtype=torch.long)  # timed on the CPU only (fp32 there)
        pos = torch.arange(width)[None]  # (1, width)
        with torch.inference_mode():
            model(tok, pos, cache)  # warm-up: first touches of buffers, kernel compilation
            start = time.perf_counter()
            for i in range(steps):
                model(tok, pos + (i + 1) * width, cache)
            return time.perf_counter() - start
    finally:
        torch.set_num_threads(before)


MATMULS = ("torch", "numpy", "numba")


def use_matmul(model: nn.Module, kind: str, weights: str = "fp32") -> None:
    """Run `model`'s linears (and, for numba, whole decoder layers) the named way: torch, numpy, numba.
    `weights="bf16"` or `"int8"`: numba's kernels over rounded weights (see NumbaLinear); other kinds ignore it."""
    use_layer_by_layer(model)
    use_torch_linears(model)
    if kind == "numpy":
        use_numpy_linears(model)
    elif kind == "numba":
        use_numba_linears(model, weights)
        use_fused_stacks(model)


def pick_faster_linears(model: nn.Module, steps: int = 4) -> str:
    """Time one-token decode steps and 4-token verification passes with each available matmul
    (torch, NumPy's BLAS, numba kernels), keep the fastest in total and return its name.

    Measured rather than assumed: OpenBLAS's two threads win on an idle 2-core machine but lose
    badly when another process holds a core, and other CPUs and BLAS builds differ again.
    """
    times: dict[str, float] = {}
    for kind in MATMULS:
        if kind == "numba" and not cpu_kernels.available():
            continue
        use_matmul(model, kind)
        threads = torch.get_num_threads() if kind == "torch" else 1
        times[kind] = sum(_step_time(model, threads, steps, width) for width in (1, 4))
    best = min(times, key=times.__getitem__)
    if times["torch"] <= 1.05 * times[best]:
        best = "torch"  # within noise: keep the plain torch model
    if best != list(times)[-1]:  # the last one timed is still in place; switching drops its copy
        use_matmul(model, best)
    return best
