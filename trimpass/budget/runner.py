"""The policy runner: one drafter's verification budget through an engine's proposals,
engine-independent. Before a proposal :meth:`PolicyRunner.begin` says how many drafting steps to
run (the policy may skip it; a skipped one drafts anyway where
:class:`trimpass.budget.probes.Probes` prices a probe worth it, so the timings and the calibration
stay current, and a drafted one now and then skips, a plain probe, so that the cost model observes
the plain step it is priced against; a bucket's timings are its own once it has timed
:data:`TIMED_MIN` proposals, before that its nearest timed bucket's, scaled by the cost model, or
none: then it drafts, and is timed); during it :meth:`PolicyRunner.drafted` records each drafted
token's confidence (the drafter's probability of the token it drafted) and raises
:class:`StopDrafting` where the policy ends drafting (requests it stops count 0 from then on);
after it :meth:`PolicyRunner.cut` cuts the draft into per-request prefixes. With lookup drafts
(the engine's per-request proposals, passed to :meth:`PolicyRunner.begin`), each request sends the
source worth more expected tokens, and one cut prices both (:mod:`trimpass.budget.sources`); a
proposal whose lookup drafts alone reach a better rate than running the drafter too runs no
drafter at all. Confidences are
calibrated by what the target accepted of earlier drafts (:meth:`PolicyRunner.accepted`). The
timings (:class:`trimpass.budget.timings.Timings`) and the cost model
(:class:`trimpass.budget.costmodel.EngineCost`) are its parts; the engine feeds them."""
from __future__ import annotations

import collections
import time

import torch

from trimpass.budget.calibration import Calibration
from trimpass.budget.costmodel import EngineCost
from trimpass.budget.dcut import best_rate
from trimpass.budget.policies import make
from trimpass.budget.probes import Probes
from trimpass.budget.sources import DraftProfile, LookupPrice
from trimpass.budget.timings import Timings, bucket

TIMED_MIN = 3  # drafting proposals a bucket times before its own timings count (the first may
# run cold)
MIN_SAMPLES = {"first_s": TIMED_MIN, "step_s": 1}


class StopDrafting(Exception):
    """Raised inside a proposal's drafting loop to end it before the next drafter forward."""


class PolicyRunner:
    """One drafter's policy, timings, cost model, calibration and counters. ``shares_cache``:
    the drafter's attention uses the target's KV cache, so a skipped proposal runs no forward."""

    def __init__(self, settings: dict, gamma_max: int, *, shares_cache: bool = False):
        self.gamma_max = int(gamma_max)
        self.policy = make(settings, self.gamma_max)
        self.shares_cache = bool(shares_cache)
        self.timings = Timings()
        self.cost = EngineCost(self.timings.overhead, self.settings.get("table"))
        self.calibration = Calibration()
        self.counts = collections.Counter()
        self.kept = collections.Counter()  # K (drafted tokens verified in all) -> steps
        self.depth = collections.Counter()  # drafting steps run -> proposals
        self.probes = Probes(self.settings["probe"])
        self._skipped: set = set()  # requests whose last proposal was skipped
        self._resumed: set = set()  # requests whose drafts in verification follow a skip
        self._sent: dict = {}  # request id -> raw prefix scores of the drafts it sent to verify
        self._sent_lookup: dict = {}  # request id -> (match length, tokens) of its lookup draft
        self.lookup_price = LookupPrice(self.gamma_max) if self.settings["lookup"] else None
        self.profile = DraftProfile(self.gamma_max)
        self._start()

    def _start(self) -> None:
        self.conf: list[torch.Tensor] = []
        self._ids: list[torch.Tensor] = []
        self._probs: list[torch.Tensor] = []
        self._t: list[float] = [time.perf_counter()]
        self._stopped: torch.Tensor | None = None
        self._gamma_run: int | None = None
        self._timed = False
        self._lookup: list | None = None  # this proposal's lookup drafts, per request
        self._plain = False  # this proposal is a plain probe: nothing at all is verified

    @property
    def settings(self) -> dict:
        return self.policy.settings

    def set(self, settings: dict) -> None:
        """A new policy; its counters start from zero, the cost model and timings are kept."""
        self.policy = make(settings, self.gamma_max)
        self.probes = Probes(self.settings["probe"])
        if not self.settings["lookup"]:
            self.lookup_price = None
        elif self.lookup_price is None:
            self.lookup_price = LookupPrice(self.gamma_max)
        for c in (self.counts, self.kept, self.depth):
            c.clear()

    # ---- before and during a proposal ----------------------------------------------------------
    def begin(self, batch: int | None, gamma: int, tokens: int | None,
              lookup: list | None = None) -> int | None:
        """A proposal of ``batch`` requests asking for ``gamma`` drafted tokens after a target
        pass of ``tokens`` tokens, with ``lookup`` drafts (per request ``(tokens, match)`` or
        None; priced where the settings turn lookup on): the drafting steps to run (0: the first
        forward only, which keeps a drafter's own cache in step), or None (no drafter forward at
        all)."""
        self._start()
        self._gamma_run = gamma
        if self.lookup_price is not None and lookup and len(lookup) == batch and \
                any(p is not None and p[0] for p in lookup):
            self._lookup = lookup
        # a first forward over prompt tokens (a prefill in the batch) is not a drafting step's time
        self._timed = batch is None or tokens is None or tokens <= batch * (1 + self.gamma_max)
        if batch is None or not gamma:
            return gamma
        skip = self._skip(batch)
        if self._plain:
            self._lookup = None
        if not skip:
            if self._lookup is None or not self._lookup_suffices(batch):
                return gamma
            self.counts["lookup_only"] += 1
        if self.shares_cache:  # the target's pass already wrote every layer's cache
            self.counts["skipped"] += skip
            return None
        self.counts["skipped_first_forward_ran"] += 1
        self._gamma_run = 0
        return 0

    def _lookup_suffices(self, batch: int) -> bool:
        """Whether this proposal's lookup drafts alone reach at least the rate of running the
        drafter too (each request then sending the source worth more, the drafter's worth its
        recent per-position profile), both priced by one cost model and the drafter's seconds."""
        cost, prof = self.cost.step_cost, self.profile.mean
        first, step = self.timing("first_s", batch), self.timing("step_s", batch)
        if cost is None or prof is None or first is None or step is None:
            return False  # the drafter is not priced yet: it drafts, and is timed
        g = self.gamma_max
        conf = self.lookup_price.confidences(self._lookup, g)
        own = torch.cumprod(conf, dim=1).sum(dim=1) >= float(torch.cumprod(prof, 0).sum())
        mixed = torch.where(own[:, None], conf, prof[None, :].expand(batch, g))
        return best_rate(conf, cost) >= best_rate(mixed, cost, first + (g - 1) * step)

    def _skip(self, batch: int) -> bool:
        accept_max = float(self.calibration.scores(torch.ones(1, dtype=torch.float64))[0])
        first_s, step_s = self.timing("first_s", batch), self.timing("step_s", batch)
        cost = self.cost.step_cost
        skip = self.policy.skip(batch=batch, gamma=self.gamma_max, cost=cost, first_s=first_s,
                                step_s=step_s, accept_max=accept_max)
        if self.policy.name == "none":  # speculation paused: nothing to learn
            return skip
        loss = Probes.loss(batch, self.gamma_max, cost, first_s, step_s, accept_max)
        plain = None if cost is None else float(cost(batch, batch))
        hopeless = skip and Probes.hopeless(batch, self.gamma_max, cost, first_s, step_s)
        if self.probes.decide(bucket(batch), skip, loss=loss, plain_s=plain, record=accept_max,
                              hopeless=hopeless):
            self.counts["probes"] += 1
            return False
        if self.policy.prices_steps and not skip and loss is not None and \
                self.probes.plain_probe(bucket(batch)):
            self.counts["plain_probes"] += 1  # timed and priced: a plain step's cost to observe
            self._plain = True
            return True
        return skip

    def timing(self, name: str, batch: int) -> float | None:
        """The drafter's ``name`` seconds at ``batch``'s bucket: its own median once timed
        enough, else the nearest timed bucket's scaled by the cost model's C(B, B) ratio, else
        None (then no policy skips: the bucket drafts, and is timed)."""
        t, least = self.timings, MIN_SAMPLES[name]
        if t.count(name, batch) >= least:
            return t.at(name, batch)
        ref, table = t.nearest(name, batch, least), self.cost.table
        if ref is None or table is None:
            return None
        k = bucket(batch)
        return t.at(name, ref) * float(table(k, k)) / float(table(ref, ref))

    def drafted(self, ids: torch.Tensor, conf: torch.Tensor, probs: torch.Tensor | None) -> None:
        """One drafting step: each request's token, its confidence [B] and (probabilistic
        drafts) its probabilities [B, V]. Raises :class:`StopDrafting` where drafting ends."""
        self._ids.append(ids)
        if probs is not None:
            self._probs.append(probs)
        if self._stopped is not None:
            conf = torch.where(self._stopped, torch.zeros_like(conf), conf)
        self.conf.append(conf.clamp(0, 1).nan_to_num(0.0))
        self._t.append(time.perf_counter())
        d = len(self._ids)
        if d < (self._gamma_run or 0) and self._stop_after(d):
            raise StopDrafting

    def _stop_after(self, d: int) -> bool:
        B, t = self.conf[-1].shape[0], self.timings
        first, step = t.at("first_s", B), t.at("step_s", B)
        conf = None
        if self.policy.reads_confidence and self.cost.table is not None and \
                step is not None and first is not None:
            conf = self.calibration.confidences(torch.stack(self.conf, dim=1).cpu())
        stop, active = self.policy.stop(conf=conf, d=d, gamma=int(self._gamma_run),
                                        cost=self.cost.step_cost, first_s=first, step_s=step,
                                        elapsed_s=self._t[-1] - self._t[0])
        if active is not None:
            self._stopped = ~active.to(self.conf[-1].device)
        return stop

    def stopped_draft(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tokens drafted before :class:`StopDrafting` ([B, d]) and their probabilities."""
        self.counts["stopped_early"] += 1
        probs = torch.stack(self._probs, dim=1).contiguous() if self._probs else None
        return torch.stack(self._ids, dim=1), probs

    # ---- after a proposal ----------------------------------------------------------------------
    def cut(self, draft, req_ids=None):
        """Each request's kept prefix of this proposal's ``draft`` [B, d] (or of its lookup draft,
        where that is worth more expected tokens), as lists."""
        if not isinstance(draft, torch.Tensor) or draft.dim() != 2 or len(self.conf) != \
                draft.shape[1]:
            self.counts["unbudgeted"] += 1
            return draft
        B, d = draft.shape
        t, lookup = self._t, self._lookup if self._lookup is not None and \
            len(self._lookup) == B else None
        if req_ids is not None:
            self._follow_skips(req_ids, skipped=d == 0 and lookup is None)
        if d == 0 and lookup is None:
            self.depth[0] += 1
            self.kept[0] += 1
            return [[] for _ in range(B)]
        if self._timed and d:
            self.timings.record("first_s", B, t[1] - t[0])
        if d > 1:
            self.timings.record("step_s", B, (t[-1] - t[1]) / (d - 1))
        raw = torch.stack(self.conf, dim=1).cpu().double() if d else torch.zeros(B, 0).double()
        cal = self.calibration.confidences(raw) if d else raw
        if d:
            self.profile.observe(cal)
        rows, conf, use, full = draft.cpu().tolist(), cal, None, torch.full((B,), d)
        if lookup is not None:
            rows, conf, use, full = self._merge(rows, cal, lookup)
        if not self.policy.reads_confidence or self.cost.table is None or B == 0:
            n = full
        else:
            n = self.policy.keep(conf=conf, cost=self.cost.step_cost, draft_time=t[-1] - t[0])
            n = torch.minimum(n.cpu(), full)  # a bucket's padding is no draft
        lengths = n.tolist()
        kept = [row[:k] for row, k in zip(rows, lengths, strict=True)]
        if req_ids is not None:
            self._record_sent(req_ids, raw, lengths, lookup, use)
        self.kept[int(n.sum())] += 1
        self.counts["mixed"] += int(len(set(lengths)) > 1)
        self.depth[d] += 1
        self.counts["proposals"] += 1
        self.counts["drafted"] += B * d
        return kept

    def _merge(self, rows: list, cal: torch.Tensor, lookup: list):
        """Per request the source worth more expected tokens (the sum of its prefix scores):
        the merged rows, their confidences [B, W], which rows are lookup drafts [B] bool and
        each row's draft length [B]."""
        B, d = cal.shape
        width = max(d, max((len(p[0]) for p in lookup if p is not None), default=0))
        own = torch.zeros(B, width, dtype=torch.float64)
        own[:, :d] = cal
        theirs = self.lookup_price.confidences(lookup, width)
        use = torch.cumprod(theirs, 1).sum(1) > torch.cumprod(own, 1).sum(1)
        conf = torch.where(use[:, None], theirs, own)
        merged = [(list(lookup[i][0]) if u else rows[i]) + [0] * width
                  for i, u in enumerate(use.tolist())]
        merged = [row[:width] for row in merged]
        full = torch.tensor([len(lookup[i][0]) if u else d for i, u in enumerate(use.tolist())],
                            dtype=torch.long)
        self.counts["lookup_rows"] += int(use.sum())
        return merged, conf, use, full

    def _record_sent(self, req_ids, raw, lengths, lookup, use) -> None:
        scores = torch.cumprod(raw, dim=1).tolist()
        use = [False] * len(lengths) if use is None else use.tolist()
        self._sent, self._sent_lookup = {}, {}
        for i, (rid, k) in enumerate(zip(req_ids, lengths, strict=False)):
            if not k:
                continue
            if use[i]:
                self._sent_lookup[rid] = (lookup[i][1], k)
                self.counts["lookup_sent"] += k
            else:
                self._sent[rid] = scores[i][:k]

    def _follow_skips(self, req_ids, skipped: bool) -> None:
        if skipped:
            self._skipped, self._resumed = set(req_ids), set()
        else:
            self._resumed, self._skipped = self._skipped & set(req_ids), set()

    def accepted(self, req_ids, emitted: list[int]) -> None:
        """What the target accepted of the drafts sent last step: ``emitted[i]`` tokens request
        ``req_ids[i]`` emitted this step (its accepted drafts and one more)."""
        if not self._sent and not self._sent_lookup:
            return
        for rid, v in zip(req_ids, emitted, strict=False):
            scores, looked = self._sent.pop(rid, None), self._sent_lookup.pop(rid, None)
            if looked and v > 0:
                got = min(v - 1, looked[1])
                self.lookup_price.observe(looked[0], looked[1], got)
                self.counts["lookup_accepted"] += got
                self.counts["accepted"] += got
            if scores and v > 0:
                self.calibration.observe(scores, v - 1)
                got = min(v - 1, len(scores))
                self.counts["accepted"] += got
                if rid in self._resumed:  # the first drafts after a skipped proposal
                    self.counts["resumed_sent"] += len(scores)
                    self.counts["resumed_accepted"] += got
        self._sent.clear()
        self._sent_lookup.clear()

    def observed(self, scheduled: dict, drafts: dict, tokens: int, seconds: float) -> None:
        """One engine step: ``scheduled`` request -> tokens, ``drafts`` request -> drafted
        tokens verified, ``tokens`` in all, its forward's ``seconds``; a pure decode step (every
        request: 1 + its drafts) refines the cost model."""
        lengths = [int(v) for v in drafts.values()]
        self.counts["verified"] += sum(lengths)
        self.counts["verified_mixed"] += int(len(set(lengths)) > 1)
        self.counts["verified_max"] = max(self.counts["verified_max"], max(lengths, default=0))
        if scheduled and all(n == 1 + drafts.get(r, 0) for r, n in scheduled.items()):
            self.cost.observe(len(scheduled), int(tokens), seconds)
            if not any(lengths):
                self.probes.plain_observed(bucket(len(scheduled)))

    def stats(self) -> dict:
        return {"policy": self.policy.name, "gamma": self.settings.get("gamma"),
                "shares_cache": self.shares_cache, **self.timings.as_dict(),
                **dict(self.counts), "probe_rates": self.probes.rates(),
                "cost_measurements": self.cost.measurements,
                "updates": self.cost.updates, "kept": dict(self.kept),
                "depth": dict(self.depth),
                "lookup": None if self.lookup_price is None else self.lookup_price.as_dict(),
                "table": None if self.cost.table is None else self.cost.table.to_dict()}
