"""D-Cut: one verification budget shared by every request of a batch, engine-independent. The
drafter gives each drafted token a confidence c_{i,t} (its probability of the token it drafted); the
score s_{i,k} = prod_{t<=k} c_{i,t} estimates P(request i accepts >= k drafted tokens), so the
expected tokens a step emits when request i keeps its first n_i drafted tokens is B + sum_i
sum_{k<=n_i} s_{i,k} (every request emits its bonus or corrected token). :func:`dcut` picks the
total K of drafted tokens verified, shared out by global score rank (scores fall along a draft, so
the top K is a prefix of every request's draft), that maximizes expected emitted tokens per second,
(B + top-K score sum) / (draft_time + C(B, B + K)), with C the verification cost (a callable or a
:class:`trimpass.budget.costmodel.CostTable`); ``buckets`` limits K to static shapes.
:func:`draft_more` says, after each step of a chain drafter, which requests can still put a token
into the cut, so drafting can stop per request and for the whole batch; :func:`next_step_pays`
whether one more step is worth its drafting time; :func:`drafting_pays`, before any drafting,
whether any draft at all could beat verifying none (so the drafter need not run).
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import torch

__all__ = ["best_rate", "dcut", "draft_more", "drafting_pays", "next_step_pays", "scores"]

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


def next_step_pays(confidences, cost: Cost, draft_time: float, step_time: float) -> bool:
    """Whether one more drafting step is expected to raise the step's best rate (myopic).

    ``confidences`` [B, d >= 1] so far (0 for stopped requests), ``draft_time`` the seconds spent
    drafting so far, ``step_time`` the seconds one more step costs. Each request's next token is
    guessed to score its last score times its last confidence (a draft's scores fall about
    geometrically); the step pays iff the best rate with those tokens, after ``draft_time +
    step_time``, beats the best rate now. :func:`draft_more` says whether a further token can
    enter the cut at all; this says whether drafting it is worth its time. At d = 0 it is True."""
    c = _check_confidences(confidences, min_gamma=0)
    dt = _check_time(draft_time, "draft_time")
    step = _check_time(step_time, "step_time")
    if not callable(cost):
        raise ValueError(f"cost: expected a callable cost(batch, tokens), got {type(cost)}")
    B, d = c.shape
    if d == 0:
        return True
    if B == 0:
        return False
    s = torch.cumprod(c, dim=1).cpu()
    _, now = _best(_rank(s)[1], cost, B, dt)
    guess = torch.cat([s, (s[:, -1] * c[:, -1].cpu())[:, None]], dim=1)
    _, later = _best(_rank(guess)[1], cost, B, dt + step)
    return later > now


def draft_more(confidences, cost: Cost, draft_time_per_step: float, *, gamma_max: int,
               draft_time_base: float = 0.0) -> torch.Tensor:
    """Which requests of a chain drafter can still put a drafted token into the cut: BoolTensor [B].

    Call after each drafting step with the confidences so far, [B, d] (d may be 0; zeros for a
    request already stopped); stop drafting request i where False, and the whole batch when none
    is True (always at d = ``gamma_max``). The final draft has depth D in [d, gamma_max] and is cut
    by ``dcut(conf[:, :D], cost, draft_time_base + D * draft_time_per_step)`` (no buckets). The rule
    (all quantities from the current draft only):

    - T_max = draft_time_base + gamma_max * draft_time_per_step bounds the final draft time;
    - r_lb = max over K in 0..B*d of (B + sum of the K highest current scores) / (T_max + C(B,
      B+K)) bounds the final optimal rate R* from below (the current tokens are still there);
    - dC(K) = C(B, B+K) - C(B, B+K-1) for K in 1..B*gamma_max, the marginal cost of the K-th token;
    - a future token x of request i scores <= s_i = its current last score (1 at d = 0), so it
      ranks after every current score > s_i and every current score == s_i of a request j <= i:
      if kept, the cut holds K* >= k_i = 1 + that count;
    - request i is active iff s_i > r_lb * min_{K >= k_i} dC(K).

    Why this never stops a request the final cut would extend: at the chosen K* every smaller K
    rates strictly lower (first maximum), so R(K*) > R(K*-1), i.e. its last kept score
    x > R* * dC(K*) >= r_lb * min_{K >= k_i} dC(K). Flat cost regions (dC = 0) keep every request
    with a positive score active; a request whose last score is 0 is never active.
    """
    c = _check_confidences(confidences, min_gamma=0)
    step = _check_time(draft_time_per_step, "draft_time_per_step")
    base = _check_time(draft_time_base, "draft_time_base")
    if isinstance(gamma_max, bool) or not float(gamma_max).is_integer() or gamma_max < 1:
        raise ValueError(f"gamma_max: must be an integer >= 1, got {gamma_max!r}")
    gamma_max = int(gamma_max)
    B, d = c.shape
    if d > gamma_max:
        raise ValueError(f"confidences: {d} drafted positions exceed gamma_max={gamma_max}")
    if not callable(cost):
        raise ValueError(f"cost: expected a callable cost(batch, tokens), got {type(cost)}")
    if B == 0 or d == gamma_max:
        return torch.zeros(B, dtype=torch.bool, device=c.device)
    s = torch.cumprod(c, dim=1).cpu()
    last = s[:, -1] if d > 0 else torch.ones(B, dtype=torch.float64)
    seconds = _costs(cost, B, torch.arange(B * gamma_max + 1))
    gain = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(_rank(s)[1], 0)])
    r_lb = torch.max((B + gain) / (base + gamma_max * step + seconds[: B * d + 1]))
    dC = seconds[1:] - seconds[:-1]  # dC[K-1] = marginal cost of the K-th token
    tail_min = torch.flip(torch.cummin(torch.flip(dC, [0]), 0).values, [0])  # min over K' >= K
    flat = s.reshape(-1)
    owner = torch.arange(B).repeat_interleave(d)
    ahead = (flat[None, :] > last[:, None]) | ((flat[None, :] == last[:, None])
                                               & (owner[None, :] <= torch.arange(B)[:, None]))
    k = 1 + ahead.sum(dim=1)  # <= B*d + 1 <= B*gamma_max
    return (last > r_lb * tail_min[k - 1]).to(c.device)


def drafting_pays(batch: int, cost: Cost, first_time: float, step_time: float, *, gamma_max: int,
                  accept_max: float = 1.0) -> bool:
    """Whether any draft could beat drafting nothing, decided before the drafter runs.

    Drafting nothing emits ``batch`` tokens in C(B, B) seconds. A draft whose cut keeps K tokens
    needs at least D = ceil(K / B) drafting steps (``first_time`` for the first, ``step_time``
    each after it) and emits at most B + K * ``accept_max`` tokens (``accept_max`` bounds any
    drafted token's probability of acceptance: 1, or a calibration's largest fitted value). It
    pays iff for some K in 1..B * ``gamma_max``, (B + K * accept_max) / (first_time + (D - 1) *
    step_time + C(B, B + K)) > B / C(B, B). False means no cut of any draft could pay: the whole
    drafting step, first forward included, can be skipped."""
    first = _check_time(first_time, "first_time")
    step = _check_time(step_time, "step_time")
    if isinstance(batch, bool) or not float(batch).is_integer() or batch < 1:
        raise ValueError(f"batch: must be an integer >= 1, got {batch!r}")
    if isinstance(gamma_max, bool) or not float(gamma_max).is_integer() or gamma_max < 1:
        raise ValueError(f"gamma_max: must be an integer >= 1, got {gamma_max!r}")
    p = float(accept_max)
    if not 0 <= p <= 1:
        raise ValueError(f"accept_max: a probability in [0, 1], got {accept_max!r}")
    if not callable(cost):
        raise ValueError(f"cost: expected a callable cost(batch, tokens), got {type(cost)}")
    B = int(batch)
    ks = torch.arange(B * int(gamma_max) + 1)
    seconds = _costs(cost, B, ks)
    depth = torch.div(ks + B - 1, B, rounding_mode="floor")  # ceil(K / B)
    draft = first + (depth - 1).clamp_min(0).double() * step
    rate = (B + ks.double() * p) / (draft + seconds)
    return bool((rate[1:] > B / seconds[0]).any())
