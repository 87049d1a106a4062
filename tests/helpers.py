"""Reference recomputations the tests compare the engine against: the slow, obvious way."""

from __future__ import annotations

import torch
from torch import Tensor

from specdec.engine.engine import StaticEngine


def chain_forward(model: object, ids: list[int], max_len: int = 256) -> tuple[StaticEngine, Tensor]:
    """A fresh engine fed `ids` as one chain from an empty cache: (engine, logits (T, V) of every token)."""
    engine = StaticEngine(model, max_len)
    out = engine.forward(torch.tensor(ids))
    return engine, out.logits


def filled(engine: StaticEngine) -> tuple[Tensor, Tensor]:
    """K/V of the committed slots of sequence 0: (L, H_kv, T, D) each."""
    n = engine.length
    return engine.cache.k[:, 0, :, :n], engine.cache.v[:, 0, :, :n]


def assert_kv_matches_fresh(engine: StaticEngine, ids: list[int], atol: float = 1e-5) -> StaticEngine:
    """The engine's cache holds exactly what recomputing `ids` from scratch would hold."""
    assert engine.length == len(ids)
    fresh, _ = chain_forward(engine.model, ids, engine.max_len)
    k, v = filled(engine)
    k_ref, v_ref = filled(fresh)
    torch.testing.assert_close(k, k_ref, atol=atol, rtol=1e-4)
    torch.testing.assert_close(v, v_ref, atol=atol, rtol=1e-4)
    return fresh


def assert_cache_matches_fresh(engine: StaticEngine, ids: list[int], atol: float = 1e-5) -> None:
    """As assert_kv_matches_fresh, and the next token's logits agree too (the engine is left as it was)."""
    fresh = assert_kv_matches_fresh(engine, ids, atol)
    probe = torch.tensor([7])
    torch.testing.assert_close(engine.forward(probe).logits, fresh.forward(probe).logits, atol=atol, rtol=1e-4)
    engine.rollback(len(ids))


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=gen).tolist()
