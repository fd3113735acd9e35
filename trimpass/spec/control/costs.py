"""What a proposal costs an engine whose drafter runs a chain before the target's verification
pass (vLLM's draft-model route), as the controller prices it: :meth:`ChainCosts.price` gives, for
a batch and a drafting depth, the verification cost C(batch, tokens) with the step's measured
overhead (:class:`~trimpass.spec.control.costmodel.EngineCost`) and the drafting seconds. The
drafter's seconds come from whole proposals, timed by the engine with the device synchronised
(:func:`trimpass.measure.timed`), never from host clocks between unsynchronised drafting steps: per
batch bucket and depth, the median of the last :data:`~trimpass.spec.control.timings.WINDOW`. A
depth not timed at a bucket is read off the depths that were: a line through them (the first
forward and each later step), or, with one depth timed, in proportion to it. A bucket's timings
count once it holds :data:`TIMED_MIN` of a depth; before that its nearest timed bucket's, scaled by
the cost model's C(B, B), or none (then the depth is not priced: the proposal drafts, and is
timed)."""
from __future__ import annotations

import collections

import numpy as np

from trimpass.spec.control.costmodel import EngineCost
from trimpass.spec.control.timings import WINDOW, Timings, bucket, nearest

TIMED_MIN = 3  # proposals of a depth a bucket times before they count (the first may run cold)


class ChainCosts:
    """``shares_cache``: the drafter's attention uses the target's KV cache, so depth 0 runs no
    drafter forward (else depth 0 is the first forward alone, which keeps the drafter's cache in
    step)."""
    plain_probes = True  # the cost model observes plain steps: a drafting bucket skips now and then
    mixes_sources = True  # each request of a proposal sends its own source

    def __init__(self, table: dict | None = None, *, shares_cache: bool = False):
        self.timings = Timings()
        self.engine = EngineCost(self.timings.overhead, table)
        self._drafting: dict = {}  # (bucket, depth) -> the last WINDOW proposals' seconds
        self._lines: dict = {}  # bucket -> its timed depths' medians and their line (a cache)
        self._cost = None  # (the table, its StepCost)
        self.shares_cache = bool(shares_cache)

    def price(self, batch: int, depth: int):
        """``(cost, drafting seconds)`` of a proposal of ``depth`` steps over ``batch``
        requests, or None where the cost model or the drafter's timing is missing."""
        cost = self.verify_cost(batch)
        if cost is None:
            return None
        if depth == 0 and self.shares_cache:
            return cost, 0.0
        seconds = self.draft_s(batch, max(depth, 1))  # depth 0: the first forward alone
        return None if seconds is None else (cost, seconds)

    @staticmethod
    def reach(depth: int) -> int:
        """The positions a proposal of ``depth`` steps drafts: all of them."""
        return depth

    def verify_cost(self, batch: int):
        """C(batch, tokens) with the step's overhead, or None before the cost model exists (one
        object per table: it reads the table and the overheads as they are when called)."""
        table = self.engine.table
        if table is None:
            return None
        if self._cost is None or self._cost[0] is not table:
            self._cost = (table, self.engine.step_cost)
        return self._cost[1]

    def observe(self, batch: int, tokens: int, seconds: float) -> None:
        """One pure decode step of ``tokens`` over ``batch`` requests took ``seconds``."""
        self.engine.observe(batch, tokens, seconds)

    def draft_s(self, batch: int, depth: int) -> float | None:
        """The drafter's seconds for ``depth`` steps at ``batch``'s bucket (the module's note)."""
        k = bucket(batch)
        if self._timed(k):
            return self._fit(k, depth)
        ref, table = nearest([b for b in {b for b, _ in self._drafting} if self._timed(b)],
                             batch), self.engine.table
        if ref is None or table is None:
            return None
        return self._fit(ref, depth) * float(table(k, k)) / float(table(ref, ref))

    def _timed(self, k: int) -> bool:
        return bool(self._line(k)[0])

    def _line(self, k: int) -> tuple:
        """Bucket ``k``'s timed depths -> median seconds, and the line through them (slope,
        first), computed once per new timing: the controller reads them several times a step."""
        if k not in self._lines:
            got = {d: float(np.median(s)) for (b, d), s in self._drafting.items()
                   if b == k and len(s) >= TIMED_MIN}
            line = tuple(np.polyfit(list(got), list(got.values()), 1)) if len(got) > 1 else None
            self._lines[k] = (got, line)
        return self._lines[k]

    def _fit(self, k: int, depth: int) -> float:
        got, line = self._line(k)
        if depth in got:
            return got[depth]
        if line is None:
            (d, s), = got.items()
            return s * depth / d
        slope, first = line
        return max(float(first + slope * depth), 0.0)

    def drafted(self, batch: int, depth: int, seconds: float) -> None:
        """One proposal of ``depth`` drafting steps took ``seconds`` (synchronised)."""
        key = (bucket(batch), int(depth))
        self._drafting.setdefault(key, collections.deque(maxlen=WINDOW)).append(float(seconds))
        self._lines.pop(key[0], None)

    def as_dict(self) -> dict:
        buckets = sorted({b for b, _ in self._drafting if self._timed(b)})
        first = {b: self._fit(b, 1) for b in buckets}
        return {**self.timings.as_dict(), "first_s": first,
                "step_s": {b: self._fit(b, 2) - first[b] for b in buckets},
                "draft_s": {f"{b}x{d}": float(np.median(s)) for (b, d), s in
                            sorted(self._drafting.items())},
                "cost_measurements": self.engine.measurements,
                "updates": self.engine.updates,
                "table": None if self.engine.table is None else self.engine.table.to_dict()}
