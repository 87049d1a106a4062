"""Where a target pass over several tokens spends its extra, per host state: `python experiments/pass_parts.py`.

SmolLM2-135M on the CPU kernels, after 256 cached tokens. Each round times, for 1 and for 5 new tokens (the 5 under a
causal mask, as a verification pass has one):
- the whole pass (`StaticEngine.forward`, rolled back after) and its fused layer stack alone (`stack_forward`);
- the stack's parts alone, each as one compiled loop over the 30 layers that does only that part of `layer_forward`:
  the four matrix products, attention (`_attend`: rope, K/V writes, scores, softmax, outputs), and the elementwise
  rest (norms, biases, residuals, SiLU);
- the output head alone (its `NumbaLinear` over random rows).

Rounds are split by the host's state, read from the one-token pass as phase_split.py reads it (Otsu's threshold; one
state when the groups differ by less than 15%), and each part's median is printed per state, with what 5 tokens add.
A benchmark: run it on an idle machine. An argument sets the rounds (default 300).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from specdec.engine.engine import StaticEngine
from specdec.models import cpu_kernels
from specdec.models.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from phase_split import DISTINCT, otsu  # noqa: E402  (a sibling script, not a package)

SIZES = (1, 5)
CONTEXT = 256

if cpu_kernels.available():
    from numba import njit

    from specdec.models.cpu_kernels import mm_into_nested as mm_into
    from specdec.models.cpu_layer import _attend, _rms_norm, _silu_mul, stack_forward

    @njit
    def stack_part(x, rope, keys, values, key_panels, value_panels, start, mask, use_mask,  # pragma: no cover
                   attn_norms, wqkv, bqkv, bo, wo, mlp_norms, w_gate_up, w_down, eps, n_heads, n_kv, head_dim,
                   hidden, tiles, att_tiles, products, attention, elementwise):
        """layer_forward's steps over every layer, each only where its flag is set (the others leave their outputs
        zero or pass the input on), so each part's time can be read alone."""
        R, dim = x.shape
        for layer in range(wqkv.shape[0]):
            h = x.copy()
            if elementwise:
                _rms_norm(x, attn_norms[layer], eps, h)
            qkv = np.zeros((R, wqkv.shape[1] * wqkv.shape[3]), dtype=np.float32)
            if products:
                mm_into(h, wqkv[layer], qkv, tiles)
            if elementwise:
                for t in range(R):
                    for i in range(bqkv.shape[1]):
                        qkv[t, i] += bqkv[layer, i]
            att = np.zeros((R, n_heads * head_dim), dtype=np.float32)
            if attention:
                _attend(qkv, rope, keys[layer, 0], values[layer, 0], key_panels[layer, 0], value_panels[layer, 0],
                        start, mask, use_mask, n_heads, n_kv, head_dim, att, att_tiles)
            o = np.zeros((R, wo.shape[1] * wo.shape[3]), dtype=np.float32)
            if products:
                mm_into(att, wo[layer], o, tiles)
            mid = x.copy()
            if elementwise:
                for t in range(R):
                    for i in range(dim):
                        mid[t, i] = x[t, i] + (o[t, i] + bo[layer, i])
                _rms_norm(mid, mlp_norms[layer], eps, h)
            gate_up = np.zeros((R, w_gate_up.shape[1] * w_gate_up.shape[3]), dtype=np.float32)
            if products:
                mm_into(h, w_gate_up[layer], gate_up, tiles)
            act = np.zeros((R, hidden), dtype=np.float32)
            if elementwise:
                _silu_mul(gate_up, hidden, act)
            down = np.zeros((R, w_down.shape[1] * w_down.shape[3]), dtype=np.float32)
            if products:
                mm_into(act, w_down[layer], down, tiles)
            if elementwise:
                for t in range(R):
                    for i in range(dim):
                        mid[t, i] += down[t, i]
            x = mid
        return x


PARTS = {"products": (True, False, False), "attention": (False, True, False), "elementwise": (False, False, True)}


def main() -> None:
    if not cpu_kernels.available():
        raise SystemExit("the CPU tile kernels need numba and llvmlite; pip install numba")
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    target = load_model("smollm2-135m", "builtin:smollm2-135m", matmul="numba")
    st, head = target.model.fused, target.model.lm_head
    engine = StaticEngine(target.model, 2048)
    ids = list(range(1000, 1000 + CONTEXT))
    engine.prefill(ids)
    cache = engine.cache
    k, v, kp, vp = cache.k.numpy(), cache.v.numpy(), cache.key_panels.numpy(), cache.value_panels.numpy()
    rng = np.random.default_rng(0)
    dim = st.wqkv.shape[2]

    def causal(m: int) -> np.ndarray:
        return np.tri(m, CONTEXT + m, CONTEXT, dtype=np.bool_)

    x = {m: 0.1 * rng.standard_normal((m, dim), dtype=np.float32) for m in SIZES}
    rope = {m: st.rope(target.model, np.arange(CONTEXT, CONTEXT + m)) for m in SIZES}
    mask = {m: causal(m) if m > 1 else st._all_visible for m in SIZES}
    segment = {m: np.array([[0, CONTEXT, 0, m]], dtype=np.int64) for m in SIZES}
    head_in = {m: torch.from_numpy(x[m]) for m in SIZES}
    new_mask = {m: torch.ones(m, m, dtype=torch.bool).tril() if m > 1 else None for m in SIZES}

    def whole(m: int) -> None:
        engine.forward(torch.zeros(m, dtype=torch.long), None, new_mask[m])
        engine.rollback(CONTEXT)

    def stack(m: int) -> None:
        stack_forward(x[m], rope[m], k, v, kp, vp, segment[m], mask[m], m > 1, st.attn_normed, st.attn_norms,
                      st.wqkv, st.bqkv, st.bo, st.wo, st.mlp_norms, st.w_gate_up, st.w_down, st.final_normed, st.norm,
                      st.norm_eps, st.n_heads, st.n_kv, st.head_dim, st.hidden, st.tiles, st.att_tiles)

    def part(flags: tuple[bool, bool, bool]):  # type: ignore[no-untyped-def]
        return lambda m: stack_part(x[m], rope[m], k, v, kp, vp, CONTEXT, mask[m], m > 1, st.attn_norms, st.wqkv,
                                    st.bqkv, st.bo, st.wo, st.mlp_norms, st.w_gate_up, st.w_down, st.norm_eps,
                                    st.n_heads, st.n_kv, st.head_dim, st.hidden, st.tiles, st.att_tiles, *flags)

    parts = {"pass": whole, "stack": stack, **{name: part(flags) for name, flags in PARTS.items()},
             "head": lambda m: head(head_in[m])}
    times: dict[tuple[str, int], list[float]] = {(p, m): [] for p in parts for m in SIZES}
    with torch.inference_mode():
        for r in range(rounds + 3):  # 3 warm-up rounds: compilation and first touches
            for m in SIZES:
                for name, fn in parts.items():
                    start = time.perf_counter()
                    fn(m)
                    if r >= 3:
                        times[name, m].append(time.perf_counter() - start)
    one = times["pass", 1]
    cut = otsu(one)
    fast, slow = [t for t in one if t < cut], [t for t in one if t >= cut]
    if not fast or statistics.mean(slow) / statistics.mean(fast) < DISTINCT:
        cut = float("inf")  # one state: every round in the first group
    print(f"tile kernels: {cpu_kernels.describe()}; {rounds} rounds after {CONTEXT} cached tokens, medians in ms "
          f"(1 token / 5 tokens / what 5 add)")
    print("| state (rounds) | " + " | ".join(parts) + " |")
    print("|---" * (1 + len(parts)) + "|")
    for state, keep in (("fast", [i for i, t in enumerate(one) if t < cut]),
                        ("slow", [i for i, t in enumerate(one) if t >= cut])):
        if not keep:
            continue
        med = {key: 1e3 * statistics.median(v[i] for i in keep) for key, v in times.items()}
        label = state if cut != float("inf") else "one state"
        cells = " | ".join(f"{med[p, 1]:.2f} / {med[p, 5]:.2f} / {med[p, 5] - med[p, 1]:+.2f}" for p in parts)
        print(f"| {label} ({len(keep)}) | {cells} |")


if __name__ == "__main__":
    main()
