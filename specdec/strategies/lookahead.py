"""Lookahead decoding (Fu et al. 2024): Jacobi iteration produces n-grams, one pass verifies them.

Every target pass feeds, after the root, two branches under one attention mask:

- the verification branch: up to G n-grams from the pool whose first token is the root, merged
  into a token tree and verified like any draft (parents >= 0);
- the lookahead branch (parents = -1, fed but never verified): a window of W columns and N - 1
  rows. Row 0 holds the heads of columns 1..W-1 (column 0's head is the root) and forms a causal
  chain after the root; row k > 0 of column c sits one position below row k - 1 and sees row 0 up
  to column c plus rows 1..k of its own column. The outputs of the last row are the next Jacobi
  iterate: column c yields the n-gram (head, row 1, ..., row N-2, output) for the pool, then the
  window moves up one row (the oldest row drops; row 1 minus its first column becomes the heads).

The lookahead branch is always argmax (a Jacobi fixed-point search). Verification is the shared
greedy match at temperature 0 (lossless) and `verify_deterministic` above it: pool n-grams are
deterministic drafts with no probabilities, so multi-candidate rejection against the target keeps
the output distribution exact. A second pool holds the n-grams of the prompt and of the committed
output (ranked by one token of left context) and is tried first: on chat with a 135M model on this
CPU it supplies most accepted guesses, and the window the rest (see configs/strategy/lookahead.yaml).
"""

from __future__ import annotations

import random
from functools import lru_cache

import torch
from torch import Tensor

from specdec.engine.engine import ForwardOut
from specdec.engine.sampling import argmax_rows
from specdec.errors import SpecdecError
from specdec.models.loader import LoadedModel
from specdec.ngram import ContextPool, NGramPool, as_tokens, candidates_to_tree
from specdec.strategies.base import DecodeState, Proposer, SpeculativeStrategy
from specdec.trees import tree_depth, tree_mask
from specdec.verify import Proposal, Verdict


def window_size(W: int, rows: int) -> int:
    """Lookahead nodes for a window of W columns and `rows` rows (row 0 has W - 1 of them)."""
    return W - 1 + (rows - 1) * W


def window_index(W: int, row: int, col: int) -> int:
    """Offset of (row, col) inside the lookahead branch; (0, 0) is the root and has none."""
    return col - 1 if row == 0 else W - 1 + (row - 1) * W + col


@lru_cache(maxsize=32)
def window_mask(W: int, rows: int) -> tuple[Tensor, Tensor]:
    """The lookahead branch alone: (n, n) bool mask among its nodes, (n,) position offsets."""
    n = window_size(W, rows)
    mask = [[False] * n for _ in range(n)]
    depth = [0] * n
    for row in range(rows):
        for col in range(1 if row == 0 else 0, W):
            i = window_index(W, row, col)
            depth[i] = col + row
            for c in range(1, col + 1):  # the heads' chain up to this column
                mask[i][window_index(W, 0, c)] = True
            for r in range(1, row + 1):  # this column's rows up to this one
                mask[i][window_index(W, r, col)] = True
    return torch.tensor(mask, dtype=torch.bool).reshape(n, n), torch.tensor(depth, dtype=torch.long)


def combined_mask(parents: list[int], W: int, rows: int) -> tuple[Tensor, Tensor]:
    """(M+1, M+1) mask and (M+1,) offsets for [root, verification tree (parents), lookahead window].

    Every node sees the root; the two branches never see each other.
    """
    V = len(parents)
    wmask, wdepth = window_mask(W, rows) if rows > 0 else (torch.zeros(0, 0, dtype=torch.bool),
                                                         torch.zeros(0, dtype=torch.long))
    M = V + len(wdepth)
    mask = torch.zeros(M + 1, M + 1, dtype=torch.bool)
    mask[:, 0] = True
    mask[:V + 1, :V + 1] = tree_mask(parents)
    mask[V + 1:, V + 1:] = wmask
    depth = torch.cat([tree_depth(parents), wdepth])
    return mask, depth


class LookaheadProposer:
    """The Jacobi window and two n-gram pools keyed by first token: `pool` holds the window's N-grams,
    `text_pool` the prompt's (and the committed output's) n-grams of size `text_ngram`.

    Text n-grams are tried first: they come from text the model has read or written. With them as
    context-ranked trigrams ahead of the window's bigrams, tau on held-apart prompts rose
    (experiments/README.md, "Figures moved out of code and configs"). Every pass verifies at most
    `verify_tokens` guess nodes (default G * (N - 1)).
    """

    TEXT_CAPACITY = 32  # text occurrences kept per first token: enough to find one with the same context

    def __init__(self, W: int, N: int, G: int, max_len: int, harvest_output: bool, seed: int = 0,
                 text_ngram: int | None = None, verify_tokens: int | None = None,
                 device: torch.device | str = "cpu") -> None:
        self.W, self.N, self.G = W, N, G
        self.device = torch.device(device)  # the target's: where its mask and positions go
        self.max_len = max_len
        self.harvest_output = harvest_output
        self.pool = NGramPool(N, G)
        self.text_pool = ContextPool(text_ngram or N, self.TEXT_CAPACITY)
        self.verify_tokens = verify_tokens if verify_tokens is not None else G * (N - 1)
        self.rows: list[list[int]] = []
        self.seed = seed
        self._pooled = 0  # next start of a committed n-gram not yet in the pool
        self._layout: tuple[int, int, int] | None = None  # (root token, verification nodes, window rows)

    def start(self, state: DecodeState, out: ForwardOut) -> None:
        text = state.ids if self.harvest_output else state.ids[:state.prompt_len]
        self._pooled = self.text_pool.add_text(text)
        # The first Jacobi iterate is arbitrary; tokens of the prompt are at least plausible ones.
        rng = random.Random(self.seed)
        prompt = state.ids[:state.prompt_len]
        self.rows = [[rng.choice(prompt) for _ in range(self.W - 1)]]

    def propose(self, state: DecodeState) -> Proposal | None:
        self._layout = None
        remaining = state.params.max_new_tokens - state.output_len
        if remaining <= 1:  # the pass yields its own token; nothing drafted could be kept
            return None
        root = state.ids[-1]
        found = self.text_pool.get(root, state.ids[-2], self.G) + self.pool.get(root, self.G)
        guesses = [g[:remaining - 1] for g in found]
        vtokens, vparents = candidates_to_tree(guesses, self.verify_tokens)
        wtokens = [t for row in self.rows for t in row]
        room = self.max_len - len(state.ids)  # cache slots left after the root
        rows = len(self.rows)
        if len(vtokens) + len(wtokens) > room:  # near the end of the cache: verification only
            wtokens, rows = [], 0
            if len(vtokens) > room or not vtokens:
                return None
        self._layout = (root, len(vtokens), rows)
        # assembled on the host from cached pieces, then one copy each to the target's device; the ids stay
        # host ints (the loop reads them with the target's choices, the engine copies them in with the root)
        mask, depth = combined_mask(vparents, self.W, rows)
        return Proposal(as_tokens(vtokens + wtokens), vparents + [-1] * len(wtokens), mask=mask.to(self.device),
                        depth=depth.to(self.device))

    def commit(self, state: DecodeState, verdict: Verdict, out: ForwardOut) -> None:
        if self._layout is not None and self._layout[2] > 0:
            self._advance(out.logits, *self._layout)
        if self.harvest_output:
            self._pooled = self.text_pool.add_text(state.ids, self._pooled)

    def _advance(self, logits: Tensor, root: int, V: int, rows: int) -> None:
        """Read the last row's outputs from `logits` (rows: [root] + nodes) and step the window."""
        W, base = self.W, 1 + V
        if rows == 1:  # the root predicts column 0, each head the column after it
            idx = [0] + [base + window_index(W, 0, c) for c in range(1, W)]
        else:
            idx = [base + window_index(W, rows - 1, c) for c in range(W)]
        new = argmax_rows(logits[idx])
        if rows < self.N - 1:  # still filling the window
            self.rows.append(new)
            return
        for c in range(W):
            head = root if c == 0 else self.rows[0][c - 1]
            self.pool.add(head, [self.rows[r][c] for r in range(1, rows)] + [new[c]])
        grown = [*self.rows, new]
        self.rows = [grown[1][1:], *grown[2:]]


class Lookahead(SpeculativeStrategy):
    """`strategy=lookahead`: Jacobi-window n-grams plus prompt/output n-grams, verified in one pass."""

    def __init__(self, target: LoadedModel, name: str = "lookahead", max_len: int = 2048,
                 prefill_chunk: int = 512, window: int = 4, level: int = 4, guesses: int = 3,
                 harvest_output: bool = True, text_ngram: int | None = None,
                 verify_tokens: int | None = None) -> None:
        if text_ngram is not None and text_ngram < 2:
            raise SpecdecError(f"lookahead needs text_ngram >= 2 (or null: the level), got {text_ngram}; "
                               "set for example strategy.text_ngram=3")
        if verify_tokens is not None and verify_tokens < 1:
            raise SpecdecError(f"lookahead needs verify_tokens >= 1 (or null: guesses * (level - 1)), got "
                               f"{verify_tokens}; set for example strategy.verify_tokens=2")
        if window < 2 or level < 2 or guesses < 1:
            raise SpecdecError(f"lookahead needs window >= 2, level >= 2 and guesses >= 1, got {window}, {level}, "
                               f"{guesses}; set for example strategy.window=4 strategy.level=4 strategy.guesses=3")
        super().__init__(target, name, max_len, prefill_chunk)
        if not getattr(self.engine, "supports_trees", False):
            raise SpecdecError("lookahead feeds a custom attention mask, which needs the compact model "
                               "(model.backend=compact); this model runs through transformers")
        self.window, self.level, self.guesses = window, level, guesses
        self.harvest_output = harvest_output
        self.text_ngram, self.verify_tokens = text_ngram, verify_tokens

    def make_proposer(self) -> Proposer:
        return LookaheadProposer(self.window, self.level, self.guesses, self.engine.max_len, self.harvest_output,
                                 text_ngram=self.text_ngram, verify_tokens=self.verify_tokens,
                                 device=self.engine.device)
