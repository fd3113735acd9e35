"""Verification budgets for speculative decoding, independent of the serving engine: D-Cut shares
one verification budget across a batch's requests by the drafter's confidence (:func:`dcut`), says
how far a chain drafter should draft (:func:`draft_more`, :func:`next_step_pays`), and prices
verification with a measured, monotone cost model (:class:`CostTable`, :func:`measure`,
:func:`cached_table`)."""
from trimpass.budget.costmodel import CostTable, cached_table, isotonic_grid, measure, pav
from trimpass.budget.dcut import dcut, draft_more, next_step_pays, scores

__all__ = ["dcut", "draft_more", "next_step_pays", "scores", "CostTable", "measure",
           "cached_table", "pav", "isotonic_grid"]
