"""The rows a reduced-vocabulary EAGLE drafter scores besides its kept ones: the request's own tokens.

Why: the drafter scores only the K target rows it was trained on (heads/eagle.py, `kept_vocab`), so a
token outside them ends every chain that reaches it. Many of the target's output tokens outside them
already occur in the request: a translation's copied words, a document's names and numbers (on the
held-apart sets, from half of them to nearly all; experiments/README.md, "The request's own tokens as
drafter rows"). Its head is the target's own output
rows over its guessed final-norm feature, so any target row can be scored without retraining: logits of
an added row j are head[j] . guess, as the kept rows' are. Proposals only: the target verifies every
token, so the output is unchanged (lossless).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from specdec.errors import SpecdecError


def output_rows(target: Any) -> Tensor:
    """(V, D) the target's output head, shared (no copy): what every row's logit is taken against."""
    model = target.model
    head = model.lm_head if target.backend == "compact" else model.get_output_embeddings()
    return head.weight


class RequestRows:
    """Per request: the kept rows' target ids (K,), then the ids of the request's tokens outside them (n,),
    with those n rows of the target's head; `extend` adds their logits after the kept ones.

    `reset(ids)` at a turn's start takes its prompt (the conversation so far); `add(ids)` takes the tokens
    the target then emits, so a word it has written once can be drafted again.
    """

    def __init__(self, kept: Tensor, head: Tensor) -> None:
        if head.dim() != 2 or int(kept.max()) >= head.shape[0]:
            raise SpecdecError(f"request rows need the target's ({head.shape[0]}, D) output head over every kept row")
        self.kept, self.head = kept, head
        self.kept_host = kept.cpu().numpy()  # read once: a turn's reset then makes no device read
        self.in_rows = np.zeros(head.shape[0], dtype=np.bool_)  # on the host: kept or added, read per token
        self.reset([])

    def reset(self, ids: Sequence[int]) -> None:
        self.in_rows[:] = False
        self.in_rows[self.kept_host] = True
        self.added: list[int] = []
        self.token_ids = self.kept  # (K + n,)
        self.extra = self.head[:0]  # (n, D), in the head's dtype and on its device
        self.add(ids)

    def add(self, ids: Sequence[int]) -> None:
        fresh = [t for t in dict.fromkeys(int(t) for t in ids) if not self.in_rows[t]]
        if not fresh:
            return
        self.in_rows[fresh] = True
        self.added += fresh
        new = torch.tensor(self.added, device=self.kept.device)
        self.token_ids = torch.cat([self.kept, new])
        self.extra = self.head[new]  # (n, D)

    def extend(self, logits: Tensor, hidden: Tensor) -> Tensor:
        """logits (..., K) over the kept rows and the feature they were taken from (..., D) -> (..., K + n)."""
        if not self.added:
            return logits
        more = hidden.to(self.extra.dtype) @ self.extra.T  # (..., n), as the kept rows' logits are taken
        return torch.cat([logits, more.to(logits.dtype)], -1)
