"""The budget policies as objects, independent of the serving engine. During a proposal a policy
says whether drafting stops after ``d`` tokens (:meth:`Policy.stop`); after it, how many drafted
tokens each request sends to verification (:meth:`Policy.keep`). ``dcut`` (D-Cut: drafting stops
where no request can put another token into the cut or another step does not pay, and the cut
maximizes expected emitted tokens per second), ``all-or-nothing`` (a step's whole draft or none of
it, by the same cost model), ``fixed`` (draft ``gamma`` tokens, keep them all), ``none``
(speculation paused: nothing drafted), ``off`` (the engine's own behaviour). Before a proposal,
:meth:`Policy.skip` says whether to draft at all: ``dcut`` and ``all-or-nothing`` skip a step where
no draft could pay (:func:`trimpass.budget.dcut.drafting_pays`), ``none`` skips every step. Every
method takes keyword arguments only (the timings are easy to swap by position). The policy runner
(:mod:`trimpass.budget.runner`) records the confidences and timings, calibrates the confidences
and calls these. A new policy is one class here and its entry in :data:`POLICIES`."""
from __future__ import annotations

import torch

from trimpass.budget.costmodel import CostTable
from trimpass.budget.dcut import dcut, draft_more, drafting_pays, next_step_pays
from trimpass.spec.config import BudgetConfig


class Policy:
    """Keep every drafted token, draft as far as the engine asks (the ``off`` policy)."""
    name = "off"
    reads_confidence = False  # whether stop() and keep() need the calibrated confidences
    prices_steps = False  # whether skip() weighs drafting against a plain step's price (which
    # plain probes then keep observed)

    def __init__(self, settings: dict):
        self.settings = settings

    def skip(self, *, batch: int, gamma: int, cost, first_s, step_s, accept_max: float) -> bool:
        """Whether this step drafts nothing, decided before the drafter runs: ``first_s`` and
        ``step_s`` the drafter's measured seconds at this batch size (None until measured),
        ``accept_max`` the largest calibrated acceptance probability of a drafted token."""
        return False

    def stop(self, *, conf, d: int, gamma: int, cost, first_s, step_s, elapsed_s):
        """``(stop drafting now, requests still drafting [B] bool or None)`` after ``d`` drafted
        tokens of at most ``gamma``: ``conf[B, d]`` calibrated confidences (None until the cost
        model and the step time are known), ``elapsed_s`` the proposal's seconds so far."""
        return False, None

    def keep(self, *, conf: torch.Tensor, cost, draft_time: float) -> torch.Tensor:
        """Drafted tokens each request sends to verification, ``[B]`` (a prefix of its draft)."""
        return torch.full((conf.shape[0],), conf.shape[1], dtype=torch.long)


class Fixed(Policy):
    """Draft ``gamma`` tokens, keep them all: the work of an engine with that draft length."""
    name = "fixed"

    def stop(self, *, conf, d, gamma, cost, first_s, step_s, elapsed_s):
        return d >= self.settings["gamma"], None


class Paused(Policy):
    """Speculation paused: no step drafts (switched on a running engine under load, say)."""
    name = "none"

    def skip(self, *, batch, gamma, cost, first_s, step_s, accept_max):
        return True


def _no_draft_pays(*, batch, gamma, cost, first_s, step_s, accept_max) -> bool:
    if cost is None or first_s is None or step_s is None or batch < 1:
        return False  # not measured at this batch size yet: draft, and measure
    return not drafting_pays(batch, cost, first_s, step_s, gamma_max=gamma, accept_max=accept_max)


class DCut(Policy):
    """D-Cut: the verification budget shared across the batch by calibrated confidence."""
    name = "dcut"
    reads_confidence = True
    prices_steps = True

    def skip(self, *, batch, gamma, cost, first_s, step_s, accept_max):
        return _no_draft_pays(batch=batch, gamma=gamma, cost=cost, first_s=first_s,
                              step_s=step_s, accept_max=accept_max)

    def stop(self, *, conf, d, gamma, cost, first_s, step_s, elapsed_s):
        if conf is None:
            return False, None
        active = draft_more(conf, cost, step_s, gamma_max=gamma, draft_time_base=first_s)
        if not bool(active.any()):
            return True, active
        conf = torch.where(active[:, None], conf, torch.zeros_like(conf))
        return not next_step_pays(conf, cost, elapsed_s, step_s), active

    def keep(self, *, conf, cost, draft_time):
        return dcut(conf, cost, draft_time=draft_time, buckets=self.settings.get("buckets"))


class AllOrNothing(Policy):
    """A step's whole draft or none of it, by D-Cut's cost model; drafts as far as asked."""
    name = "all-or-nothing"
    reads_confidence = True
    prices_steps = True

    def skip(self, *, batch, gamma, cost, first_s, step_s, accept_max):
        return _no_draft_pays(batch=batch, gamma=gamma, cost=cost, first_s=first_s,
                              step_s=step_s, accept_max=accept_max)

    def keep(self, *, conf, cost, draft_time):
        return dcut(conf, cost, draft_time=draft_time, buckets=[conf.numel()])


POLICIES = {p.name: p for p in (DCut, AllOrNothing, Fixed, Paused, Policy)}


def make(settings: dict, gamma_max: int) -> Policy:
    """The policy the checked ``settings`` name (``policy``, default ``dcut``)."""
    s = check_settings(settings, gamma_max)
    return POLICIES[s["policy"]](s)


def check_settings(settings: dict, gamma_max: int) -> dict:
    """The budget settings (a :class:`~trimpass.spec.config.BudgetConfig` as a dict, which checks
    each field), checked against the engine's draft length ``gamma_max``, and what only the budget
    can check: the cost table and D-Cut's buckets."""
    s = BudgetConfig.of(settings).for_engine(gamma_max)
    if s.get("table") is not None:
        try:
            CostTable.from_dict(s["table"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"budget table: a CostTable.to_dict() of measured seconds is "
                             f"needed: {e}") from None
    if s.get("buckets") is not None:
        dcut(torch.ones(1, 1), lambda b, t: 1.0, buckets=s["buckets"])  # dcut's own checks
    return s
