"""A drafter's whole pass, token ids to logits, as one compiled call on the CPU kernels.

Why: about half of an EAGLE drafter step on SmolLM2-135M went to Python around its compiled work (module calls,
the fused stack's checks and conversions, two product calls from Python; experiments/README.md, "A drafter's step
as one compiled call"). Here the embedding lookup, EAGLE's fc over [embed(x); h] where the drafter has one, every
layer, the final norm and the head over the rows asked for run in one call, through the same kernels in the same
order, so the logits, the hidden states and the cache are bitwise those of the module path
(tests/test_cpu_drafter.py).

Used on the fused stack by EAGLE's and EAGLE-2's proposers (strategies/eagle.py, eagle_tree.py: catch-up, chain
steps, tree expansions) and by a trained draft's engine (`StaticEngine.next_logits`). Targets (whose tied embedding
is read from the head's panels), other devices, compiled and tapped models keep the module path.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from specdec.engine.kv_cache import KVCache
from specdec.models import cpu_kernels
from specdec.models.cpu_layer import FUSED_ROWS, FusedStack
from specdec.models.cpu_linear import NumbaLinear
from specdec.models.llama import Llama

if cpu_kernels.available():
    from numba import njit

    from specdec.models.cpu_kernels import mm_into_nested as mm_into
    from specdec.models.cpu_layer import _rms_norm, layer_forward

    @njit(cache=True)
    def drafter_pass(tokens, features, embed, use_fc, fc_panels, fc_bias, fc_tiles,  # pragma: no cover - compiled
                     rope, keys, values, key_panels, value_panels, segment, mask, use_mask,
                     attn_normed, attn_norms, wqkv, bqkv, bo, wo, mlp_norms, w_gate_up, w_down, final_normed, norm,
                     eps, n_heads, n_kv, head_dim, hidden, tiles, att_tiles, head_panels, head_tiles, n_out,
                     logits_from):
        """tokens (n,) int64 -> logits of rows logits_from.. (n - logits_from, n_out) and the hidden states (n, dim).

        The layers' input is embed[tokens] (n, dim), or with use_fc fc([embed[tokens]; features]) (EAGLE's pair
        input; features (n, dim)). The layers, K/V writes and final norm are FusedStack's (`segment`, `mask` as
        in layer_forward); the head reads rows logits_from.. only. Layers run one `layer_forward` call each, as
        `stack_forward` runs them (not stack_forward itself: a cached caller must compile the parallel
        products with itself, see cpu_kernels.mm_into_nested)."""
        n, dim = tokens.shape[0], embed.shape[1]
        if use_fc:
            row = np.empty((n, 2 * dim), dtype=np.float32)
            for t in range(n):
                row[t, :dim] = embed[tokens[t]]
                row[t, dim:] = features[t]
            y = np.empty((n, fc_panels.shape[0] * fc_panels.shape[2]), dtype=np.float32)
            mm_into(row, fc_panels, y, fc_tiles)
            x = np.empty((n, dim), dtype=np.float32)
            for t in range(n):
                for i in range(dim):
                    x[t, i] = y[t, i] + fc_bias[i]
        else:
            x = np.empty((n, dim), dtype=np.float32)
            for t in range(n):
                x[t] = embed[tokens[t]]
        for layer in range(attn_norms.shape[0]):
            x = layer_forward(x, rope, keys[layer], values[layer], key_panels[layer], value_panels[layer], segment,
                              mask, use_mask, attn_normed[layer], attn_norms[layer], wqkv[layer], bqkv[layer],
                              bo[layer], wo[layer], mlp_norms[layer], w_gate_up[layer], w_down[layer], eps, n_heads,
                              n_kv, head_dim, hidden, tiles, att_tiles)
        if final_normed:
            out = np.empty_like(x)
            _rms_norm(x, norm, eps, out)
            x = out
        logits = np.empty((n - logits_from, head_panels.shape[0] * head_panels.shape[2]), dtype=np.float32)
        mm_into(x[logits_from:], head_panels, logits, head_tiles)
        return logits[:, :n_out], x


class DrafterPass:
    """`model`'s pass over a few new tokens of its cache's one sequence as one `drafter_pass` call.

    For a Llama on the CPU kernels (FusedStack) whose embedding is a float32 table and whose output head is a
    NumbaLinear; `model.fc` (EAGLE's pair input, 2 dim -> dim), when present, must be one too. `fits` says
    whether a model qualifies. Build it after the weights are final (it keeps views of them).
    """

    def __init__(self, model: Llama) -> None:
        assert self.fits(model), "DrafterPass.fits(model) is False"
        self.model = model
        self.stack: FusedStack = model.fused  # type: ignore[assignment]
        self.embed = model.embed.weight.detach().numpy()  # (V, dim) float32
        fc = getattr(model, "fc", None)
        self.use_fc = fc is not None
        dim = self.embed.shape[1]
        none = np.zeros((1, 1, 1), dtype=np.float32)  # a placeholder never read (use_fc False)
        self.fc_panels = fc.panels if fc is not None else none
        self.fc_bias = (fc.bias.detach().numpy() if fc is not None and fc.bias is not None
                        else np.zeros(dim, dtype=np.float32))  # adding 0 is exact
        self.fc_tiles = cpu_kernels.tiles_for(self.fc_panels)
        head: NumbaLinear = model.lm_head  # type: ignore[assignment]
        self.head_panels, self.n_out = head.panels, head.out_features
        self.head_tiles = cpu_kernels.tiles_for(head.panels)
        self._no_features = np.zeros((1, dim), dtype=np.float32)

    @staticmethod
    def fits(model: nn.Module) -> bool:
        fc = getattr(model, "fc", None)
        embed = getattr(model, "embed", None)
        return (isinstance(model, Llama) and isinstance(model.fused, FusedStack)
                and isinstance(model.lm_head, NumbaLinear) and model.lm_head.bias is None
                and isinstance(embed, nn.Embedding) and embed.weight.dtype == torch.float32
                and embed.weight.device.type == "cpu" and embed.weight.is_contiguous()
                and (fc is None or (isinstance(fc, NumbaLinear) and fc.in_features == 2 * fc.out_features
                                    and fc.out_features == embed.weight.shape[1])))

    def __call__(self, tokens: np.ndarray, features: np.ndarray | None, cache: KVCache,
                 mask: np.ndarray | None = None, positions: np.ndarray | None = None,
                 logits_from: int | None = None) -> tuple[Tensor, Tensor]:
        """tokens (n,) int64 at the cache's next n slots, with their pairs' features (n, dim) float32 when the model
        has an fc -> logits (n - logits_from, n_out) of rows logits_from.. (default: the last row alone) and the
        hidden states (n, dim); the cache advances by n, as the module's forward advances it.

        mask (n, S) bool, S = cached + n: which slots each row sees (default: a chain, each row the cache and the
        rows before it); positions (n,): rope's (default: the slots themselves). A tree's rows (EAGLE-2's
        expansion) give both."""
        n, start = len(tokens), cache.lengths[0]
        if cache.batch != 1 or not 1 <= n <= FUSED_ROWS:
            raise ValueError(f"DrafterPass takes 1..{FUSED_ROWS} tokens of one sequence, not {n} of {cache.batch}")
        if tokens.min() < 0 or tokens.max() >= len(self.embed):
            raise IndexError(f"token id out of range for an embedding of {len(self.embed)} rows")
        if self.use_fc and (features is None or features.shape != (n, self.embed.shape[1])):
            raise ValueError(f"features: expected ({n}, {self.embed.shape[1]}) beside the tokens")
        if mask is not None and mask.shape != (n, start + n):
            raise ValueError(f"mask of shape {mask.shape}: expected ({n}, {start + n})")
        logits_from = n - 1 if logits_from is None else logits_from
        if not 0 <= logits_from < n:
            raise ValueError(f"logits_from={logits_from}: expected 0..{n - 1}")
        cache.reserve(n)  # refuses an overflow
        st = self.stack
        if cache.key_panels is None or cache.value_panels is None:
            cache.keep_panels(st.att_panel)
        use_mask = n > 1 or mask is not None
        if mask is None:  # causal over the new rows
            mask = np.tri(n, start + n, start, dtype=np.bool_) if use_mask else st._all_visible
        rope = st.rope(self.model, np.arange(start, start + n) if positions is None else positions)
        segment = np.array([[0, start, 0, n]], dtype=np.int64)
        feats = np.ascontiguousarray(features, dtype=np.float32) if self.use_fc else self._no_features
        logits, h = drafter_pass(
            np.ascontiguousarray(tokens, dtype=np.int64), feats, self.embed, self.use_fc, self.fc_panels, self.fc_bias,
            self.fc_tiles, rope, cache.k.numpy(), cache.v.numpy(), cache.key_panels.numpy(), cache.value_panels.numpy(),
            segment, np.ascontiguousarray(mask, dtype=np.bool_), use_mask, st.attn_normed, st.attn_norms, st.wqkv,
            st.bqkv, st.bo, st.wo, st.mlp_norms, st.w_gate_up, st.w_down, st.final_normed, st.norm, st.norm_eps,
            st.n_heads, st.n_kv, st.head_dim, st.hidden, st.tiles, st.att_tiles, self.head_panels, self.head_tiles,
            self.n_out, logits_from)
        cache.advance(n)
        return torch.from_numpy(logits), torch.from_numpy(h)
