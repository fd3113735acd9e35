"""Acceptance calibration for D-Cut, learned from what the target actually accepted. D-Cut reads a
drafted token's prefix score s_{i,k} = prod_{t<=k} c_{i,t} as P(request i accepts >= k drafted
tokens); a drafter that is confident and wrong (a small drafter repeating a pattern) makes that
estimate far too high, and the cut then verifies tokens that do not pay. :class:`Calibration`
keeps the last ``window`` (score, accepted) pairs a serving loop observed (position k of a verified
draft was accepted iff k <= the number of its tokens the target accepted), fits P(accepted | s)
by isotonic regression (:func:`trimpass.isotonic.pav`, monotone non-decreasing in s), and maps a
batch's confidences to calibrated ones whose prefix products are the fitted probabilities: since
the fit is monotone and scores fall along a draft, the calibrated scores fall too, and each
calibrated confidence is their ratio, in [0, 1]. Until ``min_pairs`` pairs are seen it is the
identity.
"""
from __future__ import annotations

import collections

import numpy as np
import torch

from trimpass.isotonic import pav

__all__ = ["Calibration"]


class Calibration:
    def __init__(self, window: int = 4096, min_pairs: int = 64, refit_every: int = 32):
        if window < min_pairs or min_pairs < 1 or refit_every < 1:
            raise ValueError(f"Calibration: need window >= min_pairs >= 1 and refit_every >= 1, "
                             f"got {window}, {min_pairs}, {refit_every}")
        self.pairs: collections.deque = collections.deque(maxlen=window)
        self.min_pairs, self.refit_every = min_pairs, refit_every
        self.xs: np.ndarray | None = None
        self.ys: np.ndarray | None = None
        self._new = 0

    def observe(self, scores, accepted: int) -> None:
        """One verified draft: its kept tokens' prefix scores (non-increasing) and how many of
        them the target accepted."""
        for k, s in enumerate(scores, start=1):
            self.pairs.append((float(s), 1.0 if k <= accepted else 0.0))
        self._new += len(scores)
        if len(self.pairs) >= self.min_pairs and (self.xs is None
                                                 or self._new >= self.refit_every):
            self.refit()

    def refit(self) -> None:
        """Isotonic fit of accepted against score over the window; ties in score pooled first."""
        a = np.asarray(self.pairs, dtype=np.float64)
        order = np.argsort(a[:, 0], kind="stable")
        s, y = a[order, 0], a[order, 1]
        xs, start = np.unique(s, return_index=True)
        counts = np.diff(np.append(start, len(s)))
        means = np.add.reduceat(y, start) / counts
        self.xs, self.ys = xs, pav(means, counts)
        self._new = 0

    def scores(self, s: torch.Tensor) -> torch.Tensor:
        """Calibrated P(accepted) for prefix scores ``s`` (any shape), interpolated between the
        fitted points and held flat beyond them; ``s`` itself before the first fit."""
        if self.xs is None:
            return s
        out = np.interp(s.detach().cpu().double().numpy(), self.xs, self.ys)
        return torch.from_numpy(out).to(s.device, s.dtype)

    def confidences(self, conf: torch.Tensor) -> torch.Tensor:
        """Calibrated confidences [B, d] for raw ones: cumprod of the result = calibrated scores."""
        if self.xs is None or conf.shape[-1] == 0:
            return conf
        cal = self.scores(torch.cumprod(conf.double(), dim=-1))
        prev = torch.cat([torch.ones_like(cal[..., :1]), cal[..., :-1]], dim=-1)
        ratio = torch.where(prev > 0, cal / prev.clamp_min(1e-300), torch.zeros_like(cal))
        return ratio.clamp(0, 1).to(conf.dtype)
