"""A compact Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) over a static KV cache.

Loads Hugging Face weights by name; fuses q/k/v and gate/up so one decode step launches few kernels.
Every forward takes explicit positions and an optional mask among the new tokens, so the same code
serves prefill, single-token decode, draft chains and token trees.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec.engine.kv_cache import KVCache
from specdec.errors import SpecdecError

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class LlamaArgs:
    vocab_size: int
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    norm_eps: float
    rope_theta: float
    max_position: int
    tie_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    rope_scaling: dict[str, Any] | None = None

    @classmethod
    def from_hf(cls, cfg: Any) -> LlamaArgs:
        if cfg.model_type not in SUPPORTED_TYPES:
            raise SpecdecError(f"model type {cfg.model_type!r} has no compact implementation "
                               f"({', '.join(SUPPORTED_TYPES)}); use model.backend=hf")
        # transformers >= 5 keeps theta and scaling together in rope_parameters; older configs split them
        rope = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", None)) or 10000.0
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "llama3"):
            raise SpecdecError(f"rope scaling {kind!r} is not implemented in the compact model; "
                               "use model.backend=hf")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        qwen = cfg.model_type == "qwen2"
        bias = bool(getattr(cfg, "attention_bias", False))
        return cls(
            vocab_size=cfg.vocab_size, dim=cfg.hidden_size, hidden_dim=cfg.intermediate_size,
            n_layers=cfg.num_hidden_layers, n_heads=cfg.num_attention_heads,
            n_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim, norm_eps=cfg.rms_norm_eps,
            rope_theta=float(theta),
            max_position=cfg.max_position_embeddings,
            tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=qwen or bias, o_bias=bias and not qwen,
            rope_scaling=rope if kind == "llama3" else None,
        )


def rope_inv_freq(args: LlamaArgs) -> Tensor:
    d = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = args.rope_scaling
    if s:  # Llama 3.x: stretch low frequencies, keep high ones, blend in between
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = ((old / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        mid = (wavelen <= old / low) & (wavelen >= old / high)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv.float()


def eager_cuda(x: Tensor) -> bool:
    """An eager pass on CUDA: bound by kernel launches more than by arithmetic (prefill, batches,
    distillation). Compiled steps are left to inductor."""
    return x.is_cuda and not torch.compiler.is_compiling()


def fuse_norm(x: Tensor) -> bool:
    """Whether RMSNorm runs as torch's one rms_norm kernel rather than the five ops of the reference
    formula: in eager passes on CUDA."""
    return eager_cuda(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # normalise in fp32 as the reference does (a no-op cast for fp32 models)
        if fuse_norm(x):
            return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class PassThroughNorm(nn.Module):
    """Stands where a network has no norm (EAGLE-1's layer 0 input and output): returns its input. Keeps a
    `weight` of ones (never applied) so code that reads a norm's device, dtype or eps still works; the CPU
    kernels' fused stack skips it (cpu_layer.FusedStack)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return x


def apply_rope(x: Tensor, freqs: Tensor) -> Tensor:
    """Rotate adjacent pairs of x (B, T, H, D) by freqs (B, T, 1, D/2) as complex numbers.

    Checkpoints use the rotate-half layout (pairs i and i + D/2); at load time we permute the rows
    of wq and wk so pairs become adjacent, which leaves q.k unchanged and makes rope three ops.
    """
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs).flatten(-2).to(x.dtype)


def apply_rope_real(x: Tensor, freqs: Tensor) -> Tensor:
    """apply_rope in real arithmetic, freqs (B, T, 1, D/2, 2) holding cos and sin: inductor generates
    no code for complex tensors, so the compiled step rotates pairs this way."""
    xf = x.float().unflatten(-1, (-1, 2))  # (B, T, H, D/2, 2)
    a, b = xf[..., 0], xf[..., 1]
    cos, sin = freqs[..., 0], freqs[..., 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2).to(x.dtype)


def interleave_rows(w: Tensor, n_heads: int, head_dim: int) -> Tensor:
    """Reorder each head's rows from [0..D/2, D/2..D] to [0, D/2, 1, D/2+1, ...]."""
    rest = w.shape[1:]
    return w.reshape(n_heads, 2, head_dim // 2, *rest).transpose(1, 2).reshape(n_heads * head_dim, *rest)


def expand_kv(q: Tensor, mask: Tensor | None) -> bool:
    """Whether to repeat K/V to H heads before SDPA rather than pass enable_gqa. On CUDA only flash
    attention takes enable_gqa, and flash takes neither a mask nor fp32: SDPA then falls back to its math
    kernel, which repeats K/V itself and materializes the scores in several launches a layer, while K/V
    repeated here reach the memory-efficient kernel. Eager only: a compiled step keeps the graph the GPU
    check timed (inductor fuses the math path itself). The CPU keeps enable_gqa (no copy of the cache)."""
    return eager_cuda(q) and (mask is not None or q.dtype == torch.float32)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        qkv_out = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        self.wqkv = nn.Linear(args.dim, qkv_out, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=args.o_bias)

    def forward(self, x: Tensor, freqs: Tensor, cache: KVCache, mask: Tensor | None,
                slots: Tensor | None = None) -> Tensor:
        """slots (T,): static-shape mode (engine/static_step.py): write K/V at these cache slots and
        attend over every slot of the cache under `mask` (B, 1, T, S_max)."""
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv, self.head_dim
        qk, v = self.wqkv(x).split([(H + Hkv) * D, Hkv * D], dim=-1)
        rotate = apply_rope if slots is None else apply_rope_real
        qk = rotate(qk.view(B, T, H + Hkv, D), freqs).transpose(1, 2)  # (B, H + Hkv, T, D)
        q, k = qk.split([H, Hkv], dim=1)  # (B, H, T, D), (B, Hkv, T, D)
        v = v.view(B, T, Hkv, D).transpose(1, 2)
        if slots is None:
            keys, values = cache.write(self.layer, k, v)  # (B, Hkv, S, D), S = filled + T
        else:
            keys, values = cache.write_at(self.layer, k, v, slots)  # (B, Hkv, S_max, D)
        if H != Hkv and expand_kv(q, mask):
            keys, values = keys.repeat_interleave(H // Hkv, 1), values.repeat_interleave(H // Hkv, 1)  # (B, H, S, D)
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=keys.shape[1] != H)
        return self.wo(y.transpose(1, 2).reshape(B, T, H * D))


class MLP(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.hidden_dim = args.hidden_dim
        self.w_gate_up = nn.Linear(args.dim, 2 * args.hidden_dim, bias=False)
        self.w_down = nn.Linear(args.hidden_dim, args.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w_gate_up(x).split(self.hidden_dim, dim=-1)
        return self.w_down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, args: LlamaArgs, layer: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.attn = Attention(args, layer)
        self.mlp_norm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: Tensor, freqs: Tensor, cache: KVCache, mask: Tensor | None,
                slots: Tensor | None = None) -> Tensor:
        x = x + self.attn(self.attn_norm(x), freqs, cache, mask, slots)
        return x + self.mlp(self.mlp_norm(x))


def static_mask(slots: Tensor, tree: Tensor, size: int) -> Tensor:
    """(1, 1, T, size) bool over every cache slot: the cached ones (before slots[0]) and, within the
    new block, what `tree` (T, T) allows. Built on the device from tensors alone (no host lengths)."""
    T = tree.shape[0]
    rel = torch.arange(size, device=slots.device) - slots[:1]  # (size,) slot index relative to the block
    inside = (rel >= 0) & (rel < T)
    return ((rel < 0) | (tree[:, rel.clamp(0, T - 1)] & inside))[None, None]


class WholePass(Protocol):
    """A faster way to run the whole stack for some inputs (cpu_layer.FusedStack: CPU, a few tokens)."""

    rows: int  # the most rows one call of it runs; `head` multiplies at most this many at a time

    def takes(self, x: Tensor, mask: Tensor | None = None,
              cache: object = None) -> bool: ...  # x: (B, T, dim), the layers' input; mask (B, 1, T, S)

    def __call__(self, model: Llama, x: Tensor, positions: Tensor, cache: KVCache, mask: Tensor | None,
                 taps: tuple[int, ...] = (), seen: list[Tensor] | None = None
                 ) -> Tensor: ...  # -> final-norm hidden states (B, T, dim); taps as run_layers


class NormPlaced(nn.Module):
    """A stack with `args` (LlamaArgs) and a final `norm`: its device and dtype are read off that norm
    (under the CPU kernels the embedding's `weight` is rebuilt on each access), its cache sized from args."""

    args: LlamaArgs
    norm: RMSNorm

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        a = self.args
        return KVCache(a.n_layers, batch, a.n_kv_heads, max_len, a.head_dim, self.dtype, self.device)


class Llama(NormPlaced):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.fused: WholePass | None = None  # set by cpu_layer.use_fused_stacks
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)

    def rope(self, positions: Tensor) -> Tensor:
        angles = positions[..., None, None].float() * self.inv_freq  # (B, T, 1, D/2)
        return torch.polar(torch.ones_like(angles), angles)

    def forward(self, tokens: Tensor, positions: Tensor, cache: KVCache, mask: Tensor | None = None,
                logits_from: int = 0) -> tuple[Tensor, Tensor]:
        """Run T new tokens against the cache and append their K/V.

        tokens, positions: (B, T). mask: (B, 1, T, S) bool over cache slots plus new tokens, or None
        when every new token may see every slot (T == 1). Returns logits (B, T - logits_from, V) and
        final-norm hidden states (B, T, dim).
        """
        cache.reserve(tokens.shape[1])
        h = self.run_layers(self.embed(tokens), positions, cache, mask)  # (B, T, dim)
        cache.advance(tokens.shape[1])
        return self.head(h[:, logits_from:]), h

    def head(self, h: Tensor) -> Tensor:
        """Logits (B, T, V) of final-norm hidden states (B, T, dim). Under the CPU kernels one sequence's rows
        go `fused.rows` at a time, each then bitwise a one-row pass's (a BLAS product over more would not be)."""
        # A sliced (B, T', D) view is not contiguous when B > 1; torch would run it as a bmm against B
        # expanded copies of the output head (most of a batched prefill in a profile), so copy the rows instead.
        T = h.shape[1]
        if self.fused is None or h.shape[0] != 1 or T <= self.fused.rows:
            return self.lm_head(h.contiguous())
        step = self.fused.rows
        return torch.cat([self.lm_head(h[:, s:s + step].contiguous()) for s in range(0, T, step)], 1)

    def run_layers(self, x: Tensor, positions: Tensor, cache: KVCache, mask: Tensor | None,
                   taps: tuple[int, ...] = (), seen: list[Tensor] | None = None) -> Tensor:
        """The layers and the final norm over inputs x (B, T, dim) -> hidden states (B, T, dim).
        taps: append to `seen` the residual stream entering each of these layers (B, T, dim), in layer
        order (the fused stack too, one call per stretch of layers between taps)."""
        if self.fused is not None and self.fused.takes(x, mask, cache):
            return self.fused(self, x, positions, cache, mask, taps, seen)
        freqs = self.rope(positions)
        for i, block in enumerate(self.layers):
            if i in taps:
                seen.append(x)  # type: ignore[union-attr]
            x = block(x, freqs, cache, mask)
        return self.norm(x)

    def forward_tapped(self, tokens: Tensor, positions: Tensor, cache: KVCache, mask: Tensor | None,
                       logits_from: int, taps: tuple[int, ...]) -> tuple[Tensor, Tensor, Tensor]:
        """forward, plus the residual stream entering each layer of `taps` (increasing), concatenated:
        (B, T, len(taps) dim), what an EAGLE-3 drafter reads (heads/eagle3.py)."""
        cache.reserve(tokens.shape[1])
        seen: list[Tensor] = []
        h = self.run_layers(self.embed(tokens), positions, cache, mask, taps, seen)  # (B, T, dim)
        cache.advance(tokens.shape[1])
        return self.head(h[:, logits_from:]), h, torch.cat(seen, -1)

    def forward_static(self, tokens: Tensor, positions: Tensor, slots: Tensor, tree: Tensor,
                       cache: KVCache, taps: tuple[int, ...] = (), keep: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The step `torch.compile` captures: every shape fixed by the token bucket T and the cache size.

        tokens, positions (1, T); slots (T,) the cache slots the new K/V go to, slots[0] being the number
        of cached tokens; tree (T, T) which new tokens each new token sees. Nothing here reads a host
        integer that changes between steps, so one compiled graph (one CUDA graph) serves every step
        of a bucket. Returns logits (1, T, V) and final-norm hidden states (1, T, dim); with `taps` the
        tapped layers' inputs follow the final-norm state in the same rows: (1, T, (1 + len(taps)) dim).
        A batch of B sequences sharing the slots (left-padded, heads/batch_generate.py) passes tokens and
        positions (B, T) and `keep` (B, S_max), the slots each row may read (not its padding).
        """
        x = self.embed(tokens)  # (B, T, dim)
        seen: list[Tensor] = []
        h = self.layers_static(x, positions, slots, tree, cache, taps, seen, keep)
        return self.lm_head(h), torch.cat([h, *seen], -1) if taps else h

    def layers_static(self, x: Tensor, positions: Tensor, slots: Tensor, tree: Tensor, cache: KVCache,
                      taps: tuple[int, ...] = (), seen: list[Tensor] | None = None,
                      keep: Tensor | None = None) -> Tensor:
        """The layers and the final norm in static-shape mode (see forward_static) -> (B, T, dim)."""
        mask = static_mask(slots, tree, cache.k.shape[3])  # (1, 1, T, S_max)
        if keep is not None:
            mask = mask & keep[:, None, None, :]  # (B, 1, T, S_max)
        angles = positions[..., None, None].float() * self.inv_freq  # (1, T, 1, D/2)
        freqs = torch.stack([angles.cos(), angles.sin()], -1)  # (1, T, 1, D/2, 2)
        for i, block in enumerate(self.layers):
            if i in taps:
                seen.append(x)  # type: ignore[union-attr]
            x = block(x, freqs, cache, mask, slots)
        return self.norm(x)

    def load_hf_state_dict(self, sd: dict[str, Tensor]) -> None:
        """Copy tensors named as in Hugging Face checkpoints, fusing the projections we fuse."""
        a = self.args

        def take(name: str) -> Tensor:
            if name not in sd:
                raise SpecdecError(f"checkpoint lacks tensor {name!r}; is it a {'/'.join(SUPPORTED_TYPES)} model?")
            return sd[name]

        own: dict[str, Tensor] = {"embed.weight": take("model.embed_tokens.weight"),
                                  "norm.weight": take("model.norm.weight")}
        own["lm_head.weight"] = own["embed.weight"] if a.tie_embeddings else take("lm_head.weight")
        for i in range(a.n_layers):
            p, q = f"model.layers.{i}.", f"layers.{i}."
            att = p + "self_attn."
            for kind in ("weight", "bias") if a.qkv_bias else ("weight",):
                wq = interleave_rows(take(att + f"q_proj.{kind}"), a.n_heads, a.head_dim)
                wk = interleave_rows(take(att + f"k_proj.{kind}"), a.n_kv_heads, a.head_dim)
                own[q + f"attn.wqkv.{kind}"] = torch.cat([wq, wk, take(att + f"v_proj.{kind}")])
            own[q + "attn.wo.weight"] = take(att + "o_proj.weight")
            if a.o_bias:
                own[q + "attn.wo.bias"] = take(att + "o_proj.bias")
            own[q + "mlp.w_gate_up.weight"] = torch.cat(
                [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
            own[q + "mlp.w_down.weight"] = take(p + "mlp.down_proj.weight")
            own[q + "attn_norm.weight"] = take(p + "input_layernorm.weight")
            own[q + "mlp_norm.weight"] = take(p + "post_attention_layernorm.weight")
        # Built on the meta device, so assign the loaded tensors instead of copying into storage.
        self.load_state_dict(own, strict=True, assign=True)
        if a.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.inv_freq = rope_inv_freq(a).to(self.embed.weight.device)
