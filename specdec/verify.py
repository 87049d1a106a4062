"""Acceptance rules: which proposed tokens the target keeps, plus its own next token.

Every rule walks the proposal from the root (node 0). `logits[i]` is the target's prediction for
the token after node i, so a child c of node i is checked against row i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specdec.engine.sampling import SamplingParams, read_greedy, sample, warp
from specdec.trees import children


@dataclass
class Proposal:
    tokens: Tensor  # (N,) proposed nodes after the root
    parents: list[int]  # (N,) parent of each node (0 = root); -1 marks a node fed but never verified
    probs: Tensor | None = None  # (N, V) draft distribution each node was drawn from; None = deterministic
    mask: Tensor | None = None  # (N+1, N+1) override of the tree mask (lookahead's extra branch)
    depth: Tensor | None = None  # (N+1,) override of the position offsets

    @property
    def is_chain(self) -> bool:
        return self.parents == list(range(len(self.parents)))


@dataclass
class Verdict:
    nodes: list[int]  # accepted proposal nodes, root first excluded, in path order
    tokens: list[int]  # tokens to commit: the accepted nodes' tokens and one target token after them


def verify(proposal: Proposal, logits: Tensor, params: SamplingParams,
           generator: torch.Generator | None = None) -> Verdict:
    if params.greedy:
        return verify_greedy(proposal, logits)
    if proposal.probs is not None:
        if not proposal.is_chain:
            raise ValueError("speculative sampling with draft probabilities is implemented for chains")
        return verify_sampled_chain(proposal, logits, params, generator)
    return verify_deterministic(proposal, logits, params, generator)


def verify_greedy(proposal: Proposal, logits: Tensor) -> Verdict:
    """Keep the longest path whose every token equals the target's argmax after its parent.

    One device-to-host read: the target's argmax per row (N+1,) and the proposed tokens together."""
    pred, tokens = read_greedy(logits, proposal.tokens)  # pred[i]: target's next token after node i
    kids = children(proposal.parents)
    path: list[int] = []
    best: list[int] = []

    def walk(node: int) -> None:  # depth-first; trees are small
        nonlocal best
        if len(path) > len(best):
            best = list(path)
        for c in kids[node]:
            if tokens[c - 1] == pred[node]:
                path.append(c)
                walk(c)
                path.pop()

    walk(0)
    last = best[-1] if best else 0
    return Verdict(best, [tokens[n - 1] for n in best] + [pred[last]])


def verify_sampled_chain(proposal: Proposal, logits: Tensor, params: SamplingParams,
                         generator: torch.Generator | None) -> Verdict:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): exact in distribution.

    Accept draft x with probability min(1, p(x)/q(x)); on the first rejection draw from the
    residual max(0, p - q) renormalised; after a full acceptance draw the bonus token from p.
    """
    assert proposal.probs is not None
    p_all = warp(logits, params)  # (N+1, V)
    q_all = proposal.probs.to(p_all)
    tokens = proposal.tokens.tolist()
    accepted: list[int] = []
    for i, x in enumerate(tokens):
        p, q = p_all[i], q_all[i]
        u = torch.rand((), generator=generator, device=p.device)
        if u * q[x] < p[x]:  # u < p/q without dividing by a zero q
            accepted.append(i + 1)
            continue
        residual = (p - q).clamp_min(0)
        total = residual.sum()
        # p == q exactly leaves no residual; then any draw from p is already correct
        return Verdict(accepted, tokens[:i] + [sample(residual / total if total > 0 else p, generator)])
    return Verdict(accepted, tokens + [sample(p_all[len(tokens)], generator)])


def verify_deterministic(proposal: Proposal, logits: Tensor, params: SamplingParams,
                         generator: torch.Generator | None) -> Verdict:
    """Exact sampling for drafts without probabilities (prompt lookup, n-gram pools, trees).

    A deterministic draft is a one-hot q: child x is accepted with probability p(x); on rejection
    x is removed from p and the next sibling is tried against the renormalised rest (multi-candidate
    rejection as in SpecInfer). If every child fails, the target token is drawn from what is left.
    """
    p_all = warp(logits, params)
    tokens = proposal.tokens.tolist()
    kids = children(proposal.parents)
    node, accepted = 0, []
    while True:
        p = p_all[node].clone()
        moved = False
        seen: set[int] = set()
        for c in kids[node]:
            x = tokens[c - 1]
            if x in seen:  # a duplicate sibling was already rejected; it has no mass left
                continue
            seen.add(x)
            if torch.rand((), generator=generator, device=p.device) < p[x]:
                accepted.append(c)
                node, moved = c, True
                break
            p[x] = 0
            p = p / p.sum()
        if not moved:
            return Verdict(accepted, [tokens[n - 1] for n in accepted] + [sample(p, generator)])


def verify_typical(proposal: Proposal, logits: Tensor, params: SamplingParams, generator: torch.Generator | None,
                   epsilon: float = 0.09, delta: float = 0.3) -> Verdict:
    """Typical acceptance (Cai et al. 2024, Medusa): fast at temperature > 0, NOT distribution-preserving.

    Child x of node i passes when p_i(x) > min(epsilon, delta * exp(-H(p_i))), p_i being the target's
    warped distribution after node i: confident rows demand a likely token, flat rows accept more.
    The longest passing path wins (first in node order on ties) and the token after it is sampled
    from the target. Outputs stay plausible but their distribution differs from plain sampling.
    """
    p_all = warp(logits, params)  # (N+1, V)
    entropy = -torch.special.xlogy(p_all, p_all).sum(-1)  # (N+1,)
    threshold = torch.clamp(delta * torch.exp(-entropy), max=epsilon).tolist()
    tokens = proposal.tokens.tolist()
    parents = proposal.parents
    reach, depth = [True], [0]
    for x, p in zip(tokens, parents):
        ok = p >= 0 and reach[p] and float(p_all[p, x]) > threshold[p]
        reach.append(ok)
        depth.append(depth[p] + 1 if ok else 0)
    last = max(range(len(depth)), key=lambda n: (depth[n], -n))
    path: list[int] = []
    node = last
    while node != 0:
        path.append(node)
        node = parents[node - 1]
    path.reverse()
    return Verdict(path, [tokens[n - 1] for n in path] + [sample(p_all[last], generator)])
