"""When a batch bucket that skips its proposals drafts anyway (a probe), engine-independent. A
probe keeps the drafter's timings and the acceptance calibration current, and costs its expected
loss: the drafting seconds plus the extra verification seconds, less the plain-step seconds its
accepted tokens could save (:meth:`Probes.loss`). :class:`Probes` spends at most ``rate`` of the
plain-step seconds a bucket saves by skipping on that loss: a probe is due when the skipped steps'
seconds since the bucket's last probe reach ``loss / rate``. Each probe after which the bucket
still skips halves its rate (down to :data:`FLOOR` of the setting), since skipping keeps paying;
the rate returns to the setting, and a probe is due at once, when the acceptance record has moved
by :data:`RECORD_STEP` since the bucket's last probe, or when the batch enters the bucket from
another one after more than :data:`REENTRY` proposals elsewhere; but not where the bucket is
hopeless (:meth:`Probes.hopeless`: drafting loses at every draft length even with every drafted
token accepted), since then no acceptance record can change the decision, and an early probe
would only pay its loss (on the AVX-512 VM about 1.2 s at 64 requests, against a 21 s run); the
scheduled probes still keep its timings current.

The other way round, a bucket that drafts skips one proposal now and then (a plain probe), so that
the cost model sees what a plain step costs at that batch size: a start-up measurement that prices
the plain step too high would keep the bucket drafting where plain steps pay better, and only a
plain step observed in the engine corrects it. A plain probe costs at most one step's gain from
speculation; it is due after :data:`PLAIN_EVERY` drafted proposals without a plain step while the
bucket has observed fewer than :data:`PLAIN_SEEN` plain steps, then after twice as many each time,
up to :data:`PLAIN_MAX`."""
from __future__ import annotations

import collections
import dataclasses

FLOOR = 1 / 64  # the lowest rate, as a share of the setting
RECORD_STEP = 0.05  # a move of the acceptance record (its largest calibrated value) that re-probes
REENTRY = 16  # proposals away from a bucket after which coming back to it probes at once
PLAIN_EVERY = 4  # drafted proposals before a plain probe while the plain step is little observed
PLAIN_SEEN = 5  # plain steps a bucket observes before its plain probes back off (1 / the cost
# table's alpha: a cell's evidence when the engine's own steps outweigh its start-up measurement)
PLAIN_MAX = 256  # the most drafted proposals between two plain steps of a bucket


@dataclasses.dataclass
class _Bucket:
    rate: float
    saved_s: float = 0.0  # plain-step seconds skipped since the last probe (or drafted proposal)
    record: float | None = None  # the acceptance record at the last probe
    seen: int = 0  # the proposal count when the batch was last in this bucket


class Probes:
    """Per batch bucket: whether a proposal the policy skips drafts anyway."""

    def __init__(self, rate: float):
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate <= 1:
            raise ValueError(f"budget probe: the share of skipped seconds probes may spend, in "
                             f"(0, 1], got {rate!r}")
        self.base = float(rate)
        self._buckets: dict = {}
        self._proposals = 0
        self._last_bucket = None
        self.reentries = collections.Counter()  # bucket -> probes at a re-entry
        self._drafted = collections.Counter()  # bucket -> drafted proposals since a plain step
        self._plain_seen = collections.Counter()  # bucket -> plain steps observed

    @staticmethod
    def loss(batch: int, gamma: int, cost, draft_s: float | None,
             accept_max: float) -> float | None:
        """A probe's expected loss in seconds at ``batch`` requests drafting ``gamma`` tokens
        each: drafting (``draft_s``) and verifying B (1 + gamma) tokens instead of B, less the
        plain-step seconds of the drafted tokens it may accept (at most ``accept_max`` each).
        None where the drafting seconds or the cost model are missing."""
        if cost is None or draft_s is None or batch < 1:
            return None
        B, K = int(batch), int(batch) * int(gamma)
        plain = float(cost(B, B))
        extra = float(cost(B, B + K)) - plain
        gain = K * float(accept_max) * plain / B
        return max(draft_s + extra - gain, 0.0)

    @staticmethod
    def hopeless(batch: int, gamma_max: int, cost, draft_s) -> bool:
        """Whether drafting at ``batch`` requests loses at every draft length up to
        ``gamma_max`` even with every drafted token accepted (``draft_s(depth)``: the drafting
        seconds; False where one is missing or the cost model is)."""
        return all((x := Probes.loss(batch, g, cost, draft_s(g), 1.0)) is not None
                   and x > 0 for g in range(1, int(gamma_max) + 1))

    def decide(self, k: int, skip: bool, *, loss: float | None, plain_s: float | None,
               record: float, hopeless: bool = False) -> bool:
        """One proposal at batch bucket ``k``: whether it drafts a probe, given that the policy
        would ``skip`` it (a proposal it drafts resets the bucket), the probe's ``loss`` and a
        plain step's seconds ``plain_s`` at this bucket (None: unknown, a probe then costs one
        plain step), the acceptance record now, and whether the bucket is :meth:`hopeless`
        (then only the schedule probes it)."""
        self._proposals += 1
        entered, self._last_bucket = self._last_bucket != k, k
        b = self._buckets.setdefault(k, _Bucket(self.base, record=record, seen=self._proposals))
        stale, b.seen = entered and self._proposals - b.seen > REENTRY, self._proposals
        if not skip:
            b.rate, b.saved_s, b.record = self.base, 0.0, record
            return False
        plain = plain_s if plain_s and plain_s > 0 else 1.0
        moved = not hopeless and (b.record is None or abs(record - b.record) >= RECORD_STEP)
        stale = stale and not hopeless
        price = loss if loss is not None and loss > 0 else plain
        if not (moved or stale or b.saved_s >= price / b.rate):
            b.saved_s += plain
            return False
        # a probe: a moved record or a re-entry starts over; a scheduled one backs off
        self.reentries[k] += stale and not moved
        b.rate = self.base if moved or stale else max(b.rate / 2, self.base * FLOOR)
        b.saved_s, b.record = 0.0, record
        return True

    def plain_probe(self, k: int) -> bool:
        """One proposal at batch bucket ``k`` that the policy drafts (and :meth:`decide` did not
        change): whether it skips instead, a plain probe."""
        self._drafted[k] += 1
        doublings = min(max(self._plain_seen[k] - PLAIN_SEEN + 1, 0), PLAIN_MAX.bit_length())
        if self._drafted[k] < min(PLAIN_EVERY << doublings, PLAIN_MAX):
            return False
        self._drafted[k] = 0
        return True

    def plain_observed(self, k: int) -> None:
        """The engine observed a plain step (no drafted token) at batch bucket ``k``."""
        self._drafted[k] = 0
        self._plain_seen[k] += 1

    def rates(self) -> dict:
        """Batch bucket (or an engine's own key) -> its current probe rate."""
        return {k: b.rate for k, b in sorted(self._buckets.items(), key=lambda kb: str(kb[0]))}
