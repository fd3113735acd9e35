"""Pearson's chi-square goodness-of-fit test, in torch (no scipy): the probability of a statistic
at least this large if ``counts`` were drawn from ``probs``; bins expected below 5 are pooled."""
from __future__ import annotations

import torch


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    counts, probs = counts.double().flatten(), probs.double().flatten()
    expected = probs / probs.sum() * counts.sum()
    small = expected < min_expected
    if small.any():  # one pooled bin for the rare ids (an observed count there with ~0 expected
        counts = torch.cat([counts[~small], counts[small].sum()[None]])  # still counts against)
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
        if expected[-1] == 0:
            return 0.0 if counts[-1] > 0 else _p(counts[:-1], expected[:-1])
    return _p(counts, expected)


def _p(counts, expected) -> float:
    stat = ((counts - expected) ** 2 / expected).sum()
    df = counts.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))
