"""The baseline: one token per target pass on our engine."""

from specdec.strategies.base import SpeculativeStrategy


class Greedy(SpeculativeStrategy):
    """Autoregressive decoding (greedy, or temperature/top-p sampling); proposes nothing."""
