"""D-Cut: one verification budget shared by every request of a batch, engine-independent. The
drafter gives each drafted token a confidence c_{i,t} (its probability of the token it drafted); the
score s_{i,k} = prod_{t<=k} c_{i,t} estimates P(request i accepts >= k drafted tokens), so the
expected tokens a step emits when request i keeps its first n_i drafted tokens is B + sum_i
sum_{k<=n_i} s_{i,k} (every request emits its bonus or corrected token). :func:`dcut` picks the
total K of drafted tokens verified, shared out by global score rank (scores fall along a draft, so
the top K is a prefix of every request's draft), that maximizes expected emitted tokens per second,
(B + top-K score sum) / (draft_time + C(B, B + K)), with C the verification cost (a callable or a
:class:`trimpass.spec.control.costmodel.CostTable`); ``buckets`` limits K to static shapes.
:func:`best_rate` is the rate the cut reaches, which the controller
(:mod:`trimpass.spec.control.controller`) compares across drafting depths before any drafting.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import torch

__all__ = ["best_rate", "dcut", "scores", "tabled"]

Cost = Callable[..., object]


def _check_confidences(confidences, *, min_gamma: int) -> torch.Tensor:
    if not isinstance(confidences, torch.Tensor):
        confidences = torch.as_tensor(confidences)
    if confidences.dim() != 2:
        raise ValueError(f"confidences: expected a 2-D [batch, gamma] tensor, got shape "
                         f"{tuple(confidences.shape)}")
    if confidences.shape[1] < min_gamma:
        raise ValueError(f"confidences: gamma (dim 1) must be >= {min_gamma}, got "
                         f"{confidences.shape[1]}")
    c = confidences.detach().to(torch.float64)
    bad = torch.isnan(c) | (c < 0) | (c > 1)
    if bad.any():
        i, t = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"confidences: every entry must lie in [0, 1] (no NaN); "
                         f"confidences[{i}, {t}] = {float(c[i, t])}")
    return c


def _check_time(value, name: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a number of seconds, got {value!r}") from None
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{name}: must be finite and >= 0 seconds, got {value!r}")
    return v


def _check_buckets(buckets) -> list[int] | None:
    if buckets is None:
        return None
    out = []
    for b in buckets:
        try:
            ok = not isinstance(b, bool) and float(b).is_integer()
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"buckets: entries must be integers, got {b!r}")
        out.append(int(b))
    if any(b < 0 for b in out):
        raise ValueError(f"buckets: entries must be >= 0, got {out}")
    if any(a >= b for a, b in itertools.pairwise(out)):
        raise ValueError(f"buckets: must be sorted strictly increasing, got {out}")
    return out


def scores(confidences) -> torch.Tensor:
    """s_{i,k} = prod_{t<=k} c_{i,t} in float64: non-increasing along every draft."""
    return torch.cumprod(_check_confidences(confidences, min_gamma=0), dim=1)


def _costs(cost: Cost, batch: int, ks: torch.Tensor) -> torch.Tensor:
    """C(batch, batch + K) for every K in ``ks`` (int64, CPU), float64 seconds, checked.

    One call on a tensor of token counts when ``cost`` accepts one (a ``CostTable``, arithmetic on
    its argument); otherwise, or if that call fails or returns the wrong shape, one call per K.
    """
    tokens = ks + batch
    out = None
    try:
        got = torch.as_tensor(cost(batch, tokens), dtype=torch.float64).cpu()
        if got.numel() in (1, tokens.numel()):
            out = got.reshape(-1).expand(tokens.shape).clone()
    except Exception:  # not tensor-capable: per-K calls below surface real errors
        out = None
    if out is None:
        out = torch.tensor([float(cost(batch, t)) for t in tokens.tolist()], dtype=torch.float64)
    bad = ~torch.isfinite(out) | (out <= 0)
    if bad.any():
        j = int(bad.nonzero()[0, 0])
        raise ValueError(f"cost: must return positive, finite seconds; cost({batch}, "
                         f"{int(tokens[j])}) = {float(out[j])}")
    return out


def _rank(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Global order of the B*gamma scores (descending; ties by request, then position) and the
    sorted scores. Flat index i*gamma + k is (request, position) order, and the sort is stable."""
    flat = s.reshape(-1)
    order = torch.sort(-flat, stable=True).indices
    return order, flat[order]


def dcut(confidences, cost: Cost, draft_time: float = 0.0,
         buckets: Sequence[int] | None = None) -> torch.Tensor:
    """Tokens of each request's draft to verify: a LongTensor [B] of prefix lengths n_i.

    ``confidences`` [B, gamma] in [0, 1] (zeros past a request's draft); ``cost(batch, tokens)`` is
    the seconds to verify ``tokens`` tokens in all for ``batch`` requests (B + K: one per request
    plus the K drafted tokens kept); ``draft_time`` the seconds already spent drafting this step.
    Every candidate K (0..B*gamma, or 0 and the ``buckets`` <= B*gamma) is scored in one shot:
    rate(K) = (B + sum of the K highest scores) / (draft_time + C(B, B + K)); the first K of
    highest rate wins (equal rates choose fewer tokens: under a cost non-decreasing in tokens a
    zero-score token is never kept unless a bucket forces padding), and K = 0 when no verified
    token pays for itself. The kept tokens are
    the K highest scores, ties broken by request index then position, so n_i is a prefix length and
    sum(n) = K. With ``buckets``, n_i may reach into zero-confidence positions (padding to the
    bucket's static shape). Host reads happen for the checks and for per-K cost calls.
    """
    c = _check_confidences(confidences, min_gamma=1)
    dt = _check_time(draft_time, "draft_time")
    bk = _check_buckets(buckets)
    if not callable(cost):
        raise ValueError(f"cost: expected a callable cost(batch, tokens), got {type(cost)}")
    B, gamma = c.shape
    if B == 0:
        return torch.zeros(0, dtype=torch.long, device=c.device)
    s = torch.cumprod(c, dim=1)
    order, sorted_s = _rank(s)
    K, _ = _best(sorted_s, cost, B, dt, bk)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(B * gamma, device=s.device)
    return (rank.view(B, gamma) < K).sum(dim=1)


def _best(sorted_s: torch.Tensor, cost: Cost, B: int, dt: float, buckets=None):
    """The K of highest rate (B + sum of the K highest scores) / (dt + C(B, B + K)) over K in
    0..len(sorted_s) (or 0 and the buckets that fit), the first among equal rates, and that rate."""
    gain = torch.cat([sorted_s.new_zeros(1), torch.cumsum(sorted_s, 0)])  # gain[K]
    total = sorted_s.numel()
    if buckets is None:
        ks = torch.arange(total + 1)
    else:
        ks = torch.tensor(sorted({0, *(b for b in buckets if b <= total)}), dtype=torch.long)
    seconds = _costs(cost, B, ks).to(sorted_s.device)
    rate = (B + gain[ks.to(sorted_s.device)]) / (dt + seconds)
    i = torch.argmax(rate)  # first maximum: the smallest K among equal rates
    return ks.to(sorted_s.device)[i], float(rate[i])


def best_rate(confidences, cost: Cost, draft_time: float = 0.0) -> float:
    """The best expected emitted tokens per second :func:`dcut` can reach over ``confidences``
    [B, gamma] after ``draft_time`` seconds of drafting: what one source's draft (or a mix of
    sources' drafts, a row each) is worth, priced by the same cost model."""
    c = _check_confidences(confidences, min_gamma=1)
    dt = _check_time(draft_time, "draft_time")
    if c.shape[0] == 0:
        return 0.0
    return _best(_rank(torch.cumprod(c, dim=1).cpu())[1], cost, c.shape[0], dt)[1]


def best_prefix(confidences, cost: Cost) -> int:
    """How many tokens of one request's draft (``confidences`` [gamma], each over the one before:
    a chain, or a best-first tree's nodes) :func:`dcut` verifies at ``cost``: at least one."""
    c = torch.as_tensor(confidences, dtype=torch.float64).view(1, -1)
    return max(1, int(dcut(c, cost)[0]))


def tabled(cost: Cost, batch: int, most: int) -> Cost:
    """``cost`` read once at ``batch`` for every total up to ``most`` drafted tokens: a cost that
    indexes those seconds (for pricing several drafts of one batch against one cost)."""
    seconds = _costs(cost, int(batch), torch.arange(int(most) + 1))

    def read(b, tokens):
        return seconds[torch.as_tensor(tokens) - b]
    return read
