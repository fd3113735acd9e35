"""The runtime cost model D-Cut needs: C(batch, verified tokens) in seconds, and a drafter's time
per step, measured on this device. A :class:`CostTable` holds timings on a grid of batch sizes x
drafted token counts (verified tokens = batch + drafted tokens), fits them by weighted least-squares
isotonic regression monotone non-decreasing in both axes (:func:`pav` on a line, its exact
generalization :func:`isotonic_grid` on the grid: the minimum-lower-sets algorithm, each step a
dynamic program over staircases), and interpolates the fit bilinearly; it is monotone by
construction, never clamped. :func:`measure` times a user's verify (or drafting-step) function on
the grid within a time budget with :mod:`trimpass.measure`'s timer; :func:`cached_table` keeps the
timings on disk per device name, torch version and model key (``trimpass.measure.cached``);
:meth:`CostTable.update` refines the table online from the step times an engine observes;
:class:`StepCost` adds the per-step seconds an engine spends outside its forward.
"""
from __future__ import annotations

import bisect
import collections
import itertools
import math
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from trimpass import measure as _m
from trimpass.isotonic import isotonic_grid, pav

__all__ = ["CostTable", "StepCost", "EngineCost", "pav", "isotonic_grid", "measure", "cached_table"]


def _axis(name: str, values) -> list[int]:
    values = list(values)
    try:
        vals = [int(v) for v in values]
        ok = bool(vals) and all(v == float(x) for v, x in zip(vals, values, strict=True))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{name}: expected a non-empty list of integers, got {values}")
    if any(a >= b for a, b in itertools.pairwise(vals)):
        raise ValueError(f"{name}: must be sorted strictly increasing, got {vals}")
    return vals


RATIOS = 16  # observations whose median ratio to the given table moves the unobserved cells


def _interp(points: torch.Tensor, q: torch.Tensor):
    """Lower index, upper index and fraction of ``q`` clamped into [points[0], points[-1]]."""
    qc = torch.minimum(torch.maximum(q, points[0]), points[-1])
    if len(points) == 1:
        i = torch.zeros_like(qc, dtype=torch.long)
        return i, i, torch.zeros_like(qc)
    i = (torch.searchsorted(points, qc, right=True) - 1).clamp(0, len(points) - 2)
    return i, i + 1, (qc - points[i]) / (points[i + 1] - points[i])


def _interp1(points: list[float], q: float) -> tuple[int, int, float]:
    """:func:`_interp` of one Python number, with the same float64 operations."""
    qc = min(max(q, points[0]), points[-1])
    if len(points) == 1:
        return 0, 0, 0.0
    i = min(max(bisect.bisect_right(points, qc) - 1, 0), len(points) - 2)
    return i, i + 1, (qc - points[i]) / (points[i + 1] - points[i])


def _lerp(lo: torch.Tensor, hi: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """lo + f * (hi - lo) for lo <= hi: exact at f = 0 and where lo == hi, non-decreasing in f,
    and never above hi (so a cell never ends above where the next one starts)."""
    return torch.minimum(lo + f * (hi - lo), hi)


class CostTable:
    """Seconds to verify on a grid: ``seconds[i][j]`` for ``batches[i]`` requests carrying
    ``drafts[j]`` drafted tokens in all (``batches[i] + drafts[j]`` verified tokens).

    ``table(batch, tokens)`` is the cost D-Cut calls (scalars or tensors; ``tokens`` verified in
    all); ``table.seconds(batch, drafts)`` reads the grid's own coordinates (a drafting step timed
    with ``drafts=[0]``: ``seconds(batch, 0)``). The isotonic fit is interpolated bilinearly, held
    constant below the grid, and extended above it linearly with one slope per axis for the whole
    grid (the largest last-segment slope): non-decreasing in tokens everywhere (exactly, rounding
    included) and in batch (up to rounding).
    """

    def __init__(self, batches: Sequence[int], drafts: Sequence[int], seconds,
                 weights=None, *, alpha: float = 0.2):
        self.batches = _axis("batches", batches)
        self.drafts = _axis("drafts", drafts)
        if self.batches[0] < 1 or self.drafts[0] < 0:
            raise ValueError(f"batches must be >= 1 and drafts >= 0, got {self.batches}, "
                             f"{self.drafts}")
        shape = (len(self.batches), len(self.drafts))
        rows = [[math.nan if v is None else v for v in row] for row in seconds]
        if len(rows) != shape[0] or any(len(r) != shape[1] for r in rows):
            raise ValueError(f"seconds: expected {shape[0]} rows of {shape[1]} entries "
                             f"(batches x drafts)")
        raw = np.asarray(rows, dtype=np.float64)
        for (i, j), v in np.ndenumerate(raw):
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"seconds: entry for batch={self.batches[i]}, "
                                 f"drafts={self.drafts[j]} is missing or not positive: {v}")
        w = np.ones(shape) if weights is None else np.asarray(weights, dtype=np.float64)
        if w.shape != shape or not (np.isfinite(w).all() and (w > 0).all()):
            raise ValueError(f"weights: expected positive finite weights of shape {shape}")
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha: must lie in (0, 1], got {alpha}")
        self.raw, self.weights, self.alpha = raw, w, float(alpha)
        self.measured = raw.copy()  # the seconds as given: what update()'s ratios are against
        self.ratios: collections.deque = collections.deque(maxlen=RATIOS)
        self.plain_ratios: collections.deque = collections.deque(maxlen=RATIOS)  # no draft
        self._plain = np.zeros(shape, dtype=bool)
        self._plain[:, [j for j, k in enumerate(self.drafts) if k == 0]] = True
        self._b = torch.tensor(self.batches, dtype=torch.float64)
        self._k = torch.tensor(self.drafts, dtype=torch.float64)
        self._bl, self._kl = [float(b) for b in self.batches], [float(k) for k in self.drafts]
        self.version = 0  # counts fits
        self.refit()

    def refit(self) -> None:
        """Fit the raw timings again (isotonic in both axes) and the extension slopes."""
        self.fit = isotonic_grid(self.raw, self.weights)
        f = torch.from_numpy(self.fit.copy())
        self._fit = f
        self._rows = self.fit.tolist()  # the scalar path's copy
        self.version += 1
        nb, nk = f.shape
        self._slope_k = float(((f[:, -1] - f[:, -2]) / (self._k[-1] - self._k[-2])).max()
                              ) if nk > 1 else 0.0
        self._slope_b = float(((f[-1] - f[-2]) / (self._b[-1] - self._b[-2])).max()
                              ) if nb > 1 else 0.0

    @staticmethod
    def _coords(batch, drafts) -> tuple[torch.Tensor, torch.Tensor]:
        b = torch.as_tensor(batch, dtype=torch.float64).cpu()
        k = torch.as_tensor(drafts, dtype=torch.float64).cpu()
        return torch.broadcast_tensors(b, k)

    def seconds(self, batch, drafts):
        """Fitted seconds for ``batch`` requests carrying ``drafts`` drafted tokens in all.

        Interpolated along batch for every drafts column, then along drafts, each step as
        ``lo + f * (hi - lo)`` kept <= hi; a running max over the columns undoes rounding only
        (the fit is monotone), so the result is exactly non-decreasing in drafts (and in tokens).
        Two Python numbers take a scalar path (an engine prices every step with it) that does the
        same float64 operations in the same order, so it returns the same bits."""
        if _number(batch) and _number(drafts):
            return self._scalar(float(batch), float(drafts))
        b, k = self._coords(batch, drafts)
        ib, ib1, fb = _interp(self._b, b)
        ik, ik1, fk = _interp(self._k, k)
        col = _lerp(self._fit[ib], self._fit[ib1], fb[..., None])
        col = torch.cummax(col, dim=-1).values
        out = _lerp(col.gather(-1, ik[..., None])[..., 0], col.gather(-1, ik1[..., None])[..., 0],
                    fk)
        out = (out + self._slope_k * (k - self._k[-1]).clamp_min(0)
               + self._slope_b * (b - self._b[-1]).clamp_min(0))
        if not isinstance(batch, torch.Tensor) and not isinstance(drafts, torch.Tensor) \
                and out.dim() == 0:
            return float(out)
        dev = next((x.device for x in (drafts, batch) if isinstance(x, torch.Tensor)), None)
        return out if dev is None else out.to(dev)

    def _scalar(self, b: float, k: float) -> float:
        ib, ib1, fb = _interp1(self._bl, b)
        ik, ik1, fk = _interp1(self._kl, k)
        col, top = [], -math.inf
        for lo, hi in zip(self._rows[ib][:ik1 + 1], self._rows[ib1][:ik1 + 1], strict=True):
            top = max(top, min(lo + fb * (hi - lo), hi))
            col.append(top)
        out = min(col[ik] + fk * (col[ik1] - col[ik]), col[ik1])
        return (out + self._slope_k * max(k - self._kl[-1], 0.0)
                + self._slope_b * max(b - self._bl[-1], 0.0))

    def __call__(self, batch, tokens):
        """C(batch, tokens): seconds to verify ``tokens`` tokens in all for ``batch`` requests."""
        return self.seconds(batch, tokens - batch)

    def update(self, batch: int, tokens: int, seconds: float, *, refit: bool = True) -> None:
        """Refine from one observed verification: ``batch`` requests, ``tokens`` verified in all,
        ``seconds`` taken. The observation's ratio to the current fit, r = seconds / C(batch,
        tokens), sets a target r * fit for each grid cell around the point (its bilinear corners,
        clamped into the grid); each raw cell moves by an exponential moving average,
        raw += alpha * corner weight * (target - raw), its weight (evidence) grows by the corner
        weight up to 1/alpha, and the isotonic fit is recomputed (``refit=False`` defers it to a
        later :meth:`refit`). On a grid point this is raw <- (1-alpha) raw + alpha seconds.

        The median ratio of the last :data:`RATIOS` observations to the table as given (before
        any update; a median, so that one step stalled by something else moves nothing), rho,
        also reaches every other cell, each moving toward rho * its given seconds by alpha where
        it holds no evidence of its own, less as its evidence grows, not at all once full (1 /
        alpha): a cell the engine never observed follows the engine's observed ratio. An engine's
        steps may run at another ratio to a start-up measurement than its dummy forwards did (on
        a 2-core CPU, vLLM's plain decode steps ran at 1.7-2.4x the forwards its table was
        measured from, at every batch size); moving the observed cells alone would leave the
        unobserved cells of drafted tokens below them, and the monotone fit would then price
        verifying drafted tokens as free.

        Plain steps' cells (no drafted token) follow the ratio of plain observations alone: a
        bucket that always drafts never observes its plain step, so a plain cell raised by the
        drafted steps' ratio (in bf16 on an AVX2-only CPU, verifying 5 tokens ran at a larger
        ratio to the start-up forwards than a plain step) would keep drafting priced better than
        plain steps that are cheaper in truth, and nothing would correct it. A plain cell priced
        too low instead makes the bucket skip, and the plain steps it then observes correct
        it."""
        s = float(seconds)
        if not (math.isfinite(s) and s > 0):
            raise ValueError(f"seconds: must be positive and finite, got {seconds!r}")
        if batch < 1 or tokens < batch:
            raise ValueError(f"batch/tokens: need batch >= 1 and tokens >= batch, got {batch}, "
                             f"{tokens}")
        r = s / float(self(int(batch), int(tokens)))
        ib, ib1, fb = _interp1(self._bl, float(batch))
        ik, ik1, fk = _interp1(self._kl, float(tokens - batch))
        corners = {}
        for i, j, w in ((ib, ik, (1 - fb) * (1 - fk)), (ib, ik1, (1 - fb) * fk),
                        (ib1, ik, fb * (1 - fk)), (ib1, ik1, fb * fk)):
            if w > 0:
                corners[i, j] = corners.get((i, j), 0.0) + w
        ratio = s / sum(w * self.measured[i, j] for (i, j), w in corners.items())
        self.ratios.append(ratio)
        if tokens == batch:
            self.plain_ratios.append(ratio)
        rest = np.ones(self.raw.shape, dtype=bool)
        for i, j in corners:
            rest[i, j] = False
        cap = 1 / self.alpha  # a cell's evidence at most: it moves no more with the engine's ratio
        for cells, ratios in ((rest & ~self._plain, self.ratios),
                              (rest & self._plain, self.plain_ratios)):
            if ratios and cells.any():
                share = self.alpha * np.clip((cap - self.weights[cells]) / max(cap - 1, 1e-9),
                                             0, 1)
                self.raw[cells] += share * (statistics.median(ratios) * self.measured[cells] -
                                            self.raw[cells])
        for (i, j), w in corners.items():
            self.raw[i, j] += self.alpha * w * (r * self.fit[i, j] - self.raw[i, j])
            cap = max(1 / self.alpha, self.weights[i, j])
            self.weights[i, j] = min(self.weights[i, j] + w, cap)
        if refit:
            self.refit()

    def to_dict(self) -> dict:
        return {"batches": self.batches, "drafts": self.drafts, "seconds": self.raw.tolist(),
                "weights": self.weights.tolist(), "alpha": self.alpha}

    @classmethod
    def from_dict(cls, d: dict) -> CostTable:
        return cls(d["batches"], d["drafts"], d["seconds"], d.get("weights"),
                   alpha=d.get("alpha", 0.2))


def _number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


class StepCost:
    """An engine step's cost as D-Cut prices it: the verification ``cost(batch, tokens)`` plus
    the seconds the engine's step spends outside its forward (sampling, scheduling, output
    handling), ``plain(batch)`` for a step that verifies no drafted token and ``drafted(batch)``
    for one that does (at least ``plain``: the cost stays non-decreasing in tokens), so that
    drafting nothing is priced at what such a step really costs."""

    def __init__(self, cost: Callable, plain: Callable[[int], float],
                 drafted: Callable[[int], float]):
        self.cost, self.plain, self.drafted = cost, plain, drafted

    def __call__(self, batch, tokens):
        plain = float(self.plain(batch))
        extra = max(float(self.drafted(batch)), plain) - plain
        if isinstance(tokens, torch.Tensor):
            return self.cost(batch, tokens) + plain + extra * (tokens > batch).to(torch.float64)
        return self.cost(batch, tokens) + plain + (extra if tokens > batch else 0.0)


def _median_s(call: Callable[[], object], share_s: float, device) -> float:
    """Seconds per call within about ``share_s``: one synchronized call first (warm-up and an
    estimate); where the share holds ten more, ``trimpass.measure.median_ms`` over what is left;
    else the median of synchronized calls repeated while the share lasts (at least one)."""
    t0 = time.perf_counter()
    first = _m.timed(call, device=device)[1]
    left = share_s - (time.perf_counter() - t0)
    if left >= max(10 * first, 0.02):
        return _m.median_ms(call, device, min_time_s=(left - first) / 2) / 1e3
    if left < first:
        return first
    return _m.median_s_within(call, left, device)


def measure(fn: Callable[[int, int], object], batches: Sequence[int], drafts: Sequence[int], *,
            budget_s: float = 30.0, device: torch.device | str = "cpu",
            timer: Callable[[Callable[[], object], float], float] | None = None) -> CostTable:
    """Time ``fn(batch, drafts)`` (one verification of ``batch`` requests carrying ``drafts``
    drafted tokens in all; or one drafting step, with ``drafts=[0]``) at every grid cell, and fit.

    Each cell gets an equal share of what is left of ``budget_s``; the default timer spends about
    its share (``trimpass.measure.median_ms`` where the share holds ten calls, else repeated
    synchronized calls), so the total stays within about one call per cell of the budget and every
    cell is timed at least once. ``timer(call, share_s) -> seconds`` replaces it.
    """
    bs, ks = _axis("batches", batches), _axis("drafts", drafts)
    if not (math.isfinite(budget_s) and budget_s > 0):
        raise ValueError(f"budget_s: must be positive, got {budget_s}")
    timer = timer or (lambda call, share: _median_s(call, share, device))
    cells = [(b, k) for b in bs for k in ks]
    t0 = time.perf_counter()
    out = np.empty((len(bs), len(ks)))
    for n, (b, k) in enumerate(cells):
        share = max(0.0, budget_s - (time.perf_counter() - t0)) / (len(cells) - n)
        out[n // len(ks), n % len(ks)] = timer(lambda b=b, k=k: fn(b, k), share)
    return CostTable(bs, ks, out)


def cached_table(model_key: str, fn: Callable[[int, int], object], batches: Sequence[int],
                 drafts: Sequence[int], *, device: torch.device | str = "cpu",
                 budget_s: float = 30.0, refresh: bool = False,
                 timer: Callable[[Callable[[], object], float], float] | None = None) -> CostTable:
    """:func:`measure` once per device name, torch version, ``model_key`` and grid, kept under
    ``<cache_dir>/measure/`` by ``trimpass.measure.cached``: measured again when any changes."""
    key = f"dcut-cost:{model_key}:b={list(batches)}:k={list(drafts)}"
    value = _m.cached(key, lambda: measure(fn, batches, drafts, budget_s=budget_s, device=device,
                                           timer=timer).to_dict(), device, refresh=refresh)
    return CostTable.from_dict(value)


def _grid(top: int) -> list[int]:
    """1, 2, 4, ... up to ``top`` (included)."""
    out, n = [], 1
    while n < top:
        out.append(n)
        n *= 2
    return out + [top]


REFIT_AFTER = 8  # updates between two fits of an engine's table
REFIT_SHARE = 0.01  # the most of the observed forward seconds those fits may take


class EngineCost:
    """An engine's verification cost C(batch, tokens): a :class:`CostTable` given by the user or
    measured at start-up (:meth:`measure`), refined from every pure decode step the engine runs
    (:meth:`observe`), priced with the step's measured overhead (:attr:`step_cost`)."""

    def __init__(self, overhead: Callable[[int, bool], float], table: dict | None = None):
        self.overhead = overhead  # (batch, drafted) -> seconds outside the forward
        self.table = None if table is None else CostTable.from_dict(table)
        self.updates = self.measurements = 0
        self._pending, self._observed_s, self._refit_s = 0, 0.0, 0.0

    def measure(self, verify: Callable[[int], object], *, key: str, max_tokens: int,
                max_seqs: int, gamma_max: int, budget_s: float, device) -> None:
        """C(batch, tokens) from ``verify(n)`` (one forward of ``n`` tokens) at 1, 2, 4, ...
        tokens within ``budget_s`` seconds, cached per device and ``key``: here
        C(B, B + K) = T(B + K), held flat beyond the grid."""
        ns = _grid(min(int(max_tokens), max_seqs * (1 + gamma_max)))

        def compute() -> dict:
            times, t0 = [], time.perf_counter()
            for i, n in enumerate(ns):
                share = max(budget_s - (time.perf_counter() - t0), 0.0) / (len(ns) - i)
                times.append(_m.median_s_within(lambda n=n: verify(n), share, device,
                                                max_calls=5))
            return {"tokens": ns, "seconds": times}

        got = _m.cached(f"vllm-verify:{key}:n={ns}", compute, device)
        batches = _grid(max_seqs)
        drafts = [0] + _grid(max_seqs * gamma_max)
        tokens = [[b + k for k in drafts] for b in batches]
        self.table = CostTable(batches, drafts, np.interp(tokens, got["tokens"], got["seconds"]))
        self.measurements += 1

    def observe(self, batch: int, tokens: int, seconds: float) -> None:
        """One pure decode step (every request: 1 + its drafts) of ``tokens`` in ``seconds``.
        The fit follows every :data:`REFIT_AFTER` updates, or more rarely where its refits would
        take more than :data:`REFIT_SHARE` of the forward seconds observed (a short step on a
        large grid)."""
        if self.table is None:
            return
        self.table.update(batch, tokens, seconds, refit=False)
        self.updates += 1
        self._pending += 1
        self._observed_s += float(seconds)
        if self._pending >= REFIT_AFTER and self._refit_s <= REFIT_SHARE * self._observed_s:
            t0 = time.perf_counter()
            self.table.refit()
            self._refit_s += time.perf_counter() - t0
            self._pending = 0

    @property
    def step_cost(self) -> StepCost | None:
        """A step's cost as the policies price it: C plus the measured per-step overhead."""
        if self.table is None:
            return None
        return StepCost(self.table, lambda b: self.overhead(b, False),
                        lambda b: self.overhead(b, True))
