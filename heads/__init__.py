"""Trained drafters for specdec: a small distilled draft model, Medusa heads, and the training entry.

`specdec/` never imports this package; strategies receive the trained modules already built, through
their configs (`_target_` pointing at a loader in here). Training: `python -m heads.train head=NAME`.
"""
