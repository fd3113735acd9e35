"""What a round of the fused loop (:mod:`trimpass.hf.fused`) costs, as the speculation core's
controller prices it (:meth:`RoundCosts.price`). A lookup round (depth 0) is one batched body pass
over the proposal, ``verify_s`` whatever it keeps; a self-draft round of depth d runs about
``min(d, steps)`` one-token body steps through the trimmed head (``step_s`` each; ``steps``: how far
the loop's rounds drafted of late, since it stops below the confidence) and one full-head product
over their hidden states (``head_s``). Every cost is first timed at the warm-up with the device
synchronised (:func:`trimpass.measure.best_ms`), then follows the loop's own rounds as running
means. The loop's rounds cost the same at every batch (it serves one request), and no plain step is
observed for a cost model, so the controller's plain probes stay off."""
from __future__ import annotations

import math

DECAY = 0.9  # the running means' weight on their past


class RoundCosts:
    shares_cache = True  # depth 0 runs no drafting step
    plain_probes = False  # no cost model observes plain steps here
    mixes_sources = False  # a round runs one source: a lookup round passed over is probed at times

    def __init__(self, gamma: int):
        self.step_s = self.head_s = self.verify_s = None
        self.steps = gamma / 2  # the depth a self-draft round reaches, before any round

    def time(self, name: str, seconds: float) -> None:
        old = getattr(self, name)
        setattr(self, name, seconds if old is None else DECAY * old + (1 - DECAY) * seconds)

    def self_round(self, steps: int, seconds: float) -> None:
        """A self-draft round of ``steps`` body steps took ``seconds`` in all."""
        self.time("steps", steps)
        self.time("step_s", max(seconds - (self.head_s or 0.0), 0.0) / max(steps, 1))

    def price(self, batch: int, depth: int):
        """``(cost, drafting seconds)`` of a round of ``depth`` (0: a lookup round), or None
        before the warm-up timed it."""
        if None in (self.step_s, self.head_s, self.verify_s):
            return None
        if depth == 0:
            verify = max(self.verify_s, 1e-9)
            return (lambda b, t: verify), 0.0
        head = max(self.head_s, 1e-9)
        return (lambda b, t: head), min(depth, self.steps) * self.step_s

    def reach(self, depth: int) -> int:
        """The positions a self-draft round of ``depth`` drafts, about: it stops early below the
        confidence."""
        return min(depth, math.ceil(self.steps))

    def verify_cost(self, batch: int):
        return None  # the loop verifies every drafted token: nothing to cut

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("step_s", "head_s", "verify_s", "steps")}
