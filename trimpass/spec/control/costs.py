"""What a proposal costs an engine whose drafter runs a chain before the target's verification
pass (vLLM's draft-model route), as the controller prices it: :meth:`ChainCosts.price` gives, for
a batch and a drafting depth, the verification cost C(batch, tokens) with the step's measured
overhead (:class:`~trimpass.spec.control.costmodel.EngineCost`) and the drafting seconds. The
drafter's seconds come from whole proposals, timed by the engine with the device synchronised
(:func:`trimpass.measure.timed`), never from host clocks between unsynchronised drafting steps: a
depth-1 proposal times the first forward (``first_s``), a deeper one each later step (``step_s``,
its seconds past the first forward over its later steps). A bucket's timings are its own once it
holds :data:`TIMED_MIN` of them, before that its nearest timed bucket's, scaled by the cost
model's C(B, B), or none (then the depth is not priced: the proposal drafts, and is timed)."""
from __future__ import annotations

from trimpass.spec.control.costmodel import EngineCost
from trimpass.spec.control.timings import Timings, bucket

TIMED_MIN = 3  # proposals a bucket times before its own timings count (the first may run cold)
MIN_SAMPLES = {"first_s": TIMED_MIN, "step_s": 1}


class ChainCosts:
    """``shares_cache``: the drafter's attention uses the target's KV cache, so depth 0 runs no
    drafter forward (else depth 0 is the first forward alone, which keeps the drafter's cache in
    step)."""
    plain_probes = True  # the cost model observes plain steps: a drafting bucket skips now and then
    mixes_sources = True  # each request of a proposal sends its own source

    def __init__(self, table: dict | None = None, *, shares_cache: bool = False):
        self.timings = Timings()
        self.engine = EngineCost(self.timings.overhead, table)
        self.shares_cache = bool(shares_cache)

    def price(self, batch: int, depth: int):
        """``(cost, drafting seconds)`` of a proposal of ``depth`` steps over ``batch``
        requests, or None where the cost model or the drafter's timing is missing."""
        cost = self.engine.step_cost
        first = self.timing("first_s", batch)
        if cost is None or (first is None and (depth or not self.shares_cache)):
            return None
        if depth == 0:
            return cost, 0.0 if self.shares_cache else first
        step = self.timing("step_s", batch) if depth > 1 else 0.0
        return None if step is None else (cost, first + (depth - 1) * step)

    @staticmethod
    def reach(depth: int) -> int:
        """The positions a proposal of ``depth`` steps drafts: all of them."""
        return depth

    def verify_cost(self, batch: int):
        """C(batch, tokens) with the step's overhead, or None before the cost model exists."""
        return self.engine.step_cost

    def observe(self, batch: int, tokens: int, seconds: float) -> None:
        """One pure decode step of ``tokens`` over ``batch`` requests took ``seconds``."""
        self.engine.observe(batch, tokens, seconds)

    def timing(self, name: str, batch: int) -> float | None:
        """The drafter's ``name`` seconds at ``batch``'s bucket (see the module's note)."""
        t, least = self.timings, MIN_SAMPLES[name]
        if t.count(name, batch) >= least:
            return t.at(name, batch)
        ref, table = t.nearest(name, batch, least), self.engine.table
        if ref is None or table is None:
            return None
        k = bucket(batch)
        return t.at(name, ref) * float(table(k, k)) / float(table(ref, ref))

    def drafted(self, batch: int, depth: int, seconds: float) -> None:
        """One proposal of ``depth`` drafting steps took ``seconds`` (synchronised)."""
        if depth == 1 or (depth > 1 and self.timings.at("first_s", batch) is None):
            self.timings.record("first_s", batch, seconds / depth)
        if depth > 1:
            first = self.timings.at("first_s", batch)
            self.timings.record("step_s", batch, max(seconds - first, 0.0) / (depth - 1))

    def as_dict(self) -> dict:
        return {**self.timings.as_dict(), "cost_measurements": self.engine.measurements,
                "updates": self.engine.updates,
                "table": None if self.engine.table is None else self.engine.table.to_dict()}
