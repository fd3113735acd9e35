"""The budget policies as objects, independent of the serving engine. Before a proposal a policy
names the drafting depths it may run (:meth:`Policy.depths`; the controller prices each and runs
the best, or drafts nothing); after it, how many drafted tokens each request sends to verification
(:meth:`Policy.keep`). ``dcut`` (D-Cut: any depth, and the cut that maximizes expected emitted
tokens per second), ``all-or-nothing`` (a step's whole draft or none of it, by the same cost model),
``fixed`` (draft ``gamma`` tokens, keep them all), ``none`` (speculation paused: nothing drafted),
``off`` (the engine's own behaviour). The controller (:mod:`trimpass.spec.control.controller`)
prices, calibrates and calls these. A new policy is one class here and its entry in
:data:`POLICIES`."""
from __future__ import annotations

import torch

from trimpass.spec.config import BudgetConfig
from trimpass.spec.control.costmodel import CostTable
from trimpass.spec.control.dcut import dcut


class Policy:
    """Keep every drafted token, draft as far as the engine asks (the ``off`` policy)."""
    name = "off"
    reads_confidence = False  # whether keep() needs the calibrated confidences
    prices_steps = False  # whether the controller prices each depth (and plain steps) before
    # drafting, with the schedule's probes keeping the prices observed

    def __init__(self, settings: dict):
        self.settings = settings

    def depths(self, gamma: int) -> tuple:
        """The drafting depths a proposal asking for ``gamma`` tokens may run, decided before the
        drafter runs (an empty tuple: it drafts nothing)."""
        return (gamma,)

    def keep(self, *, conf: torch.Tensor, cost, draft_time: float) -> torch.Tensor:
        """Drafted tokens each request sends to verification, ``[B]`` (a prefix of its draft)."""
        return torch.full((conf.shape[0],), conf.shape[1], dtype=torch.long)


class Fixed(Policy):
    """Draft ``gamma`` tokens, keep them all: the work of an engine with that draft length."""
    name = "fixed"

    def depths(self, gamma):
        return (min(int(self.settings["gamma"]), gamma),)


class Paused(Policy):
    """Speculation paused: no step drafts (switched on a running engine under load, say)."""
    name = "none"

    def depths(self, gamma):
        return ()


class DCut(Policy):
    """D-Cut: the depth of best expected rate, and the verification budget shared across the
    batch by calibrated confidence."""
    name = "dcut"
    reads_confidence = True
    prices_steps = True

    def depths(self, gamma):
        return tuple(range(gamma + 1))

    def keep(self, *, conf, cost, draft_time):
        return dcut(conf, cost, draft_time=draft_time, buckets=self.settings.get("buckets"))


class AllOrNothing(Policy):
    """A step's whole draft or none of it, by D-Cut's cost model."""
    name = "all-or-nothing"
    reads_confidence = True
    prices_steps = True

    def depths(self, gamma):
        return (0, gamma)

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
