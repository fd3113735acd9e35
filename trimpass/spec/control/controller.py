"""The controller: one drafter's verification budget, engine-neutral, and the one place a step's
drafting is decided. Before any drafting, :meth:`Controller.plan` prices every depth the policy
allows (each request sending the source worth more expected tokens: its free draft, lookup's or
the suffix index's, whichever its own record prices higher (``prices.choose``), priced by match
length and position, or the drafter's, priced by position; :mod:`.prices`) with the engine's
costs (:meth:`price`: the verification cost model and the drafting seconds, e.g.
:class:`~trimpass.spec.control.costs.ChainCosts`) and picks the depth of best expected rate; depth
0 with no free draft worth sending drafts nothing; a free source the settings turn off is never
priced (:func:`free_on`). The schedule (:mod:`.schedule`) turns a
skipped proposal into a probe now and then, and a drafted one into a plain step, so that every
price stays observed. After drafting, :meth:`Controller.cut` reads the drafted ids and their
confidences once, calibrates the confidences (:mod:`.calibration`), merges each request's sources
and cuts the batch's drafts by the policy (D-Cut). :meth:`Controller.observe` learns from what the
target emitted: each offered draft, sent or not, against the target's own tokens (the price
records and the calibration); :meth:`Controller.observe_step` gives the cost model each engine
step's measured seconds."""
from __future__ import annotations

import collections
from dataclasses import dataclass

import torch

from trimpass.spec.control.calibration import Calibration
from trimpass.spec.control.dcut import best_rate, tabled
from trimpass.spec.control.policies import make
from trimpass.spec.control.prices import Sources, agreement
from trimpass.spec.control.schedule import Probes
from trimpass.spec.control.timings import bucket
from trimpass.spec.drafts import Drafts


def merge(rows: list, cal: torch.Tensor, lookup: Drafts, theirs: torch.Tensor):
    """Per request the source worth more expected tokens (the sum of its prefix scores): the
    drafter's ``rows`` with confidences ``cal`` [B, d], or its ``lookup`` draft priced ``theirs``;
    returns the rows, their confidences, their lengths and which are lookup drafts."""
    B, d = cal.shape
    conf = torch.zeros(B, max(d, theirs.shape[1]), dtype=torch.float64)
    conf[:, :d] = cal
    better = torch.cumprod(theirs, 1).sum(1) > torch.cumprod(conf, 1).sum(1)
    use = [bool(b) and c > 0 for b, c in zip(better.tolist(), lookup.counts, strict=True)]
    rows, full = list(rows), [d] * B
    for i in (i for i in range(B) if use[i]):
        rows[i], full[i], conf[i] = lookup.row(i), lookup.counts[i], theirs[i]
    return rows, conf, full, use


def takes_free(settings: dict) -> bool:
    """Whether the settings price free drafts (lookup, the suffix index) at all."""
    return bool(settings["lookup"] or settings.get("suffix"))


def free_on(settings: dict, drafts: Drafts | None) -> Drafts | None:
    """Of free drafts, the rows whose source the settings turn on (None where no row drafts)."""
    if drafts is None:
        return None
    rows = [drafts.row(i) if settings.get(s) else [] for i, s in enumerate(drafts.source)]
    if not any(rows):
        return None
    if all(bool(r) == bool(c) for r, c in zip(rows, drafts.counts, strict=True)):
        return drafts
    return Drafts.of(rows, list(drafts.source), list(drafts.match))


def _nothing(batch: int, shares_cache: bool) -> Plan:
    """Draft nothing: no drafter forward on a shared cache, else the first forward alone."""
    return Plan(None if shares_cache else 0, (False,) * batch)


@dataclass(frozen=True)
class Plan:
    """A proposal's decision, taken before drafting: ``depth`` drafting steps (None: no drafter
    forward at all), which requests may send their ``lookup`` draft, and whether this is a
    ``probe`` (a skipped bucket drafting anyway) or a ``plain`` probe (a drafting bucket not)."""
    depth: int | None
    lookup: tuple = ()
    probe: str = ""

    @property
    def drafts_nothing(self) -> bool:
        return not self.depth and not any(self.lookup)


class Controller:
    """One drafter's policy, price records, calibration, schedule and counters over an engine's
    ``costs`` (``price(batch, depth) -> (cost, drafting seconds) | None``; ``shares_cache``:
    depth 0 runs no drafter forward)."""

    def __init__(self, settings: dict, gamma_max: int, costs):
        self.gamma_max, self.costs = int(gamma_max), costs
        self.policy = make(settings, self.gamma_max)
        self.calibration = Calibration()
        self.prices = Sources(self.gamma_max)
        self.schedule = Probes(self.settings["probe"])
        self.counts, self.kept, self.depth = (collections.Counter() for _ in range(3))
        self._offered: dict = {}  # request id -> [(source, match, ids, raw scores, sent)]
        self._fresh: set = set()  # sources whose record started over since their last plan

    @property
    def settings(self) -> dict:
        return self.policy.settings


    def set(self, settings: dict) -> None:
        """A new policy; its counters start from zero, the records, costs and calibration stay."""
        self.policy = make(settings, self.gamma_max)
        self.schedule = Probes(self.settings["probe"])
        for c in (self.counts, self.kept, self.depth):
            c.clear()

    # ---- before drafting -------------------------------------------------------------------
    def plan(self, batch: int, gamma: int, lookup: Drafts | None = None, *,
             depths=None) -> Plan:
        """The decision for a proposal of ``batch`` requests asking for up to ``gamma`` tokens,
        with each request's ``lookup`` draft (priced where the settings turn lookup on), over the
        policy's depths (of ``depths`` only, where the engine can run no others)."""
        lookup = free_on(self.settings, lookup) if lookup is not None and \
            len(lookup) == batch else None
        depths = [d for d in self.policy.depths(gamma)
                  if d <= gamma and (depths is None or d in depths)]
        if not batch or not gamma or not depths:
            self.counts["skipped"] += bool(batch and gamma)
            return _nothing(batch, self.costs.shares_cache)
        if not self.policy.prices_steps:
            return Plan(depths[-1], (False,) * batch)
        tables: dict = {}  # each cost read once for this batch, whatever the depth
        rates = [self._rate(batch, d, lookup, tables) for d in depths]
        if any(r is None for r in rates):  # not priced yet: draft as deep as asked, and be timed
            return Plan(depths[-1], (False,) * batch if lookup is None else
                        tuple(c > 0 for c in lookup.counts))
        best = max(range(len(depths)), key=lambda i: rates[i][0])  # first of equal: shallowest
        return self._scheduled(batch, depths[-1], Plan(depths[best], rates[best][1]), lookup)

    def _rate(self, batch: int, depth: int, lookup: Drafts | None, tables: dict):
        """``(expected tokens per second, lookup use per request)`` at ``depth``, or None."""
        priced = self.costs.price(batch, depth)
        if priced is None:
            return None
        cost, draft_s = priced
        if id(cost) not in tables:  # the cost kept beside its table: its id stays its own
            tables[id(cost)] = (cost, tabled(cost, batch, batch * self.gamma_max))
        cost = tables[id(cost)][1]
        own = torch.zeros(batch, max(depth, 1), dtype=torch.float64)
        reach = self.costs.reach(depth)
        own[:, :reach] = self.prices["self"].row()[:reach]
        if lookup is None:
            return best_rate(own, cost, draft_s), (False,) * batch
        _, conf, _, use = merge([[]] * batch, own, lookup, self.prices.priced(lookup))
        return best_rate(conf, cost, draft_s), tuple(use)

    def _scheduled(self, batch: int, deepest: int, plan: Plan, lookup=None) -> Plan:
        """The plan, or a probe the schedule makes of it."""
        k, accept = bucket(batch), float(self.prices["self"].row()[0])
        priced = self.costs.price(batch, deepest)
        cost, draft_s = priced if priced is not None else (None, None)
        skip = not plan.depth  # the drafter does not draft (lookup drafts may go alone)
        loss = Probes.loss(batch, deepest, cost, draft_s, accept)
        plain = None if cost is None else float(cost(batch, batch))
        hopeless = skip and Probes.hopeless(batch, deepest, cost, lambda d: (
            self.costs.price(batch, d) or (None, None))[1])
        if self.schedule.decide(k, skip, loss=loss, plain_s=plain, record=accept,
                                hopeless=hopeless):
            self.counts["probes"] += 1
            return Plan(deepest, plan.lookup, "probe")
        if not skip and lookup is not None and not self.costs.mixes_sources:
            return self._lookup_probe(k, plan, lookup)
        if lookup is not None:
            self._fresh -= set(lookup.source)
        if not skip and loss is not None and self.costs.plain_probes and \
                self.schedule.plain_probe(k):
            self.counts["plain_probes"] += 1  # a plain step's cost, for the cost model to see
            skipped = _nothing(batch, self.costs.shares_cache)
            return Plan(skipped.depth, skipped.lookup, "plain")
        if plan.drafts_nothing:
            self.counts["skipped"] += 1
            return _nothing(batch, self.costs.shares_cache)
        if plan.depth:
            return plan
        self.counts["lookup_only"] += 1  # the drafter drafts nothing: no forward on a shared cache
        return Plan(None if self.costs.shares_cache else 0, plan.lookup)

    def _lookup_probe(self, k: int, plan: Plan, lookup: Drafts) -> Plan:
        """Lookup drafts passed over run anyway now and then, so that their round stays timed."""
        i = max(range(len(lookup)), key=lambda j: lookup.match[j])
        source = lookup.source[i]
        record = float(self.prices[source].row(lookup.match[i])[0])
        fresh = source in self._fresh  # its record just started over: its first match probes
        self._fresh.discard(source)
        if not self.schedule.decide((source, k), True, loss=None, plain_s=None,
                                    record=record) and not fresh:
            return plan
        self.counts["lookup_probes"] += 1
        return Plan(0, tuple(c > 0 for c in lookup.counts), "probe")

    # ---- after drafting --------------------------------------------------------------------
    def cut(self, plan: Plan, req_ids, draft=None, conf=None, *, lookup: Drafts | None = None,
            seconds: float = 0.0) -> list[list[int]]:
        """Each request's drafts to verify: of the drafter's ``draft`` [B, d] (its ``conf`` [B,
        d], raw, read here once) and of the ``lookup`` drafts the plan allows, the source worth
        more expected tokens, cut by the policy; ``seconds``: the drafting's."""
        B = len(req_ids)
        lookup = free_on(self.settings, lookup)
        ids = [[] for _ in range(B)] if draft is None else draft.tolist()
        d = len(ids[0]) if ids else 0
        raw = torch.zeros(B, d, dtype=torch.float64) if conf is None or not d else \
            conf.detach().to("cpu", torch.float64).clamp(0, 1).nan_to_num(0.0)
        cal = self.calibration.confidences(raw)
        rows, conf_rows, full, use = list(ids), cal, [d] * B, [False] * B
        if lookup is not None and len(lookup) == B and any(plan.lookup):
            rows, conf_rows, full, use = merge(rows, cal, lookup, self.prices.priced(lookup))
        n = torch.tensor(full, dtype=torch.long)
        cost = self.costs.verify_cost(B)
        if self.policy.reads_confidence and cost is not None and B and conf_rows.shape[1]:
            n = torch.minimum(self.policy.keep(conf=conf_rows, cost=cost, draft_time=seconds), n)
        kept = [row[:k] for row, k in zip(rows, n.tolist(), strict=True)]
        self._offer(req_ids, ids, raw, lookup, use, kept)
        self.kept[int(n.sum())] += 1
        self.depth[d] += 1
        self.counts["lookup_rows"] += sum(use)
        self.counts["proposals"] += bool(d)  # proposals the drafter drafted for
        self.counts["drafted"] += B * d
        return kept

    def _offer(self, req_ids, ids, raw, lookup, use, kept) -> None:
        scores, self._offered = torch.cumprod(raw, dim=1).tolist(), {}
        for i, rid in enumerate(req_ids):
            if ids[i]:
                self.offer(rid, "self", ids[i], 0 if use[i] else len(kept[i]), scores=scores[i])
            if lookup is not None and lookup.counts[i]:
                self.offer(rid, lookup.source[i], lookup.row(i), len(kept[i]) if use[i] else 0,
                           match=lookup.match[i])

    def offer(self, rid, source: str, ids, sent: int, *, match: int = 0, scores=None) -> None:
        """Request ``rid`` was offered ``ids`` by ``source`` this step, ``sent`` of them sent to
        verification (``scores``: their raw prefix scores, for the calibration); the next
        :meth:`observe` prices them against what the target emitted."""
        self._offered.setdefault(rid, []).append((source, match, list(ids), scores, int(sent)))

    def forget(self, *sources: str) -> None:
        """Start the price records of ``sources`` over (lookup's, at a new text whose repeats are
        its own): where the next plan with such a draft passes it over, it runs as a probe; the
        other records, the costs and the calibration stay."""
        self._fresh |= set(sources)
        self.prices.forget(*sources)
        self._offered.clear()

    def observe(self, req_ids, emitted: list[list[int]]) -> None:
        """Every draft offered last step priced against what its request emitted this step."""
        for rid, out in zip(req_ids, emitted, strict=False):
            for source, match, ids, scores, sent in self._offered.pop(rid, ()):
                if not out:
                    continue
                kept, reached = agreement(ids, out)
                self.prices[source].observe(match, kept, reached)
                if scores is not None:
                    self.calibration.observe(scores[:reached], kept)
                if sent:
                    got = min(len(out) - 1, sent)
                    self.counts["accepted"] += got
                    self.counts[f"{source}_accepted"] += got
                    self.counts[f"{source}_sent"] += sent
        self._offered.clear()

    def observe_step(self, scheduled: dict, drafts: dict, tokens: int, seconds: float) -> None:
        """One engine step: ``scheduled`` request -> tokens, ``drafts`` request -> drafted
        tokens verified, ``tokens`` in all, its forward's ``seconds``; a pure decode step (every
        request: 1 + its drafts) refines the cost model."""
        lengths = [int(v) for v in drafts.values()]
        self.counts["verified"] += sum(lengths)
        self.counts["verified_mixed"] += int(len(set(lengths)) > 1)
        self.counts["verified_max"] = max(self.counts["verified_max"], max(lengths, default=0))
        if scheduled and all(n == 1 + drafts.get(r, 0) for r, n in scheduled.items()):
            self.costs.observe(len(scheduled), int(tokens), seconds)
            if not any(lengths):
                self.schedule.plain_observed(bucket(len(scheduled)))

    def stats(self) -> dict:
        return {"policy": self.policy.name, "gamma": self.settings.get("gamma"),
                "shares_cache": self.costs.shares_cache, **self.costs.as_dict(),
                **dict(self.counts), "probe_rates": self.schedule.rates(),
                "kept": dict(self.kept), "depth": dict(self.depth),
                **{f"{k}_price": r.as_dict() for k, r in self.prices.items()}}
