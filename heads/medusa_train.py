"""Medusa-1 training (base frozen) as a `Trainable` for `python -m heads.train head=medusa`.

Self-distillation: the sequences are the target's own greedy continuations, so the label of head k
at position t is simply the token at t + k + 2. Head losses are weighted decay^k (0.8^k as in the
paper): later heads are harder and matter less, since their guesses count only when every earlier
one was right.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from heads.medusa import MedusaHeads, kept_vocab, new_config, output_weight
from specdec.models.loader import LoadedModel


def _tokens(data: Any) -> Iterable[int]:
    """The tokens heads must predict: labels where the data has them (the continuations), else all ids."""
    column = "labels" if "labels" in data.column_names else "input_ids"
    for row in data[column]:
        yield from (t for t in row if t >= 0)


class MedusaTrainable:
    name = "medusa"
    needs_hidden = True

    def __init__(self, num_heads: int = 4, num_layers: int = 1, projection: str = "shared",
                 head_vocab: int | None = 8192, decay: float = 0.8) -> None:
        self.num_heads, self.num_layers, self.projection = num_heads, num_layers, projection
        self.head_vocab, self.decay = head_vocab, decay

    def build(self, target: LoadedModel, data: Any = None) -> MedusaHeads:
        cfg = new_config(target, self.num_heads, self.num_layers, self.projection, self.head_vocab)
        kept = None
        if cfg.head_vocab is not None:
            if data is None:
                raise ValueError("a reduced head vocabulary is chosen from the training data; pass data")
            kept = kept_vocab(_tokens(data), cfg.head_vocab, cfg.vocab_size)
        return MedusaHeads(cfg, output_weight(target), kept)

    def loss(self, module: nn.Module, batch: dict[str, Tensor],
             target_hidden: Tensor | None) -> tuple[Tensor, dict[str, float]]:
        assert isinstance(module, MedusaHeads) and target_hidden is not None
        labels = batch["labels"].to(target_hidden.device)  # (B, T): token after each input position
        x = module.features(target_hidden.to(module.proj.dtype))  # (B, T, K, dim)
        T = labels.shape[1]
        total = x.new_zeros(())
        metrics: dict[str, float] = {}
        for k in range(module.num_heads):
            if k + 1 >= T:
                break
            # head k at t guesses token t + k + 2, which is labels[t + k + 1]
            full = labels[:, k + 1:]  # (B, T - k - 1)
            valid = full != -100
            if not valid.any():
                continue
            feats = x[:, :T - k - 1, k][valid]  # (n, dim)
            target = module.to_head[full[valid]]  # (n,) rows of the kept vocabulary, -100 if dropped
            logits = module.head_logits(feats, k)  # (n, V')
            kept = target != -100
            ce = F.cross_entropy(logits[kept], target[kept]) if kept.any() else logits.sum() * 0
            total = total + self.decay ** k * ce
            with torch.no_grad():
                top = logits.topk(min(5, logits.shape[-1]), dim=-1).indices  # (n, 5)
                hit = (top == target[:, None]) & kept[:, None]  # dropped tokens can never be hit
                metrics[f"loss_{k}"] = float(ce)
                metrics[f"top1_{k}"] = float(hit[:, 0].float().mean())
                metrics[f"top5_{k}"] = float(hit.any(-1).float().mean())
        metrics["loss"] = float(total.detach())
        return total, metrics

    def save(self, module: nn.Module, out_dir: Path, meta: dict[str, Any]) -> None:
        assert isinstance(module, MedusaHeads)
        module.save(out_dir, meta | {"decay": self.decay})
