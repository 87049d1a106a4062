"""An EAGLE-3 drafter (Li et al. 2025) as SafeAILab published it: one decoder layer over three target layers.

EAGLE-1/2 (heads/eagle.py) read the target's final-norm feature. EAGLE-3 reads the residual stream entering
three of the target's layers (low, middle, high; `target_layers`), concatenated (3 D_t) and fused by `fc`
into one D-wide feature g_t. Its single decoder layer (the checkpoints' `midlayer`) takes the pair
(g_t, token x_{t+1}): attention's q/k/v read the 2D-wide [input_norm(embed(x_{t+1})); hidden_norm(g_t)],
the residual runs on g_t (on hidden_norm(g_t) with `norm_before_residual`, a vLLM option), then the usual
MLP. Its pre-norm output guesses the next feature; `lm_head(norm(.))` scores a reduced draft vocabulary
whose row r is target id `token_ids[r]` (= r + d2t[r]).

From the second drafted token on, the drafter's own output stands where the fused feature stood (the
paper's training-time test): `forward` tells the two apart by width (3 D_t: target taps, fused; D: its
own output, used as is), so the EAGLE strategies' proposers (specdec/strategies/eagle.py, eagle_tree.py)
run it as they run EagleNet, catching up on real features and drafting on guesses, chains or trees.
Loaded from and exported to the published layout by heads/interop/eagle_layout.py.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from specdec.engine.kv_cache import KVCache
from specdec.models.llama import MLP, Attention, LlamaArgs, NormPlaced, RMSNorm, rope_inv_freq, static_mask


def default_layers(n_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's choice (SafeAILab, vLLM and SGLang alike): the inputs of layers 2, n/2 and n-3."""
    return 2, n_layers // 2, n_layers - 3


class Eagle3Net(NormPlaced):  # one layer: args.n_layers == 1
    """(token x_{t+1}, feature) pairs -> draft-vocabulary logits (B, T, K) and guessed features (B, T, D).

    args: the drafter's shape (dim D, heads, MLP width; vocab_size = the target's, which `embed` covers).
    target_layers: the target layers whose inputs `fc` reads, increasing (what the target engine taps).
    """

    fused = None  # no CPU fused stack: its layer reads 2D-wide inputs

    def __init__(self, args: LlamaArgs, target_dim: int, draft_vocab: int, target_layers: tuple[int, ...],
                 norm_before_residual: bool = False) -> None:
        super().__init__()
        D, eps = args.dim, args.norm_eps
        self.args = replace(args, n_layers=1)
        self.target_layers = tuple(target_layers)
        self.norm_before_residual = norm_before_residual
        self.embed = nn.Embedding(args.vocab_size, D)
        self.fc = nn.Linear(len(self.target_layers) * target_dim, D, bias=False)
        self.input_norm = RMSNorm(D, eps)  # on the token's embedding
        self.hidden_norm = RMSNorm(D, eps)  # on the feature
        self.attn = Attention(self.args, 0)
        self.attn.wqkv = nn.Linear(2 * D, (args.n_heads + 2 * args.n_kv_heads) * args.head_dim, bias=args.qkv_bias)
        self.mlp_norm = RMSNorm(D, eps)
        self.mlp = MLP(self.args)
        self.norm = RMSNorm(D, eps)
        self.lm_head = nn.Linear(D, draft_vocab, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(self.args), persistent=False)
        self.token_ids: Tensor | None = None  # (K,) target id of each lm_head row; None: rows are target ids

    def fuse(self, features: Tensor) -> Tensor:
        """(..., 3 D_t) target taps -> fc -> (..., D); (..., D) the drafter's own output, as it is."""
        features = features.to(self.dtype)
        return self.fc(features) if features.shape[-1] == self.fc.in_features else features

    def layer(self, tokens: Tensor, features: Tensor, freqs: Tensor, cache: Any, mask: Tensor | None,
              slots: Tensor | None = None) -> Tensor:
        """The midlayer over (B, T) tokens and their pairs' features -> pre-norm output (B, T, D)."""
        g = self.fuse(features)  # (B, T, D)
        normed = self.hidden_norm(g)
        residual = normed if self.norm_before_residual else g
        x = torch.cat([self.input_norm(self.embed(tokens)), normed], -1)  # (B, T, 2D): embedding first
        h = residual + self.attn(x, freqs, cache, mask, slots)
        return h + self.mlp(self.mlp_norm(h))

    def guesses(self, tokens: Tensor, features: Tensor, positions: Tensor, cache: KVCache,
                mask: Tensor | None = None) -> Tensor:
        """tokens, positions (B, T); features (B, T, 3 D_t or D); mask (B, 1, T, S) or None -> guessed
        features (B, T, D), the pre-norm outputs. Appends one cache row per pair."""
        cache.reserve(tokens.shape[1])
        angles = positions[..., None, None].float() * self.inv_freq  # (B, T, 1, hd/2)
        h = self.layer(tokens, features, torch.polar(torch.ones_like(angles), angles), cache, mask)
        cache.advance(tokens.shape[1])
        return h

    def forward(self, tokens: Tensor, features: Tensor, positions: Tensor, cache: KVCache,
                mask: Tensor | None = None, logits_from: int = 0) -> tuple[Tensor, Tensor]:
        """`guesses`, and the logits (B, T - logits_from, K) of lm_head(norm(.)) over them."""
        h = self.guesses(tokens, features, positions, cache, mask)
        return self.lm_head(self.norm(h[:, logits_from:])), h

    def forward_static(self, tokens: Tensor, positions: Tensor, slots: Tensor, tree: Tensor, cache: Any,
                       features: Tensor) -> tuple[Tensor, Tensor]:
        """forward at static shapes (engine/static_step.py): (1, T) tokens, features (1, T, 3 D_t or D)."""
        mask = static_mask(slots, tree, cache.k.shape[3])
        angles = positions[..., None, None].float() * self.inv_freq  # (1, T, 1, hd/2)
        freqs = torch.stack([angles.cos(), angles.sin()], -1)  # (1, T, 1, hd/2, 2)
        h = self.layer(tokens, features, freqs, cache, mask, slots)
        return self.lm_head(self.norm(h)), h
