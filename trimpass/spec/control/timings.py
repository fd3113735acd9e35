"""An engine's step overhead as the controller prices it, engine-independent: per power-of-two batch
bucket, the median of the last :data:`WINDOW` seconds of a step's overhead outside the target's
forward and the drafter (``overhead_s`` for a step that verified drafts, ``overhead_plain_s`` for
one that verified none: the gap from one forward's end to the next one's start, less the
drafter's seconds in it). A median, so a cold first call or an idle engine's gap does not stick."""
from __future__ import annotations

import collections

import numpy as np

WINDOW = 15  # the timings whose median is a bucket's
NAMES = ("overhead_s", "overhead_plain_s")


def bucket(batch: int) -> int:
    """The power of two at or above ``batch``: timings are kept per bucket."""
    return 1 << max(int(batch) - 1, 0).bit_length()


def nearest(buckets, batch: int) -> int | None:
    """Of ``buckets``, the one nearest ``batch``'s bucket (the smaller on a tie), or None."""
    n = bucket(batch).bit_length()
    return min(buckets, key=lambda k: (abs(k.bit_length() - n), k), default=None)


class Timings:
    """Bucket -> median seconds for each of :data:`NAMES` (attributes of the same names)."""

    def __init__(self):
        self.overhead_s: dict = {}
        self.overhead_plain_s: dict = {}
        self._samples: dict = {}  # (name, bucket) -> the last WINDOW seconds
        self._ended: tuple | None = None  # (when the last forward ended, its bucket, its kind)
        self._drafting_s = 0.0  # the drafter's seconds since then

    def record(self, name: str, batch: int, seconds: float) -> None:
        k = bucket(batch)
        s = self._samples.setdefault((name, k), collections.deque(maxlen=WINDOW))
        s.append(seconds)
        getattr(self, name)[k] = float(np.median(s))

    def overhead(self, batch: int, drafted: bool) -> float:
        """The overhead of a step of this kind at ``batch``'s bucket, or at the nearest bucket
        measured (of the other kind where this one has none; 0 before any)."""
        mine, other = (self.overhead_s, self.overhead_plain_s)[::1 if drafted else -1]
        got = mine or other
        return got[nearest(got, batch)] if got else 0.0

    def drafting(self, seconds: float) -> None:
        """The drafter ran ``seconds`` between two target forwards."""
        self._drafting_s += seconds

    def forward_began(self, now: float) -> None:
        """The target's forward starts at ``now``: the seconds since the last one ended, less the
        drafter's, are the last step's overhead."""
        if self._ended is not None:
            end, k, drafted = self._ended
            self.record("overhead_s" if drafted else "overhead_plain_s", k,
                        max(now - end - self._drafting_s, 0.0))
        self._ended, self._drafting_s = None, 0.0

    def forward_ended(self, now: float, batch: int, drafted: bool) -> None:
        """The target's forward of ``batch`` requests ended at ``now``; ``drafted``: whether it
        verified drafted tokens."""
        if batch > 0:
            self._ended = (now, bucket(batch), bool(drafted))

    def as_dict(self) -> dict:
        return {n: dict(getattr(self, n)) for n in NAMES}
