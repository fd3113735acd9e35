"""What a round of the fused loop (:mod:`trimpass.hf.fused`) costs, as the speculation core's
controller prices it (:meth:`RoundCosts.price`). A free round (depth 0) is one batched body pass
over a free draft (a tree, or a chain) padded to a row class, ``pass_s[rows]`` whatever it keeps, so
the size of the tree it verifies is priced too: where more rows cost more (fp32 on an AVX2 CPU) a
round verifies fewer nodes than where they do not; a self-draft round of depth d runs d one-token
body steps through the trimmed head (``step_s`` each) and one full-head product over their hidden
states (``head_s``). Its depth is fixed before it runs (:meth:`RoundCosts.depth`): the deepest of
where the drafter's confidence stopped in the last ``STOPS`` rounds (``steps``). Every cost is first
timed at the warm-up with the device synchronised (:func:`trimpass.measure.best_ms`), then follows
the loop's own rounds as running means. The loop's rounds cost the same at every batch (it serves
one request), and no plain step is observed for a cost model, so the controller's plain probes stay
off."""
from __future__ import annotations

from collections import deque

import torch

DECAY = 0.9  # the running means' weight on their past
STOPS = 4  # the recent self-draft rounds whose stop depths fix the next one's


class RoundCosts:
    shares_cache = True  # depth 0 runs no drafting step
    plain_probes = False  # no cost model observes plain steps here
    mixes_sources = False  # a round runs one source: a lookup round passed over is probed at times

    def __init__(self, gamma: int, classes: tuple = ()):
        self.step_s = self.head_s = None
        self.gamma, self.classes = gamma, tuple(classes)
        self.pass_s: dict = {rows: None for rows in self.classes}  # a free pass, by row class
        self.restart()

    def restart(self) -> None:
        """No stop depth seen yet: ``gamma`` until one is."""
        self.steps, self.stops = self.gamma, deque(maxlen=STOPS)

    def time(self, name: str, seconds: float) -> None:
        old = getattr(self, name)
        setattr(self, name, seconds if old is None else DECAY * old + (1 - DECAY) * seconds)

    def time_pass(self, rows: int, seconds: float) -> None:
        """A free round's pass over ``rows`` rows (its row class's) took ``seconds``."""
        S = next(c for c in self.classes if c >= rows)
        old = self.pass_s[S]
        self.pass_s[S] = seconds if old is None else DECAY * old + (1 - DECAY) * seconds

    def pass_cost(self, batch, tokens):
        """A free pass's seconds at ``tokens`` (``batch`` pending tokens and the drafted ones,
        an int or a tensor of them): its row class's."""
        rows = torch.as_tensor(tokens)
        seconds = torch.tensor([max(self.pass_s[c], 1e-9) for c in self.classes],
                               dtype=torch.float64)
        at = torch.bucketize(rows, torch.tensor(self.classes), right=False)
        return seconds[at.clamp(max=len(self.classes) - 1)]

    def self_round(self, steps: int, seconds: float) -> None:
        """A self-draft round of ``steps`` body steps took ``seconds`` in all."""
        self.time("step_s", max(seconds - (self.head_s or 0.0), 0.0) / max(steps, 1))

    def stopped(self, depth: int) -> None:
        """A self-draft round's drafter confidence first dropped below the loop's at ``depth``
        (its depth + 1 where it never did: it would have gone on)."""
        self.stops.append(depth)
        self.steps = max(self.stops)

    def depth(self, gamma: int, confidence: float) -> int:
        """The next self-draft round's depth, fixed before it runs: the deepest the recent rounds'
        confidence reached (``gamma`` with no confidence stop). Deepest, not their mean: a round
        stopped short costs one more full-head product, a draft past a rejection one body step,
        and the trimmed head's drafts are kept far more often than its confidence says (the real
        Gemma-3-270M, fp32, lookup=False: 22.3 tok/s at the deepest of 4, 17.8 at their mean)."""
        return gamma if not confidence else max(1, min(gamma, int(self.steps)))

    def price(self, batch: int, depth: int):
        """``(cost, drafting seconds)`` of a round of ``depth`` (0: a free draft's pass), or None
        before the warm-up timed it."""
        if None in (self.step_s, self.head_s) or None in self.pass_s.values():
            return None
        if depth == 0:
            return (self.pass_cost if self.classes else (lambda b, t: 1e-9)), 0.0
        head = max(self.head_s, 1e-9)
        return (lambda b, t: head), depth * self.step_s

    def reach(self, depth: int) -> int:
        """The drafted positions that add a token to a self-draft round of ``depth``: all but its
        last (a round emits its kept drafts and, where one is rejected, the target's token; with
        every draft kept there is no row for a token after them), so a round of depth 1 is worth
        one token, as a plain step is."""
        return max(depth - 1, 0)

    def verify_cost(self, batch: int):
        return None  # the loop verifies every drafted token: nothing to cut

    def as_dict(self) -> dict:
        return {**{k: getattr(self, k) for k in ("step_s", "head_s", "steps")},
                "pass_s": dict(self.pass_s)}
