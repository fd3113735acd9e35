"""The speculation core's control, independent of the engine: one controller
(:class:`~trimpass.spec.control.controller.Controller`) that plans each proposal's depth before
drafting, cuts the drafts, and learns from what the target emitted; D-Cut shares one verification
budget across a batch's requests by the drafter's confidence (:func:`dcut`, :func:`best_rate`),
priced by a measured, monotone cost model (:class:`CostTable`, :func:`measure`,
:func:`cached_table`); the policies it runs are objects (:mod:`trimpass.spec.control.policies`)."""
from trimpass.spec.control.controller import Controller, Plan
from trimpass.spec.control.costmodel import CostTable, cached_table, isotonic_grid, measure, pav
from trimpass.spec.control.dcut import best_rate, dcut, scores
from trimpass.spec.control.policies import POLICIES, Policy, make

__all__ = ["Controller", "Plan", "dcut", "best_rate", "scores", "CostTable", "measure",
           "cached_table", "pav", "isotonic_grid", "POLICIES", "Policy", "make"]
