"""Verification budgets for speculative decoding, independent of the serving engine: D-Cut shares
one verification budget across a batch's requests by the drafter's confidence (:func:`dcut`), says
how far a chain drafter should draft (:func:`draft_more`), and prices verification with a measured,
monotone cost model (:class:`CostTable`, :func:`measure`, :func:`cached_table`)."""
from trimpass.budget.costmodel import CostTable, cached_table, isotonic_grid, measure, pav
from trimpass.budget.dcut import dcut, draft_more, scores

__all__ = ["dcut", "draft_more", "scores", "CostTable", "measure", "cached_table", "pav",
           "isotonic_grid"]
