"""Medusa-1 training (base frozen) as a `Trainable` for `python -m heads.train head=medusa`.

Self-distillation: the sequences are the target's own greedy continuations, so the label of head k
at position t is simply the token at t + k + 2. Head losses are weighted decay^k (0.8^k as in the
paper): later heads are harder and matter less, since their guesses count only when every earlier
one was right.

With `kl_weight` > 0 each head also learns the target's whole distribution over the token it guesses
(KL(target || head) on the kept rows, as the draft and EAGLE do): the target's final-norm state at
t + k + 1 through the same frozen projection gives it. Ranks below the first are what a token tree
spends its nodes on, and a one-hot label says nothing about them.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from heads.draft_model import start_minutes
from heads.head_loss import head_loss
from heads.medusa import MedusaConfig, MedusaHeads, heads_for, kept_vocab, new_config, output_weight, read_saved
from heads.medusa_sequential import SequentialMedusaHeads
from specdec.errors import SpecdecError
from specdec.models.loader import LoadedModel


def _tokens(data: Any) -> Iterable[int]:
    """The tokens heads must predict: labels where the data has them (the continuations), else all ids."""
    column = "labels" if "labels" in data.column_names else "input_ids"
    for row in data[column]:
        yield from (t for t in row if t >= 0)


# what a saved start must share with the heads being trained (a MedusaConfig's fields besides the target's)
MEDUSA_SHAPE = ("num_heads", "num_layers", "projection", "head_vocab", "root_input", "sequential", "chain_head0")


class MedusaLoss(nn.Module):
    """The module the trainer prepares: heads plus their loss in `forward`, so that distributed training
    (which synchronises gradients only through forward calls) sees every head's computation."""

    def __init__(self, heads: MedusaHeads) -> None:
        super().__init__()
        self.heads = heads

    def forward(self, hidden: Tensor, labels: Tensor, input_ids: Tensor | None = None,
                prompt_weight: float = 0.0, kl_weight: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
        """hidden (B, T, dim), labels (B, T) -> per-head loss (cross-entropy, plus kl_weight times the KL
        to the target's distribution), top-1 and top-5 hit rates, each (K,).

        With prompt_weight > 0 (and input_ids), heads also learn at positions whose future token is
        a prompt token (human text rather than the target's own continuation, as in Medusa's original
        ShareGPT training): several times the data for the same generation budget. Hit rates stay
        measured on the continuation only.
        """
        heads = self.heads
        if kl_weight > 0 and heads.proj.ndim != 2:
            raise ValueError("head.kl_weight > 0 needs projection=shared (the target's own head gives the KL)")
        T = labels.shape[1]
        if input_ids is None:  # heads that read the root or the path take them from the sequence
            if heads.reads_root:
                raise ValueError("heads with root_input need input_ids")
            x = heads.features(hidden.to(heads.proj.dtype))  # (B, T, K, dim)
        else:
            x = heads.teacher_features(hidden.to(heads.proj.dtype), input_ids)  # (B, T, K, dim)
        ce, top1, top5 = [], [], []
        for k in range(heads.num_heads):
            # head k at t guesses token t + k + 2, which is labels[t + k + 1]
            full = labels[:, k + 1:]  # (B, T - k - 1)
            valid = full != -100
            feats = x[:, :max(T - k - 1, 0), k][valid]  # (n, dim)
            target = heads.to_head[full[valid]]  # (n,) rows of the kept vocabulary, -100 if dropped
            kept = target != -100
            n = max(len(target), 1)
            if kept.any():
                teacher = hidden[:, k + 1:][valid][kept] if kl_weight > 0 else None  # (n, dim): state at t + k + 1
                loss, hits = self._ce(feats[kept], target[kept], k, teacher, kl_weight)
            else:  # keep every parameter in the graph: distributed training expects a gradient for each
                loss, hits = x[..., k, :].sum() * 0, torch.zeros(2, device=x.device)
            if prompt_weight > 0 and input_ids is not None and T > k + 2:
                future = input_ids[:, k + 2:]  # (B, T - k - 2): token t + k + 2
                prompt = (labels[:, k + 1:T - 1] == -100) & (future >= 0)  # not a continuation token
                p_target = heads.to_head[future[prompt]]
                p_kept = p_target != -100
                if p_kept.any():
                    p_loss, _ = self._ce(x[:, :T - k - 2, k][prompt][p_kept], p_target[p_kept], k)
                    loss = loss + prompt_weight * p_loss
            ce.append(loss)
            top1.append(hits[0] / n)  # dropped tokens count as misses
            top5.append(hits[1] / n)
        return torch.stack(ce), torch.stack(top1), torch.stack(top5)

    def _ce(self, feats: Tensor, rows: Tensor, k: int, teacher: Tensor | None = None,
            kl_weight: float = 0.0) -> tuple[Tensor, Tensor]:
        """Head k's mean cross-entropy on (n, dim) features against kept-vocabulary rows (n,), plus
        kl_weight times its mean KL to the target's distribution read from `teacher` (n, dim) states,
        and (2,) top-1 and top-5 hit counts. The shared frozen projection goes through head_loss, which
        never holds (n, V') logits (most of a CPU step); a trainable one needs them for its own gradient."""
        heads = self.heads
        if heads.proj.ndim == 2:
            every = torch.ones_like(rows, dtype=torch.bool)
            ce, kl, hits = head_loss(feats, heads.proj, rows, teacher, every, every if teacher is not None else None)
            return (ce + kl_weight * kl if teacher is not None else ce), hits
        logits = heads.head_logits(feats, k)  # (n, V')
        with torch.no_grad():
            top = logits.topk(min(5, logits.shape[-1]), dim=-1).indices  # (n, 5)
            hits = torch.stack([(top[:, 0] == rows).sum(), (top == rows[:, None]).any(-1).sum()]).float()
        return F.cross_entropy(logits, rows), hits


class MedusaTrainable:
    """Medusa-1 heads, or with `sequential` Hydra's sequentially dependent heads (named so on disk)."""

    needs_hidden = True

    @property
    def name(self) -> str:
        return "hydra" if self.sequential else "medusa"

    def __init__(self, num_heads: int = 4, num_layers: int = 1, projection: str = "shared",
                 head_vocab: int | None = 8192, decay: float = 0.8, prompt_weight: float = 0.0,
                 kl_weight: float = 0.0, root_input: bool = False, sequential: bool = False,
                 chain_grad: bool = True, chain_head0: bool = False, init_from: str | None = None) -> None:
        if kl_weight < 0:
            raise SpecdecError(f"head.kl_weight must be >= 0, got {kl_weight}")
        if kl_weight > 0 and projection != "shared":
            raise SpecdecError("head.kl_weight > 0 needs head.projection=shared (the target's own head gives the "
                               "distribution); set head.kl_weight=0 for own projections")
        self.num_heads, self.num_layers, self.projection = num_heads, num_layers, projection
        self.head_vocab, self.decay, self.prompt_weight = head_vocab, decay, prompt_weight
        self.kl_weight, self.root_input, self.sequential = kl_weight, root_input, sequential
        self.chain_grad, self.chain_head0 = chain_grad, chain_head0
        self.init_from = init_from
        self.start_minutes: float | None = None  # training minutes behind init_from's heads (None: unknown)

    def build(self, target: LoadedModel, data: Any = None) -> MedusaLoss:
        cfg = new_config(target, self.num_heads, self.num_layers, self.projection, self.head_vocab, self.root_input,
                         self.sequential, self.chain_head0)
        start = self._saved_start(target, cfg) if self.init_from else None
        kept = None
        if start is not None:  # its blocks learnt to score exactly its kept rows
            kept = start["kept_ids"].long() if cfg.head_vocab is not None else None
        elif cfg.head_vocab is not None:
            if data is None:
                raise ValueError("a reduced head vocabulary is chosen from the training data; pass data")
            kept = kept_vocab(_tokens(data), cfg.head_vocab, cfg.vocab_size)
        heads = heads_for(cfg, output_weight(target), kept)
        if start is not None:
            dev = heads.kept_ids.device
            missing, unexpected = heads.load_state_dict({k: v.to(dev) if k == "kept_ids" else v.to(dev, torch.float32)
                                                for k, v in start.items()}, strict=False)
            # only own copies grown from a shared start are missing: they were built from the target above
            assert not unexpected and missing in ([], ["proj"]), (missing, unexpected)
        if isinstance(heads, SequentialMedusaHeads):
            heads.chain_grad = self.chain_grad
        return MedusaLoss(heads)

    def _saved_start(self, target: LoadedModel, cfg: MedusaConfig) -> dict[str, Tensor]:
        """head.init_from's saved state, checked to be heads of exactly this head config."""
        _, saved, meta, state = read_saved(target, str(self.init_from))
        # shared -> own is allowed: each head's own copy starts as the frozen rows it learnt to score
        grows = saved.projection == "shared" and cfg.projection == "own"
        differ = [f"{f}={getattr(saved, f)}" for f in MEDUSA_SHAPE
                  if getattr(saved, f) != getattr(cfg, f) and not (f == "projection" and grows)]
        if differ:
            raise SpecdecError(f"head.init_from={self.init_from} holds other heads ({', '.join(differ)}); "
                               f"set those head options to match it, or leave head.init_from unset")
        self.start_minutes = start_minutes({"train": meta})
        return state

    def loss(self, module: nn.Module, batch: dict[str, Tensor],
             target_hidden: Tensor | None) -> tuple[Tensor, dict[str, float]]:
        assert target_hidden is not None
        dev = target_hidden.device
        # padding must not become a prompt label: mark it -1 (never a token id)
        ids = torch.where(batch["attention_mask"].bool(), batch["input_ids"], -1).to(dev)
        ce, top1, top5 = module(target_hidden, batch["labels"].to(dev), ids, self.prompt_weight, self.kl_weight)
        weights = self.decay ** torch.arange(len(ce), device=ce.device, dtype=ce.dtype)
        total = (weights * ce).sum()
        metrics = {"loss": float(total.detach())}
        for k in range(len(ce)):
            metrics |= {f"loss_{k}": float(ce[k].detach()), f"top1_{k}": float(top1[k]),
                        f"top5_{k}": float(top5[k])}
        return total, metrics

    def save(self, module: nn.Module, out_dir: Path, meta: dict[str, Any]) -> None:
        assert isinstance(module, MedusaLoss)
        module.heads.save(out_dir, meta | {"decay": self.decay, "kl_weight": self.kl_weight})
