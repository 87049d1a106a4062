"""Sequential Medusa heads: each head continues the previous one along a tree path (Hydra's idea,
Ankner et al. 2024), instead of every head guessing from the target's state alone.

Plain heads guess token t + k + 2 without knowing what the path holds at t + 2 .. t + k + 1; deep
heads must hedge over every way the path might have gone, and the product of their probabilities
(the dynamic tree's score) treats the guesses as independent. Here head 0 reads the target's state and
the root (t + 1), as with `root_input`, and head k > 0 reads head k - 1's features at the parent node
plus the parent's token:

    f_0 = stack_0(h_t,     U_0 e(t + 1))
    f_k = stack_k(f_{k-1}, U_k e(t + 1) + P_k e(x_{t + k + 1}))

where the first block of a stack is x + SiLU(W x + extra + b) and e is a token's row of the target's
frozen output head. So f_k has seen the whole path above it. With `chain_head0=false` (the shipped
heads) head 1 starts from h_t instead of f_0: head 0 then learns for itself alone, as every accepted
path starts with its guess (chained through it, the later heads' losses cost it top-1 accuracy;
experiments/README.md, "Medusa: sequential heads"). Training feeds the true tokens (teacher
forcing on the target's own continuations, which are exactly the paths verification accepts). At
inference a node's children need one more head call with that node's token, so a tree of n nodes
costs up to n small head calls (`tree_start` / `tree_expand`; the dynamic proposer in
specdec/strategies/medusa.py makes only the calls its best-first search needs).

`topk` / `topk_logprobs` (fixed trees, the tree tuner's timing, hybrids) follow each head's own top
guess: row k ranks head k's guesses after the top-1 path above it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from heads import cpu_heads
from heads.medusa import MedusaConfig, MedusaHeads, Roots
from specdec.models import cpu_kernels

_NO_ROW = np.empty(0, dtype=np.float32)  # the path row head 0 does not read


@dataclass(frozen=True)
class PathNode:
    """A tree node as the heads see it: `features` (dim,) of head `head` there, whose projection ranks the
    node's children, and the root's row, which every head's first block reads."""

    features: Tensor
    head: int
    root_row: Tensor
    state: Tensor  # (dim,) the target's state, where head 1 starts when it does not continue head 0


class SequentialMedusaHeads(MedusaHeads):
    def __init__(self, cfg: MedusaConfig, base_weight: Tensor, kept_ids: Tensor | None = None) -> None:
        super().__init__(cfg, base_weight, kept_ids)
        dim = cfg.hidden_size
        # (K - 1, dim, dim): P_k of heads 1..K-1; zero at first, so training starts from chained plain heads
        self.path_in = nn.Parameter(torch.zeros(max(cfg.num_heads - 1, 0), dim, dim, device=base_weight.device))
        # per head, per layer: (panels, bias, tile kernels) for the CPU kernels
        self.head_panels: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]] | None = None
        self._proj_tiles: np.ndarray | None = None
        self._kept_np: np.ndarray | None = None
        # Training only: False stops head k's loss from reaching the heads before it, so that head 0 (whose
        # guess every accepted path starts with) learns for itself alone. Not saved: inference is the same.
        self.chain_grad = True
        self.compiled_node: Callable[..., tuple[Tensor, Tensor, Tensor]] | None = None  # set by `compile_steps`

    # -- training and batched use ------------------------------------------------------------------

    def _extra(self, k: int, e_root: Tensor, e_prev: Tensor | None) -> Tensor:
        assert self.root_in is not None
        extra = e_root @ self.root_in[k].t()  # (..., dim)
        if k > 0 and e_prev is not None:
            extra = extra + e_prev @ self.path_in[k - 1].t()
        return extra

    def _stack(self, k: int, x: Tensor, extra: Tensor) -> Tensor:
        for i, block in enumerate(self.blocks[k]):
            x = block(x, extra if i == 0 else None)
        return x

    def features(self, hidden: Tensor, root: Tensor | int | None = None, depth: int | None = None,
                 path: Tensor | None = None) -> Tensor:
        """(..., dim) states, (...,) root ids and (..., K - 1) path ids (tokens t + 2 .., default: each head's
        own top guess) -> (..., d, dim)."""
        d = self.num_heads if depth is None else depth
        e_root = self._root_row(root).to(hidden.dtype)
        outs: list[Tensor] = []
        x = hidden
        for k in range(d):
            e_prev = None
            if k == 1 and not self.cfg.chain_head0:
                x = hidden
            if k > 0:
                if path is not None:
                    tok = path[..., k - 1]
                else:  # the previous head's own top guess
                    tok = self.kept_ids[self.head_logits(outs[-1], k - 1).argmax(-1)]
                e_prev = self.root_rows[tok].to(hidden.dtype)
                x = x if self.chain_grad else x.detach()
            x = self._stack(k, x, self._extra(k, e_root, e_prev))
            outs.append(x)
        return torch.stack(outs, dim=-2)

    def teacher_features(self, hidden: Tensor, input_ids: Tensor) -> Tensor:
        """(B, T, dim), (B, T) ids (-1: padding) -> (B, T, K, dim) with the sequence's own tokens as each
        position's root and path."""
        ids = input_ids.clamp_min(0)
        B, T = ids.shape
        ahead = torch.cat([ids, ids.new_zeros(B, self.num_heads + 1)], 1)  # past the end: labels are ignored there
        root = ahead[:, 1:T + 1]
        path = ahead[:, 2:].unfold(1, T, 1)[:, :self.num_heads - 1].transpose(1, 2)  # (B, T, K - 1): token t + 2 + j
        return self.features(hidden, root, path=path)

    # -- inference, one node at a time ---------------------------------------------------------------

    def _pack_blocks(self, block_weights: str) -> None:
        """Per head, not batched across heads: these heads run one node, so one head, at a time."""
        packed = []
        for k, blocks in enumerate(self.blocks):
            layers = []
            for i, block in enumerate(blocks):
                m = block.linear.weight.detach().float()
                if i == 0:  # [W | U | P] reads [x, e(root), e(prev)] in one product
                    assert self.root_in is not None
                    parts = [m, self.root_in[k].detach().float()]
                    parts += [self.path_in[k - 1].detach().float()] if k > 0 else []
                    m = torch.cat(parts, dim=1)
                panels = cpu_kernels.pack(m.numpy(), kind=block_weights)
                layers.append((panels, block.linear.bias.detach().float().numpy(), cpu_kernels.tiles_for(panels)))
            packed.append(layers)
        self.head_panels = packed
        # the shared projection's kernels, chosen here with its copy so that they always match its type
        self._proj_tiles = cpu_kernels.tiles_for(self.proj_panels) if self.proj_panels is not None else None
        self._kept_np = self.kept_ids.numpy()

    def _node_features(self, k: int, x: Tensor, e_root: Tensor, e_prev: Tensor | None) -> Tensor:
        """Head k's stack on one node: (dim,) input (the target's state for head 0, else the parent's
        features) -> (dim,)."""
        if self.head_panels is None:
            return self._stack(k, x, self._extra(k, e_root, e_prev))
        xs = x.numpy()
        for i, (panels, bias, tiles) in enumerate(self.head_panels[k]):
            if i == 0:
                prev = e_prev.numpy() if k > 0 and e_prev is not None else _NO_ROW
                xs = cpu_heads.residual_block(xs, e_root.numpy(), prev, panels, bias, tiles)
            else:
                xs = cpu_heads.residual_block(xs, _NO_ROW, _NO_ROW, panels, bias, tiles)
        return torch.from_numpy(xs)

    def _project(self, x: Tensor, k: int) -> Tensor:
        """(dim,) features of head k -> (V',) logits."""
        if self.proj.ndim == 3:
            return self.proj[k] @ x
        if self.proj_panels is not None:
            return torch.from_numpy(cpu_kernels.matmul(x.numpy()[None], self.proj_panels, self.proj.shape[0])[0])
        return self.proj @ x

    def _top(self, x: Tensor, k: int, width: int) -> tuple[Tensor, Tensor]:
        if self.proj_panels is not None and self._proj_tiles is not None and self._kept_np is not None:
            # the shared projection on the kernels: top-k and log-probabilities in one compiled call
            best, logp = cpu_heads.top_logprobs(x.numpy(), self.proj_panels, self.proj.shape[0], self._proj_tiles,
                                                width)
            return torch.from_numpy(self._kept_np[best]), torch.from_numpy(logp)
        logits = self._project(x, k).float()
        top = logits.topk(width)
        return self.kept_ids[top.indices], top.values - torch.logsumexp(logits, dim=-1)

    def compile_steps(self) -> None:
        """As `MedusaHeads.compile_steps`, and a tree node's step too: one graph per head (`k` and `width`
        are constants, the parent's token a device tensor)."""
        from specdec.engine.static_step import compile_mode

        super().compile_steps()
        self.compiled_node = torch.compile(self._node_top, mode=compile_mode(self.proj.device), fullgraph=True,
                                           dynamic=False)

    def _node_top(self, k: int, x: Tensor, e_root: Tensor, token: Tensor | None,
                  width: int) -> tuple[Tensor, Tensor, Tensor]:
        """Head k on one node (torch path): (dim,) input, root row, (1,) parent token -> the node's (dim,)
        features and its children's (width,) ids and log-probs."""
        f = self._stack(k, x, self._extra(k, e_root, None if token is None else self.root_rows[token][0]))
        return (f, *self._top(f, k, width))

    def _node(self, k: int, x: Tensor, e_root: Tensor, token: int | None, width: int,
              state: Tensor) -> tuple[PathNode, Tensor, Tensor]:
        if self.compiled_node is not None:
            tok = None if token is None else torch.tensor([token], device=x.device)
            f, ids, logp = (t.clone() for t in self.compiled_node(k, x, e_root, tok, width))  # replays reuse outputs
            return PathNode(f, k, e_root, state), ids, logp
        e_prev = None if token is None else self.root_rows[token]
        node = PathNode(self._node_features(k, x, e_root, e_prev), k, e_root, state)
        return (node, *self._top(node.features, k, width))

    @torch.inference_mode()
    def tree_start(self, hidden: Tensor, root: int, width: int) -> tuple[PathNode, Tensor, Tensor]:
        """The root's node and head 0's top-`width` guesses for its children: (width,) ids, (width,) log-probs."""
        h = hidden.detach().to(self.proj.dtype)
        return self._node(0, h, self._root_row(root), None, width, h)

    @torch.inference_mode()
    def tree_expand(self, parent: PathNode, token: int, width: int) -> tuple[PathNode, Tensor, Tensor]:
        """The node of `token` under `parent`, and the next head's top-`width` guesses for its children."""
        k = parent.head + 1
        x = parent.state if k == 1 and not self.cfg.chain_head0 else parent.features
        return self._node(k, x, parent.root_row, token, width, parent.state)

    def _step_logits(self, hidden: Tensor, depth: int | None, root: Roots = None) -> Tensor:
        """(S, dim) states, one root or one each -> (S, d, V'): each head after the top-1 path of the heads
        before it. Row by row: every row's path differs, so its heads run one node at a time anyway."""
        roots = root if isinstance(root, Sequence | Tensor) else [root] * len(hidden)
        return torch.stack([self._row_logits(h, depth, None if r is None else int(r)) for h, r in zip(hidden, roots)])

    def _row_logits(self, hidden: Tensor, depth: int | None, root: int | None) -> Tensor:
        """(dim,) -> (d, V')."""
        d = self.num_heads if depth is None else depth
        e_root = self._root_row(root)
        h = hidden.detach().to(self.proj.dtype)
        x = self._node_features(0, h, e_root, None)
        rows = [self._project(x, 0)]
        for k in range(1, d):
            tok = self.kept_ids[rows[-1].argmax()]
            x = self._node_features(k, h if k == 1 and not self.cfg.chain_head0 else x, e_root, self.root_rows[tok])
            rows.append(self._project(x, k))
        return torch.stack(rows)
