"""Verification budgets for speculative decoding, independent of the serving engine: D-Cut shares
one verification budget across a batch's requests by the drafter's confidence (:func:`dcut`), says
how far a chain drafter should draft (:func:`draft_more`, :func:`next_step_pays`) and whether to
draft at all (:func:`drafting_pays`), and prices verification with a measured, monotone cost model
(:class:`CostTable`, :func:`measure`, :func:`cached_table`); the policies an engine runs are
objects (:mod:`trimpass.budget.policies`)."""
from trimpass.budget.costmodel import CostTable, cached_table, isotonic_grid, measure, pav
from trimpass.budget.dcut import dcut, draft_more, drafting_pays, next_step_pays, scores
from trimpass.budget.policies import POLICIES, Policy, make

__all__ = ["dcut", "draft_more", "drafting_pays", "next_step_pays", "scores", "CostTable",
           "measure", "cached_table", "pav", "isotonic_grid", "POLICIES", "Policy", "make"]
