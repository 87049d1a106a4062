"""Training an EAGLE-3 drafter (Li et al. 2025; heads/eagle3.py) with `python -m heads.train head=eagle3`.

What differs from EAGLE-1/2's recipe (heads/eagle.py):
- the input feature of pair t is fc([a_t; b_t; c_t]), the residual stream entering three target layers
  (low, middle, high: `target_layers`, default 2, n/2 and n-3), not the final-norm state;
- no feature regression: the only loss is the token loss, KL(target || drafter) over the draft vocabulary;
- the training-time test: pass s > 1 feeds pair t the drafter's own pre-norm output of pass s - 1 at pair
  t - 1 where the fused feature stood, and lets it attend to real pairs up to t - (s - 1) and to its own
  earlier guesses after them (heads/training_time_test.py), what drafting the s-th token shows it; no
  feature noise;
- the draft vocabulary's output head is the drafter's own (trained), started from the target's rows.

The trainer reads the taps from one target pass over the distilled sequences, cached on disk next to the
data (heads/train.py `with_cached_hidden`), since generation keeps only the final state. The result is saved
in SafeAILab's published layout (config.json + model.safetensors; heads/interop/eagle_layout.py), which
`strategy=eagle3` runs as a chain, `strategy=eagle2` with the same drafter as a dynamic tree, and vLLM and
SGLang load as they are; the run's facts go to train.json and the card.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from heads.draft_model import target_embedding, target_head, vocab_maps
from heads.eagle import _final_norm_weight, eagle_args, init_fresh, parse_save_dtype
from heads.eagle3 import Eagle3Net, default_layers
from heads.head_loss import head_loss, target_distribution
from heads.training_time_test import PassStack, ttt_mask
from specdec.errors import SpecdecError
from specdec.models.llama import rope_inv_freq
from specdec.models.loader import LoadedModel

TRAIN_META = "train.json"


class Eagle3TrainModule(nn.Module):
    """Eagle3Net over whole right-padded sequences, run `unroll` times as the training-time test.

    target_rows (K, D): the target's frozen output rows of the draft vocabulary, which score the target's
    distribution the drafter learns (a buffer: neither trained nor checkpointed)."""

    def __init__(self, net: Eagle3Net, target_rows: Tensor) -> None:
        super().__init__()
        self.net = net
        self.register_buffer("target_rows", target_rows, persistent=False)

    def forward(self, tokens: Tensor, taps: Tensor, unroll: int) -> list[Tensor]:
        """tokens (B, T) x_{t+1} and taps (B, T, 3 D_t) of pairs t -> each pass's final-norm states (B, T, D),
        no logits: the loss reads them through lm_head in chunks (heads/head_loss.py).

        Pass 1 reads every pair's real taps; pass s > 1 gives pair j the guess pass s - 1 made at pair j - 1
        (pair 0 its fused taps, a filler: no pass s > 1 scores pairs j < s - 1, which have no real context)."""
        B, T = tokens.shape
        pos = torch.arange(T, device=tokens.device).expand(B, T)
        stack = PassStack()  # one forward for every pass: DDP sees one graph per step
        features, out = taps, []
        for s in range(1, unroll + 1):
            mask = ttt_mask(T, s, tokens.device)
            guess = self.net.guesses(tokens, features, pos, stack, mask)  # (B, T, D)
            out.append(self.net.norm(guess))
            if s < unroll:
                features = torch.cat([self.net.fuse(taps[:, :1]), guess[:, :-1]], 1)  # (B, T, D)
        return out


class Eagle3Trainable:
    """heads.train's Trainable for an EAGLE-3 drafter (configs/head/eagle3.yaml)."""

    needs_hidden = True

    def __init__(self, name: str = "eagle3", target_layers: list[int] | None = None, draft_vocab: int = 8192,
                 unroll: int = 2, norm_before_residual: bool = False, save_dtype: str = "fp16") -> None:
        if unroll < 1:
            raise SpecdecError(f"head.unroll={unroll} must be at least 1 (1: train on the target's features only)")
        self.name = name
        self.layers = tuple(target_layers) if target_layers else None
        self.draft_vocab = draft_vocab
        self.unroll = unroll
        self.norm_before_residual = norm_before_residual
        self.save_dtype = parse_save_dtype(save_dtype)
        self.target: LoadedModel | None = None
        self.kept_ids: Tensor | None = None
        self.to_kept: Tensor | None = None  # (V,) target id -> draft row, -1 if not kept
        self._target_buffer: Tensor | None = None  # the target's distribution, reused step to step

    def target_taps(self, target: LoadedModel) -> tuple[int, int, int]:
        """The three target layers whose inputs fc reads (checked against the target's depth)."""
        n = int(target.model.args.n_layers if target.backend == "compact" else target.model.config.num_hidden_layers)
        layers = tuple(sorted(self.layers)) if self.layers else default_layers(n)
        if len(set(layers)) != 3 or min(layers) < 0 or max(layers) >= n:
            raise SpecdecError(f"head.target_layers={list(layers)}: EAGLE-3 reads three distinct layer inputs of the "
                               f"target's {n} layers (0..{n - 1}); pass three, or null for 2, n/2 and n-3")
        return layers  # type: ignore[return-value]

    def build(self, target: LoadedModel, data: Any) -> nn.Module:
        self.target = target
        args = eagle_args(target, 1)
        V, D = target.vocab_size, target.hidden_size
        embed = target_embedding(target).detach().float()
        self.kept_ids, self.to_kept = vocab_maps(data, target, self.draft_vocab, embed.device)
        torch.manual_seed(0)
        with torch.device("meta"):
            net = Eagle3Net(args, D, len(self.kept_ids), self.target_taps(target), self.norm_before_residual)
        net.to_empty(device=embed.device)
        init_fresh(net)  # fresh layer and fc; the output norm at the target's final scale (below)
        net.norm.weight.data.copy_(_final_norm_weight(target))
        net.embed.weight = nn.Parameter(embed, requires_grad=False)
        rows = target_head(target).detach().float()[self.kept_ids].clone()  # (K, D)
        net.lm_head.weight.data.copy_(rows)  # trained from the target's own rows
        net.inv_freq = rope_inv_freq(net.args).to(embed.device)
        net.token_ids = None if len(self.kept_ids) == V else self.kept_ids
        return Eagle3TrainModule(net, rows)

    def loss(self, module: nn.Module, batch: dict[str, Tensor],
             target_hidden: Tensor | None) -> tuple[Tensor, dict[str, float]]:
        assert self.to_kept is not None and target_hidden is not None and self.target is not None
        ids, labels = batch["input_ids"], batch["labels"]
        D = self.target.hidden_size
        h, taps = target_hidden[..., :D].float(), target_hidden[..., D:].float()  # (B, T, D), (B, T, 3 D_t)
        if taps.shape[-1] != 3 * D:
            raise SpecdecError(f"the target pass gave {taps.shape[-1] // D} layer taps, EAGLE-3 reads 3; delete the "
                               "cached hidden states (hidden-*.f16 next to the data) and rerun")
        valid = batch["attention_mask"][:, 1:].bool()  # (B, T-1) pairs t = (taps of t, x_{t+1}) -> x_{t+2}
        if not valid.any():
            return taps.sum() * 0.0, {"kl": 0.0, "acc": 0.0}
        inner = module if hasattr(module, "target_rows") else module.module  # DDP wraps it
        target = target_distribution(h[:, 1:][valid], inner.target_rows, self._target_buffer)  # (N, K), real pairs
        self._target_buffer = target.buffer
        small = self.to_kept.to(labels.device)[labels[:, 1:].clamp_min(0)][valid]  # (N,) x_{t+2}'s draft row, -1: none
        scored = (labels[:, 1:][valid] >= 0) & (small >= 0)  # the continuation's tokens the drafter can propose
        loss = taps.new_zeros(())
        logs: dict[str, float] = {}
        for s, states in enumerate(module(ids[:, 1:], taps[:, :-1], self.unroll), 1):
            keep = valid.clone()
            keep[:, :s - 1] = False  # pass s scores pairs with s - 1 real pairs before their guesses
            if not keep.any():
                break
            rows = keep[valid]  # (N,)
            # KL(target || drafter) through the trained head; the cross-entropy is unused (only its hit count,
            # the agreement with the target's continuation on rows the drafter can propose, is logged)
            _, kl, hits = head_loss(states[valid], inner.net.lm_head.weight, small, target, scored & rows, rows,
                                    top=1)
            loss = loss + kl / self.unroll
            suffix = "" if s == 1 else str(s)
            logs[f"kl{suffix}"] = float(kl.detach())
            logs[f"acc{suffix}"] = float(hits[0]) / max(1, int((scored & rows).sum()))
        return loss, logs

    def save(self, module: nn.Module, out_dir: Path, meta: dict[str, Any]) -> None:
        from heads.interop.eagle_layout import export_eagle3

        assert self.target is not None
        net = module.net  # type: ignore[union-attr]
        export_eagle3(net, out_dir, target_embed=target_embedding(self.target), base_model=self.target.name,
                      dtype=self.save_dtype)
        (out_dir / TRAIN_META).write_text(json.dumps(meta, indent=2, default=str))
