"""What each draft source is worth, for D-Cut to price every source with one cost model. A lookup
draft (the request's text repeating itself: :mod:`trimpass.spec.proposers.lookup`) costs no drafter
step; its tokens' confidences are what the target accepted of earlier lookup drafts with the same
match length at the same position (:class:`LookupPrice`: P(position k accepted | every earlier one
was), a Beta prior until observed). A self-draft's confidences are the drafter's own, calibrated;
before the drafter runs, :class:`DraftProfile` says what its drafts were worth per position of late,
so that a proposal can weigh running the drafter (its measured seconds) against lookup drafts alone
before paying for it."""
from __future__ import annotations

import numpy as np
import torch

from trimpass.spec.config import LookupConfig

MATCH_MAX = LookupConfig.match_cap  # match lengths priced apart (longer ones pool with it)


class LookupPrice:
    """Acceptance of lookup drafts by match length and position, ``prior`` (accepted, rejected)
    pseudo-counts at every cell."""

    def __init__(self, gamma: int, prior: tuple[float, float] = (1.0, 1.0)):
        self.gamma = int(gamma)
        self.reached = np.zeros((MATCH_MAX + 1, self.gamma))
        self.kept = np.zeros((MATCH_MAX + 1, self.gamma))
        self.prior = prior

    def table(self) -> np.ndarray:
        """P(position k accepted | reached), [MATCH_MAX + 1, gamma] (row m: match length m)."""
        a, b = self.prior
        return (self.kept + a) / (self.reached + a + b)

    def confidences(self, proposals, width: int) -> torch.Tensor:
        """Confidences [B, width] of ``proposals`` (per row ``(tokens, match)`` or None): zero
        past each row's draft and on rows without one."""
        B = len(proposals)
        lengths = np.array([0 if p is None else min(len(p[0]), self.gamma, width)
                            for p in proposals], dtype=np.int64)
        match = np.array([0 if p is None else min(p[1], MATCH_MAX) for p in proposals],
                         dtype=np.int64)
        conf = np.zeros((B, width))
        cols = min(width, self.gamma)
        conf[:, :cols] = self.table()[match, :cols]
        conf[np.arange(width)[None, :] >= lengths[:, None]] = 0.0
        return torch.from_numpy(conf)

    def observe(self, match: int, sent: int, accepted: int) -> None:
        """One verified lookup draft of ``sent`` tokens at ``match`` of which the target accepted
        the first ``accepted``: positions up to the first rejection were reached."""
        m, reached = min(match, MATCH_MAX), min(sent, accepted + 1, self.gamma)
        self.reached[m, :reached] += 1
        self.kept[m, :min(accepted, reached)] += 1

    def as_dict(self) -> dict:
        return {"reached": self.reached.sum(axis=1).tolist(),
                "accept_first": self.table()[:, 0].round(3).tolist()}


class DraftProfile:
    """The drafter's calibrated confidence per position, a running mean over its drafts' rows
    (None before its first draft)."""

    def __init__(self, gamma: int, decay: float = 0.9):
        self.gamma, self.decay = int(gamma), decay
        self.mean: torch.Tensor | None = None

    def observe(self, conf: torch.Tensor) -> None:
        """One draft's calibrated confidences [B, d] (zeros where a request stopped)."""
        if conf.numel() == 0:
            return
        row = torch.zeros(self.gamma, dtype=torch.float64)
        d = min(conf.shape[1], self.gamma)
        row[:d] = conf[:, :d].double().mean(dim=0).cpu()
        self.mean = row if self.mean is None else self.decay * self.mean + (1 - self.decay) * row
