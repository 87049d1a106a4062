"""heads/head_loss.py: the chunked, recomputing CE + KL equals the plain autograd formula."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from heads import head_loss as hl
from specdec.errors import SpecdecError


def plain(h: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, target_h: torch.Tensor,
          ce_rows: torch.Tensor, kl_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = h @ head.T  # (N, K)
    ce = F.cross_entropy(logits[ce_rows], labels[ce_rows])
    log_p = F.log_softmax(target_h[kl_rows] @ head.T, -1)
    kl = F.kl_div(F.log_softmax(logits[kl_rows], -1), log_p, log_target=True, reduction="batchmean")
    return ce, kl


@pytest.mark.parametrize("shared", [False, True])  # the target's states, or its distribution computed once
@pytest.mark.parametrize("chunk", [7, 1 << 21])  # several ragged chunks, and one
def test_matches_plain_autograd_in_value_and_gradient(monkeypatch: pytest.MonkeyPatch, chunk: int,
                                                      shared: bool) -> None:
    monkeypatch.setattr(hl, "CHUNK_ELEMENTS", chunk * 11)
    g = torch.Generator().manual_seed(0)
    N, D, K = 30, 8, 11
    h = torch.randn(N, D, generator=g, dtype=torch.float64, requires_grad=True)
    head = torch.randn(K, D, generator=g, dtype=torch.float64)
    target_h = torch.randn(N, D, generator=g, dtype=torch.float64)
    labels = torch.randint(0, K, (N,), generator=g)
    ce_rows = torch.rand(N, generator=g) < 0.6
    kl_rows = torch.rand(N, generator=g) < 0.8
    target = hl.target_distribution(target_h, head) if shared else target_h
    ce, kl, correct = hl.head_loss(h, head, labels, target, ce_rows, kl_rows)
    ref_ce, ref_kl = plain(h, head, labels, target_h, ce_rows, kl_rows)
    assert torch.allclose(ce, ref_ce) and torch.allclose(kl, ref_kl)
    ranked = (h @ head.T).topk(5, -1).indices
    assert int(correct[0]) == int((ranked[:, 0] == labels)[ce_rows].sum())
    assert int(correct[1]) == int((ranked == labels[:, None]).any(-1)[ce_rows].sum()) > int(correct[0])
    for a, b in ((1.0, 0.0), (0.3, 2.0)):  # each term's gradient, and a weighted sum
        mine, = torch.autograd.grad(a * ce + b * kl, h, retain_graph=True)
        ref, = torch.autograd.grad(a * ref_ce + b * ref_kl, h, retain_graph=True)
        assert torch.allclose(mine, ref)


@pytest.mark.parametrize("chunk", [4, 1 << 21])
def test_a_trained_head_gets_the_plain_gradient(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    """EAGLE-3 trains its head: its gradient is summed chunk by chunk, the target's distribution (from the
    target's own rows, not the head being trained) a constant."""
    monkeypatch.setattr(hl, "CHUNK_ELEMENTS", chunk * 11)
    g = torch.Generator().manual_seed(3)
    N, D, K = 23, 8, 11
    h = torch.randn(N, D, generator=g, dtype=torch.float64, requires_grad=True)
    head = torch.randn(K, D, generator=g, dtype=torch.float64, requires_grad=True)
    target_rows, target_h = torch.randn(K, D, generator=g, dtype=torch.float64), torch.randn(N, D, generator=g,
                                                                                              dtype=torch.float64)
    labels = torch.randint(0, K, (N,), generator=g)
    ce_rows, kl_rows = torch.rand(N, generator=g) < 0.5, torch.rand(N, generator=g) < 0.7
    ce, kl, _ = hl.head_loss(h, head, labels, hl.target_distribution(target_h, target_rows), ce_rows, kl_rows)
    logits = h @ head.T
    ref_ce = F.cross_entropy(logits[ce_rows], labels[ce_rows])
    ref_kl = F.kl_div(F.log_softmax(logits[kl_rows], -1), F.log_softmax(target_h[kl_rows] @ target_rows.T, -1),
                      log_target=True, reduction="batchmean")
    assert torch.allclose(ce, ref_ce) and torch.allclose(kl, ref_kl)
    mine = torch.autograd.grad(0.4 * ce + 1.5 * kl, (h, head))
    ref = torch.autograd.grad(0.4 * ref_ce + 1.5 * ref_kl, (h, head))
    for a, b in zip(mine, ref):
        assert torch.allclose(a, b)
    with pytest.raises(SpecdecError, match="target_distribution"):  # states would be read through the trained head
        hl.head_loss(h, head, labels, target_h, ce_rows, kl_rows)


def test_the_target_distribution_reuses_a_buffer_that_fits() -> None:
    g = torch.Generator().manual_seed(2)
    head, target_h = torch.randn(11, 8, generator=g), torch.randn(30, 8, generator=g)
    small = torch.empty(5 * 11)
    dist = hl.target_distribution(target_h, head, small)  # too small: a new one
    assert dist.buffer is not small and torch.allclose(dist.p, F.softmax(target_h @ head.T, -1))
    assert torch.allclose(dist.neg_entropy, (dist.p * dist.p.log()).sum(-1))
    again = hl.target_distribution(target_h[:20], head, dist.buffer)  # fits: the same storage
    assert again.buffer is dist.buffer and again.p.data_ptr() == dist.p.data_ptr()
    assert torch.allclose(again.p, F.softmax(target_h[:20] @ head.T, -1))


def test_without_target_states_only_cross_entropy_counts() -> None:
    g = torch.Generator().manual_seed(1)
    h = torch.randn(9, 4, generator=g, requires_grad=True)
    head = torch.randn(6, 4, generator=g)
    labels = torch.randint(0, 6, (9,), generator=g)
    rows = torch.ones(9, dtype=torch.bool)
    ce, kl, _ = hl.head_loss(h, head, labels, None, rows, rows)
    assert float(kl) == 0.0
    assert torch.allclose(ce, F.cross_entropy(h @ head.T, labels))
    ce.backward()
    assert h.grad is not None and h.grad.abs().sum() > 0
