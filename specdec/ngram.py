"""N-gram bookkeeping for training-free drafters: an incremental suffix index and an n-gram pool.

Both run once per decode step on the host, so they are append-only and touch only the tokens
committed since the previous step: the cost per step does not grow with the sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class NGramIndex:
    """For every n in [n_min, n_max]: n-gram -> the positions right after each occurrence.

    `positions(key)` lists `end` such that `ids[end - n:end] == key`, oldest first; `ids[end:]` is
    what followed that occurrence. Tokens are added with `extend(ids)` as the sequence grows.
    """

    def __init__(self, n_min: int, n_max: int) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.tables: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(n_min, n_max + 1)}
        self.length = 0  # tokens of the sequence indexed so far

    def extend(self, ids: Sequence[int]) -> None:
        """Index the n-grams that end in ids[self.length:] (ids must extend what was indexed)."""
        for end in range(self.length + 1, len(ids) + 1):
            for n, table in self.tables.items():
                if end >= n:
                    table.setdefault(tuple(ids[end - n:end]), []).append(end)
        self.length = max(self.length, len(ids))

    def positions(self, key: tuple[int, ...]) -> list[int]:
        table = self.tables.get(len(key))
        return table.get(key, []) if table is not None else []


def continuation(ids: Sequence[int], end: int, k: int) -> list[int]:
    """The k tokens that followed ids[:end], copied past the end of ids with period len(ids) - end.

    A match close to the end of the sequence means the text is repeating with that period (a loop,
    a list, a refrain); continuing the copy predicts the repetition instead of stopping short.
    """
    n = len(ids)
    out: list[int] = []
    for i in range(k):
        j = end + i
        out.append(ids[j] if j < n else out[j - n])
    return out


def match_length(ids: Sequence[int], index: NGramIndex) -> int:
    """Length of the longest final n-gram that also occurs earlier (0 if none)."""
    L = len(ids)
    for n in range(min(index.n_max, L - 1), index.n_min - 1, -1):
        if any(end < L for end in index.positions(tuple(ids[L - n:]))):
            return n
    return 0


def lookup(ids: Sequence[int], index: NGramIndex, k: int, num: int, max_scan: int = 64) -> list[list[int]]:
    """Up to `num` distinct k-token continuations of the sequence's final n-gram, longest n first,
    the most recent occurrence first within each n. `index` must cover all of ids."""
    found: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    L = len(ids)
    for n in range(min(index.n_max, L - 1), index.n_min - 1, -1):
        scanned = 0
        for end in reversed(index.positions(tuple(ids[L - n:]))):
            if end >= L:  # the final n-gram itself
                continue
            cont = continuation(ids, end, k)
            key = tuple(cont)
            if key not in seen:
                seen.add(key)
                found.append(cont)
                if len(found) == num:
                    return found
            scanned += 1
            if scanned == max_scan:  # frequent n-grams (a space, a comma): the recent ones suffice
                break
    return found


class NGramPool:
    """First token -> the most recent distinct (N-1)-token tails seen after it, at most `capacity`.

    Lookahead decoding's pool: n-grams come from the prompt, the committed text and the Jacobi
    window; re-inserting a tail makes it the most recent again (LRU).
    """

    def __init__(self, n: int, capacity: int) -> None:
        if n < 2 or capacity < 1:
            raise ValueError(f"need n >= 2 and capacity >= 1, got {n}, {capacity}")
        self.n, self.capacity = n, capacity
        self.table: dict[int, list[tuple[int, ...]]] = {}

    def add(self, head: int, tail: Sequence[int]) -> None:
        tail = tuple(tail)
        tails = self.table.setdefault(head, [])
        if tail in tails:
            tails.remove(tail)
        tails.append(tail)
        if len(tails) > self.capacity:
            del tails[0]

    def add_text(self, ids: Sequence[int], start: int = 0) -> int:
        """Add every complete n-gram of ids that begins at or after `start`; return the next start."""
        n = self.n
        for i in range(start, len(ids) - n + 1):
            self.add(ids[i], ids[i + 1:i + n])
        return max(start, len(ids) - n + 1)

    def get(self, head: int, num: int) -> list[tuple[int, ...]]:
        """The `num` most recent tails after `head`, most recent first."""
        tails = self.table.get(head, [])
        return tails[::-1][:num]


class ContextPool:
    """First token -> its recent (previous token, tail) occurrences in the text, at most `capacity`.

    A pool keyed by first token, like `NGramPool`, whose lookups rank tails that followed the same
    two tokens (the previous one and the head) before the others: one token of left context picks
    the right continuation of a common head ("the", ",") far more often than recency alone.
    """

    def __init__(self, n: int, capacity: int) -> None:
        if n < 2 or capacity < 1:
            raise ValueError(f"need n >= 2 and capacity >= 1, got {n}, {capacity}")
        self.n, self.capacity = n, capacity
        self.table: dict[int, list[tuple[int, tuple[int, ...]]]] = {}

    def add_text(self, ids: Sequence[int], start: int = 0) -> int:
        """Add every complete n-gram of ids that begins at or after `start`; return the next start."""
        n = self.n
        for i in range(start, len(ids) - n + 1):
            entry = (ids[i - 1] if i > 0 else -1, tuple(ids[i + 1:i + n]))
            entries = self.table.setdefault(ids[i], [])
            if entry in entries:
                entries.remove(entry)
            entries.append(entry)
            if len(entries) > self.capacity:
                del entries[0]
        return max(start, len(ids) - n + 1)

    def get(self, head: int, prev: int, num: int) -> list[tuple[int, ...]]:
        """Up to `num` distinct tails after `head`: those preceded by `prev` first, each group newest first."""
        entries = self.table.get(head, [])[::-1]
        out: list[tuple[int, ...]] = []
        for same_context in (True, False):
            for before, tail in entries:
                if (before == prev) == same_context and tail not in out:
                    out.append(tail)
                    if len(out) == num:
                        return out
        return out


def candidates_to_tree(candidates: Sequence[Sequence[int]],
                       max_nodes: int | None = None) -> tuple[list[int], list[int]]:
    """Merge token sequences (each continuing the root) into a trie -> (tokens, parents).

    Node i + 1 holds tokens[i] and hangs under parents[i] (0 = root). Shared prefixes share nodes,
    and siblings keep the order of the candidates that created them, so earlier candidates are
    tried first by the verifier. With max_nodes the trie stops growing at that many nodes: earlier
    candidates are kept whole and the first one that does not fit keeps only its fitting prefix.
    """
    tokens: list[int] = []
    parents: list[int] = []
    child: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for cand in candidates:
        node = 0
        for tok in cand:
            nxt = child.get((node, tok))
            if nxt is None:
                if max_nodes is not None and len(tokens) >= max_nodes:
                    return tokens, parents
                tokens.append(int(tok))
                parents.append(node)
                nxt = len(tokens)
                child[(node, tok)] = nxt
            node = nxt
    return tokens, parents


def as_tokens(tokens: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(tokens), dtype=torch.long)  # (N,)
