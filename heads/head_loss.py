"""Cross-entropy plus KL to the target through a frozen output head, without (rows, K) logits in memory.

A drafter's training loss reads its hidden states through the target's frozen head (K kept rows):
cross-entropy on the target's tokens and KL(target || drafter) on the target's own distribution. Written
plainly, autograd keeps several (rows, K) tensors per step (logits, their fp32 copy, log-softmax, the
target's probabilities): at 8 x 640 rows and K = 8192, 168 MB each. On CPU each of those is a fresh
mmap that page-faults in on first touch, so the element-wise passes over them ran much slower than on
reused memory and took most of a training step. Here the rows go through in chunks of a few MB, and the
backward pass recomputes a chunk's logits instead of storing them (as fused linear-cross-entropy
kernels do), so only (rows, D) tensors live between the passes. A drafter scored against the same target
rows several times a step (EAGLE's unrolled passes) computes the target's distribution once instead
(`target_distribution`, into a buffer it keeps between steps, so it page-faults in only once).

For a row r with weights c_r (cross-entropy) and k_r (KL), the gradient of the loss with respect to its
logits is (c_r + k_r) softmax(z_r) - c_r onehot(y_r) - k_r p_r, since p_r sums to one. A head that requires
a gradient (EAGLE-3 trains its own) gets sum_r g_r^T h_r, summed chunk by chunk into one (K, D) tensor; the
target's distribution p stays a constant (read it through the target's own rows: target_distribution).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from specdec.errors import SpecdecError

CHUNK_ELEMENTS = 1 << 21  # logits per chunk: 8 MB in fp32, well inside malloc's reused heap


@dataclass
class TargetDist:
    """The target's distribution over a head's K rows at N positions, for several head_loss calls."""

    p: Tensor  # (N, K) probabilities, fp32 or wider
    neg_entropy: Tensor  # (N,) sum_k p log p: KL(p || q) = neg_entropy - sum_k p log q
    buffer: Tensor  # the flat storage p lives in: pass it back as `into` to reuse it


def _dtypes(h: Tensor) -> tuple[torch.dtype, torch.dtype]:
    """(matmul dtype: autocast's when on, else h's; soft-max dtype: never below fp32)."""
    device = h.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
    return dtype, torch.promote_types(dtype, torch.float32)


@torch.no_grad()
def target_distribution(target_h: Tensor, head: Tensor, into: Tensor | None = None) -> TargetDist:
    """softmax(target_h @ head.T) (N, K) in chunks, written into `into` when it is large enough.

    The result is read by head_loss's backward pass too: it stays valid until `into` is reused, so
    run every backward pass over a step's losses before the next step's call."""
    dtype, soft = _dtypes(target_h)
    N, K = target_h.shape[0], head.shape[0]
    if into is None or into.numel() < N * K or into.dtype != soft or into.device != target_h.device:
        into = torch.empty(N * K, dtype=soft, device=target_h.device)
    p = into[:N * K].view(N, K)
    neg_entropy = target_h.new_empty(N, dtype=soft)
    w = head.detach().to(dtype)
    with torch.autocast(target_h.device.type, enabled=False):
        for s, e in _chunks(N, K):
            log_p = F.log_softmax(F.linear(target_h[s:e].to(dtype), w).to(soft), -1)  # (n, K)
            torch.exp(log_p, out=p[s:e])
            neg_entropy[s:e] = (p[s:e] * log_p).sum(-1)
    return TargetDist(p, neg_entropy, into)


class _HeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, head: Tensor, labels: Tensor, target_h: Tensor | None, ce_w: Tensor,  # type: ignore[override]
                kl_w: Tensor, dtype: torch.dtype, top: int, dist: TargetDist | None) -> tuple[Tensor, Tensor, Tensor]:
        # h (N, D) drafter states; head (K, D), trained or frozen; labels (N,) kept-row ids, -100 where unscored;
        # target_h (N, D) the target's states or None; ce_w, kl_w (N,) per-row weights of the two terms;
        # dist: the target's distribution computed already (then target_h is None)
        soft = torch.promote_types(dtype, torch.float32)  # soft-maxes never below fp32
        ce, kl = (h.new_zeros((), dtype=soft) for _ in range(2))
        hits = h.new_zeros(2, dtype=soft)  # scored rows whose label is the top token, or among the top `top`
        w = head.to(dtype)
        for s, e in _chunks(h.shape[0], head.shape[0]):
            log_q = F.log_softmax(F.linear(h[s:e].to(dtype), w).to(soft), -1)  # (n, K)
            lab = labels[s:e]
            scored = lab >= 0
            picked = log_q.gather(1, lab.clamp_min(0)[:, None]).squeeze(1)  # (n,)
            ce -= (picked * ce_w[s:e]).sum()
            ranked = log_q.topk(min(top, log_q.shape[-1]), -1).indices  # (n, top)
            hits[0] += ((ranked[:, 0] == lab) & scored).sum()
            hits[1] += ((ranked == lab[:, None]).any(-1) & scored).sum()
            if target_h is not None:
                log_p = F.log_softmax(F.linear(target_h[s:e].to(dtype), w).to(soft), -1)  # (n, K)
                kl += ((log_p.exp() * (log_p - log_q)).sum(-1) * kl_w[s:e]).sum()
            elif dist is not None:
                kl += ((dist.neg_entropy[s:e] - (dist.p[s:e] * log_q).sum(-1)) * kl_w[s:e]).sum()
        ctx.dtype, ctx.soft, ctx.dist = dtype, soft, dist
        ctx.save_for_backward(h, head, labels, target_h, ce_w, kl_w)
        ctx.mark_non_differentiable(hits)
        return ce, kl, hits

    @staticmethod
    def backward(ctx, g_ce: Tensor, g_kl: Tensor, _: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        h, head, labels, target_h, ce_w, kl_w = ctx.saved_tensors
        w = head.to(ctx.dtype)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(head.shape, dtype=ctx.soft, device=head.device) if ctx.needs_input_grad[1] else None
        for s, e in _chunks(h.shape[0], head.shape[0]):
            c, k = ce_w[s:e] * g_ce, kl_w[s:e] * g_kl  # (n,)
            grad = F.softmax(F.linear(h[s:e].to(ctx.dtype), w).to(ctx.soft), -1).mul_((c + k)[:, None])  # (n, K)
            lab = labels[s:e]
            rows = (lab >= 0).nonzero().squeeze(1)
            grad[rows, lab[rows]] -= c[rows]
            if target_h is not None:
                p = F.softmax(F.linear(target_h[s:e].to(ctx.dtype), w).to(ctx.soft), -1)
                grad -= p.mul_(k[:, None])
            elif ctx.dist is not None:
                grad -= ctx.dist.p[s:e] * k[:, None]
            grad = grad.to(ctx.dtype)
            grad_h[s:e] = (grad @ w).to(h.dtype)  # (n, D)
            if grad_w is not None:
                grad_w += grad.T @ h[s:e].to(ctx.dtype)  # (K, D)
        return (grad_h, None if grad_w is None else grad_w.to(head.dtype), None, None, None, None, None, None, None)


def _chunks(rows: int, width: int) -> list[tuple[int, int]]:
    step = max(1, CHUNK_ELEMENTS // max(1, width))
    return [(s, min(rows, s + step)) for s in range(0, rows, step)]


def head_loss(h: Tensor, head: Tensor, labels: Tensor, target_h: Tensor | TargetDist | None, ce_rows: Tensor,
              kl_rows: Tensor | None, top: int = 5) -> tuple[Tensor, Tensor, Tensor]:
    """Mean cross-entropy over `ce_rows`, mean KL(target || drafter) over `kl_rows` (zero without
    `target_h`), and (2,) how many `ce_rows` have their label as the drafter's top token and among
    its `top` tokens.

    h, target_h (N, D), or in target_h's place its distribution over the head's rows (target_distribution);
    head (K, D), trained when it requires a gradient; labels (N,) in 0..K-1 (any value where ce_rows is False);
    ce_rows, kl_rows (N,) bool. Matmuls run in the autocast dtype when autocast is on (as F.linear would),
    soft-maxes in fp32. The target's distribution is a constant: with a trained head, pass it as a TargetDist
    computed from the target's own rows, since target_h's would be read through the head being trained.
    """
    dtype, _ = _dtypes(h)
    dist = target_h if isinstance(target_h, TargetDist) else None
    target_h = None if dist is not None else target_h
    labels = torch.where(ce_rows, labels, torch.full_like(labels, -100))
    ce_w = ce_rows.float() / ce_rows.sum().clamp_min(1)
    kl_w = torch.zeros_like(ce_w)
    if kl_rows is not None and (target_h is not None or dist is not None):
        kl_w = kl_rows.float() / kl_rows.sum().clamp_min(1)
    if head.requires_grad and target_h is not None:
        raise SpecdecError("head_loss with a trained head takes the target's distribution, not its states: pass "
                           "target_distribution(target_h, the target's own head rows)")
    with torch.autocast(h.device.type, enabled=False):
        return _HeadLoss.apply(h, head, labels, None if target_h is None else target_h.detach(),
                               ce_w, kl_w, dtype, top, dist)
